"""Triton kernels of the tiled SigLIP (sigmoid) loss, forward and backward.

Notation: A (M, K) and B (N, K) feature blocks, s > 0 and t the logit scale and bias (read
from device memory, never synced to the host), x_ij = s <A_i, B_j> + t, z_ij = +1 for the
positives i - j == diag and -1 elsewhere; the launcher passes diag = 0 when the block pair
holds the positives on its diagonal and diag = M + N (no pair matches) otherwise.

Forward (``_sigmoid_fwd_kernel``): program pid_m owns BM rows and sweeps every BN-column
tile: row_loss_i = sum_j softplus(-z_ij x_ij), accumulated in registers, one store per row.

Backward (``_sigmoid_grad_kernel``): out_i = s * sum_j dX_ij B_j with
dX_ij = g_ij (sigmoid(x_ij) - [i == j]) = -z_ij sigmoid(-z_ij x_ij) g_ij, where g_ij is the
upstream gradient of the row loss of whichever side holds the images (G_ON_A: g_a_i, else
g_b_j). Program (pid_m, pid_c) owns BM rows and DC feature columns of the output; it
recomputes each logits tile (``_dot_stream`` of the CLIP kernels, streamed over K) and, with
COMPUTE_DS, writes its share of ds = sum dX_ij <A_i, B_j> and dt = sum dX_ij (from the
fp32 dX, before its cast to the input dtype). dB is the same kernel with A and B swapped.

Out-of-range rows/columns are clamped to the last valid index for loading and masked out of
every reduction and store, as in ``infclip.kernels.clip``.
"""

import triton
import triton.language as tl

