"""The eval hook of the training loop: which steps evaluate, and running the configured
tasks (``infclip.eval``) on the unwrapped model under the training precision, compiled towers
run eagerly."""

from __future__ import annotations

import contextlib
import sys
from types import SimpleNamespace
from typing import Any

import torch

from infclip.eval import make_autocast
from infclip.train.distributed import DistInfo
from infclip.train.engine import unwrap


def eval_due(eval_cfg: Any, step: int) -> bool:
    """True when some task evaluates every ``every_n_steps`` and ``step`` is a multiple."""
    return any(t.every_n_steps and step % t.every_n_steps == 0 for t in eval_cfg.tasks)


def evaluate(cfg: Any, info: DistInfo, parts: Any, step: int, final: bool) -> dict:
    """Runs the eval tasks (all ranks together) and logs their results; {} without tasks."""
    if not parts.eval_cfg.tasks:
        return {}
    if parts.guard is not None:
        parts.guard.check()  # never spend an eval on (or report) weights a bad update poisoned
    from infclip.eval import run_evals
    from infclip.loss.build import build_loss

    # Contrastive (val-data) tasks score whole batches on one rank: the run's loss.kind, no group,
    # always tiled (vanilla/local would hold batch x batch logits) and unfiltered (same value).
    impl = cfg.loss.impl if cfg.loss.impl in ("torch", "triton") else "auto"
    loss_fn = build_loss(SimpleNamespace(kind=cfg.loss.kind, impl=impl, fp32_precision=cfg.loss.fp32_precision,
                                         temperature=cfg.loss.temperature, grad_filter=0.0), group=None)
    # pure_bf16: the weights are bf16 already; bf16 autocast casts the eval transforms' fp32 images to them
    amp = "bf16" if cfg.precision.amp == "pure_bf16" else cfg.precision.amp
    details = {} if final else None  # the final eval's per-class results: <run_dir>/per_class/
    with make_autocast(amp, info.device)(), eager_compiled_code():
        results = run_evals(
            unwrap(parts.model), parts.built.tokenizer, parts.built.preprocess_val, parts.eval_cfg,
            step=step, final=final, device=info.device, rank=info.rank, world_size=info.world_size,
            group=torch.distributed.group.WORLD if info.distributed else None, loss_fn=loss_fn, details=details,
        )
    if info.rank == 0:
        for key, n in results.items():  # the metrics leave undecodable images out: say so
            if key.endswith("/num_skipped_images"):
                print(f"warning: eval {key.split('/')[1]}: {int(n)} images could not be decoded; skipped",
                      file=sys.stderr, flush=True)
    parts.logger.log(step, results)
    if details and info.is_main:
        _write_per_class(parts, details)
    return results


def eager_compiled_code() -> contextlib.AbstractContextManager:
    """Inside, every ``torch.compile``d function (``model.compile=true``'s towers) runs its
    original eager code, so the eval's graphs (eval mode, no grad, its batch sizes) are never
    compiled. The stance is process-wide and the previous one is restored on exit; compiled
    graphs are untouched, so training after the block runs compiled without recompiling.
    Torch before 2.6 has no compile stance: the compiled towers run there."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def _write_per_class(parts: Any, details: dict) -> None:
    """Each zero-shot task's per-class accuracy and confusion matrix as CSV files in
    <run_dir>/per_class/, named in one line; a write that fails is a warning line."""
    from infclip.eval.zeroshot import write_per_class

    for name, task in details.items():
        try:
            per_class, _ = write_per_class(parts.run_dir / "per_class", name, task)
            parts.logger.write(f"eval {name}: per-class accuracy in {per_class} (confusion matrix beside it)")
        except OSError as e:
            parts.logger.write(f"warning: eval {name}: per-class results not written ({e})")
