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
from torch.autograd.function import once_differentiable

from infclip.loss import duplicates
from infclip.loss.tiled import row_dot


def positive_dots(img: Tensor, txt: Tensor) -> Tensor:
    """(m,) <I_i, T_i> in the accumulation dtype (fp32; fp64 for fp64), no autograd."""
    with torch.no_grad():
        return row_dot(img.detach(), txt.detach())


class _LSEPair(torch.autograd.Function):
    @staticmethod
    def forward(ctx, img, txt, scale, ops, group, dup):
        pos = positive_dots(img, txt)
        groups = (dup.ids, dup.ids) if dup is not None and dup.mode == "mask" else None
        pos_row = pos_col = None
        if group is None:
            row, col = ops.forward(img, txt, scale, offsets=(pos, pos), diag=True, **_kw(groups))
            if dup is not None and dup.mode == "positive":
                parts = duplicates.positive_forward(img, txt, scale, pos, pos, dup.ids, dup.ids, True, dup.pairs)
                pos_row, pos_col = (duplicates.with_self(p) for p in parts)
        else:
            from infclip.loss import ring

            row, col, pos_row, pos_col = ring.ring_forward(img, txt, scale, ops, group, pos, dup)
        ctx.save_for_backward(img, txt, scale, row, col, pos, *(() if pos_row is None else (pos_row, pos_col)))
        ctx.ops, ctx.group, ctx.dup = ops, group, dup
        if pos_row is None:
            return row, col
        return row - pos_row, col - pos_col  # LSE over all less LSE over the group, both relative to x_ii

    @staticmethod
    def backward(ctx, g_row, g_col):
        img, txt, scale, row, col, pos, *pos_lse = ctx.saved_tensors
        dup = ctx.dup
        g_row = torch.zeros_like(row) if g_row is None else g_row.to(row.dtype).contiguous()
        g_col = torch.zeros_like(col) if g_col is None else g_col.to(col.dtype).contiguous()
        if ctx.group is None:
            dimg, dtxt, dscale = _local_backward(ctx.ops, img, txt, scale, row, col, pos, g_row, g_col, dup, pos_lse)
        else:
            from infclip.loss import ring

            dimg, dtxt, dscale = ring.ring_backward(img, txt, scale, row, col, g_row, g_col, ctx.ops,
                                                    ctx.group, pos, dup, *pos_lse,
                                                    need_img=ctx.needs_input_grad[0], dtxt_dtype=txt.dtype)
        # No all-reduce of dscale: each rank returns the part of d(sum of all ranks'
        # losses)/ds that flows through its own rows; DDP's gradient averaging then gives
        # exactly the single-process gradient of the global mean loss.
        return (
            dimg.to(img.dtype) if ctx.needs_input_grad[0] else None,
            dtxt.to(txt.dtype) if ctx.needs_input_grad[1] else None,
            dscale.to(scale.dtype) if ctx.needs_input_grad[2] else None,
            None,
            None,
            None,
        )


def _kw(groups) -> dict:
    """The tiles' ``groups`` argument only when masking (backends without it keep working)."""
    return {} if groups is None else {"groups": groups}


def _local_backward(ops, img, txt, scale, row, col, pos, g_row, g_col, dup, pos_lse):
    """(dimg, dtxt, dscale) of the one-process loss. Triton writes fresh gradients in the input
    dtype (no fp32 (b, c) buffers, so the extra memory stays O(b)); the positives are folded in
    before that single rounding. "positive": the positives' weight is g w_ii (w: the
    within-group softmax) and the other same-group pairs' terms are added sparsely."""
    kw = {"out_dtype": img.dtype} if getattr(ops, "writes_out_dtype", False) else {}
    g_diag = g_row + g_col
    if dup is not None and dup.mode == "positive":
        g_diag = g_row * duplicates.positive_weight(pos_lse[0]) + g_col * duplicates.positive_weight(pos_lse[1])
    groups = (dup.ids, dup.ids) if dup is not None and dup.mode == "mask" else None
    dimg, dtxt, dscale = ops.backward(img, txt, scale, row, col, g_row, g_col, offsets=(pos, pos), g_diag=g_diag,
                                      **kw, **_kw(groups))
    if dup is not None and dup.mode == "positive":
        dscale = dscale + duplicates.positive_backward(img, txt, scale, pos, pos, dup.ids, dup.ids, True, *pos_lse,
                                                       g_row, g_col, dimg, dtxt, dup.pairs)
    return dimg, dtxt, dscale


def lse_pair(img: Tensor, txt: Tensor, scale: Tensor, ops, group=None, dup=None) -> tuple[Tensor, Tensor]:
    """(row_loss (m,), col_loss (m,)) fp32 (fp64 for fp64) with autograd to img, txt, scale:
    row_loss_i = LSE_j x_ij - x_ii, col_loss_j = LSE_i x_ij - x_jj (see module docs); with
    ``dup`` (a ``duplicates.Duplicates``) the terms of its mode (``infclip.loss.duplicates``)."""
    return _LSEPair.apply(img, txt, scale, ops, group, dup)


