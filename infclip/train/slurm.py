"""Slurm glue for the trainer: requeue after a preemption warning, and the torch.distributed
environment for tasks that submitit (``hydra/launcher=slurm``) starts without torchrun.

The sbatch template in ``scripts/slurm/`` starts torchrun on every node, which sets RANK,
WORLD_SIZE, LOCAL_RANK and MASTER_* itself; there nothing here is needed but ``requeue``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional


def job_id() -> Optional[str]:
    """The id ``scontrol requeue`` takes (``<array job>_<task>`` for array jobs), or None."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return os.environ.get("SLURM_JOB_ID")


def requeue() -> bool:
    """``scontrol requeue <job>`` when running under Slurm; True if the request was accepted.

    Called by rank 0 after the preemption checkpoint is complete. Requeueing terminates the
    job (SIGTERM, then SIGKILL after Slurm's KillWait) and puts it back in the queue; the
    next start finds the checkpoint with ``resume=auto``. ``INFCLIP_REQUEUE=0`` disables it.
    Under ``scripts/slurm/train.sbatch`` (``INFCLIP_REQUEUE_FILE`` set) rank 0 only writes that
    file and the batch script requeues after srun returns: a requeue from inside the job step
    killed torchrun while it was still shutting down (a traceback and an srun error in the log).
    """
    job = job_id()
    if not job or os.environ.get("INFCLIP_REQUEUE", "1") == "0":
        return False
    marker = os.environ.get("INFCLIP_REQUEUE_FILE")
    if marker:  # scripts/slurm/train.sbatch requeues once srun (every rank, torchrun) has exited
        tmp = f"{marker}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{job}\n")
        os.replace(tmp, marker)
        print(f"slurm: job {job} will be requeued by its batch script once every rank has exited; "
              "it resumes from the last checkpoint", flush=True)
        return True
    cmd = [os.environ.get("INFCLIP_SCONTROL", "scontrol"), "requeue", job]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"slurm: could not run {' '.join(cmd)}: {e}; resubmit the job by hand", file=sys.stderr)
        return False
    if proc.returncode != 0:
        print(f"slurm: {' '.join(cmd)} failed ({proc.stderr.strip()}); is the job requeueable "
              "(sbatch --requeue)?", file=sys.stderr)
        return False
    print(f"slurm: requeued job {job}; it resumes from the last checkpoint", flush=True)
    return True


def export_submitit_env() -> None:
    """Sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT in a submitit Slurm task.

    submitit (hydra-submitit-launcher) starts one task per GPU with srun, not torchrun, so
    nothing sets the env:// variables. A no-op outside submitit or when RANK is already set
    (torchrun), and for single-task jobs.
    """
    if "RANK" in os.environ or os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return
    if int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
        return
    import submitit  # present whenever SUBMITIT_EXECUTOR is set

    # Keep CUDA_VISIBLE_DEVICES (all of the node's GPUs): the trainer picks cuda:LOCAL_RANK.
    submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
