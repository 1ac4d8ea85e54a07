"""scripts/gpu_spy_run.py: py-spy raw stacks summarised per thread (shares of leaf chains)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from gpu_spy_run import parse, short, summarize  # noqa: E402


def test_summary_ranks_threads_and_leaf_chains(tmp_path):
    raw = tmp_path / "spy.txt"
    raw.write_text(
        "thread (1): MainThread;main (train.py:9);wait (threading.py:355) 30\n"
        "thread (1): MainThread;main (train.py:9);launch (triton/run.py:291) 10\n"
        "thread (7): jpeg-ahead_0;run (x.py:1);part (jpeg_backends.py:149) 9\n"
        "not a stack line\n")
    stacks = parse(raw)
    assert len(stacks) == 3 and stacks[0][1] == 30
    assert short("part (infclip/data/jpeg_backends.py:149)") == "part:149"
    text = summarize(stacks, threads=2, frames=2, top=5).splitlines()
    assert text[0] == "49 samples over 2 threads"
    assert text[1] == "== thread (1): MainThread: 40"
    assert text[2].split() == ["75.0%", "wait:355", "<-", "main:9"]
    assert text[3].split() == ["25.0%", "launch:291", "<-", "main:9"]
    assert text[4] == "== thread (7): jpeg-ahead_0: 9"
