"""Equality of two runs of the same sums through differently compiled kernel variants.

Under ``TRITON_INTERPRET=1`` both variants are the same numpy program: equal bit for bit. On
the GPU they are separately compiled kernels (band or not, ids or not), and the compiler may
pick another register layout, and with it another order for a row's ``tl.sum``, or contract
another product into an FMA: equal within a few fp32 roundings of the values compared. A pair
counted or dropped by mistake moves the sums by orders of magnitude more (these tests' group
members share a direction: their logits are among their rows' largest).
"""

from __future__ import annotations

import os

import torch

COMPILED_RTOL = 4e-6  # a few fp32 ulps (2^-23 = 1.2e-7) of sums over a few hundred terms


def assert_same_sums(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """``got`` equals ``want`` bit for bit in the interpreter; on the GPU within
    ``COMPILED_RTOL`` of the largest value compared (elementwise for the scalars)."""
    if os.environ.get("TRITON_INTERPRET") == "1" or got.device.type == "cpu":
        assert torch.equal(got, want), f"{what}: not bit for bit"
        return
    scale = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=COMPILED_RTOL, atol=COMPILED_RTOL * scale,
                               msg=lambda m: f"{what}: {m}")
