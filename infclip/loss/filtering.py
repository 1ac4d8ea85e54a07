"""Opt-in gradient filtering for the CLIP loss (after Cut Cross-Entropy), with a relative threshold.

The backward pass of the tiled loss recomputes each tile's logits x_ij = s <I_i, T_j> and
then spends two matmuls (4 of its 6 b^2 c FLOPs) on dI += s dX T and dT += s dX^T I, with

    dX_ij = g_row_i P_ij + g_col_j Q_ij,   P = row softmax, Q = column softmax (global LSEs).

Late in training both softmaxes are peaked: almost every entry is ~0 and the block of dX
contributes nothing. ``FilteredTileOps`` skips the two matmuls for every (row tile, column
block) whose P and Q entries are all below a threshold.

The threshold is relative, thr = eps / b (b: the global batch, the length of each softmax).
A fixed 2^-12 (Cut Cross-Entropy's) would drop *every* negative early in CLIP training,
where the softmax is ~1/b < 2^-12 for b >= 4096; eps / b drops nothing while the softmax is
within a factor eps of uniform, and only peaked rows are filtered.

Error bound (what the tests check). Each row of P and each column of Q sums to 1 and has at
most b dropped entries, each below eps / b, so the dropped mass per row/column is <= eps:

    ||dI_i - dI_i^exact|| <= s * eps * max_j ||T_j|| * (|g_row_i| + max_j |g_col_j|)
    ||dT_j - dT_j^exact|| <= s * eps * max_i ||I_i|| * (max_i |g_row_i| + |g_col_j|)
    |ds - ds^exact|      <= eps * max_ij |<I_i, T_j>| * (||g_row||_1 + ||g_col||_1)

For the CLIP loss (g = 1/(2m) on every local row and column) that is s * eps * max||T|| / m
per row and eps * max|<I, T>| for the scale. The forward pass (the loss value) is exact.

Off by default: ``clip_loss`` never filters; ``filtered_clip_loss`` (or ``loss.grad_filter
> 0`` through ``build_loss``) opts in. Two backends: ``FilteredTileOps`` (PyTorch, blocks of
tile x block) and the Triton CLIP kernels (``TritonTileOps(grad_filter=(eps, b))``: the fused
backward skips the update product of every BM x BN tile below the threshold, same rule and
bound; the logits are still recomputed, so a skipped tile saves half its FLOPs).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from infclip.loss.tiled import lazy, pick_backend, row_blocks
from infclip.loss.tiled import TorchTileOps, _acc_dtype, _offsets, fold_positives, shifted_dots


class FilteredTileOps(TorchTileOps):
    """``TorchTileOps`` whose backward skips blocks with all softmax entries below eps / columns.

    Args:
        eps: relative threshold (0 disables filtering: the result equals ``TorchTileOps``).
        columns: the global batch b (length of each softmax; W * m across W ranks).
        tile: rows per block; block: columns per block (the skip granularity is tile x block).
    Attributes after each backward: ``kept``/``total`` counts of computed/all blocks.
    """

    name = "torch-filtered"

    def __init__(self, eps: float, columns: int, tile: int = 256, block: int = 256):
        super().__init__(tile)
        if eps < 0 or columns < 1 or block < 1:
            raise ValueError(f"need eps >= 0, columns >= 1, block >= 1; got {eps}, {columns}, {block}")
        self.threshold = eps / columns
        self.block = block
        self.kept = self.total = 0

    def _keep(self, u_row: Tensor, u_col: Tensor, diag_lo: int | None) -> Tensor:
        """Column indices of the blocks (of this row tile) with some P or Q entry >= threshold;
        u_row = x - row_lse, u_col = x - col_lse (log P and log Q). Blocks holding positives
        (columns diag_lo.., when given) are always kept: their dX_ii is -g (1 - p_ii), not small.

        Decided in log space (u >= log thr), so dropped blocks cost no exp at all.
        """
        n = u_row.shape[1]
        nb = -(-n // self.block)
        peak = torch.maximum(u_row.amax(0), u_col.amax(0))  # (n,)
        if diag_lo is not None and diag_lo < n:
            peak[diag_lo:diag_lo + u_row.shape[0]] = float("inf")
        pad = torch.full((nb * self.block - n,), float("-inf"), dtype=peak.dtype, device=peak.device)
        log_thr = math.log(self.threshold) if self.threshold > 0 else float("-inf")
        keep = torch.cat([peak, pad]).view(nb, self.block).amax(1) >= log_thr
        self.kept += int(keep.sum())
        self.total += nb
        cols = torch.arange(nb * self.block, device=u_row.device).view(nb, self.block)[keep].flatten()
        return cols[cols < n]

    def backward(self, img, txt, scale, row_lse, col_lse, g_row, g_col, dimg=None, dtxt=None, offsets=None,
                 g_diag=None):
        """As ``TorchTileOps.backward``; dropped blocks contribute nothing (see module bound)."""
        m, n, c = img.shape[0], txt.shape[0], img.shape[1]
        acc = _acc_dtype(img)
        txt32, s = txt.to(acc), scale.to(acc)
        g_row, g_col = g_row.to(acc), g_col.to(acc)
        o_row, o_col = _offsets(offsets, m, n, acc, img.device)
        dimg = torch.zeros(m, c, dtype=acc, device=img.device) if dimg is None else dimg
        dtxt = torch.zeros(n, c, dtype=acc, device=img.device) if dtxt is None else dtxt
        dscale = torch.zeros((), dtype=acc, device=img.device)
        for lo, hi in row_blocks(m, n, self.tile):
            img32 = img[lo:hi].to(acc)
            dot = img32 @ txt32.T
            u_row, u_col = shifted_dots(dot, s, o_row, o_col, lo, hi, g_diag is not None)
            u_row, u_col = u_row - row_lse[lo:hi, None], u_col - col_lse[None, :]
            cols = self._keep(u_row, u_col, lo if g_diag is not None else None)
            if cols.numel() == 0:
                continue
            # -- compute tile -- on the kept columns only, positives folded in (full tile first)
            dx = g_row[lo:hi, None] * torch.exp(u_row) + g_col[None, :] * torch.exp(u_col)
            if g_diag is not None:
                fold_positives(dx, lo, hi, row_lse, col_lse, g_row, g_col, g_diag.to(acc))
            full = cols.numel() == n
            if not full:
                dx, dot = dx[:, cols], dot[:, cols]
            dscale += (dx * dot).sum()
            dx.mul_(s)  # s dX once for both products (as TorchTileOps: bitwise equal at eps = 0)
            dimg[lo:hi].addmm_(dx, txt32 if full else txt32[cols])
            if full:
                dtxt.addmm_(dx.T, img32)
            else:
                dtxt.index_add_(0, cols, dx.T @ img32)
        return dimg, dtxt, dscale


def error_bound(img: Tensor, txt: Tensor, scale: Tensor, g_row: Tensor, g_col: Tensor, eps: float):
    """The documented bounds (max per-row ||d dI||, max per-row ||d dT||, |d ds|) for ``eps``."""
    s, gr, gc = float(scale), g_row.abs(), g_col.abs()
    di = s * eps * float(txt.norm(dim=-1).max()) * float(gr.max() + gc.max())
    dt = s * eps * float(img.norm(dim=-1).max()) * float(gr.max() + gc.max())
    ds = eps * float((img.double() @ txt.double().T).abs().max()) * float(gr.sum() + gc.sum())
    return di, dt, ds


def filtered_clip_loss(image_features: Tensor, text_features: Tensor, logit_scale: Tensor, *,
                       eps: float, group=None, tile: int = 256, block: int = 256, impl: str = "torch",
                       ops=None) -> Tensor:
    """``clip_loss`` with gradient filtering at threshold eps / b; see module docs.

    The value is exact; gradients obey the module's bound. eps = 0 gives ``clip_loss``'s
    gradients. Works on one process and across ranks (``group``, same ring as ``clip_loss``).
    impl: "torch" (``FilteredTileOps``, tile x block granularity), "triton" (the Triton
    kernels, their own tile granularity; CUDA or TRITON_INTERPRET=1) or "auto" (Triton on
    CUDA). ops: a prebuilt tile backend (tests read its kept / total counts).
    """
    from infclip.loss import _check_inputs, _tiled_loss, _world

    _check_inputs(image_features, text_features, logit_scale)
    world = _world(group) if group is not None else 1
    columns = image_features.shape[0] * world
    if ops is None:
        ops = pick_backend(impl, image_features.device,
                           lambda: FilteredTileOps(eps, columns=columns, tile=tile, block=block),
                           lazy("infclip.kernels.clip", "TritonTileOps", grad_filter=(eps, columns)))
    return _tiled_loss(image_features, text_features, logit_scale, ops, group if world > 1 else None)
