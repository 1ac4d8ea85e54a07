"""Triton device helpers shared by every kernel family (clip, siglip, nt_xent).

The tiling convention of all kernels here: A (M, K) and B (N, K) are row-major feature
blocks with unit last stride; a program owns BM rows of A (``row_block``) and visits B in
BN-row tiles (``col_tile``), computing logits <A_i, B_j> over K in BK chunks
(``dot_stream``). Out-of-range rows and columns are clamped to the last valid index for
loading (``r_ld`` / ``c_ld``: no masks in the inner loop) and masked out of every
reduction and store by the caller (``row_ok`` / ``col_ok``). Offsets of whole blocks are
int64 (b * c passes 2^31 at b = 4M, c = 512).

``@triton.jit`` helpers are inlined into their callers: sharing them costs nothing at run
time.
"""

import os

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# Triton's interpreter (3.8) casts fp32 to bf16 by truncation (round toward zero, a bias of
# half an ulp on average), where the GPU rounds to nearest even: ``to_16`` rounds first there,
# so CPU tests see the GPU's rounding (the compiled GPU code is unchanged).
_INTERPRET_RTNE = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def to_16(x, dtype: tl.constexpr):
    """fp32 x cast to ``dtype`` rounded to nearest even, as on the GPU (also under the interpreter)."""
    if _INTERPRET_RTNE and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def row_block(pid_m, M, a_ptr, stride_a, BM: tl.constexpr):
    """(row0, r, row_ok, r_ld, a_blk) of row block ``pid_m``: r = arange(BM), row_ok masks
    rows >= M, r_ld clamps them for loads, a_blk points at row ``row0`` of A."""
    row0 = pid_m * BM
    r = tl.arange(0, BM)
    row_ok = row0 + r < M
    r_ld = tl.minimum(r, M - 1 - row0)
    a_blk = a_ptr + row0.to(tl.int64) * stride_a
    return row0, r, row_ok, r_ld, a_blk


@triton.jit
def col_tile(j0, N, b_ptr, stride_b, BN: tl.constexpr):
    """(cn, col_ok, c_ld, b_blk) of the BN-column tile starting at column ``j0``."""
    cn = tl.arange(0, BN)
    col_ok = j0 + cn < N
    c_ld = tl.minimum(cn, N - 1 - j0)
    b_blk = b_ptr + j0 * stride_b.to(tl.int64)
    return cn, col_ok, c_ld, b_blk


