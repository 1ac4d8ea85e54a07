"""data/build_shards.py on hostile input folders: every file is written or counted by reason,
nothing aborts the build (issue 28, defect 8)."""

import json
import os
import runpy
import sys

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
    assert stats["skipped"] == {"caption_not_utf8": 1, "caption_unreadable": 1, "unknown_extension": 1,
                                "hidden_file": 2}
    assert "wrote 1 samples" in out
    for reason in ("caption_not_utf8=1", "caption_unreadable=1", "hidden_file=2", "unknown_extension=1"):
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
