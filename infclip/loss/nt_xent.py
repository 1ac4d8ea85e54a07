"""Tiled SimCLR / NT-Xent loss: O(N) memory on one process, a ring across ranks.

Features F (2n, D) hold two augmented views, row i's positive is row i+n and vice versa.
With x_ij = s * <F_i, F_j> (s = 1 / temperature; features used as given, callers
normalize) over the global batch, the loss of the 2n local rows is

    L = (1/2n) * sum_i [ LSE_{j != i} x_ij  -  x_{i, pos(i)} ],   j over all global rows.

On W ranks each rank passes its own (2n, D) = [view 1; view 2]; the global batch is the
union, and since the denominator runs over every other row the mean of the per-rank losses
equals the single-process loss on [all views 1; all views 2].

The matrix is symmetric, so a rank needs only its own rows' LSEs in the forward pass (no
statistic travels); dL/dx_ij = g_i exp(x_ij - lse_i) (0 for j == i) and
dF = s (dX + dX^T) F: the dX F part stays local, the dX^T F part of each travelling block
goes home behind it (``infclip.loss.sweep``), as in the CLIP ring.

Tile-operation protocol (``TorchMaskedLSEOps``; ``infclip.kernels.nt_xent.TritonMaskedLSEOps``):
    forward(a (m,c), b (n,c), scale, mask_diag, offsets=None) -> row_lse (m,) fp32 over
        this block pair, excluding the pairs (i, i) when ``mask_diag`` (a and b are the
        same block).
    backward(a, b, scale, row_lse, g_row, mask_diag, da=None, db=None, offsets=None)
        -> (da (m,c), db (n,c), dscale 0-d) fp32, row_lse the final (global) LSEs.
    Optional: backward_own(f, scale, row_lse, g_row, offsets=None, out_dtype) -> (df, dscale),
        the own block's da + db in one pass (one process: the block is symmetric, so
        dF = s (dX + dX^T) F is one product; ``TritonMaskedLSEOps``).
    offsets (m,): the rows' positives' dot products o_i = <F_i, F_pos(i)>. The LSEs are
        taken and returned relative to s o (computed as LSE_j s (<F_i, F_j> - o_i): the
        per-row loss itself, no difference of two large numbers); on the own block the
        positives' dot products are *defined* as o (the same fp32 numbers in every pass)
        and their gradient -g_i is folded into dX in fp32 before any rounding or product
        (dX_i,pos(i) = g_i expm1(-lse_i)), the way ``infclip.loss.function`` does for CLIP.
Gradient semantics across ranks as ``clip_loss``: feature gradients are d(sum over ranks of
the losses)/d(local features); the temperature gradient is this rank's part.
"""

from __future__ import annotations


import torch
from torch import Tensor

from infclip.loss.tiled import RowTiledOps, _acc_dtype, lazy, pick_backend, row_blocks

IMPLS = ("auto", "vanilla", "torch", "triton")


class TorchMaskedLSEOps(RowTiledOps):
    """Row LSEs of a self-similarity block pair in plain PyTorch, one row block at a time."""

    @staticmethod
    def _logits(a: Tensor, b32: Tensor, lo: int, hi: int, s: Tensor, mask_diag: bool, off: Tensor | None):
        """(dot, u) of rows lo:hi: u = s (dot - o_i) (o = 0 without offsets), -inf where
        masked; with offsets on the own block the positives' dot products are set to o."""
        dot = a[lo:hi].to(b32.dtype) @ b32.T
        own = mask_diag and lo < b32.shape[0]
        if own and off is not None:
            rows = torch.arange(lo, hi, device=dot.device)
            dot[rows - lo, _positive_of(rows, b32.shape[0])] = off[lo:hi]
        u = s * (dot - off[lo:hi, None]) if off is not None else s * dot
        if own:
            u[:, lo:hi].diagonal().fill_(float("-inf"))
        return dot, u

    def forward(self, a: Tensor, b: Tensor, scale: Tensor, mask_diag: bool, offsets: Tensor | None = None) -> Tensor:
        acc = _acc_dtype(a)
        b32, s = b.to(acc), scale.to(acc)
        off = None if offsets is None else offsets.to(acc)
        lse = torch.empty(a.shape[0], dtype=acc, device=a.device)
        for lo, hi in row_blocks(a.shape[0], b.shape[0], self.tile):
            # -- compute tile --
            _, u = self._logits(a, b32, lo, hi, s, mask_diag, off)
            lse[lo:hi] = torch.logsumexp(u, dim=1)
        return lse

    def backward(self, a: Tensor, b: Tensor, scale: Tensor, row_lse: Tensor, g_row: Tensor,
                 mask_diag: bool, da: Tensor | None = None, db: Tensor | None = None,
                 offsets: Tensor | None = None):
        acc = _acc_dtype(a)
        b32, s, g = b.to(acc), scale.to(acc), g_row.to(acc)
        off = None if offsets is None else offsets.to(acc)
        da = torch.zeros(a.shape, dtype=acc, device=a.device) if da is None else da
        db = torch.zeros(b.shape, dtype=acc, device=a.device) if db is None else db
        ds = torch.zeros((), dtype=acc, device=a.device)
        for lo, hi in row_blocks(a.shape[0], b.shape[0], self.tile):
            dot, u = self._logits(a, b32, lo, hi, s, mask_diag, off)
            # -- compute tile --: dX = g_i softmax_ij (exp(-inf) = 0 on the masked diagonal),
            # the positives' -g_i folded in: g_i (p - 1) = g_i expm1(-lse_i).
            lse = row_lse[lo:hi].to(acc)
            dx = g[lo:hi, None] * torch.exp(u - lse[:, None])
            if mask_diag and off is not None and lo < b.shape[0]:
                rows = torch.arange(lo, hi, device=dx.device)
                dx[rows - lo, _positive_of(rows, b.shape[0])] = g[lo:hi] * torch.expm1(-lse)
            ds += (dx * dot).sum()
            da[lo:hi] += s * (dx @ b32)
            db += s * (dx.T @ a[lo:hi].to(acc))
        return da, db, ds


