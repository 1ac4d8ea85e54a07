"""Atomic, step-based checkpoints with keep-last-k pruning.

Layout: ``<run_dir>/checkpoints/step_00000100/`` holding
    model.pt        plain state_dict (no ``module.`` prefix): loads with
                    ``open_clip.create_model_and_transforms(name, pretrained=path)``
                    and ``torch.load(path, weights_only=True)``
    train.pt        optimizer, scheduler, GradScaler, step, counters (rank 0)
    rank_00000.pt   per-rank RNG states (python, numpy, torch CPU/CUDA) and data position
                    (one per rank that wrote it; together they hold the global position,
                    which resumes on another number of ranks: ``infclip.data.pipeline``)
    (+ files of ``on_publish``, e.g. open_clip_config.json / open_clip_model.safetensors)
    manifest.json   size and SHA-256 of every other file (``infclip.manifest``), written last

Invariant: a directory named ``step_*`` is complete. Every rank writes into
``.step_N.tmp``; after a barrier rank 0 runs the publish hooks (which may add files), writes
the manifest over every file then present, and renames the folder, so a kill during the write
leaves only a temporary directory (ignored, then removed) and the previous checkpoint intact.
A published folder that was damaged later (a truncated or overwritten file) fails
verification: resume skips it with a one-line warning, moves it aside as
``step_N.damaged`` (never deleted) and falls back to the newest intact one.

A full disk (``ENOSPC``/``EDQUOT``, or torch's zip writer failing on a short write) raises
``DiskFull``, one paragraph naming the disk and the room needed, after the temporary folder
is removed; nothing is pruned before a publish, so the previous checkpoints are intact.
Before a save rank 0 compares the free space with the expected size (the newest
checkpoint's, else the states' tensor bytes) and raises ``DiskFull`` before writing.

Every file loads with ``torch.load(..., weights_only=True)``: the states hold only tensors and
plain Python values (the numpy RNG key is stored as a tensor).
"""

from __future__ import annotations

import errno
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from infclip.manifest import MANIFEST, verify, write_manifest  # noqa: F401 (re-exported)

_STEP_RE = re.compile(r"^step_(\d{8})$")


class DiskFull(Exception):
    """A checkpoint did not fit on its disk (the message is the whole story: a user error)."""