from ..clip.kernels import _dot_stream

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _signed_logits(a_blk, b_blk, r_ld, c_ld, rows, cols, diag, K, stride_a, stride_b, s, t,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                   PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """(dot, zx, pos): dot = <A_i, B_j>, zx = z_ij * x_ij, pos = (i - j == diag)."""
    dot = _dot_stream(a_blk, b_blk, r_ld, c_ld, K, stride_a, stride_b, BM, BN, BK, EVEN_K, PREC, DOT_F32)
    x = dot * s + t
    pos = (rows[:, None] - cols[None, :]) == diag
    return dot, tl.where(pos, x, -x), pos


@triton.jit
def _log1p_small(u):
    """log(1 + u) for u in [0, 1]: a 4-term series below 1e-2 (log2(1 + u) loses u's digits)."""
    series = u * (1.0 - u * (0.5 - u * (0.3333333333333333 - u * 0.25)))
    return tl.where(u < 1e-2, series, tl.log2(1.0 + u) * LN2)


@triton.jit
def _sigmoid_fwd_kernel(a_ptr, b_ptr, scale_ptr, bias_ptr, row_ptr, M, N, K, stride_a, stride_b, diag,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                        PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """row_loss[rows] = sum_j -log sigmoid(z_ij x_ij) (natural units, fp32)."""
    pid_m = tl.program_id(0)
    s = tl.load(scale_ptr).to(tl.float32)
    t = tl.load(bias_ptr).to(tl.float32)
    row0 = pid_m * BM
    r = tl.arange(0, BM)
    row_ok = row0 + r < M
    r_ld = tl.minimum(r, M - 1 - row0)
    a_blk = a_ptr + row0.to(tl.int64) * stride_a
    cn = tl.arange(0, BN)
    stride_b64 = stride_b.to(tl.int64)
    acc = tl.zeros((BM,), tl.float32)
    for j0 in range(0, N, BN):
        col_ok = j0 + cn < N
        c_ld = tl.minimum(cn, N - 1 - j0)
        # -- compute tile --: softplus(-zx) = max(-zx, 0) + log1p(exp(-|zx|)), stable.
        _, zx, _ = _signed_logits(a_blk, b_ptr + j0 * stride_b64, r_ld, c_ld, row0 + r, j0 + cn, diag, K,
                                  stride_a, stride_b, s, t, BM, BN, BK, EVEN_K, PREC, DOT_F32)
        sp = tl.maximum(-zx, 0.0) + _log1p_small(tl.exp2(-tl.abs(zx) * LOG2E))
        acc += tl.sum(tl.where(col_ok[None, :], sp, 0.0), 1)
    tl.store(row_ptr + row0 + r, acc, mask=row_ok)


@triton.jit
def _sigmoid_grad_kernel(a_ptr, b_ptr, scale_ptr, bias_ptr, g_ptr, out_ptr, part_ptr,
                         M, N, K, stride_a, stride_b, stride_o, diag,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DC: tl.constexpr,
                         EVEN_K: tl.constexpr, G_ON_A: tl.constexpr,
                         ACCUM: tl.constexpr, COMPUTE_DS: tl.constexpr, PREC: tl.constexpr,
                         DOT_F32: tl.constexpr):
    """out[rows, dcols] (+)= s * sum_j dX_ij B_j[dcols]; part[program] = (ds, dt) shares."""
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    s = tl.load(scale_ptr).to(tl.float32)
    t = tl.load(bias_ptr).to(tl.float32)
    row0 = pid_m * BM
    r = tl.arange(0, BM)
    row_ok = row0 + r < M
    r_ld = tl.minimum(r, M - 1 - row0)
    a_blk = a_ptr + row0.to(tl.int64) * stride_a
    if G_ON_A:
        g_a = tl.where(row_ok, tl.load(g_ptr + row0 + r_ld).to(tl.float32), 0.0)
    d = pid_c * DC + tl.arange(0, DC)
    d_ok = d < K
    cn = tl.arange(0, BN)
    stride_b64 = stride_b.to(tl.int64)
    acc = tl.zeros((BM, DC), dtype=tl.float32)
    ds_row = tl.zeros((BM,), dtype=tl.float32)
    dt_row = tl.zeros((BM,), dtype=tl.float32)
    for j0 in range(0, N, BN):
        col_ok = j0 + cn < N
        c_ld = tl.minimum(cn, N - 1 - j0)
        b_blk = b_ptr + j0 * stride_b64
        dot, zx, pos = _signed_logits(a_blk, b_blk, r_ld, c_ld, row0 + r, j0 + cn, diag, K, stride_a,
                                      stride_b, s, t, BM, BN, BK, EVEN_K, PREC, DOT_F32)
        # -- compute tile --: dX = -z sigmoid(-z x) * g (no cancellation on the diagonal).
        sig = 1.0 / (1.0 + tl.exp2(zx * LOG2E))
        p = tl.where(pos, -sig, sig)
        if G_ON_A:
            p = p * g_a[:, None]
        else:
            p = p * tl.load(g_ptr + j0 + c_ld).to(tl.float32)[None, :]
        p = tl.where(col_ok[None, :] & row_ok[:, None], p, 0.0)
        if COMPUTE_DS:
            ds_row += tl.sum(p * dot, 1)
            dt_row += tl.sum(p, 1)
        tb = tl.load(b_blk + c_ld[:, None] * stride_b + d[None, :], mask=d_ok[None, :], other=0.0)
        p = p.to(b_ptr.dtype.element_ty)  # tensor-core input dtype (rounds like vanilla's grad)
        if DOT_F32:
            p = p.to(tl.float32)
            tb = tb.to(tl.float32)
        acc = tl.dot(p, tb, acc, input_precision=PREC)
    if COMPUTE_DS:  # every feature chunk saw all logits: count once
        first = pid_c == 0
        idx = 2 * (pid_m * tl.num_programs(1) + pid_c)
        tl.store(part_ptr + idx, tl.where(first, tl.sum(ds_row, 0), 0.0))
        tl.store(part_ptr + idx + 1, tl.where(first, tl.sum(dt_row, 0), 0.0))
    o_ptrs = out_ptr + row0.to(tl.int64) * stride_o + r[:, None] * stride_o + d[None, :]
    o_mask = row_ok[:, None] & d_ok[None, :]
    res = acc * s
    if ACCUM:
        res += tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=o_mask)
