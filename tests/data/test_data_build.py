"""data/build_shards.py: tables and image folders -> shards the pipeline reads back."""

import io
import json
import os
import runpy
import sys
import tarfile
import types

from PIL import Image
from torchvision.transforms import PILToTensor

from data_helpers import jpeg
from infclip.data.build import BuildOptions, build_shards, read_table, rows_from
from infclip.data.shards import count_samples, expand

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _images(folder, n):
    os.makedirs(folder, exist_ok=True)
    for i in range(n):
        with open(os.path.join(folder, f"img{i}.jpg"), "wb") as f:
            f.write(jpeg(i, side=24))


def _members(shard):
    with tarfile.open(shard) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def test_csv_table_with_failures(tmp_path):
    _images(tmp_path / "imgs", 5)
    (tmp_path / "imgs" / "bad.jpg").write_bytes(b"definitely not a jpeg")
    rows = ["filepath,caption"] + [f"imgs/img{i}.jpg,caption {i}" for i in range(4)] + [
        "imgs/missing.jpg,lost", "imgs/img4.jpg,  ", "imgs/bad.jpg,corrupt", "imgs/img0.gif,odd"]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    report = build_shards(rows_from(str(tmp_path / "t.csv")), BuildOptions(str(tmp_path / "out"), shard_size=3),
                          progress=False)
    assert report.written == 4 and report.shards == 2
    assert dict(report.skipped) == {"missing_image": 1, "empty_caption": 1, "corrupt_image": 1,
                                    "unknown_extension": 1}
    urls = expand(str(tmp_path / "out" / "{00000..00001}.tar"))
    assert count_samples(urls) == 4
    first = _members(urls[0])
    assert first["000000000.jpg"] == (tmp_path / "imgs" / "img0.jpg").read_bytes()  # copied byte for byte
    assert first["000000002.txt"] == b"caption 2"
    meta = json.loads(first["000000001.json"])
    assert meta["url"].endswith("img1.jpg") and meta["width"] == 24
    stats = json.load(open(tmp_path / "out" / "build_stats.json"))
    assert stats["written"] == 4 and stats["input_rows"] == 8


def test_tsv_and_image_root(tmp_path):
    _images(tmp_path / "elsewhere", 2)
    (tmp_path / "t.tsv").write_text("path\ttext\nimg0.jpg\ta, b\nimg1.jpg\tc\n")
    rows = read_table(str(tmp_path / "t.tsv"), "path", "text", image_root=str(tmp_path / "elsewhere"))
    assert rows == [(str(tmp_path / "elsewhere" / "img0.jpg"), "a, b"), (str(tmp_path / "elsewhere" / "img1.jpg"), "c")]


def test_parquet_rows_through_pyarrow(tmp_path, monkeypatch):
    table = types.SimpleNamespace(to_pydict=lambda: {"fp": ["a.jpg", "/abs/b.jpg"], "cap": ["x", None]})
    fake = types.ModuleType("pyarrow.parquet")
    fake.read_table = lambda path, columns: table
    monkeypatch.setitem(sys.modules, "pyarrow", types.ModuleType("pyarrow"))
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", fake)
    rows = read_table(str(tmp_path / "t.parquet"), "fp", "cap")
    assert rows == [(str(tmp_path / "a.jpg"), "x"), ("/abs/b.jpg", "")]


def test_folder_with_sidecars_resized_via_cli(tmp_path, capsys):
    _images(tmp_path / "src" / "a", 3)
    _images(tmp_path / "src" / "b", 2)
    for sub, n in (("a", 3), ("b", 2)):
        for i in range(n):
            if (sub, i) != ("b", 1):  # one image without a sidecar caption
                (tmp_path / "src" / sub / f"img{i}.txt").write_text(f"{sub} {i}\n")
    (tmp_path / "src" / "a" / "notes.md").write_text("ignored")
    argv = [str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--resize", "8", "--shard-size", "10"]
    monkey_argv = ["build_shards.py"] + argv
    old, sys.argv = sys.argv, monkey_argv
    try:
        runpy.run_path(os.path.join(REPO, "data", "build_shards.py"), run_name="__main__")
    finally:
        sys.argv = old
    out = capsys.readouterr().out
    assert "wrote 4 samples in 1 shards" in out and "empty_caption=1" in out
    members = _members(str(tmp_path / "out" / "00000.tar"))
    assert [members[f"00000000{i}.txt"] for i in range(4)] == [b"a 0", b"a 1", b"a 2", b"b 0"]
    img = Image.open(io.BytesIO(members["000000003.jpg"]))
    assert img.size == (8, 8) and PILToTensor()(img).shape == (3, 8, 8)


def test_shard_byte_limit_and_parallel_workers(tmp_path):
    _images(tmp_path / "imgs", 12)
    rows = [(str(tmp_path / "imgs" / f"img{i}.jpg"), f"c{i}") for i in range(12)]
    size = os.path.getsize(rows[0][0])
    opts = BuildOptions(str(tmp_path / "out"), shard_size=100, max_shard_bytes=4 * size, workers=2)
    report = build_shards(rows, opts, progress=False)
    sizes = json.load(open(tmp_path / "out" / "sizes.json"))
    assert report.written == 12 and report.shards >= 3 and sum(sizes.values()) == 12
    assert max(sizes.values()) <= 4
    names = [n for s in sorted(sizes) for n in _members(str(tmp_path / "out" / s)) if n.endswith(".txt")]
    assert names == [f"{i:09d}.txt" for i in range(12)]  # order kept with workers
