"""Benchmark shards from real photographs (scripts/bench/photos.py, data/write_photo_shards.py).

The photos come from scikit-learn (a test dependency); scikit-image's bundle is not needed.
"""

import io
import json
import os
import sys
import tarfile

import open_clip
import pytest
import torch
from PIL import Image

from infclip.data.config import DataConfig
from infclip.data.pipeline import build_train_data
from infclip.data.transforms import train_transform

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "data"))
import write_photo_shards as cli  # noqa: E402  (puts scripts/bench, the writer's folder, on sys.path)
from photos import PhotoShardOptions, bundled_photos, export_photos, folder_photos, write_photo_shards  # noqa: E402

SIDE = 64


@pytest.fixture(scope="module")
def photos():
    return bundled_photos(["sklearn"])


def _write(photos, out, seed=0, workers=1, n=64, shard_size=32):
    opts = PhotoShardOptions(out_dir=str(out), num_samples=n, shard_size=shard_size, side=SIDE,
                             seed=seed, workers=workers)
    return write_photo_shards(photos, opts)


def _members(out):
    """{member name: bytes} over every shard of ``out``."""
    files = {}
    for name in sorted(f for f in os.listdir(out) if f.endswith(".tar")):
        with tarfile.open(os.path.join(out, name)) as tar:
            files.update({f"{name}/{m.name}": tar.extractfile(m).read() for m in tar.getmembers()})
    return files


def _sof_markers(jpeg: bytes) -> set[int]:
    """The start-of-frame markers (0xC0 baseline, 0xC2 progressive, ...) before the first scan."""
    pos, found = 2, set()
    while pos + 4 <= len(jpeg) and jpeg[pos] == 0xFF:
        marker, length = jpeg[pos + 1], int.from_bytes(jpeg[pos + 2:pos + 4], "big")
        if marker == 0xDA:  # start of scan
            break
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            found.add(marker)
        pos += 2 + length
    return found


def test_layout_sizes_and_distinct_baseline_jpegs(photos, tmp_path):
    report = _write(photos, tmp_path / "a")
    assert (report.samples, report.shards) == (64, 2)
    out = tmp_path / "a"
    assert json.load(open(out / "sizes.json")) == {"00000.tar": 32, "00001.tar": 32}
    assert json.load(open(out / "00001_stats.json"))["successes"] == 32
    files = _members(out)
    jpegs = [v for k, v in files.items() if k.endswith(".jpg")]
    assert len(jpegs) == 64 and len(set(jpegs)) == 64  # distinct images
    assert sum(map(len, jpegs)) == report.image_bytes
    for k, data in files.items():
        if not k.endswith(".jpg"):
            continue
        img = Image.open(io.BytesIO(data))
        meta = json.loads(files[k[:-4] + ".json"])
        assert img.format == "JPEG" and img.mode == "RGB" and min(img.size) == SIDE
        assert img.size == (meta["width"], meta["height"]) and 85 <= meta["quality"] <= 95
        assert _sof_markers(data) == {0xC0}  # baseline, not progressive
        assert files[k[:-4] + ".txt"].decode() == meta["caption"]
        assert meta["photo"] in ("china", "flower")
    names = {json.loads(v)["photo"] for k, v in files.items() if k.endswith(".json")}
    assert names == {"china", "flower"}


def test_deterministic_for_seed_and_independent_of_workers(photos, tmp_path):
    for name, seed, workers in (("w1", 0, 1), ("w2", 0, 2), ("s1", 1, 1)):
        _write(photos, tmp_path / name, seed=seed, workers=workers)
    one, two, other = (_members(tmp_path / name) for name in ("w1", "w2", "s1"))
    assert one == two
    assert one.keys() == other.keys() and all(one[k] != other[k] for k in one if k.endswith(".jpg"))


