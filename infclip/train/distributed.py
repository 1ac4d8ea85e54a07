"""Run-time facts about the process: rank, world size, device (derived once, never edited).

torchrun (or Slurm's srun wrapper in scripts/slurm) sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT; rendezvous is env://. NCCL on GPU, gloo on CPU.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


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


def init_distributed(device_choice: str, timeout_s: float = 1800) -> DistInfo:
    """Joins the process group when launched by torchrun; a no-op for a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _device(device_choice, local_rank)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, timeout=datetime.timedelta(seconds=timeout_s),
            **({"device_id": device} if device.type == "cuda" else {}),
        )
    return DistInfo(rank, world, local_rank, device)


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def any_rank(flag: bool, info: DistInfo) -> bool:
    """True on every rank if ``flag`` is true on any rank (so all ranks stop together)."""
    if not info.distributed:
        return flag
    t = torch.tensor([int(flag)], device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
