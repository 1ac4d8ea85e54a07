"""Atomic, step-based checkpoints with keep-last-k pruning.

Layout: ``<run_dir>/checkpoints/step_00000100/`` holding
    model.pt        plain state_dict (no ``module.`` prefix): loads with
                    ``open_clip.create_model_and_transforms(name, pretrained=path)``
                    and ``torch.load(path, weights_only=True)``
    train.pt        optimizer, scheduler, GradScaler, step, counters (rank 0)
    rank_00000.pt   per-rank RNG states (python, numpy, torch CPU/CUDA) and data position

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


class Checkpointer:
    """Writes and finds checkpoints of one run; all ranks call ``save`` together."""

    def __init__(self, run_dir: str | Path, keep_last: int, rank: int, barrier: Callable[[], None]):
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last, self.rank, self.barrier = keep_last, rank, barrier
        self.protected: Optional[Path] = None  # the checkpoint this run resumed from

    def save(self, step: int, model_state: dict, train_state: dict, rank_state: dict) -> Path:
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f".step_{step:08d}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.barrier()
        _save(rank_state, tmp / f"rank_{self.rank:05d}.pt")
        if self.rank == 0:
            _save(model_state, tmp / "model.pt")
            _save(train_state, tmp / "train.pt")
        self.barrier()
        if self.rank == 0:
            if final.exists():  # re-saving the same step (e.g. final save after a periodic one)
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune()
        self.barrier()
        return final

    def _prune(self) -> None:
        for p in self.root.glob(".step_*.tmp"):
            shutil.rmtree(p, ignore_errors=True)
        ckpts = list_checkpoints(self.root.parent)
        for p in ckpts[: max(0, len(ckpts) - self.keep_last)]:
            if self.protected is None or p.resolve() != self.protected.resolve():
                shutil.rmtree(p, ignore_errors=True)

    def latest_loadable(self, world_size: int) -> Optional[Path]:
        """Newest checkpoint whose files all exist (rank files for ``world_size`` ranks)."""
        for p in reversed(list_checkpoints(self.root.parent)):
            needed = ["model.pt", "train.pt"] + [f"rank_{r:05d}.pt" for r in range(world_size)]
            if all((p / n).is_file() for n in needed):
                return p
        return None


def load(path: Path, rank: int, map_location: Any = "cpu") -> tuple[dict, dict, dict]:
    """(model_state, train_state, rank_state) of a checkpoint directory."""
    model_state = torch.load(path / "model.pt", map_location=map_location, weights_only=True)
    # train/rank states hold numpy RNG tuples and python objects: trusted, our own files.
    train_state = torch.load(path / "train.pt", map_location=map_location, weights_only=False)
    rank_state = torch.load(path / f"rank_{rank:05d}.pt", map_location="cpu", weights_only=False)
    return model_state, train_state, rank_state
