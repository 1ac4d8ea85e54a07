"""Runs the real train.py on a micro config as a child process, for kill/signal tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]

# Deterministic on CPU: micro model, tiny synthetic data, two micro-batches per step (the
# gradient cache and its RNG replay are on), one loader worker (its position is resumed).
MICRO = [
    "model.name=infclip-micro", "data.synthetic_train=256", "data.synthetic_eval=64",
    "data.synthetic_image_size=32", "data.workers=1", "data.loader_batch=16",
    "batch.global_size=32", "batch.micro_size=16", "logging.every_n_steps=1",
    "logging.wandb_mode=disabled", "logging.progress=false", "eval.tasks=[]", "device=cpu",
]


def train_cmd(data_root: Path, run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), f"data.synthetic_root={data_root}",
            f"run_dir={run_dir}", *MICRO, *overrides]


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "INFCLIP_"))}
    env.update(WANDB_MODE="disabled", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def run(cmd: list[str], cwd: Path, env: Optional[dict] = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env or child_env(), capture_output=True, text=True, timeout=timeout)


def start(cmd: list[str], cwd: Path, log: Path, env: Optional[dict] = None) -> subprocess.Popen:
    """Starts a training process writing stdout+stderr to ``log``, in a process group of its
    own (as under torchrun), so a test can signal it with its data-loader workers."""
    return subprocess.Popen(cmd, cwd=cwd, env=env or child_env(), stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def records(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line still being written
            pass
    return out


def step_records(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if "loss" in r]


def wait_for(proc: subprocess.Popen, log: Path, ready, what: str, timeout: float = 240) -> None:
    """Polls ``ready()`` until it is true; fails if the process exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        if proc.poll() is not None:
            raise AssertionError(f"training exited ({proc.returncode}) before {what}:\n{log.read_text()[-4000:]}")
        time.sleep(0.01)
    proc.kill()
    raise AssertionError(f"{what} not reached in {timeout} s:\n{log.read_text()[-4000:]}")


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, log: Path, timeout: float = 240) -> int:
    """Polls metrics.jsonl until ``step`` is logged; returns the newest logged step."""
    logged = lambda: [r["step"] for r in step_records(run_dir)]  # noqa: E731
    wait_for(proc, log, lambda: max(logged(), default=-1) >= step, f"step {step}", timeout)
    return max(logged())


def start_and_kill(cmd: list[str], run_dir: Path, step: int, cwd: Path, log: Path) -> None:
    """Start a training, SIGKILL it once ``step`` is logged (the kill may land mid-step or
    mid-checkpoint) and check it died of that signal."""
    proc = start(cmd, cwd=cwd, log=log)
    wait_for_step(proc, run_dir, step, log)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


def losses_by_step(run_dir: Path) -> dict[int, list[float]]:
    """Every logged loss of every step (a step re-run after a resume appears twice)."""
    out: dict[int, list[float]] = {}
    for r in step_records(run_dir):
        out.setdefault(r["step"], []).append(r["loss"])
    return out


def reference_run(tmp: Path, data_root: Path, steps: int, *overrides: str) -> tuple[Path, dict[int, float]]:
    """An uninterrupted run in ``tmp/run``: its folder and its one loss per step."""
    proc = run(train_cmd(data_root, tmp / "run", *overrides), cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = losses_by_step(tmp / "run")
    assert sorted(losses) == list(range(1, steps + 1)) and all(len(v) == 1 for v in losses.values())
    return tmp / "run", {s: v[0] for s, v in losses.items()}
