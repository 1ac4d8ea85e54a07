"""Finite-weights guard: no update that made a parameter NaN or inf is trained on or saved.

After each optimizer step the guard computes, on the device and without a host sync, one
flag: are all trainable parameters finite (the max |w| per tensor through one fused
``torch._foreach_norm(ord=inf)``, then one reduction; no overflow, unlike a sum of squares).
The flag is fetched together with the next value the step fetches anyway (the gradient norm
of the next step: one ``.tolist()`` for both), and before anything is written or evaluated
(``check``). So a poisoned update costs one reduction per step and is caught before the
next update, save or eval; the abort names the newest checkpoint that *is* finite.

Weights are identical on every rank (DDP all-reduces the gradients), so every rank sees the
same flag and raises together; no collective is needed.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch


class NonFiniteError(RuntimeError):
    """Training cannot continue from the current weights; the message says how to resume."""


def finite_flag(params: list[torch.Tensor]) -> torch.Tensor:
    """0-dim float tensor on the parameters' device: 1.0 iff every element is finite."""
    if not params:
        return torch.ones(())
    norms = torch._foreach_norm([p.detach() for p in params], math.inf)
    return torch.stack(norms).max().isfinite().float()  # NaN propagates through max


class WeightGuard:
    """Holds the finite flag of the latest update until it is fetched.

    Invariant: ``check()`` (or ``fetch``) has returned for an update before the weights it
    produced are written to a checkpoint, evaluated, or updated again.
    """

    def __init__(self, params: list[torch.Tensor], abort: Callable[[], str]):
        self.params = params
        self.abort = abort  # builds the abort message (last finite checkpoint, resume command)
        self._pending: Optional[torch.Tensor] = None

    def after_update(self) -> None:
        """Called after every optimizer step: queues the flag (no host sync)."""
        self._pending = finite_flag(self.params)

    def fetch(self, value: torch.Tensor) -> float:
        """``float(value)``, resolving the pending flag in the same device-to-host copy."""
        if self._pending is None:
            return float(value)
        both = torch.stack([value.detach().float().reshape(()), self._pending.to(value.device)]).tolist()
        self._resolve(both[1])
        return both[0]

    def check(self) -> None:
        """Resolves the pending flag now (before a save or an eval)."""
        if self._pending is not None:
            self._resolve(float(self._pending))

    def _resolve(self, ok: float) -> None:
        self._pending = None
        if ok != 1.0:
            raise NonFiniteError(self.abort())
