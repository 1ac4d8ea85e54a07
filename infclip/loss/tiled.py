"""The tiled Inf-CL log-sum-exp in plain PyTorch: the readable reference and the CPU path.

Notation (shared with ``infclip.kernels.clip`` and ``infclip.loss.ring``):
    I: (m, c) image features, T: (n, c) text features, s: 0-d logit scale.
    x_ij = s * <I_i, T_j>.
    row_lse_i = LSE_j x_ij      (m,)  fp32
    col_lse_j = LSE_i x_ij      (n,)  fp32

Backward, given upstream gradients g_row (m,) and g_col (n,) of the two LSE vectors:
    dX_ij = g_row_i * exp(x_ij - row_lse_i) + g_col_j * exp(x_ij - col_lse_j)
    dI = s * dX @ T,   dT = s * dX^T @ I,   ds = sum_ij dX_ij * <I_i, T_j>

Both passes visit the b x b matrix one (tile, n) row block at a time, so extra memory is
O(tile * n) for the block plus O(m + n) vectors; the full matrix never exists. The backward
is one pass: each block's dX is formed once and feeds both products, dI[block]
+= s dX T and the fp32 accumulator dT += s dX^T I[block] (``addmm_``, in place), so the
logits are recomputed once: 8 b^2 c FLOPs for forward + backward.
"""

from __future__ import annotations

import importlib
import os

import torch
from torch import Tensor

DEFAULT_TILE = 1024
TILE_ELEMENTS = 1 << 24  # cap on one (rows, n) tile buffer: 64 MB fp32, whatever the batch


def row_blocks(m: int, n: int, tile: int):
    """(lo, hi) row ranges of at most ``tile`` rows and at most TILE_ELEMENTS / n rows, so the
    working set stays O(n) with a fixed constant as the batch grows (n = 2M: 8 rows/tile)."""
    step = max(1, min(tile, TILE_ELEMENTS // max(n, 1)))
    return ((lo, min(lo + step, m)) for lo in range(0, m, step))


def pick_backend(impl: str, device: torch.device, torch_ops, triton_ops):
    """The tile backend for ``impl``: "auto" is Triton on CUDA and PyTorch elsewhere; "triton"
    off CUDA only under Triton's interpreter (TRITON_INTERPRET=1, the CPU tests).
    ``torch_ops`` / ``triton_ops`` are zero-argument factories (Triton is imported lazily)."""
    if impl == "auto":
        impl = "triton" if device.type == "cuda" else "torch"
    if impl == "torch":
        return torch_ops()
    if impl != "triton":
        raise ValueError(f"impl={impl!r} has no tile backend; choose 'auto', 'torch' or 'triton'")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1), got {device}; "
                         "use impl='torch' or 'auto'")
    return triton_ops()


def lazy(module: str, name: str, **kwargs):
    """A zero-argument factory for ``module.name(**kwargs)`` that imports ``module`` only when
    called: ``pick_backend``'s ``triton_ops``, so Triton is imported only when its tiles are
    picked (e.g. ``lazy("infclip.kernels.siglip", "TritonSigmoidOps")``)."""

    def make():
        return getattr(importlib.import_module(module), name)(**kwargs)

    return make


