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
over the feature dim, so it can use 128x256 tiles. Two-pass (``TritonTileOps(backward=
"twopass")``, today's default): dB is the same with the roles swapped, so every logits tile
is computed twice in the backward (10 b^2 c FLOPs for forward + backward). One-pass
(``backward="onepass"``, ``launch.grad_onepass_strips``): the same kernels fill P
once per strip and cuBLAS forms both dA[strip] = P @ B and an fp32 accumulator dB += P^T @
A[strip] (8 b^2 c FLOPs); the kernels are unchanged, d scale is summed once from the fills.

Persistent TMA strip kernel (``_dx_strip_tma_kernel``, the first strip candidate for
16-bit inputs with 16-byte aligned rows): the same tiles and epilogue (``_strip_epilogue``),
``per_sm`` programs per SM striding over the strip's tiles, operands loaded through tensor
descriptors (TMA), the tile loop optionally warp-specialized (``tl.range(...,
warp_specialize=True)``, slower on the H200: a sweep variant only).

Offsets and positives (HAS_OFF, HAS_DIAG; see ``infclip.loss.tiled.shifted_dots`` for the
same math in PyTorch): with per-row / per-column offsets o_a, o_b (dot products, unscaled)
the LSEs are relative to s * o, computed from s (<A_i, B_j> - o) so that no logit of
magnitude s |<A, B>| is rounded; on the square block pair that holds the CLIP positives
(HAS_DIAG) their dot products are *defined* as the offsets (o_a = o_b = <A_i, B_i>, one
fp32 vector used by every pass), so LSE_j x_ij - x_ii comes out without cancellation, and
the backward folds the positive term into dX in fp32 before any rounding or product:
dX_ii = g_a (p_ii - 1) + g_b (p'_ii - 1) + (g_a + g_b - g_d), with p_ii - 1 = expm1(-lse_a)
(``_take_positives``, on (BM,) vectors). d scale is summed from that same dX, in a form
that uses each softmax row's sum of 1 analytically (``_dx_tile``). dX_ii never
goes through the 16-bit product: it is taken out of the tile and s dX_ii B_i is added in
fp32 (the fused kernel's epilogue; the strip path's host fixup) -- or, with the strip
kernels' FOLD, the folded fp32 value is written into P and rounded once with it (exact
for fp32 inputs; for bf16 the same single rounding vanilla applies to its dX). The forward handles the
tiles that cross the diagonal in a loop of their own (``_fwd_step`` with DIAG), so the
replacement costs the other tiles nothing (no registers held across a runtime branch).

Duplicate groups (HAS_GID; ``infclip.loss.duplicates`` states the loss): per-row and
per-column group ids (int32 dense ranks on one process, int64 on the ring) are loaded as
vectors and, in the tile epilogue, every entry with equal ids is dropped from both
directions with one integer compare (``_group_drop``): -inf logits in the forward (with the
online max guarded for a row or column whose entries of a tile are all dropped), dX = 0 in
the backward. A positive's own i == j is dropped too and restored by the diagonal handling
that follows (the forward's DIAG tiles; ``_take_positives`` / FOLD in the backward), so no
i != j test runs in any tile. The flag is a constexpr and the id pointers are None when it
is off, so the off path compiles to the kernels of before.

Band (BAND, with HAS_GID; the one-process batch sorted by group, ``infclip.loss.duplicates.
sort_groups``): every same-group pair (i, j) has |i - j| <= w, w = band_ptr[0] (the largest
group's size less one, read from device memory), so only tiles within w of the diagonal
(``_in_band``: j0 < row0 + BM + w and j0 + BN > row0 - w) compare ids. The forward splits
its column loop as for DIAG, with no runtime branch in a loop: plain tiles before the band,
the band's tiles (diagonal ones included) with DIAG and the compare (DIAG's i == j select
changes nothing off the diagonal; one loop instead of three keeps the kernel the size of the
HAS_GID one: sm_90 ptxas, bf16, 256 x 128, c = 512: 2092 bytes of spill stores against 2220
for HAS_GID and 4280 for a five-loop split), plain tiles after it. The strip epilogue and
the fused backward take one uniform scalar branch per tile (``_in_band``; ``_keep_negatives``
in the fused one): in the band, load the ids and compare; else nothing. Of all tiles about (BM + 2w + BN) / b
compare. Without BAND (the ring, ``TritonTileOps`` called with two-element groups) every
tile compares, as before; BAND = False compiles to the same PTX as before the band (the off
kernels and the HAS_GID ones, int32 and int64: checked on the sm_90 PTX, debug info aside).

Consistency: the backward recomputes the dot products in the forward's K order (same BK
chunks; on the GPU a K-chained tl.dot accumulates in the same order for any tile shape),
so p_ij = exp(x_ij - lse_i) sums to 1 over j as the forward's LSE did.

Out-of-range rows/columns are clamped to the last valid index for loading (no masks in
the inner loop) and masked out of every reduction and store.
"""

import triton
import triton.language as tl

from ..tiles import (LN2, LOG2E, col_tile, dot_stream, row_block, store_rows, store_strip, strip_coords,
                     strip_tile, tma_dot, to_16, update_rows)


# -- tile epilogue pieces shared by the three kernels ------------------------------------------

@triton.jit
def _load_vec(ptr, idx, HAS: tl.constexpr, BLOCK: tl.constexpr):
    """fp32 ptr[idx] when HAS, else zeros (BLOCK,)."""
    v = tl.zeros((BLOCK,), tl.float32)
    if HAS:
        v = tl.load(ptr + idx).to(tl.float32)
    return v


@triton.jit
def _shifted(dot, o_a, o_b, s2, HAS_OFF: tl.constexpr):
    """(row-direction, column-direction) base-2 logits less the offsets: s2 (dot - o).

    HAS_OFF = 1 (fp32 inputs): subtract first, so no logit of magnitude s2 |dot| is rounded.
    HAS_OFF = 2 (16-bit inputs): one FMA per direction, s2 dot - (s2 o), whose rounded
    s2 o (~1e-5 at |s2 o| ~ 144) is far below the inputs' own bf16/fp16 rounding."""
    xr = dot * s2
    xc = xr
    if HAS_OFF == 2:
        xr = dot * s2 - (o_a * s2)[:, None]
        xc = dot * s2 - (o_b * s2)[None, :]
    elif HAS_OFF:
        xr = (dot - o_a[:, None]) * s2
        xc = (dot - o_b[None, :]) * s2
    return xr, xc


@triton.jit
def _load_ids(ptr, idx, HAS: tl.constexpr, BLOCK: tl.constexpr):
    """ptr[idx] (group ids, in the pointer's own dtype: int32 dense ranks on one process,
    int64 on the ring) when HAS, else int32 zeros (BLOCK,) (never compared)."""
    if HAS:
        v = tl.load(ptr + idx)
    else:
        v = tl.zeros((BLOCK,), tl.int32)
    return v


@triton.jit
def _group_drop(gid_a, gid_b):
    """(BM, BN) bool: entries whose row and column share a group id, i.e. duplicates that are
    not negatives. One integer compare per entry: a positive's own i == j (same id) is
    dropped too, and the callers' diagonal handling, which runs after it, puts it back
    (the forward's DIAG tiles set x_ii - s o_i = 0; the backward's ``_take_positives`` and
    FOLD overwrite dX_ii), so no i != j test is needed."""
    return gid_a[:, None] == gid_b[None, :]


@triton.jit
def _in_band(row0, j0, w, BM: tl.constexpr, BN: tl.constexpr):
    """Whether the tile (rows row0 .. row0 + BM, columns j0 .. j0 + BN) holds an entry with
    |i - j| <= w: with the pairs sorted by group id and w the largest group's size less one,
    the only tiles that can hold a same-group pair (``_near_diag`` is w = 0)."""
    return (j0 < row0 + BM + w) & (j0 + BN > row0 - w)


@triton.jit
def _keep_negatives(ok, gid_a, gid_b_ptr, c_ld, row0, j0, w, BM: tl.constexpr, BN: tl.constexpr,
                    HAS_GID: tl.constexpr, BAND: tl.constexpr):
    """The backward's tile mask ``ok`` less the duplicates (dX = 0 there; i == j is put back by
    ``_take_positives`` / FOLD): with BAND only where the tile is in the band, one uniform
    scalar branch per tile (the column ids are loaded there only)."""
    if HAS_GID:
        if BAND:
            if _in_band(row0, j0, w, BM, BN):
                ok = ok & ~_group_drop(gid_a, tl.load(gid_b_ptr + j0 + c_ld))
        else:
            ok = ok & ~_group_drop(gid_a, tl.load(gid_b_ptr + j0 + c_ld))
    return ok


@triton.jit
def _expm1(u):
    """exp(u) - 1 without cancellation near 0 (degree-8 series for |u| < 1/4)."""
    series = u * (1.0 + u * (0.5 + u * (1.0 / 6 + u * (1.0 / 24 + u * (1.0 / 120 + u * (
        1.0 / 720 + u * (1.0 / 5040 + u * (1.0 / 40320))))))))
    return tl.where(tl.abs(u) < 0.25, series, tl.exp(u) - 1.0)


@triton.jit
def _positive_dx(lse_a, g_a, g_d, lse_b_ptr, g_b_ptr, idx, g_mul):
    """(BM,) dX_ii = g_a (p_ii - 1) + g_b (p'_ii - 1) + (g_a + g_b - g_d), in fp32: the
    positive term folded before any rounding; p_ii = 2^-lse (base-2 LSEs relative to x_ii),
    p_ii - 1 by ``_expm1``. ``idx``: the rows' indices (= their diagonal columns); g_b is
    multiplied by ``g_mul`` (a power of two: exact, so g_a + g_b - g_d stays exactly 0 for
    CLIP's g_d = g_a + g_b)."""
    lse_b = tl.load(lse_b_ptr + idx).to(tl.float32) * LOG2E
    g_b = tl.load(g_b_ptr + idx).to(tl.float32) * g_mul
    return g_a * _expm1(-lse_a * LN2) + g_b * _expm1(-lse_b * LN2) + ((g_a + g_b) - g_d)


@triton.jit
def _take_positives(p, q, d_ii, e_o, rows, cols, row_ok, j0, d_vec, ds_row, BN: tl.constexpr):
    """The tile's diagonal out of p and q (zeroed) into d_vec (+= dX_ii for the rows whose
    diagonal column is in this tile) and ds_row (+= e_o, their share of d scale)."""
    has = row_ok & (rows >= j0) & (rows < j0 + BN)
    d_vec += tl.where(has, d_ii, 0.0)
    ds_row += tl.where(has, e_o, 0.0)
    on = rows[:, None] == cols[None, :]
    return tl.where(on, 0.0, p), tl.where(on, 0.0, q), d_vec, ds_row


@triton.jit
def _fwd_step(a_blk, b_ptr, stride_a, stride_b, r_ld, row0, r, row_ok, o_a, off_b_ptr, col_part_ptr,
              stride_cp, pid_m, col_start, gid_a, gid_b_ptr, j0, hi, K, s2, m_i, l_i,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
              HAS_OFF: tl.constexpr, DIAG: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr,
              HAS_GID: tl.constexpr):
    """One column tile of the forward: updates (m_i, l_i) of the rows, stores the tile's
    column partials. DIAG: the tile may cross the diagonal, whose dot products are the
    offsets (the positives' <A_i, B_i>): their shifted logits are set to 0 (with the FMA
    shift of 16-bit inputs s2 o - fl(s2 o) would leave a rounding residue: b = 1 must give
    exactly 0)."""
    cn, col_ok, c_ld, b_blk = col_tile(j0, hi, b_ptr, stride_b, BN)
    # -- compute tile --: base-2 logits of (BM rows) x (BN columns), less the offsets.
    dot = dot_stream(a_blk, b_blk, r_ld, c_ld, K, stride_a, stride_b, BM, BN, BK, EVEN_K, PREC, DOT_F32)
    o_b = _load_vec(off_b_ptr, j0 + c_ld, HAS_OFF, BN)
    if HAS_GID:  # duplicates leave both directions (a row of a tile may lose all its entries): one
        # select on the dot products (-inf shifts and scales to -inf), the compare consumed at once
        dot = tl.where(_group_drop(gid_a, tl.load(gid_b_ptr + j0 + c_ld)), float("-inf"), dot)
    xr, xc = _shifted(dot, o_a, o_b, s2, HAS_OFF)
    if DIAG:  # the positives' dot products are the offsets: x_ii - s o_i = 0, exactly (any HAS_OFF);
        # after the group drop, which also hit i == j (their ids are equal)
        on = (row0 + r)[:, None] == (j0 + cn)[None, :]
        xr = tl.where(on, 0.0, xr)
        xc = tl.where(on, 0.0, xc)
    # Row direction: online max / rescaled sum, kept in registers.
    xr = tl.where(col_ok[None, :], xr, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(xr, 1))
    m_use = m_new
    if HAS_GID:  # an all -inf row so far: any finite base gives l = 0 (exp2(-inf - -inf) would be NaN)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    l_i = l_i * tl.exp2(m_i - m_use) + tl.sum(tl.exp2(xr - m_use[:, None]), 1)
    # Column direction: this tile's LSE over the program's BM rows.
    xc = tl.where(row_ok[:, None], xc, float("-inf"))
    cm = tl.max(xc, 0)
    if HAS_GID:
        cm = tl.where(cm == float("-inf"), 0.0, cm)  # an all-dropped column: its partial is log2(0) = -inf
    cl = tl.sum(tl.exp2(xc - cm[None, :]), 0)
    tl.store(col_part_ptr + pid_m * stride_cp + (j0 - col_start) + cn, (cm + tl.log2(cl)) * LN2, mask=col_ok)
    return m_new, l_i


@triton.jit
def _lse_fwd_kernel(a_ptr, b_ptr, scale_ptr, off_a_ptr, off_b_ptr, row_part_ptr, col_part_ptr,
                    M, N, K, stride_a, stride_b, col_start, col_stop, cols_per_split,
                    stride_cp, gid_a_ptr, gid_b_ptr, band_ptr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    EVEN_K: tl.constexpr, HAS_OFF: tl.constexpr, HAS_DIAG: tl.constexpr,
                    PREC: tl.constexpr, DOT_F32: tl.constexpr, WS: tl.constexpr = False,
                    HAS_GID: tl.constexpr = False, BAND: tl.constexpr = False):
    """row_part[pid_s, rows] and col_part[pid_m, cols - col_start]: partial LSEs (natural),
    relative to s * offsets when HAS_OFF. The column tiles crossing the diagonal (HAS_DIAG)
    run in a loop of their own, between the tiles before and after them. WS: ask the
    compiler to warp-specialize the column loops (a variant timed by bench_loss_kernels).
    BAND (with HAS_GID and HAS_DIAG; ids sorted by group): the group compare runs only in
    the tiles within w = band_ptr[0] of the diagonal (``_in_band``), split off as the
    diagonal tiles are: plain | band (with DIAG) | plain, three loops, none branching."""
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    s2 = tl.load(scale_ptr).to(tl.float32) * LOG2E
    row0, r, row_ok, r_ld, a_blk = row_block(pid_m, M, a_ptr, stride_a, BM)
    o_a = _load_vec(off_a_ptr, row0 + r_ld, HAS_OFF, BM)
    gid_a = _load_ids(gid_a_ptr, row0 + r_ld, HAS_GID, BM)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    lo = col_start + pid_s * cols_per_split
    hi = tl.minimum(lo + cols_per_split, col_stop)
    d_lo = hi  # [d_lo, d_hi): the tiles (starting at lo + k BN) that cross rows [row0, row0 + BM)
    d_hi = hi
    if HAS_DIAG:
        d_lo = tl.minimum(lo + (tl.maximum(row0 - lo, 0) // BN) * BN, hi)
        d_hi = tl.maximum(tl.minimum(lo + tl.cdiv(tl.maximum(row0 + BM - lo, 0), BN) * BN, hi), d_lo)
    args = (a_blk, b_ptr, stride_a, stride_b, r_ld, row0, r, row_ok, o_a, off_b_ptr, col_part_ptr, stride_cp,
            pid_m, col_start, gid_a, gid_b_ptr)
    if BAND:  # three loops, as without: plain | band (DIAG + compare) | plain
        w = tl.load(band_ptr)  # the tiles of [lo, hi) within w of rows [row0, row0 + BM): d_lo / d_hi's rule
        b_lo = tl.minimum(lo + (tl.maximum(row0 - w - lo, 0) // BN) * BN, d_lo)
        b_hi = tl.maximum(tl.minimum(lo + tl.cdiv(tl.maximum(row0 + BM + w - lo, 0), BN) * BN, hi), d_hi)
        for j0 in tl.range(lo, b_lo, BN, warp_specialize=WS):  # before the band: no same-group pair
            m_i, l_i = _fwd_step(*args, j0, hi, K, s2, m_i, l_i, BM, BN, BK, EVEN_K, HAS_OFF, False, PREC, DOT_F32,
                                 False)
        for j0 in range(b_lo, b_hi, BN):  # DIAG's i == j select changes nothing off the diagonal
            m_i, l_i = _fwd_step(*args, j0, hi, K, s2, m_i, l_i, BM, BN, BK, EVEN_K, HAS_OFF, True, PREC, DOT_F32,
                                 True)
        for j0 in tl.range(b_hi, hi, BN, warp_specialize=WS):  # after it (a row left empty so far: exp2(-inf) = 0)
            m_i, l_i = _fwd_step(*args, j0, hi, K, s2, m_i, l_i, BM, BN, BK, EVEN_K, HAS_OFF, False, PREC, DOT_F32,
                                 False)
    else:
        for j0 in tl.range(lo, d_lo, BN, warp_specialize=WS):
            m_i, l_i = _fwd_step(*args, j0, hi, K, s2, m_i, l_i, BM, BN, BK, EVEN_K, HAS_OFF, False, PREC, DOT_F32,
                                 HAS_GID)
        if HAS_DIAG:
            for j0 in range(d_lo, d_hi, BN):
                m_i, l_i = _fwd_step(*args, j0, hi, K, s2, m_i, l_i, BM, BN, BK, EVEN_K, HAS_OFF, True, PREC,
                                     DOT_F32, HAS_GID)
            for j0 in tl.range(d_hi, hi, BN, warp_specialize=WS):
                m_i, l_i = _fwd_step(*args, j0, hi, K, s2, m_i, l_i, BM, BN, BK, EVEN_K, HAS_OFF, False, PREC,
                                     DOT_F32, HAS_GID)
    tl.store(row_part_ptr + pid_s * M + row0 + r, (m_i + tl.log2(l_i)) * LN2, mask=row_ok)


@triton.jit
def _dx_tile(dot, o_a, o_b, s2, lse_a, lse_b, g_a, g_b, ok, HAS_OFF: tl.constexpr, PEAK: tl.constexpr):
    """(p, q, peak) of one tile, zero where not ``ok``: p = dX (fp32) without the positives'
    -1; q = g_a P (x - s o_a) + g_b Q (x - s o_b) (base 2), whose sum / s2 is the tile's share
    of d scale; with PEAK the tile's largest log2 P or Q (the gradient filter's criterion).

    d scale = sum_ij dX_ij <A_i, B_j> is summed as sum_ij q_ij / s2 (+ sum_i (g_a + g_b -
    g_d)_i o_i, added by the caller): that drops o_i g_a_i sum_j (P_ij - [i = j]), which is 0
    because each softmax row sums to 1, and so does not depend on the backward recomputing
    the forward's dot products bit for bit (on the GPU it need not: other tile shapes may sum
    K in another order). The positives add nothing: x_ii - s o_i = 0."""
    xr, xc = _shifted(dot, o_a, o_b, s2, HAS_OFF)
    ur = xr - lse_a[:, None]
    uc = xc - lse_b[None, :]
    pr = g_a[:, None] * tl.exp2(ur)
    pc = g_b[None, :] * tl.exp2(uc)
    peak = float("-inf")
    if PEAK:
        peak = tl.max(tl.max(tl.where(ok, tl.maximum(ur, uc), float("-inf")), 1), 0)
    return tl.where(ok, pr + pc, 0.0), tl.where(ok, pr * xr + pc * xc, 0.0), peak


@triton.jit
def _near_diag(row0, j0, BM: tl.constexpr, BN: tl.constexpr):
    """Whether the tile (rows row0.., columns j0..) crosses the diagonal i == j."""
    return (j0 < row0 + BM) & (j0 + BN > row0)


@triton.jit
def _grad_kernel(a_ptr, b_ptr, scale_ptr, gnorm_ptr, lse_a_ptr, lse_b_ptr, off_a_ptr, off_b_ptr,
                 g_a_ptr, g_b_ptr, g_d_ptr, out_ptr, ds_ptr, kept_ptr, log2_thr,
                 M, N, K, stride_a, stride_b, stride_o, gid_a_ptr, gid_b_ptr, band_ptr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DC: tl.constexpr,
                 EVEN_K: tl.constexpr, RESIDENT: tl.constexpr, ACCUM: tl.constexpr,
                 COMPUTE_DS: tl.constexpr, HAS_OFF: tl.constexpr, HAS_DIAG: tl.constexpr,
                 FILTER: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr, HAS_GID: tl.constexpr = False,
                 BAND: tl.constexpr = False):
    """out[rows, dcols] (+)= s * sum_j dX_ij B_j[dcols]; ds_part[program] = its share of ds.

    RESIDENT (needs DC >= K, one feature chunk): the (BM, K) block of A stays on chip and
    each (BN, K) tile of B is loaded once for both products. Otherwise the logits are
    streamed over K in BK chunks and the (BN, DC) slice of B is loaded for the update.
    g_a, g_b, g_d are scaled by 1 / gnorm (gnorm_ptr holds [gnorm, 1 / gnorm], gnorm the
    power of two >= max |g|) so that dX is O(1) before its cast to the input dtype (fp16
    would flush tiny gradients to zero); the result is multiplied back. Powers of two make
    both scalings exact: with a rounded 1 / gnorm (or the GPU's approximate division)
    g_a + g_b - g_d of the positives came out ~1e-7 instead of 0, an error that dominated
    d scale once the softmax is peaked (fp32, H200: 2e-5 relative at loss 0.09).
    HAS_DIAG (square block pair): the positives folded into dX (module docs).
    FILTER (gradient filtering, after Cut Cross-Entropy; ``infclip.loss.filtering`` states
    the rule and its error bound): a tile whose P and Q entries are all below 2^log2_thr
    skips its update product (half of the kernel's FLOPs); its ds share is still summed.
    The positives never drop (they are applied in fp32 at the end). kept[program] counts
    the tiles updated.
    BAND (ids sorted by group): the group compare only in tiles within w = band_ptr[0] of the
    diagonal (``_in_band``), one scalar branch per tile.
    """
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    s = tl.load(scale_ptr).to(tl.float32)
    s2 = s * LOG2E
    gn = tl.load(gnorm_ptr).to(tl.float32)
    inv_gn = tl.load(gnorm_ptr + 1).to(tl.float32)
    row0, r, row_ok, r_ld, a_blk = row_block(pid_m, M, a_ptr, stride_a, BM)
    lse_a = tl.load(lse_a_ptr + row0 + r_ld).to(tl.float32) * LOG2E
    g_a = tl.where(row_ok, tl.load(g_a_ptr + row0 + r_ld).to(tl.float32) * inv_gn, 0.0)
    o_a = _load_vec(off_a_ptr, row0 + r_ld, HAS_OFF, BM)
    gid_a = _load_ids(gid_a_ptr, row0 + r_ld, HAS_GID, BM)
    w = 0
    if BAND:
        w = tl.load(band_ptr)
    d = pid_c * DC + tl.arange(0, DC)
    d_ok = d < K
    acc = tl.zeros((BM, DC), dtype=tl.float32)
    ds_row = tl.zeros((BM,), dtype=tl.float32)
    d_vec = tl.zeros((BM,), dtype=tl.float32)  # dX_ii (HAS_DIAG), applied in fp32 at the end
    d_ii = d_vec
    e_o = d_vec  # (g_a + g_b - g_d)_i o_i s2: the positives' share of d scale (0 for CLIP)
    if HAS_DIAG:
        g_d = tl.load(g_d_ptr + row0 + r_ld).to(tl.float32) * inv_gn
        d_ii = _positive_dx(lse_a, g_a, g_d, lse_b_ptr, g_b_ptr, row0 + r_ld, inv_gn)
        g_bd = tl.load(g_b_ptr + row0 + r_ld).to(tl.float32) * inv_gn
        e_o = ((g_a + g_bd) - g_d) * o_a * s2
    kept = 0
    if RESIDENT:
        a_res = tl.load(a_blk + r_ld[:, None] * stride_a + d[None, :], mask=d_ok[None, :], other=0.0)
        if DOT_F32:
            a_res = a_res.to(tl.float32)
    for j0 in range(0, N, BN):
        cn, col_ok, c_ld, b_blk = col_tile(j0, N, b_ptr, stride_b, BN)
        # -- compute tile --: recompute the dot products, then dX (scaled by 1/gnorm).
        if RESIDENT:
            t = tl.load(b_blk + c_ld[:, None] * stride_b + d[None, :], mask=d_ok[None, :], other=0.0)
            if DOT_F32:
                t = t.to(tl.float32)
            dot = tl.dot(a_res, tl.trans(t), input_precision=PREC)
        else:
            dot = dot_stream(a_blk, b_blk, r_ld, c_ld, K, stride_a, stride_b,
                             BM, BN, BK, EVEN_K, PREC, DOT_F32)
        lse_b = tl.load(lse_b_ptr + j0 + c_ld).to(tl.float32) * LOG2E
        g_b = tl.load(g_b_ptr + j0 + c_ld).to(tl.float32) * inv_gn
        o_b = _load_vec(off_b_ptr, j0 + c_ld, HAS_OFF, BN)
        ok = row_ok[:, None] & col_ok[None, :]
        ok = _keep_negatives(ok, gid_a, gid_b_ptr, c_ld, row0, j0, w, BM, BN, HAS_GID, BAND)
        p, q, peak = _dx_tile(dot, o_a, o_b, s2, lse_a, lse_b, g_a, g_b, ok, HAS_OFF, FILTER)
        if HAS_DIAG:
            if _near_diag(row0, j0, BM, BN):
                p, q, d_vec, ds_row = _take_positives(p, q, d_ii, e_o, row0 + r, j0 + cn, row_ok, j0, d_vec,
                                                      ds_row, BN)
        if COMPUTE_DS:  # from the fp32 dX, before its rounding (see _dx_tile)
            ds_row += tl.sum(q, 1)
        keep = True
        if FILTER:
            keep = peak >= log2_thr
        if keep:
            kept += 1
            if RESIDENT:  # B's tile is on chip already: reuse it for the update
                acc = tl.dot(to_16(p, b_ptr.dtype.element_ty).to(t.dtype), t, acc, input_precision=PREC)
            else:
                acc = update_rows(acc, p, b_blk, c_ld, d, d_ok, stride_b, PREC, DOT_F32)
    if COMPUTE_DS:  # sum_ij dX_ij <A_i, B_j> = (gnorm / s2) * sum_ij q_ij (see _dx_tile)
        ds = tl.sum(ds_row, 0) * (gn / s2)
        ds = tl.where(pid_c == 0, ds, 0.0)  # every feature chunk saw all logits: count once
        tl.store(ds_ptr + pid_m * tl.num_programs(1) + pid_c, ds)
    if FILTER:
        tl.store(kept_ptr + pid_m * tl.num_programs(1) + pid_c, kept)
    res = acc * (gn * s)
    if HAS_DIAG:  # + s dX_ii B_i in fp32 (square pair: B row i pairs with A row i)
        b_i = tl.load(b_ptr + row0.to(tl.int64) * stride_b + r_ld[:, None] * stride_b + d[None, :],
                      mask=d_ok[None, :], other=0.0).to(tl.float32)
        res += (d_vec * (gn * s))[:, None] * b_i
    store_rows(out_ptr, res, row0, r, row_ok, d, d_ok, stride_o, ACCUM)


@triton.jit
def _dx_strip_kernel(a_ptr, b_ptr, scale_ptr, lse_a_ptr, lse_b_ptr, off_a_ptr, off_b_ptr, g_a_ptr, g_b_ptr,
                     g_d_ptr, p_ptr, ds_ptr, dv_ptr, R, row_start, N, K, stride_a, stride_b, stride_p,
                     gid_a_ptr, gid_b_ptr, band_ptr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                     EVEN_K: tl.constexpr, HAS_OFF: tl.constexpr, HAS_DIAG: tl.constexpr,
                     PREC: tl.constexpr, DOT_F32: tl.constexpr, FOLD: tl.constexpr = False,
                     HAS_GID: tl.constexpr = False, BAND: tl.constexpr = False):
    """P[i, j] = s * dX[row_start + i, j] for a strip of R rows, in the input dtype.

    The strip path of the backward: a GEMM-shaped kernel (any BM, no register accumulator
    over the feature dim) writes s * dX for R rows into a bounded scratch; cuBLAS then
    forms dA[strip] = P @ B. Programs are ordered in groups of GROUP row tiles so that
    column tiles of B are reused from L2. ds_part[program] = its share of
    sum dX_ij <A_i, B_j>, from the fp32 values (positives folded in). HAS_DIAG: the
    positives' s * dX_ii go to dv[i] (fp32) instead of P, for the host to add s dX_ii B_i
    in fp32 to the product before its rounding; with FOLD they stay in P instead: the
    folded fp32 value rounded once to P's dtype, as vanilla autograd rounds its
    (softmax - one-hot) before the product (exact in fp32; in bf16 one rounding of the
    small folded value, no fp32 (R, c) product and fixup passes on the host).
    """
    pid = tl.program_id(0)
    r0, r, row_ok, r_ld, a_blk, j0, cn, col_ok, c_ld, b_blk = strip_tile(
        pid, R, row_start, N, a_ptr, b_ptr, stride_a, stride_b, BM, BN, GROUP)
    s = tl.load(scale_ptr).to(tl.float32)
    w = 0
    if BAND:
        w = tl.load(band_ptr)
    # -- compute tile --: base-2 logits, then s * dX.
    dot = dot_stream(a_blk, b_blk, r_ld, c_ld, K, stride_a, stride_b, BM, BN, BK, EVEN_K, PREC, DOT_F32)
    ds = _strip_epilogue(dot, s, r0, r, row_ok, r_ld, j0, cn, col_ok, c_ld, row_start, lse_a_ptr, lse_b_ptr,
                         off_a_ptr, off_b_ptr, g_a_ptr, g_b_ptr, g_d_ptr, p_ptr, dv_ptr, stride_p,
                         gid_a_ptr, gid_b_ptr, w, BM, BN, HAS_OFF, HAS_DIAG, FOLD, HAS_GID, BAND)
    tl.store(ds_ptr + pid, ds)


@triton.jit
def _strip_epilogue(dot, s, r0, r, row_ok, r_ld, j0, cn, col_ok, c_ld, row_start, lse_a_ptr, lse_b_ptr,
                    off_a_ptr, off_b_ptr, g_a_ptr, g_b_ptr, g_d_ptr, p_ptr, dv_ptr, stride_p,
                    gid_a_ptr, gid_b_ptr, w, BM: tl.constexpr, BN: tl.constexpr, HAS_OFF: tl.constexpr,
                    HAS_DIAG: tl.constexpr, FOLD: tl.constexpr, HAS_GID: tl.constexpr, BAND: tl.constexpr):
    """The strip kernels' tile epilogue: stores P = s dX of the tile (and dv, see
    ``_dx_strip_kernel``); returns the tile's share of d scale. BAND: the group ids are loaded
    and compared only in tiles within w of the diagonal (``_in_band``: one uniform scalar
    branch per tile)."""
    s2 = s * LOG2E
    row0 = row_start + r0
    lse_a = tl.load(lse_a_ptr + row0 + r_ld).to(tl.float32) * LOG2E
    g_a = tl.load(g_a_ptr + row0 + r_ld).to(tl.float32)
    o_a = _load_vec(off_a_ptr, row0 + r_ld, HAS_OFF, BM)
    lse_b = tl.load(lse_b_ptr + j0 + c_ld).to(tl.float32) * LOG2E
    g_b = tl.load(g_b_ptr + j0 + c_ld).to(tl.float32)
    o_b = _load_vec(off_b_ptr, j0 + c_ld, HAS_OFF, BN)
    ok = row_ok[:, None] & col_ok[None, :]
    # duplicates are not negatives: dX = 0 there (the store still writes those zeros); i == j is
    # dropped too and put back below (_take_positives, FOLD)
    neg = ok
    if HAS_GID:
        if BAND:
            if _in_band(row0, j0, w, BM, BN):
                neg = ok & ~_group_drop(tl.load(gid_a_ptr + row0 + r_ld), tl.load(gid_b_ptr + j0 + c_ld))
        else:
            neg = ok & ~_group_drop(tl.load(gid_a_ptr + row0 + r_ld), tl.load(gid_b_ptr + j0 + c_ld))
    p, q, _ = _dx_tile(dot, o_a, o_b, s2, lse_a, lse_b, g_a, g_b, neg, HAS_OFF, False)
    ds_row = tl.zeros((BM,), dtype=tl.float32)
    if HAS_DIAG:
        if _near_diag(row0, j0, BM, BN):
            g_d = tl.load(g_d_ptr + row0 + r_ld).to(tl.float32)
            d_ii = _positive_dx(lse_a, g_a, g_d, lse_b_ptr, g_b_ptr, row0 + r_ld, 1.0)
            g_bd = tl.load(g_b_ptr + row0 + r_ld).to(tl.float32)
            e_o = ((g_a + g_bd) - g_d) * o_a * s2
            d_vec = tl.zeros((BM,), dtype=tl.float32)
            p, q, d_vec, ds_row = _take_positives(p, q, d_ii, e_o, row0 + r, j0 + cn, row_ok, j0, d_vec, ds_row, BN)
            if FOLD:
                p = tl.where((row0 + r)[:, None] == (j0 + cn)[None, :], d_ii[:, None], p)
            else:
                has = row_ok & (row0 + r >= j0) & (row0 + r < j0 + BN)  # each row's diagonal is in one tile
                tl.store(dv_ptr + r0 + r, d_vec * s, mask=has)
    store_strip(p_ptr, p * s, r0, r, cn, j0, ok, stride_p)
    return tl.sum(tl.sum(q, 1) + ds_row, 0) / s2


@triton.jit
def _dx_strip_tma_kernel(a_ptr, b_ptr, scale_ptr, lse_a_ptr, lse_b_ptr, off_a_ptr, off_b_ptr, g_a_ptr, g_b_ptr,
                         g_d_ptr, p_ptr, ds_ptr, dv_ptr, R, row_start, M, N, K, stride_a, stride_b, stride_p,
                         gid_a_ptr, gid_b_ptr, band_ptr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                         NUM_PROGS: tl.constexpr, HAS_OFF: tl.constexpr, HAS_DIAG: tl.constexpr,
                         FOLD: tl.constexpr, WS: tl.constexpr, PREC: tl.constexpr, DOT_F32: tl.constexpr,
                         HAS_GID: tl.constexpr = False, BAND: tl.constexpr = False):
    """``_dx_strip_kernel`` as a persistent kernel with TMA loads (tensor descriptors over
    the whole of A (M, K) and B (N, K): rows/columns past the end read as zeros and are
    masked as usual): NUM_PROGS programs stride over the strip's tiles in the same grouped
    order; WS asks the compiler to warp-specialize the tile loop (producer warps issuing
    the loads, consumers running the MMAs and the epilogue). ds_part[program] sums its
    tiles' shares. 16-bit inputs only (tensor-core dtypes; K * 2 bytes a multiple of 16)."""
    pid = tl.program_id(0)
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_a, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_b, 1], block_shape=[BN, BK])
    s = tl.load(scale_ptr).to(tl.float32)
    w = 0
    if BAND:
        w = tl.load(band_ptr)
    n_tiles = tl.cdiv(R, BM) * tl.cdiv(N, BN)
    ds = tl.zeros((1,), dtype=tl.float32)
    for tile in tl.range(pid, n_tiles, NUM_PROGS, flatten=True, warp_specialize=WS):
        r0, r, row_ok, r_ld, j0, cn, col_ok, c_ld = strip_coords(tile, R, N, BM, BN, GROUP)
        # -- compute tile --: base-2 logits via TMA loads, then s * dX.
        acc = tma_dot(a_desc, b_desc, row_start + r0, j0, K, BM, BN, BK, PREC, DOT_F32)
        ds += _strip_epilogue(acc, s, r0, r, row_ok, r_ld, j0, cn, col_ok, c_ld, row_start, lse_a_ptr, lse_b_ptr,
                              off_a_ptr, off_b_ptr, g_a_ptr, g_b_ptr, g_d_ptr, p_ptr, dv_ptr, stride_p,
                              gid_a_ptr, gid_b_ptr, w, BM, BN, HAS_OFF, HAS_DIAG, FOLD, HAS_GID, BAND)
    tl.store(ds_ptr + pid + tl.arange(0, 1), ds)
