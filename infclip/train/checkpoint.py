"""Atomic, step-based checkpoints with keep-last-k pruning.

Layout: ``<run_dir>/checkpoints/step_00000100/`` holding
    model.pt        plain state_dict (no ``module.`` prefix): loads with
                    ``open_clip.create_model_and_transforms(name, pretrained=path)``
                    and ``torch.load(path, weights_only=True)``
    train.pt        optimizer, scheduler, GradScaler, step, counters (rank 0)
    rank_00000.pt   per-rank RNG states (python, numpy, torch CPU/CUDA) and data position
    (+ files of ``on_publish``, e.g. open_clip_config.json / open_clip_model.safetensors)

Invariant: a directory named ``step_*`` is complete. Every rank writes into
``.step_N.tmp``; after a barrier rank 0 renames it, so a kill during the write leaves
only a temporary directory (ignored, then removed) and the previous checkpoint intact.
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

_STEP_RE = re.compile(r"^step_(\d{8})$")


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
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

    def latest_loadable(self, world_size: int) -> Optional[Path]:
        """Newest checkpoint whose files all exist (rank files for ``world_size`` ranks)."""
        self._recover_moved_aside()
        for p in reversed(list_checkpoints(self.root.parent)):
            needed = ["model.pt", "train.pt"] + [f"rank_{r:05d}.pt" for r in range(world_size)]
            if all((p / n).is_file() for n in needed):
                return p
        return None


    def _recover_moved_aside(self) -> None:
        """A kill between moving a re-saved step aside and renaming its replacement into
        place leaves only ``.step_N.old``: put it back (rank 0 only; it owns renames)."""
        if self.rank != 0 or not self.root.is_dir():
            return
        for old in self.root.glob(".step_*.old"):
            final = old.with_name(old.name[1:-4])
            if not final.exists():
                os.replace(old, final)


def load(path: Path, rank: int, map_location: Any = "cpu") -> tuple[dict, dict, dict]:
    """(model_state, train_state, rank_state) of a checkpoint directory."""
    model_state = torch.load(path / "model.pt", map_location=map_location, weights_only=True)
    # train/rank states hold numpy RNG tuples and python objects: trusted, our own files.
    train_state = torch.load(path / "train.pt", map_location=map_location, weights_only=False)
    rank_state = torch.load(path / f"rank_{rank:05d}.pt", map_location="cpu", weights_only=False)
    return model_state, train_state, rank_state
