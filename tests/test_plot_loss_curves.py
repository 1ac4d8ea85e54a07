"""scripts/bench/plot_loss_curves.py: the noise band of seeds and each other run's verdict
against it, the final-evaluation table, the plot."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))
import plot_loss_curves as plc  # noqa: E402

STEPS = 300


def write_run(path: Path, seed: int, offset: float = 0.0, recall: float = 0.5) -> str:
    """A decaying loss with per-step noise of seed ``seed`` (+ ``offset``), and a final eval record."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for s in range(1, STEPS + 1):
            loss = 2.0 + 6.0 * math.exp(-s / 60) + offset + rng.gauss(0, 0.05)
            f.write(json.dumps({"step": s, "loss": loss, "lr": 1e-3}) + "\n")
        f.write(json.dumps({"step": STEPS, "eval/val/loss": 2.5 + offset, "eval/val/i2t_r1": recall,
                            "eval/val/t2i_r1": recall - 0.1, "eval/val/i2t_r10": recall + 0.2,
                            "eval/val/i2t_r5": recall + 0.1, "eval/val/num_loss_batches": 4}) + "\n")
    return str(path)


def test_a_seed_is_inside_the_band_and_a_shifted_run_is_not(tmp_path, capsys):
    files = [write_run(tmp_path / f"s{i}.jsonl", seed=i) for i in range(3)]
    files.append(write_run(tmp_path / "shifted.jsonl", seed=3, offset=0.15, recall=0.3))
    out = tmp_path / "curves.png"
    verdict = plc.main([*files, "--labels", "bf16-s0,bf16-s1,bf16-s2,shifted", "--band", "2",
                        "--out", str(out)])
    assert verdict == {"bf16-s2": True, "shifted": False}
    text = capsys.readouterr().out
    assert "shifted: OUTSIDE the band" in text and "bf16-s2: inside the band" in text
    row = next(line for line in text.splitlines() if line.startswith("| shifted |"))
    head = next(line for line in text.splitlines() if line.startswith("| run |"))
    cols = [c.strip() for c in head.strip("|").split("|")]
    vals = dict(zip(cols, [c.strip() for c in row.strip("|").split("|")]))
    assert vals["val/loss"] == "2.6500" and vals["val/i2t_r1"] == "0.3000"
    assert "val/num_loss_batches" not in cols  # bookkeeping, not quality
    assert cols.index("val/i2t_r1") < cols.index("val/i2t_r5") < cols.index("val/i2t_r10")  # numbers in order
    assert out.stat().st_size > 10_000  # a PNG with the band and four curves


def test_smoothing_is_a_trailing_mean():
    run = {1: 1.0, 2: 3.0, 3: 5.0, 4: 7.0}
    assert plc.smooth(run, 2) == {1: 1.0, 2: 2.0, 3: 4.0, 4: 6.0}
    assert plc.smooth(run, 1) == run


def test_band_needs_two_seeds_and_a_run_to_judge(tmp_path, capsys):
    files = [write_run(tmp_path / f"s{i}.jsonl", seed=i) for i in range(2)]
    for bad in (["--band", "2"], ["--band", "1"], ["--labels", "only-one"], ["--smooth", "0"]):
        with pytest.raises(SystemExit) as e:
            plc.main([*files, *bad])
        assert e.value.code == 2  # argparse's usage error: one message, exit 2
    err = capsys.readouterr().err
    assert "--band 2: the band needs at least 2 runs" in err and "--smooth 0: a trailing mean" in err
