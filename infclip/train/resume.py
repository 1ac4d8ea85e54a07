"""Which checkpoint a run starts from (``resume=auto`` / ``none`` / a path), loading it into
the built parts and the loop state, and what a resume with a changed config does.

Another number of ranks: the data position is a place in a global sample order that does not
depend on the world size (``infclip.data.stream``), joined from every rank file of the
checkpoint, so a run written on W ranks goes on on W' (any divisor of its ``data.streams``)
with the same global batch in every later step and no sample of the epoch repeated or
skipped; the startup line says so. Ranks beyond the old world start RNG streams of their own.

Changed keys on resume: the optimizer hyperparameters (``optim.lr``, weight decay, betas,
eps) and the schedule (``schedule.*``, ``steps``) apply from the resumed step on (the saved
optimizer/scheduler state would otherwise silently keep the old ones); each change is printed
in one line and recorded in metrics.jsonl. Keys the saved state depends on (architecture,
trainable parameters, optimizer kind, objective, batch and seed) are refused with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from infclip.config import ConfigError
from infclip.data.pipeline import merge_positions
from infclip.data.stream import mix_seed
from infclip.train import checkpoint as ckpt
from infclip.train.distributed import DistInfo, broadcast_object, on_rank0
from infclip.train.engine import unwrap

# key -> why a checkpoint cannot continue under another value
FIXED_ON_RESUME = {
    "model.name": "the saved weights are of that architecture",
    "model.config_file": "the saved weights are of that architecture",
    "model.image_size": "the saved position embeddings have that grid",
    "model.lock_image": "the optimizer state covers exactly the trainable parameters",
    "model.lock_image_unlocked_groups": "the optimizer state covers exactly the trainable parameters",
    "model.lock_text": "the optimizer state covers exactly the trainable parameters",
    "model.lock_text_unlocked_layers": "the optimizer state covers exactly the trainable parameters",
    "optim.name": "the saved optimizer state belongs to that optimizer",
    "loss.kind": "the saved logit scale/bias belong to that objective",
    "task": "the saved weights belong to that task",
    "batch.global_size": "the saved data position counts steps of that many samples",
    "seed": "the data order and the random state replayed on resume follow it",
    "data.streams": "the saved data position is a place in a global sample order of that many streams",
}
APPLIED_ON_RESUME = ("optim.lr", "optim.weight_decay", "optim.beta1", "optim.beta2", "optim.eps",
                     "schedule.", "steps")


class ResumeError(ConfigError):
    """The run cannot resume as configured; the message names the checkpoint and the fix."""


@dataclass
class Loaded:
    """A checkpoint picked and read before the model is built (``load_checkpoint``)."""

    path: Path
    model_state: dict
    train_state: dict
    rank_state: Optional[dict]  # None for a rank beyond the world that wrote it


def load_checkpoint(cfg: Any, info: DistInfo, run_dir: Path, checkpointer: Any) -> Optional[Loaded]:
    """Before any model or data is built: picks the checkpoint to resume (rank 0, broadcast),
    reads it, refuses a change of a key its state depends on, and says ``resumed from <path> at
    step N`` first of the start's lines (the model and data lines follow). None for a fresh start."""
    say = print if info.is_main else (lambda line: None)
    path = _resume_path(cfg, info, run_dir, checkpointer, say)
    if path is None:
        return None
    loaded = Loaded(path, *_load(path, info))
    from omegaconf import OmegaConf

    _refuse_fixed_changes(loaded.train_state.get("config") or {}, OmegaConf.to_container(cfg, resolve=True), path)
    say(f"resumed from {path} at step {loaded.train_state['step']}")
    return loaded


