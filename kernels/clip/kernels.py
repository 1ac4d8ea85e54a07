"""Triton kernels of the tiled CLIP log-sum-exp (Inf-CL), forward and backward.

Notation: A (M, K) and B (N, K) are feature blocks, s a positive 0-d scale (read from
device memory, never synced to the host), x_ij = s * <A_i, B_j>. Everything is computed in
base 2 inside the kernels (x * log2(e), exp2, log2) and stored in natural units.

Forward (``_lse_fwd_kernel``): one pass over the tiles produces both directions. Program
(pid_m, pid_s) owns the BM rows ``pid_m`` and one split of the launch's column range; it
keeps an online (max, sum) per row in registers and writes, for every BN-column tile, the
column LSE over its BM rows into ``col_part[pid_m, :]``. The host merges the partials
(``torch.logsumexp``); it bounds their size by launching column chunks.

Backward (``_grad_kernel``): dA_i = s * sum_j dX_ij B_j with
dX_ij = gA_i exp(x_ij - lseA_i) + gB_j exp(x_ij - lseB_j). Program (pid_m, pid_c) owns
BM rows and DC feature columns of dA and keeps that (BM, DC) accumulator in registers
while it sweeps all column tiles of B, recomputing each logits tile. dB is the same
kernel with the roles of A and B swapped. Optionally it also writes the program's share
of ds = sum_ij dX_ij <A_i, B_j>, summed from the fp32 dX before its cast.

Strip backward (``_dx_strip_kernel``): a GEMM-shaped kernel writes P = s * dX for a strip
of R rows (bounded scratch); cuBLAS then forms dA[strip] = P @ B. No register accumulator
over the feature dim, so it can use 128x256 tiles.

Out-of-range rows/columns are clamped to the last valid index for loading (no masks in
the inner loop) and masked out of every reduction and store.
"""

import triton
import triton.language as tl

from ..tiles import LN2, LOG2E, col_tile, dot_stream, row_block, store_rows, store_strip, strip_tile, update_rows


