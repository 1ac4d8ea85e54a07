"""Standalone autograd entry point of the Triton kernels (no ``infclip`` imports).

``clip_loss_triton(img, txt, scale)`` is the symmetric CLIP loss on one device. Its
backward writes the feature gradients directly in the input dtype (no fp32 (b, c)
buffers), so the extra memory is O(b) vectors plus the forward's bounded partials.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .ops import TritonTileOps


class TritonLSEPair(torch.autograd.Function):
    """(row_lse (m,), col_lse (n,)) of x = s * img @ txt.T; saves only inputs and O(b) vectors."""

    @staticmethod
    def forward(ctx, img: Tensor, txt: Tensor, scale: Tensor, ops: TritonTileOps):
        row_lse, col_lse = ops.forward(img, txt, scale)
        ctx.save_for_backward(img, txt, scale, row_lse, col_lse)
        ctx.ops = ops
        return row_lse, col_lse

    @staticmethod
    def backward(ctx, g_row: Tensor | None, g_col: Tensor | None):
        img, txt, scale, row_lse, col_lse = ctx.saved_tensors
        g_row = torch.zeros_like(row_lse) if g_row is None else g_row
        g_col = torch.zeros_like(col_lse) if g_col is None else g_col
        dimg, dtxt, ds = ctx.ops.backward(img, txt, scale, row_lse, col_lse, g_row, g_col,
                                          out_dtype=img.dtype)
        need = ctx.needs_input_grad
        return (dimg if need[0] else None, dtxt if need[1] else None,
                ds.to(scale.dtype) if need[2] else None, None)


def lse_pair_triton(img: Tensor, txt: Tensor, scale: Tensor, ops: TritonTileOps | None = None):
    """Differentiable (row_lse, col_lse); grads in the input dtype."""
    return TritonLSEPair.apply(img, txt, scale, ops or TritonTileOps())


def clip_loss_triton(img: Tensor, txt: Tensor, scale: Tensor, fp32_precision: str = "ieee") -> Tensor:
    """fp32 mean over i of (row_lse_i + col_lse_i) / 2 - s <img_i, txt_i>."""
    row_lse, col_lse = lse_pair_triton(img, txt, scale, TritonTileOps(fp32_precision))
    diag = scale.float() * (img.float() * txt.float()).sum(-1)
    return 0.5 * (row_lse.mean() + col_lse.mean()) - diag.mean()
