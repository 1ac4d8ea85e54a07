"""Triton kernels of the tiled NT-Xent loss: row LSEs of a self-similarity block pair.

Notation: A (M, K), B (N, K) feature blocks, s > 0 (1 / temperature, read from device
memory), x_ij = s <A_i, B_j>; the pairs with i - j == diag are excluded (the launcher
passes diag = 0 for the own block, where they are the self-similarities, and diag = M + N,
which matches nothing, for a remote block). Base-2 inside, natural units outside.

Forward (``_masked_lse_fwd_kernel``): program pid_m owns BM rows, sweeps every BN-column
tile with an online (max, sum) per row: lse_i = LSE_{j, i-j != diag} x_ij.

Backward (``_masked_grad_kernel``): out_i = s * sum_j dX_ij B_j with
dX_ij = g_k exp(x_ij - lse_k), k = i (LSE_ON_A: the rows of A own the softmax, giving dA)
or k = j (the columns own it: with A and B swapped this is dB = s dX^T A). Program
(pid_m, pid_c) owns BM rows and DC feature columns; COMPUTE_DS writes its share of
ds = sum dX_ij <A_i, B_j>. The logits are recomputed with the CLIP kernels' ``_dot_stream``.
"""

import triton
import triton.language as tl

from ..clip.kernels import _dot_stream

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _masked_lse_fwd_kernel(a_ptr, b_ptr, scale_ptr, lse_ptr, M, N, K, stride_a, stride_b, diag,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                           PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """lse[rows] over the unmasked columns (-inf for a row with none)."""
    pid_m = tl.program_id(0)
    s2 = tl.load(scale_ptr).to(tl.float32) * LOG2E
    row0 = pid_m * BM
    r = tl.arange(0, BM)
    rows = row0 + r
    row_ok = rows < M
    r_ld = tl.minimum(r, M - 1 - row0)
    a_blk = a_ptr + row0.to(tl.int64) * stride_a
    cn = tl.arange(0, BN)
    stride_b64 = stride_b.to(tl.int64)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    for j0 in range(0, N, BN):
        cols = j0 + cn
        c_ld = tl.minimum(cn, N - 1 - j0)
        # -- compute tile --: masked base-2 logits, online max / rescaled sum.
        x = _dot_stream(a_blk, b_ptr + j0 * stride_b64, r_ld, c_ld, K, stride_a, stride_b,
                        BM, BN, BK, EVEN_K, PREC, DOT_F32) * s2
        live = (cols[None, :] < N) & ((rows[:, None] - cols[None, :]) != diag)
        x = tl.where(live, x, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(x, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far: no NaN
        l_i = l_i * tl.exp2(m_i - m_ref) + tl.sum(tl.exp2(x - m_ref[:, None]), 1)
        m_i = m_new
    tl.store(lse_ptr + rows, (m_i + tl.log2(l_i)) * LN2, mask=row_ok)


@triton.jit
def _masked_grad_kernel(a_ptr, b_ptr, scale_ptr, lse_ptr, g_ptr, out_ptr, ds_ptr,
                        M, N, K, stride_a, stride_b, stride_o, diag,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DC: tl.constexpr,
                        EVEN_K: tl.constexpr, LSE_ON_A: tl.constexpr, ACCUM: tl.constexpr,
                        COMPUTE_DS: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """out[rows, dcols] (+)= s * sum_j dX_ij B_j[dcols]; ds_part[program] = its ds share."""
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    s = tl.load(scale_ptr).to(tl.float32)
    s2 = s * LOG2E
    row0 = pid_m * BM
    r = tl.arange(0, BM)
    rows = row0 + r
    row_ok = rows < M
    r_ld = tl.minimum(r, M - 1 - row0)
    a_blk = a_ptr + row0.to(tl.int64) * stride_a
    if LSE_ON_A:
        lse_a = tl.load(lse_ptr + row0 + r_ld).to(tl.float32) * LOG2E
        g_a = tl.load(g_ptr + row0 + r_ld).to(tl.float32)
    d = pid_c * DC + tl.arange(0, DC)
    d_ok = d < K
    cn = tl.arange(0, BN)
    stride_b64 = stride_b.to(tl.int64)
    acc = tl.zeros((BM, DC), dtype=tl.float32)
    ds_row = tl.zeros((BM,), dtype=tl.float32)
    for j0 in range(0, N, BN):
        cols = j0 + cn
        c_ld = tl.minimum(cn, N - 1 - j0)
        b_blk = b_ptr + j0 * stride_b64
        dot = _dot_stream(a_blk, b_blk, r_ld, c_ld, K, stride_a, stride_b, BM, BN, BK, EVEN_K, PREC, DOT_F32)
        x = dot * s2
        # -- compute tile --: dX = g exp(x - lse) of the side that owns the softmax; masked.
        if LSE_ON_A:
            p = g_a[:, None] * tl.exp2(x - lse_a[:, None])
        else:
            lse_b = tl.load(lse_ptr + j0 + c_ld).to(tl.float32) * LOG2E
            g_b = tl.load(g_ptr + j0 + c_ld).to(tl.float32)
            p = g_b[None, :] * tl.exp2(x - lse_b[None, :])
        live = row_ok[:, None] & (cols[None, :] < N) & ((rows[:, None] - cols[None, :]) != diag)
        p = tl.where(live, p, 0.0)
        if COMPUTE_DS:
            ds_row += tl.sum(p * dot, 1)
        tb = tl.load(b_blk + c_ld[:, None] * stride_b + d[None, :], mask=d_ok[None, :], other=0.0)
        p = p.to(b_ptr.dtype.element_ty)
        if DOT_F32:
            p = p.to(tl.float32)
            tb = tb.to(tl.float32)
        acc = tl.dot(p, tb, acc, input_precision=PREC)
    if COMPUTE_DS:
        ds = tl.where(pid_c == 0, tl.sum(ds_row, 0), 0.0)  # every feature chunk saw all logits
        tl.store(ds_ptr + pid_m * tl.num_programs(1) + pid_c, ds)
    o_ptrs = out_ptr + row0.to(tl.int64) * stride_o + r[:, None] * stride_o + d[None, :]
    o_mask = row_ok[:, None] & d_ok[None, :]
    res = acc * s
    if ACCUM:
        res += tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=o_mask)
