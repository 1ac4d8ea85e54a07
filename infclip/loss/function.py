"""Autograd wrapper around tile operations: the per-row terms of the CLIP loss.

``lse_pair(img, txt, scale, ops, group)`` returns ``(row_loss, col_loss)`` for the local
rows and local texts, with x_ij = s <I_i, T_j> and the positives' logits x_ii:

    row_loss_i = LSE_j x_ij - x_ii   (j over every text of the batch)
    col_loss_j = LSE_i x_ij - x_jj   (i over every image of the batch)

so the CLIP loss is the mean of (row_loss + col_loss) / 2. The positives are part of the
tiles, not a separate term: <I_i, T_i> is computed once in fp32 (``row_dot``) and passed
to the tiles as their offsets (``infclip.loss.tiled.shifted_dots``), so the LSEs come
back already relative to x_ii (no difference of two large numbers) and the backward
folds -[i == j] into dX_ij before any rounding or product (``fold_positives``). Each
feature gradient is formed once and rounded once to the input dtype.

With ``group=None`` both span this process's batch; with a process group they span the
global batch and the ring in ``infclip.loss.ring`` moves feature blocks between ranks.
Only O(b) vectors are saved for backward; tiles are recomputed there.
"""

from __future__ import annotations

import torch
from torch import Tensor

from infclip.loss.tiled import row_dot


def positive_dots(img: Tensor, txt: Tensor) -> Tensor:
    """(m,) <I_i, T_i> in the accumulation dtype (fp32; fp64 for fp64), no autograd."""
    with torch.no_grad():
        return row_dot(img.detach(), txt.detach())


class _LSEPair(torch.autograd.Function):
    @staticmethod
    def forward(ctx, img, txt, scale, ops, group):
        pos = positive_dots(img, txt)
        if group is None:
            row, col = ops.forward(img, txt, scale, offsets=(pos, pos), diag=True)
        else:
            from infclip.loss import ring

            row, col = ring.ring_forward(img, txt, scale, ops, group, pos)
        ctx.save_for_backward(img, txt, scale, row, col, pos)
        ctx.ops, ctx.group = ops, group
        return row, col

    @staticmethod
    def backward(ctx, g_row, g_col):
        img, txt, scale, row, col, pos = ctx.saved_tensors
        g_row = torch.zeros_like(row) if g_row is None else g_row.to(row.dtype).contiguous()
        g_col = torch.zeros_like(col) if g_col is None else g_col.to(col.dtype).contiguous()
        if ctx.group is None:
            # Triton writes fresh gradients in the input dtype (no fp32 (b, c) buffers, so the
            # extra memory stays O(b)); the positives are folded in before that single rounding.
            kw = {"out_dtype": img.dtype} if getattr(ctx.ops, "writes_out_dtype", False) else {}
            dimg, dtxt, dscale = ctx.ops.backward(img, txt, scale, row, col, g_row, g_col, offsets=(pos, pos),
                                                  g_diag=g_row + g_col, **kw)
        else:
            from infclip.loss import ring

            dimg, dtxt, dscale = ring.ring_backward(img, txt, scale, row, col, g_row, g_col, ctx.ops,
                                                    ctx.group, pos)
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
    """(row_loss (m,), col_loss (m,)) fp32 (fp64 for fp64) with autograd to img, txt, scale:
    row_loss_i = LSE_j x_ij - x_ii, col_loss_j = LSE_i x_ij - x_jj (see module docs)."""
    return _LSEPair.apply(img, txt, scale, ops, group)