def maybe_resume(cfg: Any, info: DistInfo, parts: Any, state: Any, loaded: Optional[Loaded]) -> dict[str, list]:
    """Puts the checkpoint ``load_checkpoint`` read (if any) into model, optimizer, scheduler,
    scaler, data position, RNG and ``state``; all ranks resume the same step. Returns the applied
    config changes, ``{key: [old, new]}`` ({} for a fresh start or an unchanged config)."""
    if loaded is None:
        return {}
    path, model_state, train_state, rank_state = loaded.path, loaded.model_state, loaded.train_state, loaded.rank_state
    saved_cfg = train_state.get("config") or {}
    unwrap(parts.model).load_state_dict(model_state)
    fresh_groups = [{k: v for k, v in g.items() if k != "params"} for g in parts.optimizer.param_groups]
    parts.optimizer.load_state_dict(train_state["optimizer"])
    parts.scheduler.load_state_dict(train_state["scheduler"])  # restores base_lrs: the saved peak lr
    _apply_hyperparameters(parts.optimizer, parts.scheduler, fresh_groups, cfg.optim.lr)
    if parts.scaler is not None and train_state["scaler"] is not None:
        parts.scaler.load_state_dict(train_state["scaler"])
    state.step, state.samples = train_state["step"], train_state["samples"]
    state.nonfinite_total = train_state["nonfinite_total"]
    written = _load_data_position(path, parts)
    if rank_state is not None:
        ckpt.set_rng_state(rank_state["rng"])
    else:  # a rank the checkpoint's world did not have
        _seed_new_rank(cfg.seed, state.step, info.rank)
    parts.checkpointer.protected = path
    if path.parent.resolve() == parts.checkpointer.root.resolve():
        state.saved_step = state.step  # this run's own checkpoint: no need to write it again
    parts.logger.write(_data_line(cfg, info, parts, state, written))
    changes = config_changes(saved_cfg, parts.config, APPLIED_ON_RESUME)
    saved_lr = (train_state["scheduler"].get("base_lrs") or [cfg.optim.lr])[0]
    if "optim.lr" not in changes and saved_lr != cfg.optim.lr:  # a checkpoint without its config
        changes["optim.lr"] = [saved_lr, cfg.optim.lr]
    for key, (old, new) in changes.items():
        parts.logger.write(f"resume: {key} changed {old!r} -> {new!r}; applied from step {state.step + 1} "
                           f"(lr now {parts.optimizer.param_groups[0]['lr']:.4g})")
    return changes


def _trained_on(data: dict) -> tuple[str, Any]:
    """(the data of a config's ``data`` section in words, what identifies it): the synthetic
    set's parameters, or the shard URLs (a folder and a brace range of its files agree)."""
    if data.get("kind", "synthetic") == "synthetic":
        keys = ("synthetic_train", "synthetic_image_size", "synthetic_seed")
        return ("the embedded synthetic captioned shapes (data.kind=synthetic)",
                ("synthetic", *(data.get(k) for k in keys)))
    specs = [s.get("shards") for s in data.get("sources") or []] or [data.get("shards")]
    words = f"data.shards={specs[0]}" if not data.get("sources") else f"data.sources={specs}"
    return words, tuple(_urls(spec) for spec in specs)


def _urls(spec: Any) -> Any:
    from infclip.data.shards import expand, folder_spec

    try:
        return tuple(expand(folder_spec(str(spec))))
    except ValueError:
        return spec


