"""``data.workers=auto`` and ``data.decode_threads=auto``: loader workers and GPU-decoder threads
per training process, from the cores it may run on and the training processes that share them.

Invariants: every result is >= 1; an explicit number is returned as given; the same machine and
launch give the same numbers (a pure function of :class:`Machine`). The trainer takes the
smallest worker count over its ranks, because the default ``data.streams`` (ranks x workers)
must be the same on every rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

AUTO = "auto"
# Worker counts auto picks from: the default data.streams = ranks x workers then has many
# divisors, so a checkpoint resumes on more world sizes (infclip/data/stream.py).
DIVISIBLE = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
TRAINER_THREADS = 2  # the training process's own busy threads beside the workers: main, step-pipeline filler


@dataclass(frozen=True)
class Machine:
    """What this process may use: ``cores`` (its CPU affinity), of ``all_cores`` on the
    machine, and the training processes on this node (``local_ranks``), which share the
    cores when ``shared``."""

    cores: int
    all_cores: int
    local_ranks: int
    shared: bool
    source: str  # where local_ranks came from, for the startup line


@dataclass(frozen=True)
class Sizing:
    workers: int
    decode_threads: int
    why: str  # one clause per key: what was chosen and why


def this_machine(world_size: int, env: Optional[Mapping[str, str]] = None, gpus: Optional[int] = None) -> Machine:
    """The :class:`Machine` of this process. Local ranks: ``LOCAL_WORLD_SIZE`` (torchrun,
    submitit), else for a distributed run the GPUs on this node (one rank each), else 1. The
    affinity counts as shared by them under torchrun (its processes inherit its affinity) or
    when it is the whole machine; a narrower affinity outside torchrun is this process's own
    binding (Slurm's per-task cores)."""
    env = os.environ if env is None else env
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    all_cores = os.cpu_count() or cores
    if env.get("LOCAL_WORLD_SIZE"):
        local, source = int(env["LOCAL_WORLD_SIZE"]), "LOCAL_WORLD_SIZE"
    elif world_size > 1:
        gpus = _gpus_on_node() if gpus is None else gpus
        local, source = (min(world_size, gpus), "GPUs on this node") if gpus else (1, "no GPU")
    else:
        local, source = 1, "one process"
    shared = "TORCHELASTIC_RUN_ID" in env or cores >= all_cores
    return Machine(cores, all_cores, max(local, 1), shared, source)


def _gpus_on_node() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # no torch CUDA runtime: no GPUs to share the cores with
        return 0


def cores_per_rank(m: Machine) -> int:
    """This process's share of its cores (>= 1)."""
    return max(1, m.cores // m.local_ranks) if m.shared else m.cores


def size_loader(m: Machine, decode: str, workers: Any = AUTO, decode_threads: Any = AUTO) -> Sizing:
    """Loader workers and decoder threads for one training process (``decode``: "cpu" or
    "device", as resolved). Auto workers: on the CPU path the workers decode every image, so
    they get the rank's cores but the trainer's own threads; on the device path they only
    parse headers and pack bytes, and more of them slowed the step (2 ranks on 32 cores:
    14 workers each +24 % replay time, 8 each +9 %), so they get half. Either is rounded down
    to a count in DIVISIBLE. Auto decoder threads (nvImageCodec instances, device path): 2,
    or 1 when the rank has fewer than 8 cores."""
    share = cores_per_rank(m)
    where = _where(m, share)
    if workers == AUTO:
        want = share - TRAINER_THREADS if decode == "cpu" else share // 2
        workers = max(d for d in DIVISIBLE if d <= max(want, 1))
        job = (f"all but {TRAINER_THREADS} of them (the workers decode)" if decode == "cpu"
               else "half of them (the GPU decodes; the workers parse headers)")
        why = f"data.workers=auto: {workers} per rank ({job}, rounded down to one of {DIVISIBLE[:8]}...; {where})"
    else:
        why = f"data.workers={workers} (as set; {where})"
    if decode_threads == AUTO:
        decode_threads = 2 if share >= 8 else 1
        why += f"; data.decode_threads=auto: {decode_threads}"
    return Sizing(int(workers), int(decode_threads), why)


def _where(m: Machine, share: int) -> str:
    if not m.shared:
        return f"{share} cores: this process's own affinity ({m.cores} of {m.all_cores})"
    if m.local_ranks == 1:
        return f"{share} cores in this process's affinity"
    return (f"{share} cores: {m.cores} in the affinity shared by {m.local_ranks} local ranks "
            f"({m.source})")


def check_count(key: str, value: Any, minimum: int) -> None:
    """``value`` is "auto" or a whole number >= ``minimum``; raises ValueError naming ``key``."""
    if value == AUTO:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key} must be auto (sized to this machine's cores) or a whole number >= {minimum}, "
                         f"got {value!r}")
