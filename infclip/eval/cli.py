"""``python -m infclip.eval``: evaluate a checkpoint or an open_clip model.

    python -m infclip.eval checkpoint=runs/quickstart
    python -m infclip.eval checkpoint=openai model=ViT-B-32 tasks=[imagenet,coco] data_root=/datasets
    python -m infclip.eval checkpoint=RUN "tasks=[imagenet,{name: digits, kind: zeroshot, root: /d}]"
    python -m infclip.eval checkpoint=RUN tasks=[datacomp] data_root=/datasets
    torchrun --nproc-per-node 8 -m infclip.eval checkpoint=... tasks=[imagenet]

``checkpoint`` is a model.pt file, a checkpoint step folder, a run folder (its latest
checkpoint), an open_clip pretrained tag, or ``none`` (random init). ``tasks`` (or the
trainer's key ``eval.tasks``: the same list) mixes preset names (``configs/eval_task/<name>.yaml``;
``${data_root}`` and ``${synthetic_root}`` in them are filled from this config), suite names
(:mod:`infclip.eval.suites`) and inline task dicts (fields of EvalTaskConfig);
``task.<name>.<field>=value`` overrides one field of a task. ``model`` defaults to the
checkpoint's own architecture. Prints a table on rank 0 and writes a JSON result file
(``output``), the run's eval.jsonl and wandb.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import sys
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import MISSING, DictConfig, OmegaConf

from infclip.eval.config import EvalConfig, EvalConfigError, EvalTaskConfig, validate_eval
from infclip.eval.suites import SUITES, SuitePlan, plan_suite
from infclip.manifest import MANIFEST, verify

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


@dataclass
class EvalCommandConfig:
    """Schema of ``configs/eval.yaml``."""

    checkpoint: str = MISSING  # model.pt | step dir | run dir (latest) | open_clip tag | none
    # open_clip model name; None: the checkpoint's own (its open_clip_config.json or its run's
    # config.yaml), else infclip-tiny. A name that differs from the checkpoint's is an error.
    model: Optional[str] = None
    model_config_file: Optional[str] = None  # custom open_clip JSON config (registered under its stem)
    # preset names, suite names and inline task dicts, mixed; None: eval.tasks (the trainer's
    # key, same syntax) or, when that is empty too, the synthetic presets
    tasks: Optional[list[Any]] = None
    task: dict[str, Any] = field(default_factory=dict)  # per-task overrides: task.imagenet.root=/x
    data_root: str = "data"  # ${data_root} in the presets
    synthetic_root: Optional[str] = None  # ${synthetic_root}; None: the data package's default cache
    eval: EvalConfig = field(default_factory=EvalConfig)  # batch size, workers, chunk, all_ranks
    precision: str = "fp32"  # "fp32" | "bf16" | "fp16" (autocast for the encoders)
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    output: Optional[str] = None  # JSON results; None: <checkpoint folder>/eval.json or ./eval_results.json
    log_to_run: bool = True  # append the metrics to <run>/eval.jsonl when the checkpoint is in a run folder
    # "online" | "offline" | "disabled"; None: the run's logging.wandb_mode, else disabled
    wandb_mode: Optional[str] = None
    wandb_project: str = "infclip"


def register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="eval_command_schema", node=EvalCommandConfig)


# -- checkpoints -------------------------------------------------------------------------------


def _latest_step_dir(folder: Path) -> Optional[Path]:
    """Newest step folder whose loaded files (model.pt and open_clip's files) verify against
    its manifest; each newer damaged one is named in a one-line warning, set aside as
    ``step_N.damaged`` and skipped (``infclip.export.newest_intact``)."""
    from infclip.export import newest_intact

    return newest_intact(folder, warn=lambda line: print(line, file=sys.stderr, flush=True))


def _verified_model(path: Path) -> str:
    """``path`` (a model.pt) if its folder's manifest, when there is one, vouches for it and
    for every other file the command loads from that folder (open_clip's files)."""
    from infclip.export import open_clip_files

    files = (path.name, *open_clip_files(path.parent))
    problem = verify(path.parent, need=files, only=files) if (path.parent / MANIFEST).is_file() else None
    if problem:
        raise EvalConfigError(f"checkpoint {path.parent} is damaged: {problem}; give an intact step folder "
                              "or the run folder (its newest intact checkpoint is used)")
    return str(path)


_READ_TRIES = 3  # a run folder's checkpoint pruned while read: this many choices of the newest


def load_checkpoint(cfg: DictConfig, device: torch.device) -> tuple[Optional[str], tuple]:
    """(resolved checkpoint, (model, tokenizer, val preprocess)) of ``cfg.checkpoint``.

    When ``checkpoint`` names a run (or checkpoints) folder and the checkpoint chosen in it
    vanishes while it is read (a training writing there pruned it: ``checkpoint.keep_last``),
    the newest remaining intact one is chosen and read instead, with one warning line; a
    named step folder or file that vanishes is an error. When this returns the model is in
    memory: nothing later reads the checkpoint's files (only its path names the outputs).
    """
    for attempt in range(1, _READ_TRIES + 1):
        pretrained = resolve_checkpoint(cfg.checkpoint)
        try:
            return pretrained, build(cfg, device, pretrained)
        except EvalConfigError:
            if attempt == _READ_TRIES or not (_vanished(pretrained) and _picks_newest(cfg.checkpoint)):
                raise
        print(f"warning: checkpoint {Path(pretrained).parent} was removed while it was read (pruned by a "
              "training in that run folder?): evaluating the newest remaining intact checkpoint instead",
              file=sys.stderr, flush=True)
    raise AssertionError("unreachable: the last try returns or raises")


def _vanished(pretrained: Optional[str]) -> bool:
    """True when ``pretrained`` was a local file (a path, not a tag) and is gone now."""
    return pretrained is not None and _is_local(pretrained) and not os.path.isfile(pretrained)


def _is_local(pretrained: str) -> bool:
    """A resolved checkpoint is a local path (it may have vanished since) or an open_clip tag
    (no path separator, as open_clip names them)."""
    return os.sep in pretrained or os.path.exists(pretrained)


def _picks_newest(spec: str) -> bool:
    """``checkpoint`` names a folder whose newest checkpoint is chosen (not one step folder)."""
    path = Path(spec).expanduser()
    return path.is_dir() and not _STEP_DIR.match(path.name)


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


DEFAULT_TASKS = ("synthetic_zeroshot", "synthetic_retrieval")
_TASK_FIELDS = tuple(f.name for f in fields(EvalTaskConfig))


def load_task(name: str, cfg: DictConfig) -> EvalTaskConfig:
    """Preset ``configs/eval_task/<name>.yaml`` with roots filled in and ``task.<name>`` applied."""
    path = CONFIG_DIR / "eval_task" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (CONFIG_DIR / "eval_task").glob("*.yaml"))
        raise EvalConfigError(f"tasks: unknown task {name!r}; presets in {path.parent}: {known}; "
                              f"suites: {sorted(SUITES)}; or an inline task {{name: ..., kind: ..., root: ...}}")
    text = path.read_text()
    syn = _synthetic_root(cfg) if "${synthetic_root}" in text else cfg.synthetic_root
    wrap = OmegaConf.create({"data_root": cfg.data_root, "synthetic_root": syn, "t": OmegaConf.load(path)})
    OmegaConf.resolve(wrap)
    merged = OmegaConf.merge(OmegaConf.structured(EvalTaskConfig(name=name)), wrap.t, cfg.task.get(name, {}))
    return OmegaConf.to_object(merged)


def inline_task(entry: Any, where: str, cfg: DictConfig) -> EvalTaskConfig:
    """An inline task dict (the trainer's eval.tasks entry syntax) as an EvalTaskConfig."""
    entry = OmegaConf.to_container(entry, resolve=True) if OmegaConf.is_config(entry) else dict(entry)
    unknown = sorted(set(entry) - set(_TASK_FIELDS))
    if unknown:
        raise EvalConfigError(f"{where}: unknown key {unknown[0]!r} in an inline task; its keys: {list(_TASK_FIELDS)}")
    if not entry.get("name"):
        raise EvalConfigError(f"{where}: an inline task needs a name (it keys the results: eval/<name>/...), "
                              "e.g. {name: digits, kind: zeroshot, root: /data/digits, format: imagefolder}")
    merged = OmegaConf.merge(OmegaConf.structured(EvalTaskConfig), entry, cfg.task.get(entry["name"], {}))
    return OmegaConf.to_object(merged)


def _task_entries(cfg: DictConfig) -> tuple[str, list[Any]]:
    """(key, entries): ``tasks`` or ``eval.tasks`` (one of them), or the default presets."""
    given_eval = len(cfg.eval.tasks) > 0
    if cfg.tasks is not None and given_eval:
        raise EvalConfigError("tasks=[...] and eval.tasks=[...] both given: they are the same list; keep one")
    if cfg.tasks is not None:
        return "tasks", list(cfg.tasks)
    if given_eval:
        return "eval.tasks", list(cfg.eval.tasks)
    run = _run_of(cfg.checkpoint)
    if run is not None:
        return f"{run / 'config.yaml'} eval.tasks", _run_tasks(run)
    return "tasks", list(DEFAULT_TASKS)


def task_source(cfg: DictConfig) -> str:
    """Where the evaluated task list came from (for the command's first line)."""
    key = _task_entries(cfg)[0]
    return "the default presets" if key == "tasks" and cfg.tasks is None else key


def _run_of(checkpoint: Optional[str]) -> Optional[Path]:
    """The training run folder ``checkpoint`` names (the folder or one of its step folders /
    files) when it holds the run's config.yaml, else None."""
    if not checkpoint or not _is_local(str(checkpoint)):
        return None
    path = Path(str(checkpoint)).expanduser()
    for cand in (path, path.parent.parent, path.parent.parent.parent):
        if (cand / "config.yaml").is_file() and (cand / "checkpoints").is_dir():
            return cand
    return None


def load_run_config(path: Path) -> DictConfig:
    """A run's ``config.yaml`` as a mapping; EvalConfigError (naming the file) when it cannot
    be read or is not a YAML mapping."""
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:  # yaml's ScannerError / ParserError, OSError, UnicodeDecodeError
        raise EvalConfigError(f"{path} cannot be read as the run's configuration "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); restore it "
                              "from the run's checkpoints' folder history, or give model= and tasks= on the "
                              "command line with a checkpoint path to its step folder's model.pt") from None
    if not isinstance(cfg, DictConfig):
        raise EvalConfigError(f"{path} is not a YAML mapping (the run's configuration); restore it, or give "
                              "model= and tasks= on the command line")
    return cfg


