"""data/build_shards.py on hostile input folders: every file is written or counted by reason,
nothing aborts the build, nothing hangs or reads without bound."""

import json
import os
import runpy
import sys

import pytest

from data_helpers import jpeg
from infclip.data.build import BuildOptions, build_shards, rows_from

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _image(path, caption=None, seed=0):
    path.write_bytes(jpeg(seed, side=16))
    if caption is not None:
        path.with_suffix(".txt").write_bytes(caption)


def _build_cli(src, out, capsys, *extra):
    old, sys.argv = sys.argv, ["build_shards.py", str(src), "--out", str(out), *extra]
    try:
        runpy.run_path(os.path.join(REPO, "data", "build_shards.py"), run_name="__main__")
    finally:
        sys.argv = old
    return capsys.readouterr().out, json.loads((out / "build_stats.json").read_text())


def test_bad_captions_and_odd_names_are_skipped_and_counted(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    _image(src / "good.jpg", b"a good caption")
    _image(src / "latin1.jpg", "caf\xe9".encode("latin-1"))  # not UTF-8
    _image(src / "dir.jpg")
    (src / "dir.txt").mkdir()  # a folder where the sidecar caption should be
    _image(src / "anim.gif", b"a gif")
    _image(src / "..jpg", b"hidden")
    _image(src / "._good.jpg")  # macOS AppleDouble: not an image
    out, stats = _build_cli(src, tmp_path / "out", capsys)
    assert stats["written"] == 1
    assert stats["skipped"] == {"caption_not_utf8": 1, "caption_not_regular_file": 1, "unknown_extension": 1,
                                "hidden_file": 2}
    assert "wrote 1 samples" in out
    for reason in ("caption_not_utf8=1", "caption_not_regular_file=1", "hidden_file=2", "unknown_extension=1"):
        assert reason in out


def test_every_file_of_a_folder_is_written_or_counted(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    _image(src / "a.jpg", b"a")
    _image(src / "sub" / "b.png", b"\xff\xfe")
    _image(src / "sub" / "c.jpg")  # no sidecar: empty caption
    (src / "notes.md").write_text("not a sample")
    (src / "orphan.txt").write_text("a caption without an image")
    rows = rows_from(str(src))
    report = build_shards(rows, BuildOptions(str(tmp_path / "out")), progress=False)
    files = [n for _, _, names in os.walk(src) for n in names if not n.endswith(".txt")]
    assert report.written + sum(report.skipped.values()) == len(files) == len(rows) == 4
    assert dict(report.skipped) == {"caption_not_utf8": 1, "empty_caption": 1, "unknown_extension": 1}



@pytest.mark.timeout(30)  # a blocking open of a FIFO would hang here: fail instead
def test_fifos_are_counted_not_opened(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    _image(src / "good.jpg", b"fine")
    os.mkfifo(src / "pipe.jpg")  # nobody ever writes: open() would block forever
    (src / "pipe.txt").write_text("a caption for a FIFO")
    _image(src / "fifo_caption.jpg")
    os.mkfifo(src / "fifo_caption.txt")
    out, stats = _build_cli(src, tmp_path / "out", capsys, "--workers", "2")
    assert stats["written"] == 1
    assert stats["skipped"] == {"image_not_regular_file": 1, "caption_not_regular_file": 1}
    assert "image_not_regular_file=1" in out and "caption_not_regular_file=1" in out


@pytest.mark.timeout(30)
def test_devices_are_not_read_and_images_are_capped(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    _image(src / "good.jpg", b"fine")
    os.symlink("/dev/zero", src / "zero.jpg")  # endless bytes behind a link
    (src / "zero.txt").write_text("a caption for /dev/zero")
    (src / "big.jpg").write_bytes(jpeg(1, side=16) + b"\0" * 2**20)  # a JPEG + 1 MB: over the cap below
    (src / "big.txt").write_text("a large file")
    os.symlink("good.jpg", src / "link.jpg")  # a link to a regular file is read
    (src / "link.txt").write_text("linked")
    # --follow-links: /dev/zero is outside the folder (skipped as such by default); it must not be read either way
    out, stats = _build_cli(src, tmp_path / "out", capsys, "--max-image-mb", "1", "--follow-links")
    assert stats["written"] == 2
    assert stats["skipped"] == {"image_not_regular_file": 1, "image_too_large": 1}
    assert "image_not_regular_file=1" in out and "image_too_large=1" in out
    report = build_shards(rows_from(str(src), follow_links=True), BuildOptions(str(tmp_path / "out2")), progress=False)
    assert report.written == 3 and dict(report.skipped) == {"image_not_regular_file": 1}  # default cap: 64 MB
