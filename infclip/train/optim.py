"""Optimizer and learning-rate schedule from config.

AdamW, the paper's modified AdaFactor via timm's big_vision-style ``AdafactorBigVision``
(momentum = beta1, second-moment decay capped at beta2), or any timm optimizer by name
(``optim.name=timm/lamb``: ``timm.optim.create_optimizer_v2`` on our parameter groups).
Gains, biases, embeddings of positions/class tokens and the logit scale/bias get no
weight decay (open_clip's rule: every parameter with fewer than 2 dims, plus the named
ones). Frozen (LiT-locked) parameters are left out entirely, so they hold no state.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from timm.optim import AdafactorBigVision

_NO_DECAY_NAMES = ("logit_scale", "logit_bias", "positional_embedding", "class_embedding", "bias")


def _no_decay(name: str, p: torch.Tensor) -> bool:
    return p.ndim < 2 or any(k in name for k in _NO_DECAY_NAMES) or ".ln" in name or "norm" in name


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: decayed matrices and undecayed gains/biases/scales; frozen params excluded."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if _no_decay(name, p) else decay).append(p)
    if not decay and not no_decay:
        raise ValueError("the model has no trainable parameters (are both towers locked?)")
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, cfg: Any) -> torch.optim.Optimizer:
    """``cfg`` is an OptimConfig."""
    groups = param_groups(model, cfg.weight_decay)
    if cfg.name == "adamw":
        # fused: one kernel for the whole update on CUDA (no per-parameter launches)
        fused = all(p.is_cuda for g in groups for p in g["params"])
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None)
    if cfg.name == "adafactor":
        return AdafactorBigVision(groups, lr=cfg.lr, momentum=cfg.beta1, beta2_cap=cfg.beta2)
    if cfg.name.startswith("timm/"):  # open_clip's --opt timm/<name>: timm's factory, our groups
        from timm.optim import create_optimizer_v2

        # weight_decay=0 here: each group carries its own (create_optimizer_v2 would otherwise
        # re-split the groups by its own no-decay rule)
        return create_optimizer_v2(groups, opt=cfg.name[5:], lr=cfg.lr, weight_decay=0.0,
                                   betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    raise ValueError(f"optim.name={cfg.name!r}: choose 'adamw', 'adafactor' or 'timm/<optimizer>'")


def lr_factor(step: int, total: int, warmup: int, kind: str, min_ratio: float,
              cooldown: int = 0, power: float = 1.0) -> float:
    """Multiplier of the peak lr at ``step`` (0-based): linear warm-up, then cosine to
    ``min_ratio``, constant, or constant until the last ``cooldown`` steps, which decay as
    ``min_ratio + (1 - min_ratio) * (1 - progress) ** power`` (open_clip's const-cooldown; the
    last step reaches ``min_ratio`` exactly)."""
    if step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    if kind == "const-cooldown":
        start = total - cooldown
        if step < start:
            return 1.0
        progress = min(1.0, (step - start + 1) / max(1, cooldown))
        return min_ratio + (1 - min_ratio) * (1 - progress) ** power
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Any, total_steps: int):
    """``cfg`` is a ScheduleConfig; stepping once per optimizer step."""
    warmup = cfg.warmup_steps or math.ceil(cfg.warmup_fraction * total_steps)
    cooldown = cfg.cooldown_steps or math.ceil(cfg.cooldown_fraction * total_steps)
    if cfg.kind == "const-cooldown" and warmup + cooldown > total_steps:
        raise ValueError(f"warm-up ({warmup}) and cooldown ({cooldown}) steps exceed train.steps={total_steps}: "
                         "shorten schedule.warmup_* or schedule.cooldown_*")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total_steps, warmup, cfg.kind, cfg.min_lr_ratio, cooldown,
                                       cfg.cooldown_power)
    )