def _run_tasks(run: Path) -> list[Any]:
    """The run's own eval.tasks (what the trainer evaluated): ``synthetic:`` roots resolved the
    way the trainer resolved them (the run's own synthetic dataset), and left out, as the
    trainer left them out, for a run on its own data (data.kind=wds)."""
    run_cfg = load_run_config(run / "config.yaml")
    tasks = OmegaConf.to_container(run_cfg.get("eval", {}).get("tasks", []), resolve=True) or []
    if run_cfg.get("data", {}).get("kind", "synthetic") != "synthetic":  # the trainer skipped these too
        tasks = [t for t in tasks if not str(t.get("root", "")).startswith("synthetic:")]
    if not tasks:
        raise EvalConfigError(f"the run {run} evaluated no tasks (its config.yaml has no eval.tasks the trainer ran: "
                              "eval.tasks=[], or only the embedded synthetic set's, skipped for its own data): name "
                              "the tasks to evaluate with \"tasks=[{name: mine, kind: zeroshot, format: imagefolder, "
                              "root: /data/mine_val}]\" (presets, suites or inline dicts; docs/eval.md)")
    if any(str(t.get("root", "")).startswith("synthetic:") for t in tasks):
        from infclip.data.config import DataConfig
        from infclip.data.synthetic import ensure_synthetic

        data = run_cfg.get("data", {})
        keys = ("synthetic_root", "synthetic_train", "synthetic_eval", "synthetic_image_size", "synthetic_seed")
        root = ensure_synthetic(DataConfig(**{k: data[k] for k in keys if k in data})).root
        for t in tasks:
            if str(t.get("root", "")).startswith("synthetic:"):
                t["root"] = str(Path(root) / "eval" / str(t["root"]).split(":", 1)[1])
    return tasks