@triton.jit
def grouped_tile(pid, R, N, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr):
    """(pid_m, pid_n) of a flat program id over a (cdiv(R, BM), cdiv(N, BN)) grid, ordered in
    groups of GROUP row tiles so that consecutive programs reuse B's column tiles from L2."""
    n_m = tl.cdiv(R, BM)
    n_n = tl.cdiv(N, BN)
    per_group = GROUP * n_n
    first_m = (pid // per_group) * GROUP
    group_m = tl.minimum(n_m - first_m, GROUP)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    return pid_m, pid_n


@triton.jit
def strip_tile(pid, R, row_start, N, a_ptr, b_ptr, stride_a, stride_b,
               BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr):
    """The (BM rows, BN columns) tile of program ``pid`` in a strip of R rows of A starting at
    ``row_start``, in ``grouped_tile`` order: (r0, r, row_ok, r_ld, a_blk) as ``row_block``
    (strip-relative rows) and (j0, cn, col_ok, c_ld, b_blk) as ``col_tile``."""
    pid_m, pid_n = grouped_tile(pid, R, N, BM, BN, GROUP)
    r0 = pid_m * BM
    r = tl.arange(0, BM)
    row_ok = r0 + r < R
    r_ld = tl.minimum(r, R - 1 - r0)
    a_blk = a_ptr + (row_start + r0).to(tl.int64) * stride_a  # a tensor even if row_start is specialized
    j0 = pid_n * BN
    cn, col_ok, c_ld, b_blk = col_tile(j0, N, b_ptr, stride_b, BN)
    return r0, r, row_ok, r_ld, a_blk, j0, cn, col_ok, c_ld, b_blk


@triton.jit
def strip_coords(tile, R, N, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr):
    """(r0, r, row_ok, r_ld, j0, cn, col_ok, c_ld) of tile ``tile`` of a strip of R rows x N
    columns in ``grouped_tile`` order: ``strip_tile`` without the block pointers, for the
    persistent kernels that load their operands through tensor descriptors."""
    pid_m, pid_n = grouped_tile(tile, R, N, BM, BN, GROUP)
    r0 = pid_m * BM
    j0 = pid_n * BN
    r = tl.arange(0, BM)
    cn = tl.arange(0, BN)
    row_ok = r0 + r < R
    r_ld = tl.minimum(r, R - 1 - r0)
    col_ok = j0 + cn < N
    c_ld = tl.minimum(cn, N - 1 - j0)
    return r0, r, row_ok, r_ld, j0, cn, col_ok, c_ld


@triton.jit
def tma_dot(a_desc, b_desc, row, j0, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
            PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """(BM, BN) fp32 = A[row:row + BM] @ B[j0:j0 + BN]^T through tensor descriptors (TMA;
    rows past the descriptors' shapes read as zeros), K in chunks of BK (``dot_stream``'s
    order)."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = a_desc.load([row, k0])
        y = b_desc.load([j0, k0])
        if DOT_F32:  # interpreter: see load_kchunk
            x = x.to(tl.float32)
            y = y.to(tl.float32)
        acc = tl.dot(x, tl.trans(y), acc, input_precision=PREC)
    return acc


@triton.jit
def load_kchunk(a_blk, b_blk, r_ld, c_ld, kk, K, stride_a, stride_b,
                EVEN_K: tl.constexpr, DOT_F32: tl.constexpr):
    """(A[r_ld, kk], B[c_ld, kk]) operand tiles of one K chunk (zero past K)."""
    a_ptrs = a_blk + r_ld[:, None] * stride_a + kk[None, :]
    b_ptrs = b_blk + c_ld[:, None] * stride_b + kk[None, :]
    if EVEN_K:
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
    else:
        a = tl.load(a_ptrs, mask=kk[None, :] < K, other=0.0)
        b = tl.load(b_ptrs, mask=kk[None, :] < K, other=0.0)
    if DOT_F32:  # interpreter: its 16-bit dot is wrong, upcast (values stay exact)
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return a, b


@triton.jit
def dot_stream(a_blk, b_blk, r_ld, c_ld, K, stride_a, stride_b,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               EVEN_K: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """(BM, BN) fp32 = A[r_ld] @ B[c_ld]^T, streaming K in chunks of BK."""
    ks = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a, b = load_kchunk(a_blk, b_blk, r_ld, c_ld, k0 + ks, K, stride_a, stride_b, EVEN_K, DOT_F32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PREC)
    return acc


@triton.jit
def update_rows(acc, p, b_blk, c_ld, d, d_ok, stride_b, PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """acc (BM, DC) += p (BM, BN) @ B[c_ld, d]; p is rounded to B's dtype first (the
    tensor-core input dtype, as vanilla autograd rounds its logits gradient)."""
    t = tl.load(b_blk + c_ld[:, None] * stride_b + d[None, :], mask=d_ok[None, :], other=0.0)
    p = to_16(p, b_blk.dtype.element_ty)
    if DOT_F32:
        p = p.to(tl.float32)
        t = t.to(tl.float32)
    return tl.dot(p, t, acc, input_precision=PREC)


@triton.jit
def store_rows(out_ptr, res, row0, r, row_ok, d, d_ok, stride_o, ACCUM: tl.constexpr):
    """out[row0 + r, d] (+)= res (fp32), cast once to out's dtype; masked rows/columns skipped."""
    o_ptrs = out_ptr + row0.to(tl.int64) * stride_o + r[:, None] * stride_o + d[None, :]
    o_mask = row_ok[:, None] & d_ok[None, :]
    if ACCUM:
        res += tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, to_16(res, out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def store_strip(p_ptr, p, r0, r, cn, j0, ok, stride_p):
    """P[r0 + r, j0 + cn] = p (cast to P's dtype), where ``ok``: one tile of a strip scratch."""
    p_ptrs = p_ptr + (r0 + r)[:, None].to(tl.int64) * stride_p + (j0 + cn)[None, :]
    tl.store(p_ptrs, to_16(p, p_ptr.dtype.element_ty), mask=ok)