@triton.jit
def _lse_fwd_kernel(a_ptr, b_ptr, scale_ptr, row_part_ptr, col_part_ptr,
                    M, N, K, stride_a, stride_b, col_start, col_stop, cols_per_split,
                    stride_cp,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    EVEN_K: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """row_part[pid_s, rows] and col_part[pid_m, cols - col_start]: partial LSEs (natural)."""
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    s2 = tl.load(scale_ptr).to(tl.float32) * LOG2E
    row0, r, row_ok, r_ld, a_blk = row_block(pid_m, M, a_ptr, stride_a, BM)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    lo = col_start + pid_s * cols_per_split
    hi = tl.minimum(lo + cols_per_split, col_stop)
    for j0 in range(lo, hi, BN):
        cn, col_ok, c_ld, b_blk = col_tile(j0, hi, b_ptr, stride_b, BN)
        # -- compute tile --: base-2 logits of (BM rows) x (BN columns).
        x = dot_stream(a_blk, b_blk, r_ld, c_ld, K, stride_a, stride_b,
                       BM, BN, BK, EVEN_K, PREC, DOT_F32) * s2
        # Row direction: online max / rescaled sum, kept in registers.
        xr = tl.where(col_ok[None, :], x, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(xr, 1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(xr - m_new[:, None]), 1)
        m_i = m_new
        # Column direction: this tile's LSE over the program's BM rows.
        xc = tl.where(row_ok[:, None], x, float("-inf"))
        cm = tl.max(xc, 0)
        cl = tl.sum(tl.exp2(xc - cm[None, :]), 0)
        cp_ptrs = col_part_ptr + pid_m * stride_cp + (j0 - col_start) + cn
        tl.store(cp_ptrs, (cm + tl.log2(cl)) * LN2, mask=col_ok)
    tl.store(row_part_ptr + pid_s * M + row0 + r, (m_i + tl.log2(l_i)) * LN2, mask=row_ok)


@triton.jit
def _grad_kernel(a_ptr, b_ptr, scale_ptr, gnorm_ptr, lse_a_ptr, lse_b_ptr, g_a_ptr, g_b_ptr,
                 g_d_ptr, out_ptr, ds_ptr, M, N, K, stride_a, stride_b, stride_o,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DC: tl.constexpr,
                 EVEN_K: tl.constexpr, RESIDENT: tl.constexpr, ACCUM: tl.constexpr,
                 COMPUTE_DS: tl.constexpr, HAS_DIAG: tl.constexpr, PREC: tl.constexpr,
                 DOT_F32: tl.constexpr):
    """out[rows, dcols] (+)= s * sum_j dX_ij B_j[dcols]; ds_part[program] = its share of ds.

    RESIDENT (needs DC >= K, one feature chunk): the (BM, K) block of A stays on chip and
    each (BN, K) tile of B is loaded once for both products. Otherwise the logits are
    streamed over K in BK chunks and the (BN, DC) slice of B is loaded for the update.
    g_a, g_b are divided by gnorm = max |g| so that dX is O(1) before its cast to the
    input dtype (fp16 would flush tiny gradients to zero); the result is multiplied back.
    HAS_DIAG (square block pair): also the gradient of -sum_i g_d_i x_ii (the CLIP loss's
    positive pairs), added to the fp32 result before its single rounding.
    """
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    s = tl.load(scale_ptr).to(tl.float32)
    s2 = s * LOG2E
    gn = tl.load(gnorm_ptr).to(tl.float32)
    row0, r, row_ok, r_ld, a_blk = row_block(pid_m, M, a_ptr, stride_a, BM)
    lse_a = tl.load(lse_a_ptr + row0 + r_ld).to(tl.float32) * LOG2E
    g_a = tl.where(row_ok, tl.load(g_a_ptr + row0 + r_ld).to(tl.float32) / gn, 0.0)
    d = pid_c * DC + tl.arange(0, DC)
    d_ok = d < K
    acc = tl.zeros((BM, DC), dtype=tl.float32)
    ds_row = tl.zeros((BM,), dtype=tl.float32)
    if RESIDENT:
        a_res = tl.load(a_blk + r_ld[:, None] * stride_a + d[None, :], mask=d_ok[None, :], other=0.0)
        if DOT_F32:
            a_res = a_res.to(tl.float32)
    for j0 in range(0, N, BN):
        cn, col_ok, c_ld, b_blk = col_tile(j0, N, b_ptr, stride_b, BN)
        # -- compute tile --: recompute the base-2 logits, then dX (scaled by 1/gnorm).
        if RESIDENT:
            t = tl.load(b_blk + c_ld[:, None] * stride_b + d[None, :], mask=d_ok[None, :], other=0.0)
            if DOT_F32:
                t = t.to(tl.float32)
            x = tl.dot(a_res, tl.trans(t), input_precision=PREC) * s2
        else:
            x = dot_stream(a_blk, b_blk, r_ld, c_ld, K, stride_a, stride_b,
                           BM, BN, BK, EVEN_K, PREC, DOT_F32) * s2
        lse_b = tl.load(lse_b_ptr + j0 + c_ld).to(tl.float32) * LOG2E
        g_b = tl.load(g_b_ptr + j0 + c_ld).to(tl.float32) / gn
        p = g_a[:, None] * tl.exp2(x - lse_a[:, None]) + g_b[None, :] * tl.exp2(x - lse_b[None, :])
        p = tl.where(col_ok[None, :], p, 0.0)
        if COMPUTE_DS:  # from fp32 dX, before its rounding to the input dtype
            ds_row += tl.sum(p * x, 1)
        if RESIDENT:  # B's tile is on chip already: reuse it for the update
            acc = tl.dot(p.to(b_ptr.dtype.element_ty).to(t.dtype), t, acc, input_precision=PREC)
        else:
            acc = update_rows(acc, p, b_blk, c_ld, d, d_ok, stride_b, PREC, DOT_F32)
    acc = acc * gn  # = sum_j dX_ij B_j[dcols]
    if COMPUTE_DS:  # sum_ij dX_ij <A_i, B_j> = (gnorm / s2) * sum_ij p_ij x_ij
        ds = tl.sum(tl.where(row_ok, ds_row, 0.0), 0) * (gn / s2)
        ds = tl.where(pid_c == 0, ds, 0.0)  # every feature chunk saw all logits: count once
        tl.store(ds_ptr + pid_m * tl.num_programs(1) + pid_c, ds)
    res = acc * s
    if HAS_DIAG:  # - s * g_d_i * B_i (square block pair: B row i pairs with A row i), in fp32
        g_d = tl.load(g_d_ptr + row0 + r_ld).to(tl.float32)
        b_i = tl.load(b_ptr + row0.to(tl.int64) * stride_b + r_ld[:, None] * stride_b + d[None, :],
                      mask=d_ok[None, :], other=0.0).to(tl.float32)
        res -= (s * g_d)[:, None] * b_i
    store_rows(out_ptr, res, row0, r, row_ok, d, d_ok, stride_o, ACCUM)


@triton.jit
def _dx_strip_kernel(a_ptr, b_ptr, scale_ptr, lse_a_ptr, lse_b_ptr, g_a_ptr, g_b_ptr, p_ptr, ds_ptr,
                     R, row_start, N, K, stride_a, stride_b, stride_p,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                     EVEN_K: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """P[i, j] = s * dX[row_start + i, j] for a strip of R rows, in the input dtype.

    The strip path of the backward: a GEMM-shaped kernel (any BM, no register accumulator
    over the feature dim) writes s * dX for R rows into a bounded scratch; cuBLAS then
    forms dA[strip] = P @ B. Programs are ordered in groups of GROUP row tiles so that
    column tiles of B are reused from L2. ds_part[program] = its share of
    sum dX_ij <A_i, B_j>, from the fp32 values.
    """
    pid = tl.program_id(0)
    r0, r, row_ok, r_ld, a_blk, j0, cn, col_ok, c_ld, b_blk = strip_tile(
        pid, R, row_start, N, a_ptr, b_ptr, stride_a, stride_b, BM, BN, GROUP)
    s = tl.load(scale_ptr).to(tl.float32)
    s2 = s * LOG2E
    # -- compute tile --: base-2 logits, then s * dX.
    x = dot_stream(a_blk, b_blk, r_ld, c_ld, K, stride_a, stride_b, BM, BN, BK, EVEN_K, PREC, DOT_F32) * s2
    lse_a = tl.load(lse_a_ptr + row_start + r0 + r_ld).to(tl.float32) * LOG2E
    g_a = tl.load(g_a_ptr + row_start + r0 + r_ld).to(tl.float32)
    lse_b = tl.load(lse_b_ptr + j0 + c_ld).to(tl.float32) * LOG2E
    g_b = tl.load(g_b_ptr + j0 + c_ld).to(tl.float32)
    p = g_a[:, None] * tl.exp2(x - lse_a[:, None]) + g_b[None, :] * tl.exp2(x - lse_b[None, :])
    ok = row_ok[:, None] & col_ok[None, :]
    p = tl.where(ok, p, 0.0)
    tl.store(ds_ptr + pid, tl.sum(tl.sum(p * x, 1), 0) / s2)
    store_strip(p_ptr, p * s, r0, r, cn, j0, ok, stride_p)
