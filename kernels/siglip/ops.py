"""``TritonSigmoidOps``: the SigLIP tile-operation protocol of ``infclip.loss.siglip`` on Triton.

    forward(img (m,c), txt (n,c), scale, bias, diag) -> row_loss (m,) fp32
    backward(img, txt, scale, bias, g_row (m,), diag, dimg=None, dtxt=None)
        -> (dimg (m,c), dtxt (n,c), dscale 0-d, dbias 0-d) fp32; accumulates when given.
``diag``: the block pair holds the positives on its diagonal (own images x own texts).
Scale and bias stay on the device (read by the kernels through pointers: no host sync).
Block configs are fixed (no tuning yet); the interpreter uses small tiles.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from .kernels import _sigmoid_fwd_kernel, _sigmoid_grad_kernel


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class Config:
    """BM rows x BN columns per tile, K streamed in BK chunks, DC output feature columns."""

    BM: int = 64
    BN: int = 64
    BK: int = 32
    DC: int = 128
    num_warps: int = 4
    num_stages: int = 3


def default_config(k: int) -> Config:
    """Small tiles under the interpreter. On GPU 64x64 tiles, DC = 128 feature columns per
    program, 8 warps: the largest config that ptxas compiles for sm_90 without register
    spills in fp32 and bf16 (4 warps or DC = 256 spill; checked in tests/kernels). Untuned:
    no GPU timing has been done yet."""
    if interpreting():
        return Config(16, 16, 16, 16, 1, 1)
    return Config(64, 64, 32, min(128, max(32, 1 << math.ceil(math.log2(k)))), num_warps=8, num_stages=3)


class TritonSigmoidOps:
    """Fused Triton SigLIP tiles: one forward pass (row sums), two backward passes (dI, dT).

    Args:
        fp32_precision: dot precision for float32 inputs: "ieee" (default) or "tf32".
        config: block sizes (``default_config`` by feature dim when None).
    """

    name = "triton"

    def __init__(self, fp32_precision: str = "ieee", config: Config | None = None):
        if fp32_precision not in ("ieee", "tf32"):
            raise ValueError(f"fp32_precision must be 'ieee' or 'tf32', got {fp32_precision!r}")
        self.fp32_precision, self.config = fp32_precision, config

    def _meta(self, a: Tensor) -> dict:
        cfg = self.config or default_config(a.shape[1])
        prec = self.fp32_precision if a.dtype == torch.float32 else "tf32"
        dot_f32 = interpreting() and a.element_size() == 2  # the interpreter's 16-bit dot is wrong
        return dict(BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, EVEN_K=a.shape[1] % cfg.BK == 0, PREC=prec,
                    DOT_F32=dot_f32, num_warps=cfg.num_warps, num_stages=cfg.num_stages), cfg

    def forward(self, img: Tensor, txt: Tensor, scale: Tensor, bias: Tensor, diag: bool) -> Tensor:
        img, txt, scale, bias = _prep(img, txt, scale, bias)
        m, n, k = img.shape[0], txt.shape[0], img.shape[1]
        meta, cfg = self._meta(img)
        rows = torch.empty(m, device=img.device, dtype=torch.float32)
        grid = (triton_cdiv(m, cfg.BM),)
        _sigmoid_fwd_kernel[grid](img, txt, scale, bias, rows, m, n, k, img.stride(0), txt.stride(0),
                                  0 if diag else m + n, **meta)
        return rows

    def backward(self, img: Tensor, txt: Tensor, scale: Tensor, bias: Tensor, g_row: Tensor, diag: bool,
                 dimg: Tensor | None = None, dtxt: Tensor | None = None):
        img, txt, scale, bias = _prep(img, txt, scale, bias)
        g = g_row.float().contiguous()
        acc_i, acc_t = dimg is not None, dtxt is not None
        dimg = torch.empty(img.shape, device=img.device, dtype=torch.float32) if dimg is None else dimg
        dtxt = torch.empty(txt.shape, device=img.device, dtype=torch.float32) if dtxt is None else dtxt
        off = 0 if diag else img.shape[0] + txt.shape[0]
        part = self._grad(img, txt, scale, bias, g, dimg, acc_i, True, off, True)
        self._grad(txt, img, scale, bias, g, dtxt, acc_t, False, off, False)
        ds, db = part.view(-1, 2).sum(0)
        return dimg, dtxt, ds, db

    def _grad(self, a, b, scale, bias, g, out, accumulate, g_on_a, diag_off, compute_ds):
        """out (+)= s dX @ b for the rows of a; returns the (programs, 2) (ds, dt) shares."""
        m, n, k = a.shape[0], b.shape[0], a.shape[1]
        meta, cfg = self._meta(a)
        grid = (triton_cdiv(m, cfg.BM), triton_cdiv(k, cfg.DC))
        part = torch.empty(2 * grid[0] * grid[1] if compute_ds else 2, device=a.device, dtype=torch.float32)
        _sigmoid_grad_kernel[grid](a, b, scale, bias, g, out, part, m, n, k, a.stride(0), b.stride(0),
                                   out.stride(0), diag_off, DC=cfg.DC, G_ON_A=g_on_a, ACCUM=accumulate,
                                   COMPUTE_DS=compute_ds, **meta)
        return part


def triton_cdiv(x: int, y: int) -> int:
    return (x + y - 1) // y


def _prep(img: Tensor, txt: Tensor, scale: Tensor, bias: Tensor):
    if img.dtype != txt.dtype:
        raise ValueError(f"dtype mismatch: {img.dtype} vs {txt.dtype}")
    if img.shape[1] != txt.shape[1]:
        raise ValueError(f"feature dims differ: {img.shape[1]} vs {txt.shape[1]}")
    to32 = (lambda x: x.detach().reshape(1).float())
    return img.contiguous(), txt.contiguous(), to32(scale), to32(bias)