def _acc_dtype(t: Tensor) -> torch.dtype:
    """fp32 accumulation, or fp64 for float64 inputs (used by the ground-truth tests)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


# Softmax entries below exp(-80) (~2e-35) are flushed to exact zeros in fp32: left alone they
# and their products with the upstream gradient become denormals, which CPUs process ~100x
# slower (a peaked softmax would stall the CPU path). fp64 (the tests' ground truth) keeps all.
_EXP_FLOOR = -80.0


def _softmax_entries(d: Tensor) -> Tensor:
    """exp(d) (d = x - lse, in place), with entries below exp(_EXP_FLOOR) exactly zero for fp32."""
    if d.dtype != torch.float64:
        d.masked_fill_(d < _EXP_FLOOR, float("-inf"))
    return torch.exp(d)


class RowTiledOps:
    """Base of the plain-PyTorch tile backends: they visit a block pair ``tile`` rows at a time
    (see ``row_blocks``)."""

    name = "torch"

    def __init__(self, tile: int = DEFAULT_TILE):
        if tile < 1:
            raise ValueError(f"tile must be >= 1, got {tile}")
        self.tile = tile


class TorchTileOps(RowTiledOps):
    """Tile operations in plain PyTorch (any device), fp32 accumulation (fp64 for fp64 inputs).

    ``forward`` returns LSEs over *this block pair only*; callers that combine blocks
    (the ring) merge partial LSEs with ``torch.logaddexp``. ``backward`` takes the final
    (global) LSEs and accumulates into ``dimg``/``dtxt`` when they are given.

    Offsets and the positive pairs (see ``offset_logits``): with ``offsets = (o_row, o_col)``
    the LSEs are returned (and taken) relative to them, LSE_j x_ij - o_row_i; ``diag`` in
    forward / ``g_diag`` in backward mark the square block pair whose diagonal holds the
    positives: their logits are *defined* as the offsets (o_row = o_col = s <I_i, T_i>, the
    same fp32 values in every pass), and the backward adds -g_diag_i to dX_ii in the tile
    (``fold_positives``), so the CLIP loss's positive term never cancels after a rounding.

    Duplicates (``groups = (g_row (m,), g_col (n,))`` int64 group ids, or None): entries with
    g_row_i == g_col_j leave both LSEs and dX, except i == j on the positives' diagonal
    (``mask_groups``; ``infclip.loss.duplicates`` states the loss).
    """

    def forward(self, img: Tensor, txt: Tensor, scale: Tensor, offsets=None, diag: bool = False,
                groups=None) -> tuple[Tensor, Tensor]:
        """Returns (row_lse (m,), col_lse (n,)), fp32, over the block pair (img, txt)."""
        m, n = img.shape[0], txt.shape[0]
        acc = _acc_dtype(img)
        txt32 = txt.to(acc)
        s = scale.to(acc)
        o_row, o_col = _offsets(offsets, m, n, acc, img.device)
        row_lse = torch.empty(m, dtype=acc, device=img.device)
        col_lse = torch.full((n,), float("-inf"), dtype=acc, device=img.device)
        for lo, hi in row_blocks(m, n, self.tile):
            # -- compute tile --: (t, n) logits of one row block, fp32, less the offsets.
            u_row, u_col = shifted_dots(img[lo:hi].to(acc) @ txt32.T, s, o_row, o_col, lo, hi, diag)
            mask_groups(u_row, u_col, groups, lo, hi, diag)
            row_lse[lo:hi] = torch.logsumexp(u_row, dim=1)
            col_lse = torch.logaddexp(col_lse, torch.logsumexp(u_col, dim=0))
        return row_lse, col_lse

    def backward(
        self,
        img: Tensor,
        txt: Tensor,
        scale: Tensor,
        row_lse: Tensor,
        col_lse: Tensor,
        g_row: Tensor,
        g_col: Tensor,
        dimg: Tensor | None = None,
        dtxt: Tensor | None = None,
        offsets=None,
        g_diag: Tensor | None = None,
        groups=None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Returns (dimg (m, c), dtxt (n, c), dscale 0-d), fp32; accumulates into given buffers."""
        m, n, c = img.shape[0], txt.shape[0], img.shape[1]
        acc = _acc_dtype(img)
        txt32 = txt.to(acc)
        s = scale.to(acc)
        g_row, g_col = g_row.to(acc), g_col.to(acc)
        o_row, o_col = _offsets(offsets, m, n, acc, img.device)
        if dimg is None:
            dimg = torch.zeros(m, c, dtype=acc, device=img.device)
        if dtxt is None:
            dtxt = torch.zeros(n, c, dtype=acc, device=img.device)
        dscale = torch.zeros((), dtype=acc, device=img.device)
        for lo, hi in row_blocks(m, n, self.tile):
            img32 = img[lo:hi].to(acc)
            dot = img32 @ txt32.T  # (t, n) <I_i, T_j>
            u_row, u_col = shifted_dots(dot, s, o_row, o_col, lo, hi, g_diag is not None)
            mask_groups(u_row, u_col, groups, lo, hi, g_diag is not None)
            # -- compute tile --: dX from both softmax directions, positives folded in.
            dx = (g_row[lo:hi, None] * _softmax_entries(u_row.sub_(row_lse[lo:hi, None]))
                  + g_col[None, :] * _softmax_entries(u_col.sub_(col_lse[None, :])))
            if g_diag is not None:
                fold_positives(dx, lo, hi, row_lse, col_lse, g_row, g_col, g_diag.to(acc))
            dscale += (dx * dot).sum()
            # One pass: s dX of the block feeds both products, accumulated in place (no (n, c)
            # temporaries: dtxt is the fp32 accumulator the memory rule allows).
            dx.mul_(s)
            dimg[lo:hi].addmm_(dx, txt32)
            dtxt.addmm_(dx.T, img32)
        return dimg, dtxt, dscale


def _offsets(offsets, m: int, n: int, acc: torch.dtype, device) -> tuple[Tensor, Tensor]:
    """(o_row (m,), o_col (n,)) in the accumulation dtype; zeros when ``offsets`` is None."""
    if offsets is None:
        return torch.zeros(m, dtype=acc, device=device), torch.zeros(n, dtype=acc, device=device)
    o_row, o_col = offsets
    if o_row.shape != (m,) or o_col.shape != (n,):
        raise ValueError(f"offsets must be ({m},) and ({n},), got {tuple(o_row.shape)} and {tuple(o_col.shape)}")
    return o_row.to(acc), o_col.to(acc)


