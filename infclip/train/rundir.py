"""The run directory: where it is (``derive_run_dir``), who trains in it (``run_dir_lock``)
and what an accepted start records in it (``record_start``: config.yaml, overrides.txt).

One training per run directory: rank 0 holds ``train.lock`` (JSON: host, pid, start time,
Slurm job) from before the model is built until the process ends. A second start on the
same directory refuses, naming the holder. A lock whose owner is gone is stale and taken
over with a warning: same host and the pid no longer runs (or runs a younger process: the
pid was reused), or the same Slurm job id (a requeued job's earlier run, which Slurm ended).
A lock held from another host by another job is never broken: the message says how to
remove it by hand once that run is known to be dead.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Optional

from omegaconf import OmegaConf

from infclip.train.distributed import DistInfo, on_rank0

LOCK_NAME = "train.lock"


class RunDirBusy(RuntimeError):
    """Another training holds this run directory."""


class RunDirUnusable(RuntimeError):
    """The run directory cannot be created or written (permissions, name length, full disk)."""


def record_start(cfg: Any, run_dir: Path, overrides: list[str]) -> None:
    """Rank 0, once the start is accepted (lock held, checkpoint loaded): the resolved
    config and the overrides. A refused start never reaches this, so it leaves the
    folder's record of the run as it was."""
    OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    (run_dir / "overrides.txt").write_text("\n".join(overrides) + "\n")


@contextlib.contextmanager
def run_dir_lock(run_dir: Path, info: DistInfo) -> Iterator[None]:
    """Holds ``run_dir/train.lock`` (rank 0) for the block; every rank raises ``RunDirBusy``
    if it is held by a live training. Creates ``run_dir``; on the way out removes the lock
    and, when the block wrote nothing else into a folder it created, the folder."""
    created = info.is_main and not os.path.exists(run_dir)  # (never raises: a name too long is found below)
    token = on_rank0(info, lambda: acquire(run_dir))
    try:
        yield
    finally:
        if info.is_main and token:
            release(run_dir, token, remove_dir=created)


