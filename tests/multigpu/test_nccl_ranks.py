"""Multi-GPU checks under NCCL, on every visible GPU (2 or more): the ring against the one-GPU
loss, the DDP engine's steps against one process, and a killed rank's resume against
uninterrupted runs. Run by ``scripts/gpu_tests/run.sh OUT --multi``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs 2 or more CUDA GPUs (scripts/gpu_tests/run.sh --multi)")
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def torchrun(args: list[str], log: Path, timeout: float) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={GPUS}", *args]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONPATH=str(REPO), OMP_NUM_THREADS="4")
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=timeout)
    assert proc.returncode == 0, log.read_text()[-6000:]


@pytest.mark.parametrize("case", ["ring", "ddp"])
def test_ranks_match_one_process(case, tmp_path):
    torchrun([str(HERE / "_nccl_case.py"), case], tmp_path / f"{case}.log", timeout=240)


def test_a_killed_rank_resumes_within_the_run_to_run_spread(tmp_path):
    """SIGKILL one training process mid-run (step pipeline and prefetch on, the defaults):
    torchrun restarts every rank from the last checkpoint, and each step's loss equals the
    uninterrupted runs' within their own spread (two of them)."""
    out = tmp_path / "resume"
    cmd = [sys.executable, str(REPO / "scripts/slurm/resume_check.py"), "--nproc", str(GPUS), "--mode", "worker",
           "--steps", "12", "--ckpt-every", "4", "--kill-at", "6", "--refs", "2", "--parallel", "--tol", "1e-6",
           "--out", str(out), "--", "batch.global_size=1024", "batch.micro_size=256", "eval.tasks=[]",
           "logging.wandb_mode=disabled"]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=400)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "PASS" in proc.stdout
