"""Triton kernels of the tiled SigLIP (sigmoid) loss, forward and backward.

Notation: A (M, K) and B (N, K) feature blocks, s > 0 and t the logit scale and bias (read
from device memory, never synced to the host), x_ij = s <A_i, B_j> + t, z_ij = +1 for the
positives i - j == diag and -1 elsewhere; the launcher passes diag = 0 when the block pair
holds the positives on its diagonal and diag = M + N (no pair matches) otherwise.

Forward (``_sigmoid_fwd_kernel``): program (pid_m, pid_s) owns BM rows and one split of
the columns: part[pid_s, i] = sum_j softplus(-z_ij x_ij) over the split, accumulated in
registers (the host sums the splits; splits only fill the GPU at small b).

Backward (``_sigmoid_grad_kernel``): out_i = s * sum_j dX_ij B_j with
dX_ij = g_ij (sigmoid(x_ij) - [i == j]) = -z_ij sigmoid(-z_ij x_ij) g_ij, where g_ij is the
upstream gradient of the row loss of whichever side holds the images (G_ON_A: g_a_i, else
g_b_j). Program (pid_m, pid_c) owns BM rows and DC feature columns of the output; it
recomputes each logits tile (``tiles.dot_stream``, streamed over K) and, with COMPUTE_DS,
writes its share of ds = sum dX_ij <A_i, B_j> and dt = sum dX_ij (from the fp32 dX,
before its cast to the input dtype). dB is the same kernel with A and B swapped.

Strip backward (``_sigmoid_strip_kernel``): a GEMM-shaped kernel writes P = s * dX for a
strip of rows into a bounded scratch (and its (ds, dt) shares); cuBLAS then forms
out[strip] = P @ B (see ``infclip.kernels.launching.strip_backward``).

Out-of-range rows/columns are clamped to the last valid index for loading and masked out of
every reduction and store (``infclip.kernels.tiles``).
"""

import triton
import triton.language as tl

from ..tiles import LN2, LOG2E, col_tile, dot_stream, row_block, store_rows, store_strip, strip_tile, update_rows