def plan_tasks(cfg: DictConfig) -> tuple[list[EvalTaskConfig], list[SuitePlan]]:
    """Every task of the command, in order (suites expanded to their datasets found under
    data_root; each missing one is printed on one line), and the suite plans."""
    key, entries = _task_entries(cfg)
    tasks: list[EvalTaskConfig] = []
    suites: list[SuitePlan] = []
    for i, entry in enumerate(entries):
        if isinstance(entry, str) and entry in SUITES:
            plan, suite_tasks = plan_suite(entry, cfg.data_root)
            for ds, root in plan.missing:
                print(f"suite {entry}: skipping {ds.name} ({root}/test not found)")
            suites.append(plan)
            tasks.extend(OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(t), cfg.task.get(t.name, {})))
                         for t in suite_tasks)
        elif isinstance(entry, str):
            tasks.append(load_task(entry, cfg))
        elif OmegaConf.is_dict(entry) or isinstance(entry, dict):
            tasks.append(inline_task(entry, f"{key}[{i}]", cfg))
        else:
            raise EvalConfigError(f"{key}[{i}]={entry!r}: give a preset or suite name, or an inline task "
                                  "{name: ..., kind: ..., root: ...}")
    if not tasks:
        where = ", ".join(f"{p.name} ({len(p.missing)} missing)" for p in suites)
        raise EvalConfigError(f"{key}: nothing to evaluate; no dataset of {where} is under data_root={cfg.data_root!r} "
                              "(each as wds_<name>/test/*.tar); set data_root to the folder holding them")
    unknown = set(cfg.task) - {t.name for t in tasks}
    if unknown:
        raise EvalConfigError(f"task.{sorted(unknown)[0]} overrides a task that is not in "
                              f"{key}={[t.name for t in tasks]}")
    return tasks, suites


