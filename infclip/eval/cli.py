"""``python -m infclip.eval``: evaluate a checkpoint or an open_clip model on task presets.

    python -m infclip.eval checkpoint=runs/quickstart model=infclip-tiny
    python -m infclip.eval checkpoint=openai model=ViT-B-32 tasks=[imagenet,coco] data_root=/datasets
    torchrun --nproc-per-node 8 -m infclip.eval checkpoint=... tasks=[imagenet]

``checkpoint`` is a model.pt file, a checkpoint step folder, a run folder (its latest
checkpoint), an open_clip pretrained tag, or ``none`` (random init). Task presets live in
``configs/eval_task/<name>.yaml``; ``${data_root}`` and ``${synthetic_root}`` in them are
filled from this config, and ``task.<name>.<field>=value`` overrides one preset field.
Prints a table on rank 0 and writes a JSON result file (``output``).
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import MISSING, DictConfig, OmegaConf

from infclip.eval.config import EvalConfig, EvalConfigError, EvalTaskConfig, validate_eval
from infclip.manifest import MANIFEST, verify

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


@dataclass
class EvalCommandConfig:
    """Schema of ``configs/eval.yaml``."""

    checkpoint: str = MISSING  # model.pt | step dir | run dir (latest) | open_clip tag | none
    model: str = "infclip-tiny"  # open_clip model name (or one of infclip/model_configs)
    model_config_file: Optional[str] = None  # custom open_clip JSON config (registered under its stem)
    tasks: list[str] = field(default_factory=lambda: ["synthetic_zeroshot", "synthetic_retrieval"])
    task: dict[str, Any] = field(default_factory=dict)  # per-preset overrides: task.imagenet.root=/x
    data_root: str = "data"  # ${data_root} in the presets
    synthetic_root: Optional[str] = None  # ${synthetic_root}; None: the data package's default cache
    eval: EvalConfig = field(default_factory=EvalConfig)  # batch size, workers, chunk, all_ranks
    precision: str = "fp32"  # "fp32" | "bf16" | "fp16" (autocast for the encoders)
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    output: Optional[str] = None  # JSON results; None: <checkpoint folder>/eval.json or ./eval_results.json


def register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="eval_command_schema", node=EvalCommandConfig)


# -- checkpoints -------------------------------------------------------------------------------


def _latest_step_dir(folder: Path) -> Optional[Path]:
    """Newest step folder whose model.pt verifies against its manifest; each newer damaged
    one is named in a one-line warning and skipped."""
    steps = [p for p in folder.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and (p / "model.pt").is_file()]
    for step in sorted(steps, key=lambda p: int(p.name[5:]), reverse=True):
        problem = verify(step, need=("model.pt",), only=("model.pt",))
        if problem is None:
            return step
        print(f"warning: skipping damaged checkpoint {step}: {problem}", file=sys.stderr, flush=True)
    return None


def _verified_model(path: Path) -> str:
    """``path`` (a model.pt) if its folder's manifest, when there is one, vouches for it."""
    problem = verify(path.parent, need=(path.name,), only=(path.name,)) if (path.parent / MANIFEST).is_file() else None
    if problem:
        raise EvalConfigError(f"checkpoint {path.parent} is damaged: {problem}; give an intact step folder "
                              "or the run folder (its newest intact checkpoint is used)")
    return str(path)


def resolve_checkpoint(spec: str) -> Optional[str]:
    """A local model.pt path, an open_clip tag (returned unchanged), or None for ``none``."""
    if spec.lower() in ("none", "random", ""):
        return None
    path = Path(spec).expanduser()
    if path.is_file():
        return _verified_model(path)
    if path.is_dir():
        if (path / "model.pt").is_file():
            return _verified_model(path / "model.pt")
        for folder in (path / "checkpoints", path):
            step = _latest_step_dir(folder) if folder.is_dir() else None
            if step is not None:
                return str(step / "model.pt")
        raise EvalConfigError(f"checkpoint={spec!r}: no model.pt and no checkpoints/step_*/model.pt under it; "
                              "give a model.pt, a step folder or a run folder")
    if os.sep in spec or spec.endswith((".pt", ".pth", ".bin", ".safetensors")):
        raise EvalConfigError(f"checkpoint={spec!r} does not exist; give a model.pt, a step folder, a run "
                              "folder or an open_clip pretrained tag (e.g. openai)")
    return spec  # an open_clip pretrained tag


