"""Leaving a torchrun job's process group, for the trainer and the eval command alike.

``torch.distributed.destroy_process_group`` only drops the package's own references. A group
object still referenced elsewhere (the DDP model, cyclic garbage once training returns; the
eval command's ``Dist``; the frames an error's traceback holds) keeps the backend's native
threads (gloo's workers, NCCL's watchdog) alive into interpreter finalization, where they can
abort the process ("terminate called without an active exception", SIGABRT) after a finished
run, or in place of an error's exit status 2 (most likely a worker that needs the GIL, ended by
the exiting interpreter). Collecting the garbage as well runs the group's destructor, which
joins those threads while the interpreter is alive.
"""

from __future__ import annotations

import gc

import torch.distributed as dist


def leave() -> None:
    """Destroys the default process group (if any) and collects cyclic garbage now. Idempotent:
    call it where the process is done with the group, and again once an error's traceback is
    gone (the group object it kept is freed only then)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