def acquire(run_dir: Path) -> str:
    """Takes the lock (creating ``run_dir``); returns its token. Raises ``RunDirBusy``, or
    ``RunDirUnusable`` when the folder cannot be created or written."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        return _take(run_dir)
    except OSError as e:
        raise RunDirUnusable(_unusable_message(run_dir, e)) from None


def _unusable_message(run_dir: Path, e: OSError) -> str:
    import errno

    why = {errno.ENAMETOOLONG: "a name in it is longer than the file system allows (usually 255 bytes)",
           errno.EACCES: "no permission", errno.EROFS: "a read-only file system",
           errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded"}.get(e.errno, "")
    return (f"run_dir {run_dir} cannot be created or written ({type(e).__name__}: {e.strerror}"
            f"{'; ' + why if why else ''}); choose another run_dir (or a shorter name) on a writable disk")


def _take(run_dir: Path) -> str:
    lock = run_dir / LOCK_NAME
    mine = {"host": socket.gethostname(), "pid": os.getpid(), "start": time.time(),
            "slurm_job": os.environ.get("SLURM_JOB_ID"), "token": uuid.uuid4().hex}
    for _ in range(3):  # a lock removed between our attempts: try again
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = _read(lock)
            if holder is None:
                continue
            why = stale_reason(holder) if holder else _unreadable_stale(lock)
            if why is None:
                raise RunDirBusy(_busy_message(run_dir, holder)) from None
            print(f"warning: taking over the stale lock {lock} ({why})", file=sys.stderr, flush=True)
            _replace(lock, mine)
            return mine["token"]
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(mine, f)
        except OSError:  # a full disk: no empty lock left behind for the next start to puzzle over
            lock.unlink(missing_ok=True)
            raise
        return mine["token"]
    raise RunDirBusy(f"could not take the lock {lock}: it keeps changing (another start is racing this one)")


def release(run_dir: Path, token: str, remove_dir: bool = False) -> None:
    """Removes the lock if it is still ours; then ``run_dir`` if asked and it is empty."""
    lock = run_dir / LOCK_NAME
    holder = _read(lock)
    if holder is not None and holder.get("token") == token:
        lock.unlink(missing_ok=True)
    if remove_dir:
        with contextlib.suppress(OSError):
            run_dir.rmdir()  # only if empty


def stale_reason(holder: dict) -> Optional[str]:
    """Why the holder is certainly gone, or None while it may still run."""
    job = os.environ.get("SLURM_JOB_ID")
    if job and holder.get("slurm_job") == job and holder.get("pid") != os.getpid():
        return f"held by an earlier run of this Slurm job {job}"
    if holder.get("host") != socket.gethostname():
        return None
    pid = int(holder.get("pid", -1))
    started = _process_start(pid)
    if started is None:
        return f"its process {pid} on this host is gone"
    if started > float(holder.get("start", 0)) + 1.0:
        return f"pid {pid} now belongs to a process started after the lock was taken"
    return None


def _unreadable_stale(lock: Path) -> Optional[str]:
    """A lock without readable content: a start killed between creating and writing it is
    stale once it is a minute old (a live start writes it within microseconds)."""
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return None
    return f"unreadable, {age:.0f} s old" if age > 60 else None


def _busy_message(run_dir: Path, holder: dict) -> str:
    if not holder.get("pid"):  # empty or unreadable: a start writing it this moment, or a broken file
        return (f"run_dir {run_dir} has a lock file {run_dir / LOCK_NAME} that is empty or unreadable and less "
                "than a minute old: another start may be writing it this moment. Wait a minute and start again "
                "(an unreadable lock older than that is taken over), or, if no training uses this run_dir, "
                "delete the lock file.")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("start", 0))))
    return (f"run_dir {run_dir} is in use by another training (pid {holder.get('pid')} on host "
            f"{holder.get('host')}, started {when}; lock file {run_dir / LOCK_NAME}). Two trainings in one "
            "run_dir would overwrite each other's checkpoints. Wait for it to end, give this run another "
            "run_dir (or name), or, if that process is certainly dead, delete the lock file.")


def _process_start(pid: int) -> Optional[float]:
    """Start time (epoch seconds) of a running process, or None if there is none. Where
    /proc is missing, a live pid reports 0.0 (alive, start unknown)."""
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # exists, another user's
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return None  # a zombie: exited, not yet reaped
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return 0.0


def _read(lock: Path) -> Optional[dict]:
    try:
        data = json.loads(lock.read_text())
        return data if isinstance(data, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable or half-written: treated as held by an unknown owner


def _replace(lock: Path, mine: dict) -> None:
    tmp = lock.with_name(f".{LOCK_NAME}.{mine['token']}")
    tmp.write_text(json.dumps(mine))
    os.replace(tmp, lock)


def derive_run_dir(cfg: Any) -> Path:
    """``run_dir`` if set, else ``runs_root/name``; under a Hydra multirun (``-m``) each job
    gets ``runs_root/name/<its override dirname>`` so sweep members never share (and never
    resume from) one directory, while a requeued job finds its own again."""
    if cfg.run_dir:
        return Path(cfg.run_dir).expanduser()
    run_dir = Path(cfg.runs_root, cfg.name).expanduser()
    sub = _multirun_subdir()
    return run_dir / sub if sub else run_dir


def _multirun_subdir() -> Optional[str]:
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
            return None
        job = HydraConfig.get().job
    except ImportError:
        return None
    sub = (job.override_dirname or f"job{job.num}").replace("/", "_")  # one path component
    if len(sub) > 120:  # keep it readable and within file-name limits, still unique
        sub = f"{sub[:100]}-{hashlib.sha1(sub.encode()).hexdigest()[:10]}"
    return sub
