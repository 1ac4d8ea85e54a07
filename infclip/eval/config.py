"""Evaluation configuration (owned by ``infclip.eval``; composed into train and eval configs).

A task is *data only*: ImageNet, its variants, ObjectNet, the synthetic class split, COCO
and Flickr30k are all presets (``configs/eval_task/*.yaml``) of the task kinds below;
``contrastive`` is open_clip's ``--val-data``: held-out training-format shards scored with the
run's contrastive loss and retrieval recall.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

KINDS = ("zeroshot", "retrieval", "contrastive")
FORMATS = {"zeroshot": ("wds", "imagefolder"), "retrieval": ("flat", "karpathy", "wds"), "contrastive": ("wds",)}
MAX_AUTO_WORKERS = 8  # eval.workers=null: one per core available to this rank, at most this many


@dataclass
class EvalTaskConfig:
    """One evaluation task: zero-shot classification, image-text retrieval, or a held-out
contrastive validation set (loss + retrieval).

    Paths by (kind, format):
      zeroshot/wds          root = clip_benchmark wds dir: classnames.txt,
                            zeroshot_classification_templates.txt, {split}/nshards.txt, {split}/{i}.tar
                            holding {key}.jpg|.png|.webp + {key}.cls (integer label).
      zeroshot/imagefolder  root = class-folder tree (e.g. ImageNet val); labels = sorted folder order.
      retrieval/flat        annotations = JSON list [{"image": rel_path, "caption": [str, ...]}]
                            (default <root>/<split>.json); images relative to root (default: the
                            JSON's folder).
      retrieval/karpathy    annotations = Karpathy's dataset_{coco,flickr30k}.json (images[] with
                            filepath?/filename/split/sentences[].raw); rows with split == `split`
                            are used; images at <root>/<filepath>/<filename>.
      retrieval/wds         root = clip_benchmark retrieval wds dir ({split}/*.tar holding
                            {key}.jpg|.png|.webp + {key}.txt with one caption per line).
      contrastive/wds       root = shard spec in the training format (img2dataset / data.shards:
                            "/data/val/{00000..00003}.tar" or a comma list) holding {key}.jpg + {key}.txt
                            (one caption per sample); reports loss over batches of `batch` samples
                            plus i2t/t2i R@1/5/10 over all samples (infclip.eval.contrastive).
    """

    name: str = ""  # label used in metric keys, e.g. "imagenet" -> eval/imagenet/top1
    kind: str = "zeroshot"  # "zeroshot" | "retrieval" | "contrastive"
    root: str = ""  # dataset root (see the table above)
    format: str = "wds"  # zeroshot: "wds" | "imagefolder"; retrieval: "flat" | "karpathy"
    split: str = "test"  # wds split folder / Karpathy split / flat JSON stem
    annotations: Optional[str] = None  # retrieval: annotation file
    # zeroshot class names: "imagenet" (open_clip's IMAGENET_CLASSNAMES), a file with one name
    # per line, a JSON file {folder: name} (imagefolder), or None: <root>/classnames.txt (wds) or
    # the folder names (imagefolder). Checked against the labels (see infclip.eval.data).
    classnames: Optional[str] = None
    # zeroshot prompt templates: "openai_imagenet" (open_clip's 80 OPENAI_IMAGENET_TEMPLATES),
    # "simple_imagenet", a file with one template per line ("{c}" or "{}" marks the class name),
    # or None: <root>/zeroshot_classification_templates.txt if present, else "openai_imagenet".
    templates: Optional[str] = None
    every_n_steps: int = 0  # during training: run when step % n == 0 (0: only at the end)
    max_samples: Optional[int] = None  # evaluate N images only (ImageFolder: spread over classes; None: all)
    # contrastive only (required there): samples per loss batch -- the training batch size whose
    # loss is reported (eval.batch_size stays the encoder's batch). Trailing samples that do not
    # fill a batch are left out of the loss (not of the recall).
    batch: Optional[int] = None


@dataclass
class EvalConfig:
    """Which evaluations run, how they are batched and where."""

    tasks: list[EvalTaskConfig] = field(default_factory=list)
    batch_size: int = 256  # images (or prompts/captions) per encoder pass per rank
    workers: Optional[int] = None  # DataLoader workers per rank (0: in-process; None: the cores this rank has, <= 8)
    chunk_size: int = 4096  # retrieval similarity chunk (rows) -- never a full N x M beyond it
    all_ranks: bool = True  # True: shard the eval over ranks; False: rank 0 only


class EvalConfigError(ValueError):
    """An evaluation setting is invalid; the message names the config key and the fix."""


def task_key(task: EvalTaskConfig, index: Optional[int], field_name: str) -> str:
    """The config key of a task field, for error messages (``eval.tasks[0].root``)."""
    where = f"eval.tasks[{index}]" if index is not None else f"eval task {task.name!r}"
    return f"{where}.{field_name}"


def validate_eval(cfg: EvalConfig) -> None:
    """Reject impossible settings before any model or data work."""
    for key in ("batch_size", "chunk_size"):
        if getattr(cfg, key) <= 0:
            raise EvalConfigError(f"eval.{key} must be > 0, got {getattr(cfg, key)}")
    if cfg.workers is not None and cfg.workers < 0:
        raise EvalConfigError(f"eval.workers must be >= 0 (or null: one per available core), got {cfg.workers}")
    names = [t.name for t in cfg.tasks]
    if len(set(names)) != len(names):
        raise EvalConfigError(f"eval.tasks names must be unique (they key the metrics), got {names}")
    for i, task in enumerate(cfg.tasks):
        validate_task(task, i)


def validate_task(task: EvalTaskConfig, index: Optional[int] = None) -> None:
    """Check one task's kind/format/name fields (paths are checked when the data is opened)."""
    if not task.name:
        raise EvalConfigError(f"{task_key(task, index, 'name')} is empty; give the task a name")
    if task.kind not in KINDS:
        raise EvalConfigError(f"{task_key(task, index, 'kind')}={task.kind!r}: choose one of {list(KINDS)}")
    if task.format not in FORMATS[task.kind]:
        raise EvalConfigError(
            f"{task_key(task, index, 'format')}={task.format!r} is not a {task.kind} format; "
            f"choose one of {list(FORMATS[task.kind])}"
        )
    if task.every_n_steps < 0:
        raise EvalConfigError(f"{task_key(task, index, 'every_n_steps')} must be >= 0")
    if task.max_samples is not None and task.max_samples <= 0:
        raise EvalConfigError(f"{task_key(task, index, 'max_samples')} must be > 0 (or null for all)")
    _validate_batch(task, index)


def _validate_batch(task: EvalTaskConfig, index: Optional[int]) -> None:
    key = task_key(task, index, "batch")
    if task.kind != "contrastive":
        if task.batch is not None:
            raise EvalConfigError(f"{key}={task.batch} is only for kind=contrastive (the loss batch); "
                                  f"remove it from this {task.kind} task (eval.batch_size sets the encoder batch)")
        return
    if task.batch is None:
        raise EvalConfigError(f"{key} is required for kind=contrastive: the batch size whose contrastive loss "
                              "is reported, e.g. batch=4096 (usually batch.global_size)")
    if isinstance(task.batch, bool) or not isinstance(task.batch, int) or task.batch < 2:
        raise EvalConfigError(f"{key}={task.batch!r} must be an integer >= 2 (a batch of one pair has no negatives)")
    if task.max_samples is not None and task.max_samples < task.batch:
        raise EvalConfigError(f"{task_key(task, index, 'max_samples')}={task.max_samples} is smaller than "
                              f"{key}={task.batch}: no full loss batch; raise max_samples or lower batch")


def resolve_workers(workers: Optional[int]) -> int:
    """``eval.workers``, or when None the CPU cores this process may run on (its affinity mask,
    shared among the node's ranks), capped at MAX_AUTO_WORKERS: never more workers than cores."""
    if workers is not None:
        return workers
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    return max(0, min(MAX_AUTO_WORKERS, cores // ranks_here))
