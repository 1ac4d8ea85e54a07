"""data/build_shards.py: argument errors are one line (exit 2), no traceback; links out of
the input folder are skipped and counted unless --follow-links."""

import json
import os
import subprocess
import sys

import pytest
from data_helpers import jpeg

from infclip.data.build import rows_from

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(tmp_path, *args):
    return subprocess.run([sys.executable, os.path.join(REPO, "data", "build_shards.py"), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})


@pytest.mark.parametrize("args, message", [
    (["missing.csv", "--out", "o"], "error: input 'missing.csv' does not exist"),
    (["t.csv", "--out", "o", "--caption-col", "text"], "error: t.csv has no column(s) ['text']"),
    (["t.csv", "--out", "o", "--shard-size", "0"], "error: --shard-size 0 is not valid: it must be a whole number > 0"),
    (["t.csv", "--out", "o", "--workers", "0"], "error: --workers 0 is not valid: it must be >= 1"),
])
def test_argument_errors_are_one_line(tmp_path, args, message):
    (tmp_path / "t.csv").write_text("filepath,caption\na.jpg,a dog\n")
    proc = _cli(tmp_path, *args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith(message) and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "o").exists()


def test_links_out_of_the_input_folder_are_skipped_unless_allowed(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("do not pack me")
    outside = tmp_path / "outside.jpg"
    outside.write_bytes(jpeg(0, side=16))
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.jpg").write_bytes(jpeg(1, side=16))
    (src / "a.txt").symlink_to(secret)
    (src / "b.jpg").symlink_to(outside)
    (src / "c.jpg").write_bytes(jpeg(2, side=16))
    (src / "c.txt").write_text("a cat")
    (src / "d.txt").write_text("target")
    (src / "d.jpg").write_bytes(jpeg(3, side=16))
    (src / "e.jpg").symlink_to(src / "d.jpg")  # a link inside the folder is fine
    rows = dict(rows_from(str(src)))
    assert str(rows[str(src / "a.jpg")]) == "Skip(reason='caption_link_outside_input')"
    assert str(rows[str(src / "b.jpg")]) == "Skip(reason='link_outside_input')"
    assert rows[str(src / "c.jpg")] == "a cat" and rows[str(src / "e.jpg")] == ""
    followed = dict(rows_from(str(src), follow_links=True))
    assert followed[str(src / "a.jpg")] == "do not pack me" and followed[str(src / "b.jpg")] == ""
    proc = _cli(tmp_path, str(src), "--out", str(tmp_path / "o"))
    assert proc.returncode == 0, proc.stderr
    stats = json.loads((tmp_path / "o" / "build_stats.json").read_text())
    assert "caption_link_outside_input=1" in proc.stdout and "link_outside_input=1" in proc.stdout, (proc.stdout, stats)
