"""Atomic, step-based checkpoints with keep-last-k pruning.

Layout: ``<run_dir>/checkpoints/step_00000100/`` holding
    model.pt        plain state_dict (no ``module.`` prefix): loads with
                    ``open_clip.create_model_and_transforms(name, pretrained=path)``
                    and ``torch.load(path, weights_only=True)``
    train.pt        optimizer, scheduler, GradScaler, step, counters (rank 0)
    rank_00000.pt   per-rank RNG states (python, numpy, torch CPU/CUDA) and data position
    (+ files of ``on_publish``, e.g. open_clip_config.json / open_clip_model.safetensors)
    manifest.json   size and SHA-256 of every other file (``infclip.manifest``), written last

Invariant: a directory named ``step_*`` is complete. Every rank writes into
``.step_N.tmp``; after a barrier rank 0 runs the publish hooks (which may add files), writes
the manifest over every file then present, and renames the folder, so a kill during the write
leaves only a temporary directory (ignored, then removed) and the previous checkpoint intact.
A published folder that was damaged later (a truncated or overwritten file) fails
verification: resume skips it with a one-line warning, moves it aside as
``step_N.damaged`` (never deleted) and falls back to the newest intact one.

Every file loads with ``torch.load(..., weights_only=True)``: the states hold only tensors and
plain Python values (the numpy RNG key is stored as a tensor).
"""

from __future__ import annotations

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

    def save(self, step: int, model_state: dict, train_state: dict, rank_state: dict) -> Path:
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f".step_{step:08d}.tmp"
        self._together(lambda: _fresh_dir(tmp), rank0_only=True)
        self._together(lambda: _save(rank_state, tmp / f"rank_{self.rank:05d}.pt"), rank0_only=False)
        self._together(lambda: self._publish(tmp, final, model_state, train_state), rank0_only=True)
        return final

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


def needed_files(world_size: int) -> tuple[str, ...]:
    """The files a checkpoint needs to resume on ``world_size`` ranks."""
    return ("model.pt", "train.pt", *(f"rank_{r:05d}.pt" for r in range(world_size)))


def verify_checkpoint(path: Path, world_size: int) -> Optional[str]:
    """None when ``path`` can resume ``world_size`` ranks; else why not (one phrase)."""
    rank_files = [f"rank_{r:05d}.pt" for r in range(world_size)]
    problem = verify(path, need=("model.pt", "train.pt"))
    if problem is None and not all((path / n).is_file() for n in rank_files):
        written = sorted(p.name for p in path.glob("rank_*.pt"))
        return f"has rank files {written[:4]}, not those for world size {world_size}"
    return problem


def load(path: Path, rank: int, map_location: Any = "cpu") -> tuple[dict, dict, dict]:
    """(model_state, train_state, rank_state) of a checkpoint directory, all with
    ``weights_only=True`` (a checkpoint from before the tensor RNG form allows numpy's arrays)."""
    model_state = torch.load(path / "model.pt", map_location=map_location, weights_only=True)
    train_state = torch.load(path / "train.pt", map_location=map_location, weights_only=True)
    with torch.serialization.safe_globals(_numpy_rng_globals()):
        rank_state = torch.load(path / f"rank_{rank:05d}.pt", map_location="cpu", weights_only=True)
    return model_state, train_state, rank_state


def _numpy_rng_globals() -> list:
    """What an older rank file's numpy RNG tuple (a uint32 array) needs to unpickle."""
    names = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, *names]