def _positive_of(rows: Tensor, m: int) -> Tensor:
    """Column of each row's positive in the own block: i <-> i + m/2."""
    return (rows + m // 2) % m


class _NTXentRows(torch.autograd.Function):
    """Per-row losses lse_i - x_{i,pos(i)} (2n,); saves O(n) beyond the features.

    The positive term lives inside the tiles (their offsets, see the module docs), so the
    per-row loss is formed without cancellation and its gradient is folded into dX in fp32
    and rounded to the feature dtype once.
    """

    @staticmethod
    def forward(ctx, f, scale, ops, group):
        off = positive_dots(f)
        if group is None:
            rows = ops.forward(f, f, scale, True, offsets=off)
        else:
            rows = _ring_forward(f, scale, ops, group, off)
        ctx.save_for_backward(f, scale, rows, off)
        ctx.ops, ctx.group = ops, group
        return rows

    @staticmethod
    def backward(ctx, g_row):
        f, scale, rows, off = ctx.saved_tensors
        g_row = g_row.to(rows.dtype).contiguous()
        if ctx.group is None and hasattr(ctx.ops, "backward_own"):  # one pass over the symmetric block
            df, ds = ctx.ops.backward_own(f, scale, rows, g_row, offsets=off, out_dtype=f.dtype)
            return (df if ctx.needs_input_grad[0] else None,
                    ds.to(scale.dtype) if ctx.needs_input_grad[1] else None, None, None)
        if ctx.group is None:
            d_rows, d_cols, ds = ctx.ops.backward(f, f, scale, rows, g_row, True, offsets=off)
        else:
            d_rows, d_cols, ds = _ring_backward(f, scale, rows, g_row, ctx.ops, ctx.group, off)
        d_rows += d_cols
        df = d_rows.to(f.dtype) if ctx.needs_input_grad[0] else None
        return df, (ds.to(scale.dtype) if ctx.needs_input_grad[1] else None), None, None


def positive_dots(f: Tensor) -> Tensor:
    """(2n,) <f_i, f_pos(i)> in the accumulation dtype (no autograd); pos(i) = (i + n) mod 2n."""
    from infclip.loss.tiled import row_dot

    with torch.no_grad():
        return row_dot(f.detach(), f.detach().roll(f.shape[0] // 2, dims=0))


def _ring_forward(f: Tensor, scale: Tensor, ops, group, off: Tensor) -> Tensor:
    from infclip.loss.ring import Ring, check_equal_shapes
    from infclip.loss.sweep import ring_sweep

    ring = Ring.of(group)
    check_equal_shapes(f, f, scale, ring.group)
    lse = torch.full((f.shape[0],), float("-inf"), dtype=_acc_dtype(f), device=f.device)

    def tile(k, blocks, _):
        torch.logaddexp(lse, ops.forward(f, blocks[0], scale, k == 0, offsets=off), out=lse)

    ring_sweep(ring, [f], tile)
    return lse


def _ring_backward(f: Tensor, scale: Tensor, lse: Tensor, g_row: Tensor, ops, group, off: Tensor):
    from infclip.loss.ring import Ring
    from infclip.loss.sweep import ring_sweep

    acc = _acc_dtype(f)
    d_rows = torch.zeros(f.shape, dtype=acc, device=f.device)
    ds = torch.zeros((), dtype=acc, device=f.device)

    def tile(k, blocks, part):
        ds.add_(ops.backward(f, blocks[0], scale, lse, g_row, k == 0, da=d_rows, db=part, offsets=off)[2])

    d_cols = ring_sweep(Ring.of(group), [f], tile, acc_like=f, acc_dtype=acc)
    return d_rows, d_cols, ds


def masked_ops(impl: str, like: Tensor):
    """Tile backend: "auto" is Triton on CUDA (as ``clip_loss``), PyTorch elsewhere; "triton"
    runs the fused kernels on CUDA, or on CPU under TRITON_INTERPRET=1 (the tests)."""
    triton_ops = lazy("infclip.kernels.nt_xent", "TritonMaskedLSEOps")
    return pick_backend(impl, like.device, TorchMaskedLSEOps, triton_ops)


def positives(rows: int, device=None) -> Tensor:
    """pos (rows,): index of each row's positive, i <-> i + rows/2."""
    n = rows // 2
    return (torch.arange(rows, device=device) + n) % rows


def nt_xent_reference(f: Tensor, scale: Tensor, pos: Tensor | None = None) -> Tensor:
    """Naive full-matrix NT-Xent (the SimCLR formulation): (2N)^2 logits in the input dtype."""
    x = scale.to(f.dtype) * f @ f.T
    x = x.masked_fill(torch.eye(f.shape[0], dtype=torch.bool, device=f.device), float("-inf"))
    pos = positives(f.shape[0], f.device) if pos is None else pos
    loss = torch.nn.functional.cross_entropy(x, pos)
    return loss if loss.dtype == torch.float64 else loss.float()


def _temperature_scale(temperature, like: Tensor) -> Tensor:
    """s = 1 / temperature as a 0-d tensor (autograd flows to a tensor temperature)."""
    if not isinstance(temperature, Tensor):
        temperature = torch.tensor(float(temperature), dtype=torch.float32, device=like.device)
    if temperature.numel() != 1 or temperature.device != like.device:
        raise ValueError(
            f"temperature must be a float or a 1-element tensor on {like.device}, got "
            f"shape {tuple(temperature.shape)} on {temperature.device}"
        )
    if not bool(temperature.detach() > 0):
        raise ValueError(f"temperature must be > 0, got {float(temperature)}")
    return 1.0 / temperature.reshape(())


def _check_features(f: Tensor) -> None:
    if not isinstance(f, Tensor) or f.dim() != 2:
        raise ValueError(f"features must be a 2-D tensor (2N, D), got {getattr(f, 'shape', type(f))}")
    if f.shape[0] < 2 or f.shape[0] % 2:
        raise ValueError(
            f"features must have an even number of rows >= 2 (views 1 then views 2), got {f.shape[0]}"
        )
    if not f.is_floating_point():
        raise ValueError(f"features must be floating point, got {f.dtype}")


def nt_xent_loss(features: Tensor, temperature, *, impl: str = "auto", group=None) -> Tensor:
    """NT-Xent (SimCLR's InfoNCE) without the (2N)^2 matrix; see the module docs.

    Args:
        features: (2N, D) local rows [view 1 of samples 0..N-1; view 2 of the same samples].
        temperature: > 0, float or 0-d tensor (may require grad); logits = <f_i, f_j> / T.
        impl: "auto" (Triton on CUDA, else torch), "torch" (tiled), "triton" (fused kernels; CUDA, or
            CPU under TRITON_INTERPRET=1) or "vanilla" (full matrix; one process only).
        group: process group for the ring across ranks, or None.
    Returns:
        float32 scalar (float64 for float64 features): mean over the 2N local rows.
    """
    from infclip.loss import _world

    _check_features(features)
    scale = _temperature_scale(temperature, features)
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r} for nt_xent_loss; choose one of {IMPLS}")
    distributed = group is not None and _world(group) > 1
    if impl == "vanilla":
        if distributed:
            raise ValueError("impl='vanilla' for nt_xent_loss runs on one process; use impl='auto' with a group")
        return nt_xent_reference(features, scale)
    rows = _NTXentRows.apply(features, scale, masked_ops(impl, features), group if distributed else None)
    loss = rows.mean()
    return loss if loss.dtype == torch.float64 else loss.float()