def shifted_dots(dot: Tensor, s: Tensor, o_row: Tensor, o_col: Tensor, lo: int, hi: int, diag: bool
                 ) -> tuple[Tensor, Tensor]:
    """(s (dot - o_row), s (dot - o_col)) for rows lo:hi of a block pair: the logits less the
    offsets, without rounding a logit of magnitude s |dot| first. When ``diag`` (the square
    block pair holding the positives) the positives' dot products are first set to the
    offsets: o = <I_i, T_i> is computed once, in fp32 (``row_dot``), so the forward, the
    backward and the loss value use the same numbers for them and x_ii - s o_i = 0 exactly.
    ``dot`` is modified in place (the backward's d scale uses the same values)."""
    if diag and lo < dot.shape[1]:
        d = dot[:, lo:hi].diagonal()
        d.copy_(o_row[lo:lo + d.shape[0]])
    return s * (dot - o_row[lo:hi, None]), s * (dot - o_col[None, :])


def mask_groups(u_row: Tensor, u_col: Tensor, groups, lo: int, hi: int, diag: bool) -> None:
    """Sets the logits of rows lo:hi to -inf (in place, both directions) where the row's and
    the column's group ids are equal, except on the positives' diagonal when ``diag``: those
    pairs are then neither negatives nor positives. ``groups`` None: nothing to do; a third
    element (the Triton kernels' band of a sorted batch) is ignored: every entry is compared."""
    if groups is None:
        return
    g_row, g_col = groups[:2]
    same = g_row[lo:hi, None] == g_col[None, :]
    if diag and lo < same.shape[1]:
        same[:, lo:hi].diagonal().fill_(False)
    u_row.masked_fill_(same, float("-inf"))
    u_col.masked_fill_(same, float("-inf"))


def fold_positives(dx: Tensor, lo: int, hi: int, row_lse: Tensor, col_lse: Tensor, g_row: Tensor,
                   g_col: Tensor, g_diag: Tensor) -> None:
    """dX_ii = g_row_i (p_ii - 1) + g_col_i (p'_ii - 1) + (g_row_i + g_col_i - g_diag_i) on the
    diagonal of rows lo:hi, in place: the gradient of -sum_i g_diag_i x_ii folded into dX in
    the accumulation dtype, before any rounding or product. p_ii = exp(-row_lse_i) (row_lse
    relative to x_ii, see ``shifted_dots``), so p_ii - 1 = expm1(-row_lse_i), exact even
    when the softmax is peaked (p_ii ~ 1)."""
    if lo >= dx.shape[1]:
        return
    d = dx[:, lo:hi].diagonal()
    rows = slice(lo, lo + d.shape[0])
    d.copy_(g_row[rows] * torch.expm1(-row_lse[rows]) + g_col[rows] * torch.expm1(-col_lse[rows])
            + ((g_row[rows] + g_col[rows]) - g_diag[rows]))


ROW_DOT_CHUNK = 1 << 20  # elements per chunk: fp32 temporaries of row_dot stay <= ~12 MB


class _RowDot(torch.autograd.Function):
    """d_i = <a_i, b_i> accumulated in fp32 (fp64 for fp64), chunked over rows.

    ``(a.float() * b.float()).sum(-1)`` would hold two fp32 (b, c) copies (saved for backward
    too); here temporaries are bounded by ROW_DOT_CHUNK elements and the backward writes
    the gradients directly in the input dtype.
    """

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor) -> Tensor:
        acc = _acc_dtype(a)
        out = torch.empty(a.shape[0], dtype=acc, device=a.device)
        for lo, hi in _row_chunks(a):
            out[lo:hi] = (a[lo:hi].to(acc) * b[lo:hi].to(acc)).sum(-1)
        ctx.save_for_backward(a, b)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        a, b = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad
        ga = torch.empty_like(a) if need_a else None
        gb = torch.empty_like(b) if need_b else None
        for lo, hi in _row_chunks(a):
            gc = g[lo:hi, None].to(_acc_dtype(a))
            if need_a:
                ga[lo:hi] = gc * b[lo:hi]
            if need_b:
                gb[lo:hi] = gc * a[lo:hi]
        return ga, gb


def _row_chunks(a: Tensor):
    step = max(1, ROW_DOT_CHUNK // max(1, a.shape[1]))
    for lo in range(0, a.shape[0], step):
        yield lo, min(lo + step, a.shape[0])


def row_dot(a: Tensor, b: Tensor) -> Tensor:
    """(m,) fp32 (fp64 for fp64) row-wise dot products <a_i, b_i>, O(chunk) extra memory."""
    return _RowDot.apply(a, b)
