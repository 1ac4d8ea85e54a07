"""Evaluation configuration (owned by ``infclip.eval``; composed into train and eval configs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class EvalTaskConfig:
    """One evaluation task: zero-shot classification or image-text retrieval."""

    name: str = ""  # label used in metric keys, e.g. "imagenet" -> eval/imagenet/top1
    kind: str = "zeroshot"  # "zeroshot" | "retrieval"
    root: str = ""  # dataset root (ImageFolder tree, clip_benchmark wds dir, or image dir)
    format: str = "wds"  # zeroshot: "wds" | "imagefolder"; retrieval: "karpathy" | "flat"
    split: str = "test"
    annotations: Optional[str] = None  # retrieval: annotation file
    classnames: Optional[str] = None  # zeroshot: "imagenet" (open_clip metadata) or a file path
    templates: Optional[str] = None  # zeroshot: "openai_imagenet" or a file path
    every_n_steps: int = 0  # 0: only at the end of training
    max_samples: Optional[int] = None  # evaluate on the first N samples only


@dataclass
class EvalConfig:
    """Which evaluations run, how they are batched and where."""

    tasks: list[EvalTaskConfig] = field(default_factory=list)
    batch_size: int = 256
    workers: int = 2
    chunk_size: int = 4096  # retrieval similarity chunk (rows) -- never a full N x M beyond it
    all_ranks: bool = True  # True: shard the eval over ranks; False: rank 0 only
