"""The evaluation hook: run the due tasks and return flat metrics ``eval/<task>/<metric>``.

Side-effect free for training: every module's train/eval flag is restored, the torch CPU and
CUDA RNG states are forked (the DataLoader gets its own generator; Python's and NumPy's global
RNGs are never used), and everything runs under ``torch.no_grad``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import astuple
from typing import Any, Callable, ContextManager, Iterator, Optional, Union

import torch
from omegaconf import OmegaConf

from infclip.eval.config import EvalConfig, EvalTaskConfig, resolve_workers, validate_eval
from infclip.eval.contrastive import LossFn, evaluate_contrastive
from infclip.eval.data import load_contrastive, load_retrieval, load_zeroshot
from infclip.eval.embed import Runtime, split_preprocess
from infclip.eval.retrieval import evaluate_retrieval
from infclip.eval.zeroshot import evaluate_zeroshot

_AMP = {"bf16": torch.bfloat16, "fp16": torch.float16}
_DATA_CACHE: dict[Any, Any] = {}  # opened datasets (file lists, labels), reused across hook calls
_LOADERS = {"zeroshot": load_zeroshot, "retrieval": load_retrieval, "contrastive": load_contrastive}


def make_autocast(precision: str, device: Union[str, torch.device]) -> Callable[[], ContextManager]:
    """A zero-argument autocast factory for "fp32" | "bf16" | "fp16" on ``device``."""
    device = torch.device(device)
    if precision == "fp32":
        return contextlib.nullcontext
    if precision not in _AMP:
        raise ValueError(f"precision={precision!r}: choose one of fp32, bf16, fp16")
    return lambda: torch.autocast(device.type, dtype=_AMP[precision])


def due_tasks(cfg: EvalConfig, step: int, final: bool) -> list[tuple[int, EvalTaskConfig]]:
    """(index, task) pairs to run at ``step``: all when final, else those whose period divides step."""
    if final:
        return list(enumerate(cfg.tasks))
    return [(i, t) for i, t in enumerate(cfg.tasks) if t.every_n_steps > 0 and step % t.every_n_steps == 0]


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """model.eval() inside; afterwards each submodule gets its own previous flag back (frozen
    LiT towers stay in eval mode, not switched to train by a blanket model.train())."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def _load(task: EvalTaskConfig, index: int, transform: Callable):
    """Open a task's dataset, reusing it across hook calls (key: the task and the transform
    object itself -- not its id, which a dead object's successor may reuse)."""
    loader = _LOADERS[task.kind]
    try:
        key = (astuple(task), transform)
        cached = _DATA_CACHE.get(key)
    except TypeError:  # an unhashable callable: no caching
        return loader(task, transform, index)
    if cached is None:
        if len(_DATA_CACHE) > 32:
            _DATA_CACHE.clear()
        cached = _DATA_CACHE[key] = loader(task, transform, index)
    return cached


def check_tasks(cfg: EvalConfig) -> None:
    """Validate the config and open every task's dataset (no model, no image decoded), so a
    wrong path fails at startup rather than at the first evaluation step."""
    if OmegaConf.is_config(cfg):
        cfg = OmegaConf.to_object(cfg)
    validate_eval(cfg)
    for index, task in enumerate(cfg.tasks):
        _LOADERS[task.kind](task, _identity, index)


def _identity(x):
    return x


def run_task(model, tokenizer, preprocess, task: EvalTaskConfig, index: int, cfg: EvalConfig,
             rt: Runtime, loss_fn: Optional[LossFn] = None, details: Optional[dict] = None) -> dict[str, float]:
    """Metrics of one task (unprefixed keys), identical on every rank of ``rt``; a zero-shot
    task fills ``details`` with its per-class counts and confusion matrix."""
    cpu_tf, on_device = split_preprocess(preprocess)
    data = _load(task, index, cpu_tf)
    workers = resolve_workers(cfg.workers)
    if task.kind == "zeroshot":
        return evaluate_zeroshot(model, tokenizer, data, on_device, cfg.batch_size, workers, cfg.chunk_size, rt,
                                 details)
    if task.kind == "contrastive":
        return evaluate_contrastive(model, tokenizer, data, on_device, cfg.batch_size, workers, cfg.chunk_size,
                                    rt, batch=task.batch, loss_fn=loss_fn)
    return evaluate_retrieval(model, tokenizer, data, on_device, cfg.batch_size, workers, cfg.chunk_size, rt)


def run_evals(model, tokenizer, preprocess, cfg: EvalConfig, *, step: int, final: bool,
              device: Union[str, torch.device], rank: int = 0, world_size: int = 1, group=None,
              autocast: Optional[Callable[[], ContextManager]] = None,
              loss_fn: Optional[LossFn] = None, details: Optional[dict] = None) -> dict[str, float]:
    """Run the tasks due at ``step`` (all of them when ``final``); returns {"eval/<task>/<metric>": v}.

    model: unwrapped open_clip CLIP (encode_image / encode_text). preprocess: PIL -> float
    tensor, or a (PIL -> uint8 tensor, on-device batch normalizer) pair. With cfg.all_ranks
    every rank of ``group`` must call this (same step) and all get the same dict; otherwise
    only rank 0 evaluates and the other ranks return {} at once. ``autocast``: zero-argument
    context factory (e.g. ``make_autocast("bf16", device)``); None runs in fp32. ``loss_fn``:
    the contrastive tasks' loss, with the trainer's signature ``loss_fn(img, txt, scale[, bias])``
    and no process group (each batch is scored whole on one rank); training passes its own
    ``loss.kind``, None uses CLIP's loss (SigLIP's for a model with a logit bias). ``details``:
    a dict that gets ``{task name: per-class counts and confusion matrix}`` of each zero-shot
    task (``infclip.eval.zeroshot.write_per_class`` writes them).
    """
    if OmegaConf.is_config(cfg):  # a Hydra node straight from the trainer's config
        cfg = OmegaConf.to_object(cfg)
    tasks = due_tasks(cfg, step, final)
    if not tasks or (not cfg.all_ranks and rank != 0):
        return {}
    validate_eval(cfg)
    device = torch.device(device)
    if not cfg.all_ranks:
        rank, world_size, group = 0, 1, None
    rt = Runtime(device, rank, world_size, group, autocast or contextlib.nullcontext)
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    metrics: dict[str, float] = {}
    with eval_mode(model), torch.no_grad(), torch.random.fork_rng(devices=cuda):
        for index, task in tasks:
            start = time.perf_counter()
            mine = {} if details is not None and task.kind == "zeroshot" else None
            result = run_task(model, tokenizer, preprocess, task, index, cfg, rt, loss_fn, mine)
            if mine:
                details[task.name] = mine
            result["seconds"] = time.perf_counter() - start
            metrics.update({f"eval/{task.name}/{k}": float(v) for k, v in result.items()})
    return metrics
