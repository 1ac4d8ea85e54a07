"""Standalone autograd entry point of the Triton kernels (no ``infclip`` imports).

``clip_loss_triton(img, txt, scale)`` is the symmetric CLIP loss on one device, one
autograd node (``TritonCLIPLoss``). Its backward writes each feature gradient once,
directly in the input dtype (no fp32 (b, c) buffers, no second gradient for the positive
pairs), so the extra memory is O(b) vectors plus the bounded scratch/partial buffers.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .ops import TritonTileOps
from .reference import row_dot


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


def loss_forward(ops: TritonTileOps, img: Tensor, txt: Tensor, scale: Tensor, groups: Tensor | None = None,
                 band: Tensor | None = None):
    """(loss 0-d fp32, row (b,), col (b,), pos (b,)) of the symmetric CLIP loss: row / col the
    two directions' LSEs relative to the positives' logits s * pos, pos = <img_i, txt_i> fp32.
    Autocast is off inside (the positives' product stays fp32-accumulated in the inputs' dtype,
    as in the CUDA graphs, which are captured with autocast off). groups: (b,) group ids or
    None (``TritonTileOps.fused_loss``): same-group pairs i != j leave both LSEs. band: None, or
    with the batch sorted by group a (1,) int32 w bounding |i - j| of every same-group pair:
    only the tiles within w of the diagonal compare ids (``ops._groups``)."""
    with torch.autocast(img.device.type, enabled=False):
        pos = row_dot(img, txt)
        kw = _groups_kw(groups, band)
        row, col = ops.forward(img, txt, scale, offsets=(pos, pos), diag=True, **kw)
        return 0.5 * (row.mean() + col.mean()), row, col, pos


def loss_backward(ops: TritonTileOps, img: Tensor, txt: Tensor, scale: Tensor, row: Tensor, col: Tensor,
                  pos: Tensor, g: Tensor, out: tuple[Tensor, Tensor] | None = None, groups: Tensor | None = None,
                  w_diag: Tensor | None = None, need: tuple[bool, bool] = (True, True), band: Tensor | None = None
                  ) -> tuple[Tensor | None, Tensor | None, Tensor]:
    """(dimg, dtxt in the input dtype, dscale fp32 0-d) of ``loss_forward`` for upstream g (0-d);
    ``out``: (dimg, dtxt) buffers to write them into (else fresh tensors). groups, band: as
    ``loss_forward``. w_diag (b,): the positives' weight in -sum_i g_diag_i x_ii is
    g_lse_i w_diag_i instead of 2 g_lse_i (a multi-positive loss: its within-group softmax
    shares, summed over both directions). need: which of (dimg, dtxt) to compute (the other
    is None; ``TritonTileOps.backward``)."""
    b = img.shape[0]
    g_lse = (0.5 / b * g.float()).expand(b).contiguous()
    g_diag = 2 * g_lse if w_diag is None else g_lse * w_diag  # 2 g_lse: exactly g_row + g_col (CLIP)
    dimg, dtxt = out if out is not None else (None, None)
    kw = _groups_kw(groups, band)
    return ops.backward(img, txt, scale, row, col, g_lse, g_lse, dimg, dtxt, out_dtype=img.dtype, g_diag=g_diag,
                        offsets=(pos, pos), overwrite=out is not None, need=need, **kw)


def _groups_kw(groups: Tensor | None, band: Tensor | None) -> dict:
    """The tile ops' ``groups`` argument: none, (ids, ids) or (ids, ids, band)."""
    if groups is None:
        return {}
    return {"groups": (groups, groups) if band is None else (groups, groups, band)}


class TritonCLIPLoss(torch.autograd.Function):
    """The whole symmetric CLIP loss of a square batch as one autograd node.

    loss = mean_i [ (row_lse_i + col_lse_i) / 2 - s <img_i, txt_i> ]. The positives'
    dot products d_i = <img_i, txt_i> are computed once in fp32 and passed to the kernels
    as offsets: the kernels return LSE - s d directly (no difference of two large numbers),
    use d as the positives' dot products in every pass, and fold the positive term into dX
    in fp32 before any rounding; the feature gradients are written once, in the input dtype.

    ``groups`` (b,) int32 / int64 group ids, or None: duplicates "mask" (same-group pairs i != j
    are neither negatives nor positives) in the same kernels and passes, with the group
    compare in their tile epilogues (``kernels``, HAS_GID).
    """

    @staticmethod
    def forward(ctx, img: Tensor, txt: Tensor, scale: Tensor, ops: TritonTileOps, groups: Tensor | None = None
                ) -> Tensor:
        loss, row, col, pos = loss_forward(ops, img, txt, scale, groups)
        ctx.save_for_backward(img, txt, scale, row, col, pos)
        ctx.ops, ctx.groups = ops, groups
        return loss

    @staticmethod
    @once_differentiable  # the kernels' gradients are not differentiable again: say so, not silently
    def backward(ctx, g: Tensor):
        img, txt, scale, row, col, pos = ctx.saved_tensors
        need = ctx.needs_input_grad  # a locked tower's features: their gradient is never formed
        dimg, dtxt, ds = loss_backward(ctx.ops, img, txt, scale, row, col, pos, g, groups=ctx.groups,
                                       need=(need[0], need[1]))
        return (dimg if need[0] else None, dtxt if need[1] else None,
                ds.to(scale.dtype) if need[2] else None, None, None)


def clip_loss_triton(img: Tensor, txt: Tensor, scale: Tensor, fp32_precision: str = "ieee",
                     ops: TritonTileOps | None = None) -> Tensor:
    """fp32 mean over i of (row_lse_i + col_lse_i) / 2 - s <img_i, txt_i> (one process)."""
    ops = ops or TritonTileOps(fp32_precision)
    return TritonCLIPLoss.apply(img, txt, scale, ops)