# -- tasks -------------------------------------------------------------------------------------


def _synthetic_root(cfg: DictConfig) -> str:
    from infclip.data.config import DataConfig
    from infclip.data.synthetic import ensure_synthetic

    return ensure_synthetic(DataConfig(synthetic_root=cfg.synthetic_root)).root


def load_task(name: str, cfg: DictConfig) -> EvalTaskConfig:
    """Preset ``configs/eval_task/<name>.yaml`` with roots filled in and ``task.<name>`` applied."""
    path = CONFIG_DIR / "eval_task" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (CONFIG_DIR / "eval_task").glob("*.yaml"))
        raise EvalConfigError(f"tasks: unknown task {name!r}; presets in {path.parent}: {known}")
    text = path.read_text()
    syn = _synthetic_root(cfg) if "${synthetic_root}" in text else cfg.synthetic_root
    wrap = OmegaConf.create({"data_root": cfg.data_root, "synthetic_root": syn, "t": OmegaConf.load(path)})
    OmegaConf.resolve(wrap)
    merged = OmegaConf.merge(OmegaConf.structured(EvalTaskConfig(name=name)), wrap.t, cfg.task.get(name, {}))
    return OmegaConf.to_object(merged)


def build_eval_config(cfg: DictConfig) -> EvalConfig:
    """The EvalConfig of the command: its batch settings and the selected presets (validated)."""
    unknown = set(cfg.task) - set(cfg.tasks)
    if unknown:
        raise EvalConfigError(f"task.{sorted(unknown)[0]} overrides a task that is not in tasks={list(cfg.tasks)}")
    ecfg: EvalConfig = OmegaConf.to_object(cfg.eval)
    ecfg.tasks = [load_task(name, cfg) for name in cfg.tasks]
    validate_eval(ecfg)
    return ecfg


# -- running -----------------------------------------------------------------------------------


@dataclass
class Dist:
    """This process's place in a torchrun job (world_size 1 without torchrun)."""

    rank: int
    world_size: int
    device: torch.device
    group: Any = None


def init_distributed(device: str) -> Dist:
    """Join the torchrun group if there is one (NCCL on CUDA, gloo on CPU)."""
    import torch.distributed as dist

    world, rank, local = (int(os.environ.get(k, d)) for k, d in (("WORLD_SIZE", 1), ("RANK", 0), ("LOCAL_RANK", 0)))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    dev = torch.device(f"cuda:{local}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if world == 1:
        return Dist(0, 1, dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return Dist(rank, world, dev, dist.group.WORLD)


def build(cfg: DictConfig, device: torch.device, pretrained: Optional[str]):
    """(model, tokenizer, val preprocess) through the project's open_clip factory (weights_only load)."""
    from infclip.config import ModelConfig
    from infclip.model import build_model

    built = build_model(ModelConfig(name=cfg.model, config_file=cfg.model_config_file, pretrained=pretrained),
                        device=device)
    return built.model, built.tokenizer, built.preprocess_val


def format_table(metrics: dict[str, float]) -> str:
    """One row per task metric: value and chance level in percent."""
    lines = [f"{'task':<24} {'metric':<24} {'value %':>9} {'chance %':>9}"]
    for key, value in metrics.items():
        _, task, name = key.split("/", 2)
        if name.endswith("_chance") or name.startswith("num_") or name == "seconds":
            continue
        chance = metrics.get(f"{key}_chance")
        chance_text = f"{100 * chance:9.2f}" if chance is not None else ""
        lines.append(f"{task:<24} {name:<24} {100 * value:9.2f} {chance_text}")
    return "\n".join(lines)


def default_output(pretrained: Optional[str]) -> str:
    if pretrained and os.path.isfile(pretrained):
        return str(Path(pretrained).parent / "eval.json")
    return "eval_results.json"


def write_results(path: str, cfg: DictConfig, pretrained: Optional[str], ecfg: EvalConfig,
                  metrics: dict[str, float], world_size: int) -> None:
    step = re.search(r"step_(\d{8})", pretrained or "")
    record = {
        "checkpoint": cfg.checkpoint, "resolved": pretrained, "model": cfg.model,
        "step": int(step.group(1)) if step else None, "precision": cfg.precision, "world_size": world_size,
        "tasks": {t.name: asdict(t) for t in ecfg.tasks}, "metrics": metrics,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)