def build_eval_config(cfg: DictConfig) -> EvalConfig:
    """The EvalConfig of the command: its batch settings and every task (validated)."""
    return _eval_config(cfg, plan_tasks(cfg)[0])


def _eval_config(cfg: DictConfig, tasks: list[EvalTaskConfig]) -> EvalConfig:
    ecfg: EvalConfig = OmegaConf.to_object(cfg.eval)
    ecfg.tasks = tasks
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


@dataclass
class Architecture:
    """What a checkpoint file says about the model it belongs to (all None when nothing does)."""

    name: Optional[str] = None  # model name recorded with it
    model_cfg: Optional[dict] = None  # open_clip model config (open_clip_config.json)
    local_dir: Optional[Path] = None  # a folder open_clip loads as local-dir:
    image_size: Optional[int] = None  # the run's model.image_size (config.yaml; None: the config's own)


def checkpoint_architecture(pretrained: Optional[str]) -> Architecture:
    """From the checkpoint folder's open_clip_config.json, else its run's config.yaml."""
    from infclip.export import CONFIG_NAME, WEIGHTS_NAME

    if not pretrained or not os.path.isfile(pretrained):
        return Architecture()
    folder = Path(pretrained).parent
    if (folder / CONFIG_NAME).is_file() and (folder / WEIGHTS_NAME).is_file():
        saved = json.loads((folder / CONFIG_NAME).read_text())
        return Architecture(saved.get("model_name"), saved.get("model_cfg"), folder)
    run_cfg = folder.parent.parent / "config.yaml"
    if folder.parent.name == "checkpoints" and run_cfg.is_file():
        model = load_run_config(run_cfg).get("model", {})
        name = Path(model.config_file).stem if model.get("config_file") else model.get("name")
        return Architecture(name, image_size=model.get("image_size"))
    return Architecture()


def _same_architecture(requested: str, arch: Architecture) -> bool:
    import open_clip

    wanted = open_clip.get_model_config(requested)
    if arch.model_cfg is not None and wanted is not None:
        saved = {k: v for k, v in arch.model_cfg.items() if k != "init_logit_bias"}
        return saved == wanted
    return arch.name is None or arch.name == requested