class _FusedPositive(torch.autograd.Function):
    """duplicates="positive" on one process as one autograd node around the fused CLIP loss's
    passes (``infclip.kernels.clip.function.loss_forward`` / ``loss_backward``): the plain
    kernels (no group ids: the denominators are the plain LSEs), plus the same-group pairs'
    sparse terms from the pair list that ``duplicates.prepare`` found once for the call. The
    positives' weight in the kernels' folded dX_ii is g (w_ii + w'_ii) (``loss_backward``'s
    w_diag), so nothing b^2 is added to the plain loss's work."""

    @staticmethod
    def forward(ctx, img, txt, scale, ops, dup):
        from infclip.kernels.clip.function import loss_forward

        _, row, col, pos = loss_forward(ops, img, txt, scale)
        parts = duplicates.positive_forward(img, txt, scale, pos, pos, dup.ids, dup.ids, True, dup.pairs)
        pos_row, pos_col = (duplicates.with_self(p) for p in parts)
        ctx.save_for_backward(img, txt, scale, row, col, pos, pos_row, pos_col)
        ctx.ops, ctx.dup = ops, dup
        return 0.5 * ((row - pos_row).mean() + (col - pos_col).mean())  # LSE over all less LSE over the group

    @staticmethod
    @once_differentiable  # the kernels' gradients are not differentiable again: say so, not silently
    def backward(ctx, g):
        from infclip.kernels.clip.function import loss_backward

        img, txt, scale, row, col, pos, pos_row, pos_col = ctx.saved_tensors
        dup = ctx.dup
        w_diag = duplicates.positive_weight(pos_row) + duplicates.positive_weight(pos_col)
        dimg, dtxt, ds = loss_backward(ctx.ops, img, txt, scale, row, col, pos, g, w_diag=w_diag)
        g_lse = (0.5 / img.shape[0] * g.float()).expand(img.shape[0])  # as loss_backward's g_row = g_col
        ds = ds + duplicates.positive_backward(img, txt, scale, pos, pos, dup.ids, dup.ids, True, pos_row, pos_col,
                                               g_lse, g_lse, dimg, dtxt, dup.pairs)
        need = ctx.needs_input_grad
        return (dimg if need[0] else None, dtxt if need[1] else None,
                ds.to(scale.dtype) if need[2] else None, None, None)


class _SortedMask(torch.autograd.Function):
    """duplicates="mask" on one process as one autograd node: the pairs permuted so that every
    group is contiguous (``duplicates.sort_groups``; the loss is a mean over pairs, invariant
    to permuting them), then the fused CLIP loss's passes with the sorted int32 ids and the
    band w (the largest group's size less one): the kernels compare ids only in tiles within
    w of the diagonal, the only ones that can hold a same-group pair.

    The permuted features exist only during each pass (gathered in the forward, gathered
    again in the backward, whose image copy then receives the un-permuted image gradient):
    between the passes the node holds the inputs and O(b) vectors, as the plain loss does.
    The gradients are un-permuted by gathers with the inverse permutation (no scatter)."""

    @staticmethod
    def forward(ctx, img, txt, scale, ops, srt):
        from infclip.kernels.clip.function import loss_forward

        loss, row, col, pos = loss_forward(ops, img.index_select(0, srt.order), txt.index_select(0, srt.order),
                                           scale, srt.ids, srt.band)
        ctx.save_for_backward(img, txt, scale, row, col, pos)
        ctx.ops, ctx.srt = ops, srt
        return loss

    @staticmethod
    @once_differentiable  # the kernels' gradients are not differentiable again: say so, not silently
    def backward(ctx, g):
        from infclip.kernels.clip.function import loss_backward

        img, txt, scale, row, col, pos = ctx.saved_tensors
        srt, need = ctx.srt, ctx.needs_input_grad
        img_s, txt_s = img.index_select(0, srt.order), txt.index_select(0, srt.order)
        dimg_s, dtxt_s, ds = loss_backward(ctx.ops, img_s, txt_s, scale, row, col, pos, g, groups=srt.ids,
                                           band=srt.band, need=(need[0], need[1]))
        # back to the caller's order, dimg_i = dimg_s[inverse_i], into the sorted copies' storage
        # (the gradients have the inputs' dtype and shape)
        dimg = torch.index_select(dimg_s, 0, srt.inverse, out=img_s) if need[0] else None
        dtxt = torch.index_select(dtxt_s, 0, srt.inverse, out=txt_s) if need[1] else None
        return dimg, dtxt, ds.to(scale.dtype) if need[2] else None, None, None


def fused_duplicates_loss(img: Tensor, txt: Tensor, scale: Tensor, ops, dup) -> Tensor:
    """The one-process CLIP loss with duplicates on a backend with a fused loss node (Triton):
    "mask" is ``_SortedMask`` (the fused loss's kernels and passes on the batch sorted by group,
    the group compare only in the band of tiles around the diagonal); "positive" is
    ``_FusedPositive``. ``dup``: from ``duplicates.prepare`` ("positive"), or the ids as given
    ("mask": ``sort_groups`` takes any integer ids and gives the kernels their int32 ranks)."""
    if dup.mode == "mask":
        from infclip.kernels.clip import graphs

        if graphs.eligible(ops, img, txt):  # an eager call: no resident graph pool beside it (fused_loss's rule)
            graphs.release()
        return _SortedMask.apply(img, txt, scale, ops, duplicates.sort_groups(dup.ids))
    return _FusedPositive.apply(img, txt, scale, ops, dup)
