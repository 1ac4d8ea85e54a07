"""Run-time facts about the process: rank, world size, device (derived once, never edited).

torchrun (or Slurm's srun wrapper in scripts/slurm) sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT; rendezvous is env://. NCCL on GPU, gloo on CPU.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist


T = TypeVar("T")


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _device(choice: str, local_rank: int) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda but CUDA is not available; use device=auto or device=cpu")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _nccl_kwargs(device: torch.device) -> dict:
    """NCCL on a high-priority stream: the loss ring's transfers then get SMs while a tile
    kernel runs, so communication stays hidden behind compute."""
    if device.type != "cuda":
        return {}
    kwargs: dict = {"device_id": device}
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is not None:
        opts = nccl.Options()
        opts.is_high_priority_stream = True
        kwargs["pg_options"] = opts
    return kwargs


class PeersMissing(RuntimeError):
    """The other ranks of the job did not join (or answer) within ``dist.join_timeout_s``."""


WAIT_NOTE_S = 30.0  # a rank still waiting for its peers says so after this long (or half the join timeout)


def init_distributed(device_choice: str, timeout_s: float = 1800, join_timeout_s: Optional[float] = None) -> DistInfo:
    """Joins the process group when launched by torchrun (or by hand: RANK, WORLD_SIZE,
    MASTER_ADDR/PORT); a no-op for a single process. The group's collectives time out after
    ``join_timeout_s`` (default: ``timeout_s``) until :func:`set_collective_timeout` is called,
    so the start (rendezvous, the first collectives) is bounded by it; a rank still waiting
    for its peers after at most 30 s says so on stderr. Raises PeersMissing when they never come."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _device(device_choice, local_rank)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        join = timeout_s if join_timeout_s is None else join_timeout_s
        with waiting_note(rank, world, join):
            try:
                dist.init_process_group(backend, timeout=datetime.timedelta(seconds=join), **_nccl_kwargs(device))
            except (RuntimeError, dist.DistError) as e:  # DistStoreError / "timed out" from the store
                raise peers_missing(rank, world, join, e) from None
    return DistInfo(rank, world, local_rank, device)


def peers_missing(rank: int, world: int, join_s: float, err: BaseException) -> PeersMissing:
    """The one paragraph for peers that never joined or never answered the first collective."""
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    return PeersMissing(
        f"rank {rank} of WORLD_SIZE={world} waited {join_s:g} s (dist.join_timeout_s) for the other ranks at "
        f"{where}, but not all of them came ({first}). Start every rank (torchrun on every node with the same "
        "--nnodes, --rdzv-endpoint / MASTER_ADDR and MASTER_PORT), or raise dist.join_timeout_s for a slow start")


@contextlib.contextmanager
def waiting_note(rank: int, world: int, join_s: float):
    """Prints one line when the block is still waiting after min(30 s, join_s / 2)."""
    note = f"rank {rank}: still waiting for the other ranks of WORLD_SIZE={world} to join " \
           f"(gives up after dist.join_timeout_s={join_s:g} s)"
    timer = threading.Timer(min(WAIT_NOTE_S, join_s / 2), lambda: print(note, file=sys.stderr, flush=True))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def set_collective_timeout(timeout_s: float) -> None:
    """From now on a collective of the default group waits up to ``timeout_s`` (after the start,
    which ran under the join timeout)."""
    if dist.is_initialized():
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s), None)


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def all_ok(ok: bool, info: DistInfo) -> bool:
    """True on every rank iff ``ok`` on every rank: a barrier that also carries failure."""
    if not info.distributed:
        return ok
    t = torch.tensor([int(ok)], device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def on_rank0(info: DistInfo, fn: Callable[[], T]) -> Optional[T]:
    """Runs ``fn`` on rank 0 while the others wait; if it raises, every rank raises (no rank
    is left waiting in a barrier until the collective timeout)."""
    result, err = None, None
    if info.is_main:
        try:
            result = fn()
        except Exception as e:  # re-raised below, after every rank knows
            err = e
    if not all_ok(err is None, info):
        raise err if err is not None else RuntimeError("rank 0 failed (see its log); stopping this rank too")
    return result


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    """Rank 0's ``obj`` on every rank (small picklable objects: paths, flags)."""
    if not info.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]