def build(cfg: DictConfig, device: torch.device, pretrained: Optional[str]):
    """(model, tokenizer, val preprocess). ``model`` unset: the checkpoint's own architecture
    (loaded by open_clip as local-dir: when the folder holds open_clip's files); set: it must be
    the checkpoint's, else an error names both."""
    import open_clip

    from infclip.config import ModelConfig
    from infclip.model import build_model, register_config_file

    requested = register_config_file(cfg.model_config_file) if cfg.model_config_file else cfg.model
    try:
        arch = checkpoint_architecture(pretrained)
    except OSError as e:  # its files vanished between a check and the read (pruned meanwhile)
        raise EvalConfigError(_load_failure(str(pretrained), requested or "its own", e)) from e
    if _vanished(pretrained):  # a path that is gone, not an open_clip tag
        gone = FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), pretrained)
        raise EvalConfigError(_load_failure(str(pretrained), requested or "its own", gone))
    if requested is not None and not _same_architecture(requested, arch):
        raise EvalConfigError(f"model={requested!r} but checkpoint {pretrained} is a {arch.name!r} model; "
                              f"drop model= (the checkpoint's own architecture is used) or set model={arch.name}")
    if requested is None and pretrained is not None and not os.path.isfile(pretrained):
        raise EvalConfigError(f"checkpoint={pretrained!r} is an open_clip pretrained tag: name its architecture "
                              "with model=<open_clip model name> (e.g. model=ViT-B-32)")
    name = requested or arch.name or "infclip-tiny"
    if arch.local_dir is None or requested is not None:
        if open_clip.get_model_config(name) is None and not name.startswith("hf-hub:"):
            raise EvalConfigError(f"model={name!r} is not an open_clip model config; give an open_clip model "
                                  "name (open_clip.list_models()) or model_config_file=/path/to/config.json")
    try:
        if requested is None and arch.local_dir is not None:
            spec = f"local-dir:{arch.local_dir}"
            model, _, preprocess = open_clip.create_model_and_transforms(spec, device=device)
            return model, open_clip.get_tokenizer(spec), preprocess
        built = build_model(ModelConfig(name=name, config_file=cfg.model_config_file, pretrained=pretrained,
                                        image_size=arch.image_size), device=device)
    except Exception as e:  # a load failure: wrong architecture, a refused pickle, a vanished file
        if pretrained is None:
            raise
        raise EvalConfigError(_load_failure(pretrained, name, e)) from e
    return built.model, built.tokenizer, built.preprocess_val


def _load_failure(pretrained: str, name: str, e: BaseException) -> str:
    """Why a checkpoint did not load, blaming the architecture only for a key/shape mismatch."""
    from infclip.model import ModelError

    if isinstance(e, ModelError) and e.__cause__ is not None:  # build_model's wrapper: the real reason
        e = e.__cause__
    text = str(e)
    first = f"{type(e).__name__}: {text.strip().splitlines()[0][:300]}" if text.strip() else type(e).__name__
    if isinstance(e, FileNotFoundError) or "No such file" in text or "is not a file" in text:
        return (f"checkpoint {pretrained} disappeared while it was read ({first}); a training writing into "
                "that run folder may have pruned it (checkpoint.keep_last): evaluate again (the run folder "
                "gives its newest checkpoint), or copy the step folder first")
    if "Weights only load failed" in text or "Unpickl" in type(e).__name__ or "pickle" in text.lower():
        return (f"checkpoint {pretrained} is not a plain weights file: loading it would run pickled code, "
                f"which is refused ({first}); give a state dict saved with torch.save(model.state_dict()) "
                "or a .safetensors file")
    return (f"checkpoint {pretrained} does not load into model={name!r} ({first}); give the architecture it "
            "was trained with (model=<name>), or another checkpoint if this file is damaged")


RAW_METRICS = ("loss", "loss_batch_size", "logit_scale", "num_skipped_images")  # not fractions: printed as they are


def format_table(metrics: dict[str, float]) -> str:
    """One row per task metric: value and chance level in percent (a loss, batch size or logit
    scale as it is)."""
    lines = [f"{'task':<24} {'metric':<24} {'value %':>9} {'chance %':>9}"]
    for key, value in metrics.items():
        _, task, name = key.split("/", 2)
        if name.endswith("_chance") or name.startswith("num_") or name == "seconds":
            continue
        if name in RAW_METRICS:
            lines.append(f"{task:<24} {name:<24} {value:9.4f}")
            continue
        chance = metrics.get(f"{key}_chance")
        chance_text = f"{100 * chance:9.2f}" if chance is not None else ""
        lines.append(f"{task:<24} {name:<24} {100 * value:9.2f} {chance_text}")
    return "\n".join(lines)


def nonfinite_warnings(metrics: dict[str, float]) -> list[str]:
    """One warning line per task that had queries with non-finite scores (NaN/inf embeddings:
    a collapsed or damaged model; those queries were counted as misses), and one per task
    with images that could not be decoded (left out)."""
    lines = []
    for key, n in metrics.items():
        if key.endswith("/num_nonfinite") and n:
            task = key.split("/")[1]
            total = sum(metrics.get(f"eval/{task}/{k}", 0.0) for k in ("num_samples", "num_images", "num_texts"))
            lines.append(f"warning: {task}: {int(n)} of {int(total)} queries scored non-finite similarities "
                         "(the model's embeddings are NaN/inf: collapsed or damaged weights); counted as misses")
        if key.endswith("/num_skipped_images") and n:
            lines.append(f"warning: {key.split('/')[1]}: {int(n)} images could not be read or decoded (damaged, "
                         "not an image, or not a regular file); skipped: the metrics are those of the others")
    return lines


