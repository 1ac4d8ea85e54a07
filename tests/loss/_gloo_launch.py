"""Runs a test file as a script on W gloo ranks (``python file case``), with a wall-clock bound.

Assertions run inside the ranks; a failing rank exits non-zero and its log tail is shown, a
deadlocked ring fails at the timeout instead of hanging CI.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

LAUNCH_TIMEOUT_S = 150


def launch(script: str, case: str, world: int, tmp_path: Path, timeout: float = LAUNCH_TIMEOUT_S) -> None:
    env = dict(os.environ, WORLD_SIZE=str(world), OMP_NUM_THREADS="1", INIT=f"file://{tmp_path}/store")
    logs = [tmp_path / f"rank{r}.log" for r in range(world)]
    procs = [
        subprocess.Popen([sys.executable, script, case], env={**env, "RANK": str(r)},
                         stdout=log.open("w"), stderr=subprocess.STDOUT)
        for r, log in enumerate(logs)
    ]
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case}: ranks still running after {timeout} s (deadlock?)\n" + _tails(logs))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode != 0 for p in procs):
        pytest.fail(f"{case}: rank exit codes {[p.returncode for p in procs]}\n" + _tails(logs))


def _tails(logs: list[Path]) -> str:
    return "\n".join(f"--- {log.name} ---\n{log.read_text()[-4000:]}" for log in logs)


def init_rank() -> tuple[int, int]:
    """Child side: join the gloo group described by RANK / WORLD_SIZE / INIT."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=os.environ["INIT"], rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    return rank, world


def init_triton_rank() -> tuple[int, int]:
    """``init_rank`` for cases that run impl="triton" on their ranks. Gloo ranks always hold CPU
    tensors, so their Triton tiles must run under Triton's interpreter even on a GPU machine
    (where the root conftest leaves TRITON_INTERPRET unset and ``pick_backend`` refuses CPU
    tensors). Set here, before anything imports ``infclip.kernels`` (``infclip.loss`` imports
    the kernels lazily, when a Triton backend is first picked)."""
    os.environ["TRITON_INTERPRET"] = "1"
    return init_rank()


def subgroups(rank: int, world: int):
    """(members, group) for each of [0, 1], [0, 1, 2], the non-contiguous [1, 3] and the whole
    world that ``rank`` belongs to. Every rank creates every group (``new_group`` is collective,
    in the same order on all ranks), just before the members use it."""
    import torch.distributed as dist

    for members in ([0, 1], [0, 1, 2], [1, 3], list(range(world))):
        group = dist.new_group(members)
        if rank in members:
            yield members, group


def rel_err(got, want) -> float:
    """max |got - want| / max |want| in float64."""
    got, want = got.double(), want.double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
