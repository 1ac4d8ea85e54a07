"""Which checkpoint a run starts from (``resume=auto`` / ``none`` / a path) and loading it
into the built parts and the loop state."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from infclip.train import checkpoint as ckpt
from infclip.train.distributed import DistInfo, broadcast_object, on_rank0
from infclip.train.engine import unwrap


def maybe_resume(cfg: Any, info: DistInfo, parts: Any, state: Any) -> None:
    """Loads the chosen checkpoint (if any) into model, optimizer, scheduler, scaler, data
    position, RNG and ``state``; all ranks resume the same step."""
    path = _resume_path(cfg, info, parts)
    if path is None:
        return
    model_state, train_state, rank_state = ckpt.load(path, info.rank, map_location=info.device)
    unwrap(parts.model).load_state_dict(model_state)
    parts.optimizer.load_state_dict(train_state["optimizer"])
    parts.scheduler.load_state_dict(train_state["scheduler"])
    if parts.scaler is not None and train_state["scaler"] is not None:
        parts.scaler.load_state_dict(train_state["scaler"])
    state.step, state.samples = train_state["step"], train_state["samples"]
    state.nonfinite_total = train_state["nonfinite_total"]
    parts.data.load_state_dict(rank_state["data"])
    ckpt.set_rng_state(rank_state["rng"])
    parts.checkpointer.protected = path
    if path.parent.resolve() == parts.checkpointer.root.resolve():
        state.saved_step = state.step  # this run's own checkpoint: no need to write it again
    parts.logger.write(f"resumed from {path} at step {state.step}")


def _resume_path(cfg: Any, info: DistInfo, parts: Any) -> Optional[Path]:
    """Rank 0 picks the checkpoint and broadcasts it, so all ranks resume the same step
    (even where a network file system shows ranks different directory listings)."""
    path = on_rank0(info, lambda: _pick_checkpoint(cfg, info, parts))
    return broadcast_object(path, info)


def _pick_checkpoint(cfg: Any, info: DistInfo, parts: Any) -> Optional[Path]:
    existing = ckpt.list_checkpoints(parts.run_dir)
    if cfg.resume == "none":
        if existing:  # a fresh run would mix its checkpoints with the old run's (and prune them)
            raise ValueError(
                f"resume=none but {parts.run_dir}/checkpoints already holds {existing[-1].name}; "
                "choose a new run_dir (or name), delete that folder, or use resume=auto to continue it"
            )
        return None
    if cfg.resume != "auto":
        return _explicit_checkpoint(Path(cfg.resume).expanduser(), info.world_size)
    path = parts.checkpointer.latest_loadable(info.world_size)
    if path is None and existing:
        raise RuntimeError(
            f"checkpoints exist in {parts.run_dir}/checkpoints but none has rank files for world size "
            f"{info.world_size}; resume with the original number of ranks, or choose a new run_dir"
        )
    return path


def _explicit_checkpoint(path: Path, world_size: int) -> Path:
    missing = [n for n in ["model.pt", "train.pt"] + [f"rank_{r:05d}.pt" for r in range(world_size)]
               if not (path / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"resume={str(path)!r} is not a complete checkpoint for {world_size} rank(s): missing {missing[:4]}; "
            "point resume at a checkpoints/step_XXXXXXXX folder written with the same number of ranks"
        )
    return path