def default_output(pretrained: Optional[str]) -> str:
    """``<checkpoint folder>/eval.json``; for a step folder pruned after it was read,
    ``<run>/eval_step_N.json`` (never the current directory, never a re-created step folder);
    ``eval_results.json`` here for an open_clip tag or a random init."""
    if not pretrained or not _is_local(pretrained):
        return "eval_results.json"
    folder, run = Path(pretrained).parent, run_folder(pretrained)
    if run is not None and not folder.is_dir():
        return str(run / f"eval_{folder.name}.json")
    return str(folder / "eval.json")


def write_results(path: str, cfg: DictConfig, pretrained: Optional[str], ecfg: EvalConfig,
                  metrics: dict[str, float], world_size: int) -> None:
    record = {
        "checkpoint": cfg.checkpoint, "resolved": pretrained, "model": cfg.model,
        "step": checkpoint_step(pretrained), "precision": cfg.precision, "world_size": world_size,
        "tasks": {t.name: asdict(t) for t in ecfg.tasks}, "metrics": metrics,
    }
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: the file is whole or the previous one
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def check_output(path: str) -> None:
    """Refuses (EvalConfigError) an ``output`` path the results could not be written to: a
    folder, a path through a regular file, a read-only or full file system. Creates its parent
    folder and a test file there (removed)."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, "is a folder")
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        why = "a part of its path is a file, not a folder" if e.errno in (errno.EEXIST, errno.ENOTDIR) else e.strerror
        raise EvalConfigError(f"output={path} cannot be written ({why or e}); nothing was evaluated. "
                              "Give output= a writable file path (its folder is created)") from None


def checkpoint_step(pretrained: Optional[str]) -> Optional[int]:
    step = re.search(r"step_(\d{8})", pretrained or "")
    return int(step.group(1)) if step else None


def run_folder(pretrained: Optional[str]) -> Optional[Path]:
    """The run folder of a ``<run>/checkpoints/step_N/model.pt`` checkpoint (None otherwise),
    from the path alone: the step folder may have been pruned since it was read."""
    if not pretrained or not _is_local(pretrained):
        return None
    folder = Path(pretrained).parent
    return folder.parent.parent if folder.parent.name == "checkpoints" else None


EVAL_LOG = "eval.jsonl"  # the eval command's records in a run folder (the training curve stays its own)


def log_to_run(run: Path, step: Optional[int], metrics: dict[str, float], cfg: DictConfig) -> None:
    """Append one record to the run's eval.jsonl (the trainer's record format, marked as this
    command's); the training curve in metrics.jsonl is never written by the eval command."""
    import time

    record = {"step": step, "time": time.time(), "event": "eval_command", "source": "eval",
              "checkpoint": cfg.checkpoint, **metrics}
    with open(run / EVAL_LOG, "a") as f:
        f.write(json.dumps(record) + "\n")


def wandb_mode(cfg: DictConfig, run: Optional[Path]) -> str:
    """``wandb_mode``, or the run's own logging.wandb_mode, or disabled."""
    if cfg.wandb_mode is not None:
        return cfg.wandb_mode
    if run is not None and (run / "config.yaml").is_file():
        return str(load_run_config(run / "config.yaml").get("logging", {}).get("wandb_mode", "disabled"))
    return "disabled"


def log_wandb(mode: str, cfg: DictConfig, run: Optional[Path], step: Optional[int], metrics: dict[str, float],
              suites: list[SuitePlan]) -> None:
    """One wandb run (job_type eval, grouped with the training run) holding the metrics and a
    table per suite (dataset, metric, value)."""
    import wandb

    where = run if run is not None else Path(".")
    name = f"{where.resolve().name}-eval" + (f"-step{step}" if step is not None else "")
    wb = wandb.init(project=cfg.wandb_project, mode=mode, dir=str(where), job_type="eval", name=name,
                    group=where.resolve().name, config={"checkpoint": cfg.checkpoint, "step": step})
    try:
        wb.log({**metrics, **({"step": step} if step is not None else {})})
        for plan in suites:
            rows = [[ds.name, ds.metric, metrics[f"eval/{plan.name}/{ds.name}"]] for ds in plan.found]
            wb.log({f"eval/{plan.name}/table": wandb.Table(columns=["dataset", "metric", "value"], data=rows)})
    finally:
        wb.finish()