def rng_state() -> dict[str, Any]:
    """Every RNG the step uses, as tensors and plain values (loadable with weights_only=True)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                   "has_gauss": int(has_gauss), "gauss": float(gauss)}
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    if isinstance(n, dict):
        np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    else:  # a checkpoint written before the tensor form: numpy's own tuple
        np.random.set_state(n)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_RE.match(p.name)]
    return sorted(found, key=lambda p: int(p.name[5:]))


def _save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fresh_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


def _fsync_dir(path: Path) -> None:
    """Makes a rename durable (the directory entry itself is on disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpointer:
    """Writes and finds checkpoints of one run; all ranks call ``save`` together.

    ``agree(ok) -> bool`` is a collective returning True iff ``ok`` on every rank (a barrier
    that also carries failure): a write that fails on one rank (full disk, say) raises on
    every rank instead of leaving the others waiting in a barrier until the timeout.
    """

    def __init__(self, run_dir: str | Path, keep_last: int, rank: int, barrier: Callable[[], None],
                 agree: Optional[Callable[[bool], bool]] = None,
                 on_publish: Optional[Callable[[Path, dict], None]] = None):
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last, self.rank = keep_last, rank
        self.agree = agree or (lambda ok: (barrier(), ok)[1])
        self.protected: Optional[Path] = None  # the checkpoint this run resumed from
        self.on_publish = on_publish  # rank 0: (tmp folder, model_state) -> writes extra files before the rename
        # fn(folder) run by rank 0 on the complete temporary folder before its manifest is
        # written and it is published (e.g. export files); what they add is verified too
        self.publish_hooks: list[Callable[[Path], None]] = []
        self.rejected: dict[str, str] = {}  # checkpoint name -> why latest_loadable skipped it
        # infclip.train.remote.RemoteCheckpoints (checkpoint.remote): rank 0 mirrors each published
        # checkpoint there; its failures are warnings, never errors
        self.remote: Any = None

    def save(self, step: int, model_state: dict, train_state: dict, rank_state: dict) -> Path:
        """Writes and publishes checkpoint ``step`` (all ranks). On a full disk: ``DiskFull``
        after the temporary folder is removed; the published checkpoints are untouched."""
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f".step_{step:08d}.tmp"
        need = self._expected_bytes(model_state, train_state)
        try:
            self._together(lambda: self._check_room(final.name, need), rank0_only=True)
            self._together(lambda: _fresh_dir(tmp), rank0_only=True)
            self._together(lambda: _save(rank_state, tmp / f"rank_{self.rank:05d}.pt"), rank0_only=False)
            self._together(lambda: self._publish(tmp, final, model_state, train_state), rank0_only=True)
        except DiskFull:
            raise
        except Exception as e:
            if not _disk_full(e, self.root, need):
                raise
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise DiskFull(self._no_room(final.name, need, "the write failed")) from e
        if self.remote is not None and self.rank == 0:  # after the local publish: local is the truth
            self.remote.mirror(final, self.protected)
        return final

    def _expected_bytes(self, model_state: dict, train_state: dict) -> int:
        """Bytes the next checkpoint takes: the newest one's, else the states' tensors (the
        model twice when open_clip's safetensors copy is written too)."""
        done = list_checkpoints(self.root.parent)
        if done:
            return sum(f.stat().st_size for f in done[-1].rglob("*") if f.is_file())
        copies = 2 if self.on_publish is not None else 1
        return copies * _tensor_bytes(model_state) + _tensor_bytes(train_state)

    def _check_room(self, name: str, need: int) -> None:
        """Rank 0, before anything is written: refuse when ``need`` bytes cannot fit."""
        if _free_bytes(self.root) < need:
            raise DiskFull(self._no_room(name, need, "not enough free space to start it"))

    def _no_room(self, name: str, need: int, what: str) -> str:
        """The paragraph of ``DiskFull``: the disk, the room a checkpoint needs, the fix."""
        usage = shutil.disk_usage(_existing(self.root))
        kept = [p.name for p in list_checkpoints(self.root.parent)]
        return (f"no room for checkpoint {name} on the disk holding {self.root} (mount point "
                f"{_mount_point(self.root)}: {_mb(usage.free)} free of {_mb(usage.total)}): {what}. A checkpoint "
                f"needs about {_mb(need)}, and checkpoint.keep_last + 1 = {self.keep_last + 1} of them must fit "
                f"(the new one is written before the oldest is pruned): {_mb((self.keep_last + 1) * need)}. "
                f"No unfinished temporary folder was left; the previous checkpoints are intact "
                f"({', '.join(kept) or 'none yet'}). Free space on that disk, lower checkpoint.keep_last, or "
                "set run_dir on a larger disk, then start again: resume=auto continues from the newest checkpoint")

    def _together(self, fn: Callable[[], Any], rank0_only: bool) -> None:
        err: Optional[BaseException] = None
        if not rank0_only or self.rank == 0:
            try:
                fn()
            except Exception as e:  # re-raised below, after every rank knows
                err = e
        if not self.agree(err is None):
            raise err if err is not None else RuntimeError("checkpoint write failed on another rank (see its log)")

    def _publish(self, tmp: Path, final: Path, model_state: dict, train_state: dict) -> None:
        """Rank 0: the shared files, then the atomic rename that makes the checkpoint exist."""
        _save(model_state, tmp / "model.pt")
        _save(train_state, tmp / "train.pt")
        if self.on_publish is not None:
            self.on_publish(tmp, model_state)
        for hook in self.publish_hooks:
            hook(tmp)
        write_manifest(tmp)  # last: covers every file now in the folder (the export files too)
        old = final.with_name(f".{final.name}.old")
        if final.exists():  # re-saving a step: move the old one aside, never delete it first
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        shutil.rmtree(old, ignore_errors=True)
        self._prune()

    def _prune(self) -> None:
        for p in [*self.root.glob(".step_*.tmp"), *self.root.glob(".step_*.old")]:
            shutil.rmtree(p, ignore_errors=True)
        ckpts = list_checkpoints(self.root.parent)
        for p in ckpts[: max(0, len(ckpts) - self.keep_last)]:
            if self.protected is None or p.resolve() != self.protected.resolve():
                shutil.rmtree(p, ignore_errors=True)

    def latest_loadable(self, world_size: int, warn: Callable[[str], None] = print) -> Optional[Path]:
        """Newest checkpoint that verifies (``verify_checkpoint``) for ``world_size`` ranks.

        Rank 0 only. Each newer one that fails is named in one ``warn`` line and kept in
        ``rejected``; a damaged one (not merely written for another world size) is moved
        aside to ``step_N.damaged``, so pruning never counts it and a re-save never collides.
        Unfinished ``.step_N.tmp`` folders of an interrupted save are removed first (one line).
        """
        self._recover_moved_aside()
        self._remove_unfinished(warn)
        self.rejected = {}
        for p in reversed(list_checkpoints(self.root.parent)):
            problem = verify_checkpoint(p, world_size)
            if problem is None:
                return p
            self.rejected[p.name] = problem
            if "for world size" in problem:
                warn(f"warning: skipping checkpoint {p}: {problem}")
                continue
            aside = p.with_name(f"{p.name}.damaged")
            if not aside.exists():
                os.replace(p, aside)
            warn(f"warning: skipping damaged checkpoint {p}: {problem}; moved aside to {aside.name}, "
                 "falling back to the previous one")
        return None

    def _remove_unfinished(self, warn: Callable[[str], None]) -> None:
        """Removes the ``.step_N.tmp`` folders an interrupted save left (kill, second Ctrl-C,
        full disk): never a checkpoint, only a partial copy of one (rank 0 only)."""
        if self.rank != 0 or not self.root.is_dir():
            return
        left = sorted(self.root.glob(".step_*.tmp"))
        for p in left:
            if p.is_symlink() or not p.is_dir():  # the link itself, never what it points to
                p.unlink(missing_ok=True)
            else:
                shutil.rmtree(p, ignore_errors=True)
        if left:
            warn(f"removed {', '.join(p.name for p in left)} in {self.root}: unfinished checkpoint "
                 f"write(s) of an interrupted run (the complete checkpoints are untouched)")

    def _recover_moved_aside(self) -> None:
        """A kill between moving a re-saved step aside and renaming its replacement into
        place leaves only ``.step_N.old``: put it back (rank 0 only; it owns renames)."""
        if self.rank != 0 or not self.root.is_dir():
            return
        for old in self.root.glob(".step_*.old"):
            final = old.with_name(old.name[1:-4])
            if not final.exists():
                os.replace(old, final)


def _disk_full(err: BaseException, root: Path, need: int) -> bool:
    """``err`` (or its cause) is ENOSPC/EDQUOT; or torch's zip writer failed on a short write
    (``unexpected pos``, ``file write failed``) while the disk has less than ``need`` free."""
    for e in (err, err.__cause__, err.__context__):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
    text = str(err)
    return ("unexpected pos" in text or "write failed" in text) and _free_bytes(root) < need


def _tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a nested state (dicts, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing ancestor (the checkpoints folder may not exist yet)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(_existing(path)).free


def _mount_point(path: Path) -> str:
    path = _existing(path).resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return str(path)


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


def needed_files(world_size: int) -> tuple[str, ...]:
    """The files a checkpoint needs to resume on ``world_size`` ranks."""
    return ("model.pt", "train.pt", *(f"rank_{r:05d}.pt" for r in range(world_size)))


def saved_world_size(path: Path) -> int:
    """The number of ranks that wrote checkpoint ``path`` (its rank files)."""
    return len(list(path.glob("rank_*.pt")))


def verify_checkpoint(path: Path, world_size: int) -> Optional[str]:
    """None when ``path`` is complete and can resume ``world_size`` ranks; else why not (one
    phrase; "for world size" in it when the checkpoint is intact but written for another).

    A checkpoint written on another number of ranks resumes when its data position's global
    sample order splits over ``world_size`` ranks (``infclip.data.pipeline``: the ranks must
    divide its streams)."""
    problem = verify(path, need=("model.pt", "train.pt"))
    if problem is not None:
        return problem
    written = saved_world_size(path)
    if written == 0 or not all((path / f"rank_{r:05d}.pt").is_file() for r in range(written)):
        names = sorted(p.name for p in path.glob("rank_*.pt"))
        return f"has rank files {names[:4]}, not those of a complete world (rank_00000.pt onwards)"
    if written == world_size:
        return None
    return _world_change_problem(path, written, world_size)


def _world_change_problem(path: Path, written: int, world_size: int) -> Optional[str]:
    """Why the data position of a checkpoint of ``written`` ranks cannot go on with
    ``world_size`` ranks (None when it can)."""
    from infclip.data.pipeline import order_streams

    try:
        streams = order_streams(load_rank_states(path)[0].get("data") or {})
    except Exception as e:  # a rank file that cannot be read: the resume itself says more
        return f"was written on {written} rank(s) and its rank_00000.pt cannot be read for world size {world_size} ({e})"
    if streams is None:
        return (f"was written on {written} rank(s) and holds no data position that resumes on another number: "
                f"not for world size {world_size}")
    if streams % world_size:
        fits = ", ".join(str(d) for d in range(1, streams + 1) if streams % d == 0)
        return (f"was written on {written} rank(s) with a global sample order of {streams} streams, which "
                f"{world_size} rank(s) cannot split (it resumes on {fits} rank(s)): not for world size {world_size}")
    return None


def load(path: Path, rank: int, map_location: Any = "cpu") -> tuple[dict, dict, Optional[dict]]:
    """(model_state, train_state, rank_state) of a checkpoint directory, all with
    ``weights_only=True`` (a checkpoint from before the tensor RNG form allows numpy's arrays).
    ``rank_state`` is None for a rank beyond the world that wrote it (a resume on more ranks)."""
    model_state = torch.load(path / "model.pt", map_location=map_location, weights_only=True)
    train_state = torch.load(path / "train.pt", map_location=map_location, weights_only=True)
    rank_state = _load_rank(path, rank) if rank < max(saved_world_size(path), 1) else None
    return model_state, train_state, rank_state


def load_rank_states(path: Path) -> list[dict]:
    """Every rank's state (RNG and data position) of a checkpoint, rank 0 first."""
    return [_load_rank(path, r) for r in range(saved_world_size(path))]


def _load_rank(path: Path, rank: int) -> dict:
    with torch.serialization.safe_globals(_numpy_rng_globals()):
        return torch.load(path / f"rank_{rank:05d}.pt", map_location="cpu", weights_only=True)


def _numpy_rng_globals() -> list:
    """What an older rank file's numpy RNG tuple (a uint32 array) needs to unpickle."""
    names = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, *names]
