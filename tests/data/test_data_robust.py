"""Bad data never crashes a run and never goes unseen: every kind is skipped and counted."""

import io
import os
import random
import tarfile

import pytest
import torch
from torchvision.transforms import PILToTensor, Resize

from data_helpers import IdTokenizer, ids, jpeg, write_shards
from infclip.data.config import DataConfig
from infclip.data.pipeline import DataError, build_train_data
from infclip.data.stream import epoch_shards


def write_tar(path, members):
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))


def good(i):
    return [(f"g{i:04d}.jpg", jpeg(i)), (f"g{i:04d}.txt", f"s{i:06d}".encode())]


class PickyTransform:
    """Resize + uint8, but raise on 13x13 images (stands in for any transform failure)."""

    def __call__(self, img):
        if img.size == (13, 13):
            raise ValueError("cannot handle 13x13")
        return PILToTensor()(Resize((8, 8))(img))


def _small_jpeg(side):
    buf = io.BytesIO()
    from PIL import Image

    Image.new("RGB", (side, side), (1, 2, 3)).save(buf, format="JPEG")
    return buf.getvalue()


def _corrupt_shards(folder):
    """Shards A (sample-level faults, each followed by a good sample), B (tar cut mid-member),
    C (random bytes), D (deleted after start) and E (good, must be read last)."""
    os.makedirs(folder)
    noise = random.Random(0).randbytes(700)
    big = jpeg(7, side=64)
    faults = [
        [("b0.jpg", noise), ("b0.txt", b"random bytes as jpg")],
        [("b1.jpg", big[: len(big) // 2]), ("b1.txt", b"truncated jpg")],
        [("b2.jpg", jpeg(1)), ("b2.json", b"{}")],  # no caption
        [("b3.jpg", jpeg(2)), ("b3.txt", b"   \n")],  # empty caption
        [("b4.xyz", b"???"), ("b4.txt", b"unknown extension")],
        [("b5.txt", b"caption without an image"), ("b5.json", b"{}")],
        [("b6.jpg", _small_jpeg(13)), ("b6.txt", b"transform fails")],
    ]
    members = []
    for i, fault in enumerate(faults):
        members += fault + good(100 + i)
    write_tar(f"{folder}/00000.tar", members)
    write_tar(f"{folder}/00001.tar", [m for i in range(5) for m in good(200 + i)])
    with tarfile.open(f"{folder}/00001.tar") as tar:
        cut = tar.getmember("g0204.jpg").offset_data + 10  # inside the 5th sample's image
    with open(f"{folder}/00001.tar", "r+b") as f:
        f.truncate(cut)
    with open(f"{folder}/00002.tar", "wb") as f:
        f.write(random.Random(1).randbytes(3000))
    write_tar(f"{folder}/00003.tar", good(300))
    write_tar(f"{folder}/00004.tar", good(400) + good(401))
    return 7 + 4 + 2  # good samples readable in one pass


EXPECTED = {"corrupt_image": 2, "missing_caption": 1, "empty_caption": 1, "unknown_extension": 1,
            "missing_image": 1, "transform_error": 1, "truncated_tar": 1, "unreadable_shard": 2}


def _build(spec, seed, num_samples, **kw):
    cfg = DataConfig(kind="wds", shards=spec, **{"loader_batch": 1, "workers": 0, "shuffle_buffer": 0, **kw})
    return build_train_data(cfg, transform=PickyTransform(), tokenizer=IdTokenizer(), rank=0, world_size=1,
                            seed=seed, num_samples=num_samples)


def test_every_kind_of_corruption_is_skipped_and_counted(tmp_path):
    n_good = _corrupt_shards(tmp_path / "s")
    spec = str(tmp_path / "s" / "{00000..00004}.tar")
    # pick a seed whose epoch order reads the good shard E last, so one epoch reads everything
    seed = next(s for s in range(200) if epoch_shards(_build(spec, s, n_good).spec, 0, 0)[-1].endswith("4.tar"))
    data = _build(spec, seed, n_good)
    os.remove(tmp_path / "s" / "00003.tar")  # vanishes after the start: unreadable, not fatal
    it = data.batches()
    got = [ids(next(it)[1])[0] for _ in range(n_good)]
    assert sorted(got) == [100 + i for i in range(7)] + [200 + i for i in range(4)] + [400, 401]
    assert data.skip_counts() == EXPECTED
    assert data.state_dict()["skips"] == EXPECTED  # carried across a resume


def test_counts_are_summed_over_workers(tmp_path):
    os.makedirs(tmp_path / "w")
    for s in range(2):
        write_tar(f"{tmp_path}/w/{s:05d}.tar",
                  [("bad.jpg", b"not a jpeg"), ("bad.txt", b"x")] + [m for i in range(3) for m in good(10 * s + i)])
    data = _build(str(tmp_path / "w" / "{00000..00001}.tar"), 0, 6, workers=2)
    it = data.batches()
    got = sorted(ids(next(it)[1])[0] for _ in range(6))
    assert got == [0, 1, 2, 10, 11, 12]
    assert data.skip_counts() == {"corrupt_image": 2}


def test_bad_json_caption(tmp_path):
    os.makedirs(tmp_path / "j")
    write_tar(f"{tmp_path}/j/00000.tar", [
        ("a.jpg", jpeg(1)), ("a.json", b"{not json"),
        ("b.jpg", jpeg(2)), ("b.txt", b"no json here"),
        ("c.jpg", jpeg(3)), ("c.json", b'{"captions": []}'),
        ("d.jpg", jpeg(4)), ("d.json", b'{"captions": ["s000004", "alt4"]}')])
    data = _build(str(tmp_path / "j" / "00000.tar"), 0, 1, json_caption_key="captions")
    images, tokens = next(data.batches())
    assert ids(tokens) == [4] and images.shape == (1, 3, 8, 8)
    assert data.skip_counts() == {"bad_json": 1, "missing_json": 1, "missing_caption": 1}


def test_shards_that_never_yield_raise_a_clear_error(tmp_path):
    os.makedirs(tmp_path / "x")
    for s in range(2):
        with open(f"{tmp_path}/x/{s:05d}.tar", "wb") as f:
            f.write(b"\0garbage" * 100)
    data = _build(str(tmp_path / "x" / "{00000..00001}.tar"), 0, 4)
    with pytest.raises(DataError, match=r"no training shard gives a sample.*'unreadable_shard': 2"):
        next(data.batches())


def test_a_worker_whose_shards_are_all_empty_borrows_instead_of_stopping_the_run(tmp_path):
    """Shards 0 and 1 are empty, 2 and 3 good; with 2 workers, one worker's whole share is
    the two empty shards. The run still trains (that worker reads the others' shards), the
    empty shards are counted, and the batches are the same after a resume mid-way."""
    write_shards(tmp_path / "h", [6, 6], start=2)
    for empty in ("00000.tar", "00001.tar"):  # valid archives without a member
        write_tar(tmp_path / "h" / empty, [])
    spec = str(tmp_path / "h" / "{00000..00003}.tar")
    seed = next(s for s in range(200) if sorted(os.path.basename(u) for u in
                                                epoch_shards(_build(spec, s, 12, workers=2).spec, 0, 0))
                == ["00000.tar", "00001.tar"])
    data = _build(spec, seed, 12, workers=2)
    it = data.batches()
    got = [ids(next(it)[1])[0] for _ in range(12)]
    assert set(got) <= set(range(12)) and len(set(got)) >= 6, got
    assert data.skip_counts()["empty_shard"] >= 2
    state = data.state_dict()
    tail = [ids(next(it)[1])[0] for _ in range(4)]
    it.close()
    resumed = _build(spec, seed, 12, workers=2)
    resumed.load_state_dict(state)
    it2 = resumed.batches()
    assert [ids(next(it2)[1])[0] for _ in range(4)] == tail
    it2.close()


def test_empty_archive_and_header_cut_are_counted_by_their_reason(tmp_path):
    from collections import Counter

    from infclip.data.shards import iter_samples

    write_tar(tmp_path / "empty.tar", [])
    write_tar(tmp_path / "full.tar", good(1) + good(2) + good(3))
    raw = (tmp_path / "full.tar").read_bytes()
    header = raw.index(b"g0003.txt")  # the last sample's caption header
    (tmp_path / "cut_header.tar").write_bytes(raw[: header + 100])
    (tmp_path / "cut_between.tar").write_bytes(raw[:header])
    for name, n, counts in (("empty.tar", 0, {"empty_shard": 1}), ("full.tar", 3, {}),
                            ("cut_header.tar", 2, {"truncated_tar": 1}), ("cut_between.tar", 2, {"truncated_tar": 1})):
        c = Counter()
        got = list(iter_samples(str(tmp_path / name), c))
        assert len(got) == n and dict(c) == counts, (name, len(got), dict(c))
        assert all("txt" in sample for sample in got)  # never a sample that lost its caption


def test_failing_pipe_command_is_counted_not_fatal(tmp_path):
    os.makedirs(tmp_path / "p")
    write_tar(f"{tmp_path}/p/00000.tar", good(1) + good(2))
    spec = f"pipe:cat {tmp_path}/p/00000.tar::pipe:cat {tmp_path}/p/does-not-exist.tar"
    seed = next(s for s in range(200) if epoch_shards(_build(spec, s, 2).spec, 0, 0)[-1].endswith("00000.tar"))
    data = _build(spec, seed, 2)
    it = data.batches()
    assert sorted(ids(next(it)[1])[0] for _ in range(2)) == [1, 2]
    assert data.skip_counts() == {"unreadable_shard": 1}
