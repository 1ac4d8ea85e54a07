"""A closed stdout (``train.py | head``) does not end the run: it trains, checkpoints and logs
to the run folder."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "model.name=infclip-micro", "data.synthetic_train=64", "data.synthetic_eval=8",
    "data.synthetic_image_size=32", "data.workers=0", "data.loader_batch=16",
    "batch.global_size=32", "batch.micro_size=16", "logging.wandb_mode=disabled",
    "logging.progress=false", "logging.every_n_steps=1", "eval.tasks=[]", "steps=3",
]


@pytest.mark.timeout(300)
def test_training_goes_on_when_the_reader_of_stdout_is_gone(tmp_path):
    cmd = [sys.executable, str(ROOT / "train.py"), f"data.synthetic_root={tmp_path / 'syn'}",
           f"run_dir={tmp_path / 'run'}", *TINY]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"})
    proc.stdout.readline()  # `| head -1`
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=240) == 0, err[-3000:]
    assert "BrokenPipeError" not in err and "stdout was closed by its reader" in err
    steps = [json.loads(x).get("step") for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {1, 2, 3} <= set(steps)
    assert (tmp_path / "run" / "checkpoints" / "step_00000003" / "manifest.json").is_file()