@triton.jit
def _signed_logits(a_blk, b_blk, r_ld, c_ld, rows, cols, diag, K, stride_a, stride_b, s, t,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                   PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """(dot, zx, pos): dot = <A_i, B_j>, zx = z_ij * x_ij, pos = (i - j == diag)."""
    dot = dot_stream(a_blk, b_blk, r_ld, c_ld, K, stride_a, stride_b, BM, BN, BK, EVEN_K, PREC, DOT_F32)
    x = dot * s + t
    pos = (rows[:, None] - cols[None, :]) == diag
    return dot, tl.where(pos, x, -x), pos


@triton.jit
def _log1p_small(u):
    """log(1 + u) for u in [0, 1]: a 4-term series below 1e-2 (log2(1 + u) loses u's digits)."""
    series = u * (1.0 - u * (0.5 - u * (0.3333333333333333 - u * 0.25)))
    return tl.where(u < 1e-2, series, tl.log2(1.0 + u) * LN2)


@triton.jit
def _sigmoid_dx(zx, pos, g, ok, G_ON_A: tl.constexpr):
    """dX = -z sigmoid(-z x) * g, zero where not ``ok``; g holds the row (G_ON_A) or column
    weights. Written as +-sigmoid(-zx): no cancellation on the diagonal."""
    sig = 1.0 / (1.0 + tl.exp2(zx * LOG2E))
    p = tl.where(pos, -sig, sig)
    if G_ON_A:
        p = p * g[:, None]
    else:
        p = p * g[None, :]
    return tl.where(ok, p, 0.0)


@triton.jit
def _sigmoid_fwd_kernel(a_ptr, b_ptr, scale_ptr, bias_ptr, part_ptr, M, N, K, stride_a, stride_b, diag,
                        cols_per_split,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                        PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """part[pid_s, rows] = sum over the split's columns of -log sigmoid(z_ij x_ij) (fp32)."""
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    s = tl.load(scale_ptr).to(tl.float32)
    t = tl.load(bias_ptr).to(tl.float32)
    row0, r, row_ok, r_ld, a_blk = row_block(pid_m, M, a_ptr, stride_a, BM)
    acc = tl.zeros((BM,), tl.float32)
    lo = pid_s * cols_per_split
    hi = tl.minimum(lo + cols_per_split, N)
    for j0 in range(lo, hi, BN):
        cn, col_ok, c_ld, b_blk = col_tile(j0, hi, b_ptr, stride_b, BN)
        # -- compute tile --: softplus(-zx) = max(-zx, 0) + log1p(exp(-|zx|)), stable.
        _, zx, _ = _signed_logits(a_blk, b_blk, r_ld, c_ld, row0 + r, j0 + cn, diag, K,
                                  stride_a, stride_b, s, t, BM, BN, BK, EVEN_K, PREC, DOT_F32)
        sp = tl.maximum(-zx, 0.0) + _log1p_small(tl.exp2(-tl.abs(zx) * LOG2E))
        acc += tl.sum(tl.where(col_ok[None, :], sp, 0.0), 1)
    tl.store(part_ptr + pid_s * M + row0 + r, acc, mask=row_ok)


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
    row0, r, row_ok, r_ld, a_blk = row_block(pid_m, M, a_ptr, stride_a, BM)
    if G_ON_A:
        g = tl.load(g_ptr + row0 + r_ld).to(tl.float32)
    d = pid_c * DC + tl.arange(0, DC)
    d_ok = d < K
    acc = tl.zeros((BM, DC), dtype=tl.float32)
    ds_row = tl.zeros((BM,), dtype=tl.float32)
    dt_row = tl.zeros((BM,), dtype=tl.float32)
    for j0 in range(0, N, BN):
        cn, col_ok, c_ld, b_blk = col_tile(j0, N, b_ptr, stride_b, BN)
        dot, zx, pos = _signed_logits(a_blk, b_blk, r_ld, c_ld, row0 + r, j0 + cn, diag, K, stride_a,
                                      stride_b, s, t, BM, BN, BK, EVEN_K, PREC, DOT_F32)
        # -- compute tile --: dX, its (ds, dt) shares from fp32, then the update.
        if not G_ON_A:
            g = tl.load(g_ptr + j0 + c_ld).to(tl.float32)
        p = _sigmoid_dx(zx, pos, g, row_ok[:, None] & col_ok[None, :], G_ON_A)
        if COMPUTE_DS:
            ds_row += tl.sum(p * dot, 1)
            dt_row += tl.sum(p, 1)
        acc = update_rows(acc, p, b_blk, c_ld, d, d_ok, stride_b, PREC, DOT_F32)
    if COMPUTE_DS:  # every feature chunk saw all logits: count once
        first = pid_c == 0
        idx = 2 * (pid_m * tl.num_programs(1) + pid_c)
        tl.store(part_ptr + idx, tl.where(first, tl.sum(ds_row, 0), 0.0))
        tl.store(part_ptr + idx + 1, tl.where(first, tl.sum(dt_row, 0), 0.0))
    store_rows(out_ptr, acc * s, row0, r, row_ok, d, d_ok, stride_o, ACCUM)


@triton.jit
def _sigmoid_strip_kernel(a_ptr, b_ptr, scale_ptr, bias_ptr, g_ptr, p_ptr, part_ptr,
                          R, row_start, N, K, stride_a, stride_b, stride_p, diag,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                          EVEN_K: tl.constexpr, G_ON_A: tl.constexpr, PREC: tl.constexpr,
                          DOT_F32: tl.constexpr):
    """P[i, j] = s * dX[row_start + i, j] for a strip of R rows (input dtype);
    part[program] = its (ds, dt) shares from the fp32 dX."""
    pid = tl.program_id(0)
    r0, r, row_ok, r_ld, a_blk, j0, cn, col_ok, c_ld, b_blk = strip_tile(
        pid, R, row_start, N, a_ptr, b_ptr, stride_a, stride_b, BM, BN, GROUP)
    s = tl.load(scale_ptr).to(tl.float32)
    t = tl.load(bias_ptr).to(tl.float32)
    rows = row_start + r0 + r
    dot, zx, pos = _signed_logits(a_blk, b_blk, r_ld, c_ld, rows, j0 + cn, diag, K, stride_a, stride_b,
                                  s, t, BM, BN, BK, EVEN_K, PREC, DOT_F32)
    # -- compute tile --: s * dX and its (ds, dt) shares.
    if G_ON_A:
        g = tl.load(g_ptr + row_start + r0 + r_ld).to(tl.float32)
    else:
        g = tl.load(g_ptr + j0 + c_ld).to(tl.float32)
    ok = row_ok[:, None] & col_ok[None, :]
    p = _sigmoid_dx(zx, pos, g, ok, G_ON_A)
    tl.store(part_ptr + 2 * pid, tl.sum(tl.sum(p * dot, 1), 0))
    tl.store(part_ptr + 2 * pid + 1, tl.sum(tl.sum(p, 1), 0))
    store_strip(p_ptr, p * s, r0, r, cn, j0, ok, stride_p)
