"""Autograd wrapper around tile operations: the two LSE vectors and the positives of the CLIP loss.

``lse_pair(img, txt, scale, ops, group)`` returns ``(row_lse, col_lse, pos)`` for the local
rows and local texts, pos_i = x_ii = s <I_i, T_i>. The positives live inside the same
Function so each feature gradient is formed once in fp32 and rounded once to the input
dtype (a separate autograd branch would add a second (b, c) gradient and round twice). With ``group=None`` both span this process's batch; with a
process group they span the global batch and the ring in ``infclip.loss.ring`` moves
feature blocks between ranks. Only O(b) vectors are saved for backward; tiles are
recomputed there.
"""

from __future__ import annotations

import torch
from torch import Tensor

from infclip.loss.tiled import _row_chunks, row_dot


class _LSEPair(torch.autograd.Function):
    @staticmethod
    def forward(ctx, img, txt, scale, ops, group):
        if group is None:
            row_lse, col_lse = ops.forward(img, txt, scale)
        else:
            from infclip.loss import ring

            row_lse, col_lse = ring.ring_forward(img, txt, scale, ops, group)
        ctx.save_for_backward(img, txt, scale, row_lse, col_lse)
        ctx.ops, ctx.group = ops, group
        return row_lse, col_lse, scale.to(row_lse.dtype) * row_dot(img, txt)

    @staticmethod
    def backward(ctx, g_row, g_col, g_pos):
        img, txt, scale, row_lse, col_lse = ctx.saved_tensors
        g_row = torch.zeros_like(row_lse) if g_row is None else g_row.to(row_lse.dtype).contiguous()
        g_col = torch.zeros_like(col_lse) if g_col is None else g_col.to(col_lse.dtype).contiguous()
        g_pos = None if g_pos is None else g_pos.to(row_lse.dtype).contiguous()
        if ctx.group is None and getattr(ctx.ops, "writes_out_dtype", False):
            # Triton writes fresh gradients in the input dtype (no fp32 (b, c) buffers, so the
            # extra memory stays O(b)) and adds the positives before its single rounding.
            kw = {"out_dtype": img.dtype, "g_diag": None if g_pos is None else -g_pos}
            dimg, dtxt, dscale = ctx.ops.backward(img, txt, scale, row_lse, col_lse, g_row, g_col, **kw)
        else:
            if ctx.group is None:
                dimg, dtxt, dscale = ctx.ops.backward(img, txt, scale, row_lse, col_lse, g_row, g_col)
            else:
                from infclip.loss import ring

                dimg, dtxt, dscale = ring.ring_backward(
                    img, txt, scale, row_lse, col_lse, g_row, g_col, ctx.ops, ctx.group
                )
            if g_pos is not None:
                dscale = dscale + _add_positive_grads(dimg, dtxt, img, txt, scale, g_pos)
        # No all-reduce of dscale: each rank returns the part of d(sum of all ranks'
        # losses)/ds that flows through its own rows; DDP's gradient averaging then gives
        # exactly the single-process gradient of the global mean loss.
        return (
            dimg.to(img.dtype) if ctx.needs_input_grad[0] else None,
            dtxt.to(txt.dtype) if ctx.needs_input_grad[1] else None,
            dscale.to(scale.dtype) if ctx.needs_input_grad[2] else None,
            None,
            None,
        )


def lse_pair(img: Tensor, txt: Tensor, scale: Tensor, ops, group=None) -> tuple[Tensor, Tensor, Tensor]:
    """(row_lse (m,), col_lse (m,), pos (m,)) fp32 (fp64 for fp64) with autograd to img, txt, scale."""
    return _LSEPair.apply(img, txt, scale, ops, group)


def _add_positive_grads(dimg: Tensor, dtxt: Tensor, img: Tensor, txt: Tensor, scale: Tensor,
                        g_pos: Tensor) -> Tensor:
    """Adds d(sum_i g_pos_i s <I_i, T_i>) to the fp32 feature gradients in place, chunked;
    returns its d/ds."""
    s = scale.to(dimg.dtype)
    for lo, hi in _row_chunks(img):
        g = g_pos[lo:hi, None].to(dimg.dtype)
        dimg[lo:hi] += (g * s) * txt[lo:hi].to(dimg.dtype)
        dtxt[lo:hi] += (g * s) * img[lo:hi].to(dimg.dtype)
    return (g_pos.to(dimg.dtype) * row_dot(img, txt)).sum()