def refuse_other_data(cfg: Any, run_dir: Path) -> None:
    """``resume=auto`` into a run folder whose checkpoints were trained on other data than
    this command names is refused (it would continue that run on other data), naming both and
    the fix: this run's own ``name=`` or ``run_dir=``. Checked before any model is built,
    against the folder's config.yaml (the accepted start's); nothing to check without one (nor
    where the folder cannot be read: its creation gives that error in one paragraph)."""
    from omegaconf import OmegaConf

    if cfg.resume != "auto":
        return
    try:
        saved_file, existing = run_dir / "config.yaml", ckpt.list_checkpoints(run_dir)
        if not existing or not saved_file.is_file():
            return
    except OSError:  # a name too long, a path through a file, no permission
        return
    saved = OmegaConf.to_container(OmegaConf.load(saved_file), resolve=True).get("data") or {}
    before, asked = _trained_on(saved), _trained_on(OmegaConf.to_container(cfg.data, resolve=True))
    if before[1] == asked[1]:
        return
    name = Path(str(cfg.data.shards).split("{")[0].rstrip("/")).name if cfg.data.kind == "wds" else "synthetic"
    raise ResumeError(
        f"run_dir {run_dir} holds a run trained on {before[0]} (checkpoints up to {existing[-1].name}), and this "
        f"command asks for {asked[0]}: resume=auto would continue that run on other data. Give this run its "
        f"own folder with name={name or 'mine'} (or run_dir=/path/to/new/run); to continue that run, give "
        f"its data again; to start from its weights on the new data, add model.pretrained={existing[-1] / 'model.pt'} "
        f"to the new run.")


def _load_data_position(path: Path, parts: Any) -> int:
    """Every rank reads every rank file's data position and continues the joined one; returns
    the number of ranks that wrote the checkpoint."""
    states = [r.get("data") for r in ckpt.load_rank_states(path)]
    parts.data.load_state_dict(merge_positions(states))
    return len(states)


def _seed_new_rank(seed: int, step: int, rank: int) -> None:
    """RNG of a rank beyond the checkpoint's world: its own stream, a pure function of
    (seed, step, rank) (the data order never depends on it: its seeds are mix_seed's)."""
    import random

    import numpy as np

    value = mix_seed("resume-rank", seed, step, rank)
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)


def _data_line(cfg: Any, info: DistInfo, parts: Any, state: Any, written: int) -> str:
    """The startup line on the data position, saying what a change of world size keeps."""
    where = parts.data.describe()
    if written == info.world_size:
        return f"resume: data at {where}"
    new = "" if info.world_size <= written else f"; ranks {written}..{info.world_size - 1} start RNG streams of their own"
    return (f"resume: written on {written} rank(s), resuming on {info.world_size}: the global sample order goes on at "
            f"{where}; the same global batch ({cfg.batch.global_size} samples, "
            f"{cfg.batch.global_size // info.world_size} per rank) and schedule from step {state.step + 1}, no sample "
            f"of the epoch repeated or skipped{new}")


def _load(path: Path, info: DistInfo) -> tuple[dict, dict, Optional[dict]]:
    try:
        return ckpt.load(path, info.rank, map_location=info.device)
    except Exception as e:
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
        if (path / ckpt.MANIFEST).is_file():  # its bytes are the ones written: not damage
            raise ResumeError(
                f"checkpoint {path} matches its manifest but cannot be loaded ({why}); it was written by "
                "another version of infclip or torch. Resume with that version, or start a new run from "
                f"its weights: model.pretrained={path / 'model.pt'} in another run_dir."
            ) from None
        raise ResumeError(  # a damaged file of a checkpoint without manifest (older version)
            f"checkpoint {path} cannot be loaded ({why}); it has no manifest to verify it by. Resume from "
            "an older one with resume=<its folder>, or move this one aside."
        ) from None


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(saved: dict, current: dict, keys: tuple[str, ...]) -> dict[str, list]:
    """``{key: [saved, current]}`` for dotted keys matching ``keys`` (a trailing ``.`` is a
    prefix) whose value differs; {} when the checkpoint carries no config (older version)."""
    if not saved:
        return {}
    old, new = _flat(saved), _flat(current)
    match = [k for k in new if any(k == p or (p.endswith(".") and k.startswith(p)) for p in keys)]
    return {k: [old.get(k), new[k]] for k in sorted(match) if old.get(k) != new[k]}


