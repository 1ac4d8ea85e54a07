"""The clip_benchmark commands we print (``infclip.eval.wds_export``'s and docs/eval.md's)
reproduce our fp32 numbers: they pass ``--no_amp`` (clip_benchmark's autocast default moves
accuracies in the third decimal). tests/eval/test_eval_docs.py runs the documented one."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]


def test_wds_export_prints_a_clip_benchmark_command_in_fp32(tmp_path):
    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(8):
            Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(tmp_path / "imgs" / cls / f"{i}.png")
    proc = subprocess.run([sys.executable, "-m", "infclip.eval.wds_export", str(tmp_path / "imgs"), "--out",
                           str(tmp_path / "wds")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    command = next(x for x in proc.stdout.splitlines() if x.startswith("clip_benchmark eval "))
    assert " --no_amp" in command and "--dataset wds/wds " in command


def test_the_documented_clip_benchmark_command_runs_in_fp32():
    text = (ROOT / "docs" / "eval.md").read_text()
    commands = re.findall(r"^clip_benchmark eval [^\n]*(?:\\\n[^\n]*)*", text, flags=re.M)
    assert commands and all("--no_amp" in c for c in commands)
