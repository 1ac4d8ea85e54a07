"""Autograd wrapper around tile operations: the two LSE vectors of the CLIP loss.

``lse_pair(img, txt, scale, ops, group)`` returns ``(row_lse, col_lse)`` for the local
rows and local texts. With ``group=None`` both span this process's batch; with a
process group they span the global batch and the ring in ``infclip.loss.ring`` moves
feature blocks between ranks. Only O(b) vectors are saved for backward; tiles are
recomputed there.
"""

from __future__ import annotations

import torch
from torch import Tensor


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
        return row_lse, col_lse

    @staticmethod
    def backward(ctx, g_row, g_col):
        img, txt, scale, row_lse, col_lse = ctx.saved_tensors
        g_row = torch.zeros_like(row_lse) if g_row is None else g_row.to(row_lse.dtype).contiguous()
        g_col = torch.zeros_like(col_lse) if g_col is None else g_col.to(col_lse.dtype).contiguous()
        if ctx.group is None:
            # Backends that can write fresh gradients in the input dtype (Triton) do so: no
            # fp32 (b, c) buffers, so the extra memory stays O(b).
            kw = {"out_dtype": img.dtype} if getattr(ctx.ops, "writes_out_dtype", False) else {}
            dimg, dtxt, dscale = ctx.ops.backward(img, txt, scale, row_lse, col_lse, g_row, g_col, **kw)
        else:
            from infclip.loss import ring

            dimg, dtxt, dscale = ring.ring_backward(
                img, txt, scale, row_lse, col_lse, g_row, g_col, ctx.ops, ctx.group
            )
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


def lse_pair(img: Tensor, txt: Tensor, scale: Tensor, ops, group=None) -> tuple[Tensor, Tensor]:
    """(row_lse (m,), col_lse (m,)) fp32 with autograd to img, txt and scale."""
    return _LSEPair.apply(img, txt, scale, ops, group)