def _refuse_fixed_changes(saved: dict, current: dict, path: Path) -> None:
    changed = config_changes(saved, current, tuple(FIXED_ON_RESUME))
    if changed:
        key, (old, new) = next(iter(changed.items()))
        raise ResumeError(
            f"cannot resume {path} with {key}={new!r}: it was written with {key}={old!r}, and "
            f"{FIXED_ON_RESUME[key]}. Resume with {key}={old!r}, or start a new run (another run_dir, "
            "or resume=<checkpoint>/model.pt as model.pretrained for new optimizer state)."
        )


def _apply_hyperparameters(optimizer: torch.optim.Optimizer, scheduler: Any, fresh: list[dict],
                           lr: float) -> None:
    """After loading saved optimizer/scheduler state: the configured hyperparameters win.

    ``Optimizer.load_state_dict`` restores the saved groups' lr, weight decay, betas...; put
    back the values built from this config, then the scheduler's peak (``base_lrs``,
    ``initial_lr``) and the current lr from the (possibly changed) schedule at the saved step.
    With an unchanged config every value is recomputed bit for bit as the saved one.
    """
    for group, built in zip(optimizer.param_groups, fresh):
        group.update({k: v for k, v in built.items() if k not in ("lr", "initial_lr")})
        group["initial_lr"] = lr
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    factors = [f(scheduler.last_epoch) for f in scheduler.lr_lambdas]
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, factors):
        group["lr"] = base * factor
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def _resume_path(cfg: Any, info: DistInfo, run_dir: Path, checkpointer: Any,
                 say: Callable[[str], None]) -> Optional[Path]:
    """Rank 0 picks the checkpoint and broadcasts it, so all ranks resume the same step
    (even where a network file system shows ranks different directory listings)."""
    path = on_rank0(info, lambda: _pick_checkpoint(cfg, info, run_dir, checkpointer, say))
    return broadcast_object(path, info)


def _pick_checkpoint(cfg: Any, info: DistInfo, run_dir: Path, checkpointer: Any,
                     say: Callable[[str], None]) -> Optional[Path]:
    """The checkpoint resume= names (None: a fresh start); ``say`` gets the lines about it."""
    existing = ckpt.list_checkpoints(run_dir)
    if cfg.resume == "none":
        if existing:  # a fresh run would mix its checkpoints with the old run's (and prune them)
            raise ResumeError(
                f"resume=none but {run_dir}/checkpoints already holds {existing[-1].name}; "
                "choose a new run_dir (or name), delete that folder, or use resume=auto to continue it"
            )
        _refuse_used_remote(checkpointer.remote)
        return None
    if cfg.resume != "auto":
        return _explicit_checkpoint(Path(cfg.resume).expanduser(), info.world_size)
    path = checkpointer.latest_loadable(info.world_size, warn=say)
    if path is None and checkpointer.remote is not None:
        path = _from_remote(checkpointer, info.world_size, say)
    if path is None and existing:
        why = "; ".join(f"{name}: {reason}" for name, reason in checkpointer.rejected.items())
        raise ResumeError(
            f"no checkpoint in {run_dir}/checkpoints can resume {info.world_size} rank(s) ({why}). "
            "Resume on a number of ranks named there, point resume= at an intact "
            "checkpoint elsewhere, or choose a new run_dir."
        )
    return path


def refuse_other_world_early(cfg: Any, info: DistInfo, run_dir: Path) -> None:
    """Before any model is built: a world size that no checkpoint this start would resume can
    continue (its data order cannot be split over these ranks) is refused now, with the world
    sizes that work (rank 0 decides, every rank raises). Anything less clear-cut (damaged
    checkpoints, a remote) is left to ``maybe_resume``."""
    problem = broadcast_object(on_rank0(info, lambda: world_problem(cfg, run_dir, info.world_size)), info)
    if problem:
        raise ResumeError(problem)


