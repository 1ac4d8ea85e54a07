"""Run-time facts about the process: rank, world size, device (derived once, never edited).

torchrun (or Slurm's srun wrapper in scripts/slurm) sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT; rendezvous is env://. NCCL on GPU, gloo on CPU.
"""

from __future__ import annotations

import datetime
import os
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


def init_distributed(device_choice: str, timeout_s: float = 1800) -> DistInfo:
    """Joins the process group when launched by torchrun; a no-op for a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _device(device_choice, local_rank)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, timeout=datetime.timedelta(seconds=timeout_s), **_nccl_kwargs(device),
        )
    return DistInfo(rank, world, local_rank, device)


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