def test_shards_load_through_the_training_pipeline(photos, tmp_path):
    report = _write(photos, tmp_path / "p")
    spec = str(tmp_path / "p" / "{00000..00001}.tar")
    cfg = DataConfig(kind="wds", shards=spec, loader_batch=16, workers=0, shuffle_buffer=8)
    data = build_train_data(cfg, transform=train_transform(32), tokenizer=open_clip.get_tokenizer("RN50"),
                            rank=0, world_size=1, seed=0)
    assert data.num_samples == report.samples == 64 and data.epoch_batches == 4
    it = data.batches()
    batches = [next(it) for _ in range(data.epoch_batches)]
    assert all(im.shape == (16, 3, 32, 32) and im.dtype == torch.uint8 for im, _ in batches)
    assert all(tok.shape == (16, 77) for _, tok in batches)
    assert data.skip_counts() == {}
    it.close()


def test_export_then_folder_route_reproduces_bundled_shards(photos, tmp_path, capsys):
    export_photos(photos, str(tmp_path / "src"))
    again = folder_photos(str(tmp_path / "src"))
    assert [(p.name, p.description) for p in again] == [(p.name, p.description) for p in photos]
    assert all(list(a.image.getdata()) == list(b.image.getdata()) for a, b in zip(again, photos))
    _write(photos, tmp_path / "bundled")
    cli.main(["--photos", str(tmp_path / "src"), "--out", str(tmp_path / "cli"), "--num-samples", "64",
              "--shard-size", "32", "--side", str(SIDE), "--workers", "2"])
    assert _members(tmp_path / "cli") == _members(tmp_path / "bundled")
    printed = capsys.readouterr().out
    stats = json.load(open(tmp_path / "cli" / "photo_stats.json"))
    assert stats["num_samples"] == 64 and stats["mean_image_kb"] > 0
    assert stats["decode_images_per_s_single_core"] > 0
    assert f"{stats['mean_image_kb']:.1f} kB" in printed and "images/s" in printed


def test_cli_export_photos_alone(tmp_path, capsys):
    cli.main(["--bundles", "sklearn", "--export-photos", str(tmp_path / "ex")])
    assert sorted(os.listdir(tmp_path / "ex")) == ["captions.json", "china.png", "flower.png"]
    assert "exported 2 photos" in capsys.readouterr().out
    assert not (tmp_path / "ex" / "sizes.json").exists()


def test_plain_folder_captions_from_file_names(tmp_path, photos):
    (tmp_path / "mine").mkdir()
    photos[0].image.crop((0, 0, 200, 150)).save(tmp_path / "mine" / "red_barn.jpg", quality=90)
    got = folder_photos(str(tmp_path / "mine"))
    assert [(p.name, p.description, p.image.size) for p in got] == [("red_barn", "red barn", (200, 150))]
    with pytest.raises(FileNotFoundError):
        folder_photos(str(tmp_path))  # no photos directly in it


def test_tar_writer_bytes_equal_webdataset(tmp_path):
    import webdataset as wds

    from infclip.data.writer import tar_writer

    samples = [{"__key__": f"k{i}", "jpg": bytes([i]) * (100 + i), "txt": b"a cat", "json": b"{}"}
               for i in range(3)]
    ours = tar_writer(str(tmp_path / "ours.tar"))
    theirs = wds.TarWriter(str(tmp_path / "wds.tar"), user="infclip", group="infclip", mode=0o644,
                           encoder=False, mtime=0)
    for s in samples:
        ours.write(s)
        theirs.write(s)
    ours.close()
    theirs.close()
    assert (tmp_path / "ours.tar").read_bytes() == (tmp_path / "wds.tar").read_bytes()


def test_writer_runs_with_numpy_and_pil_only(photos, tmp_path):
    """The CLI with --photos imports no webdataset/open_clip/torchvision/torch/sklearn/skimage
    (the GPU hosts lack them)."""
    import subprocess

    export_photos(photos, str(tmp_path / "src"))
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    argv = ["w", "--photos", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--num-samples", "8",
            "--side", "32"]
    heavy = ("webdataset", "open_clip", "torchvision", "torch", "sklearn", "skimage")
    code = (f"import sys, runpy; sys.argv = {argv!r}; runpy.run_path('data/write_photo_shards.py', "
            f"run_name='__main__'); print('HEAVY', [m for m in {heavy!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout and "samples written : 8" in out.stdout