def world_problem(cfg: Any, run_dir: Path, world_size: int) -> Optional[str]:
    """Why no checkpoint ``resume=`` names can go on on ``world_size`` ranks, when that is
    the only reason (every candidate intact but written for a world it cannot split)."""
    if cfg.resume == "none":
        return None
    if cfg.resume != "auto":
        path = Path(cfg.resume).expanduser()
        problem = ckpt.verify_checkpoint(path, world_size) if path.is_dir() else None
        if problem and "for world size" in problem:
            return f"resume={str(path)!r} cannot resume {world_size} rank(s): {problem}. Start on a number of ranks it names"
        return None
    found = ckpt.list_checkpoints(run_dir)
    problems = {p.name: ckpt.verify_checkpoint(p, world_size) for p in found}
    if not found or getattr(cfg.checkpoint, "remote", None) or not all(
            v and "for world size" in v for v in problems.values()):
        return None
    name = found[-1].name
    return (f"no checkpoint in {run_dir}/checkpoints can resume {world_size} rank(s): {name} {problems[name]}. "
            "Start on a number of ranks named there, or choose a new run_dir")


def _remote_names(remote: Any) -> list[str]:
    """The remote's complete checkpoints; a remote that cannot be read is refused (it may hold
    this run's checkpoints: a fresh start would mix its own with them, and prune them)."""
    try:
        return remote.complete()
    except Exception as e:
        raise ResumeError(
            f"checkpoint.remote={remote.url!r} cannot be read ({type(e).__name__}: {str(e).strip()[:200]}); "
            "fix its access (credentials, network), or set checkpoint.remote=null to run without it"
        ) from None


def _refuse_used_remote(remote: Any) -> None:
    """resume=none into a remote that already holds checkpoints is refused, as locally."""
    names = _remote_names(remote) if remote is not None else []
    if names:
        raise ResumeError(
            f"resume=none but checkpoint.remote={remote.url!r} already holds {names[-1]}; choose another "
            "checkpoint.remote (or run_dir and remote), delete those, or use resume=auto to continue it"
        )


def _from_remote(checkpointer: Any, world_size: int, say: Callable[[str], None]) -> Optional[Path]:
    """No intact local checkpoint: the newest remote one that verifies, downloaded into this
    run's checkpoints folder (rank 0), with one line saying so; None when the remote has none."""
    remote = checkpointer.remote
    if not _remote_names(remote):
        return None
    checkpointer.root.mkdir(parents=True, exist_ok=True)
    path = remote.fetch_latest(checkpointer.root, world_size)
    if path is not None:
        say(f"resume: no intact checkpoint in {checkpointer.root}; downloaded {path.name} "
            f"from {remote.url} (verified against its manifest)")
    return path


def _explicit_checkpoint(path: Path, world_size: int) -> Path:
    problem = ckpt.verify_checkpoint(path, world_size) if path.is_dir() else "is not a folder"
    if problem:
        raise ResumeError(
            f"resume={str(path)!r} cannot resume {world_size} rank(s): {problem}; point resume at an "
            "intact checkpoints/step_XXXXXXXX folder whose data order this number of ranks can split "
            "(or resume on a number of ranks it names)"
        )
    return path


def last_finite_checkpoint(run_dir: Path, world_size: int) -> Optional[Path]:
    """Newest checkpoint of ``run_dir`` that verifies and whose weights are all finite."""
    for path in reversed(ckpt.list_checkpoints(run_dir)):
        if ckpt.verify_checkpoint(path, world_size) is not None:
            continue
        weights = torch.load(path / "model.pt", map_location="cpu", weights_only=True)
        if all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point()):
            return path
    return None


def resume_command(overrides: list[str], path: Path, lr: float) -> str:
    """``python train.py <this start's overrides> resume=<path> optim.lr=<lr>`` (shell-quoted)."""
    import shlex

    kept = [o for o in overrides if not o.lstrip("+~").startswith(("resume=", "optim.lr="))]
    args = [*kept, f"resume={path}", f"optim.lr={lr:.3g}"]
    return "python train.py " + " ".join(shlex.quote(a) for a in args)
