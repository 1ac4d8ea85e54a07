"""Hopper (sm_90) forward of the CLIP LSEs in Gluon: warp-specialized, ping-pong consumers.

Computes what ``launch.lse_forward`` computes for its fast case -- 16-bit A (M, K) and B
(N, K), the offsets' one-FMA shift (HAS_OFF == 2), optionally the positives' diagonal
(HAS_DIAG), group ids only in the band case (BAND, below) -- and returns the same final
(row_lse (M,), col_lse (N,)) fp32, natural log, relative to s * offsets. Written against triton 3.6's Gluon API
(``triton.experimental.gluon``); importing this module never fails (no GPU, no Gluon: the
kernel is simply not available, see ``gluon_available``).

Why not the Triton kernel's structure: the Triton forward (``kernels._lse_fwd_kernel``)
runs each tile's exp2 epilogue after its MMAs, so the tensor cores idle during it. The
FlashAttention-3 cure inside one warpgroup (issue tile j+1's wgmma, run tile j's epilogue,
then wait) needs the whole B tile of j+1 in shared memory while its wgmma is in flight:
BN x K x 2 bytes = 128 KB for BN = 128, K = 512 (256 KB at K = 1024), which with a resident
A block and a prefetch ring does not fit Hopper's 227 KB. Here the overlap comes from two
consumer warpgroups instead (FA3's ping-pong), which need only a K-chunk ring:

Design (one program = BM rows x one column range, as the Triton kernel's (pid_m, pid_s)):
  * A[row0:row0 + BM, :] is loaded once by TMA into shared memory, as NK = K / BK chunks
    (BM, BK) (resident for the whole column range: only B is streamed, BM flop per byte).
  * B streams through one FIFO ring of STAGES (BN, BK) chunks; chunk g = t * NK + k is
    tile t's k-th K chunk, in slot g % STAGES, barrier phase (g // STAGES) & 1.
  * Partitions (``gl.warp_specialize``): a 1-warp producer issues every TMA load (A once,
    then the chunks of tiles 0, 1, 2, ... in order, each after the slot's ``empty``
    barrier); consumer 0 (the default partition, 4 warps) takes the even column tiles,
    consumer 1 (a 4-warp worker) the odd ones. A consumer's tile: wait for its turn,
    issue the NK async wgmmas (slot released as soon as the wgmma after it retires), hand
    the turn to the other consumer (once the last is issued: ``gluon_common.mma_turn``),
    wait for the last, then run the tile's epilogue while the other consumer's wgmmas run
    on the tensor cores.
  * Turn-taking (``turn`` barriers) makes the MMA phases run strictly in tile order. This is
    the ping-pong and also what makes one shared FIFO sound: the consumer of tile t waits
    on chunks that follow, in ring order, every chunk the previous tile's consumer has
    already seen filled, so a ``ready`` wait never meets a barrier two phases behind.
  * Epilogue (registers, per consumer): xr = s2 dot - s2 o_a, xc = s2 dot - s2 o_b
    (s2 = s log2 e, one FMA each, as ``kernels._shifted`` HAS_OFF == 2); the diagonal
    entries set to exactly 0 on the tiles that cross it; invalid rows / columns -inf on
    the edge tiles only (a uniform runtime branch). Row direction: online (max, sum) per
    row over the consumer's tiles; column direction: the tile's LSE over the BM rows,
    stored to ``col_part[pid_m, col - col_start]``.
  * Band (BAND, with HAS_DIAG; ``kernels._lse_fwd_kernel`` with HAS_GID and BAND): int32 group
    ids of a batch sorted by group and w (a (1,) device tensor: every same-group pair has
    |i - j| <= w). A tile within w of the diagonal (``kernels._in_band``'s test, one uniform
    branch per tile) loads its columns' ids and sets the dot products of same-group entries to
    -inf (both directions; i == j put back to 0 by the diagonal fix after it), with the
    guards of ``kernels._fwd_step`` for a row or column whose entries so far are all dropped;
    any other tile loads and compares nothing. The Triton kernel splits its column loop
    instead (no runtime branch in a Triton loop); here a uniform branch per tile is what the
    edge / diagonal fixes use already. BAND off: the id pointers are None and the kernel
    compiles to the PTX of before (checked, sm_90a).
  * Fixed reference (FIXED, with HAS_DIAG; on wherever ``fixed_flag`` holds, a device flag
    read once per program, no host sync): the exp2 of each entry is taken against the
    constant FIXED_REF (base-2 units above the offsets) instead of a running max, so each
    direction costs one FMA, one exp2 and one add per entry: no row or column max, no
    rescaling of the row sums, no cross-warp column max (only its sum). Exact where the flag
    holds: every entry is then at most FIXED_LIMIT, so no term exceeds 2^100 (no sum of
    <= 2^22 terms overflows), and every row or column sum holds its positive (x_ii = 0:
    2^-FIXED_REF), so the terms the exp2 flushes to zero (< 2^-126 each) are < 2^-32 of that
    sum together. A partial over tiles without the diagonal may flush to -inf: the host's
    logsumexp with the diagonal tile's partial makes that the same negligible error. Where
    the flag is off (s (1.016 - o_i) > 119 for some positive o_i of unit features: at s = 100
    a positive's cosine below about -0.17) the running max as before. H200, forward alone,
    b = 65,536: 1.13x / 1.12x / 1.16x at c = 512 / 768 / 1024 over the running max
    (``scripts/tools/check_gluon_fwd.py``, commit 1853948).
  * Partials: ``row_part[2 * pid_s + consumer, rows]`` (each consumer saw half the tiles:
    twice the Triton path's row splits) and ``col_part[pid_m, cols]``; the host merges them
    with ``torch.logsumexp`` exactly as ``lse_forward`` does, column chunks bounding
    ``col_part`` to ``PART_BUDGET_BYTES``.

Invariants / shapes: a, b contiguous 16-bit (bf16 or fp16, the same), rows 16-byte aligned
(TMA), K a multiple of BK = 64 with the resident A block and >= 2 ring stages fitting
``SMEM_BYTES`` (K <= 1024 at BM = 64); off_a (M,), off_b (N,) fp32; scale a 0-d CUDA
tensor (read on the device). Rows of A past M and of B past N are zero-filled by TMA and
masked out of every reduction and store. Both LSE directions are computed in base 2 from
the same fp32 accumulator (K summed in BK chunks in order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..launching import cdiv, column_splits

from . import gluon_common as gc
from .gluon_common import (GLUON_ERROR, LN2, LOG2E, MAX_STAGES, SMEM_BYTES, SMEM_RESERVE, TensorDescriptor,
                           compile_info, fence_async_shared, flops, gl, gluon, jit, mbarrier, mma_turn, tma,
                           turn_barriers)

PART_BUDGET_BYTES = 32 << 20  # as launch.PART_BUDGET_BYTES: col_part stays <= 32 MB per launch
# The fixed-reference epilogue (module docs): every entry's exp2 is taken against the constant
# FIXED_REF (base-2 units above the offset) instead of a running max. Used where every entry is
# provably at most FIXED_LIMIT (``fixed_flag``): no sum can overflow (2^100 x 2^22 entries), and
# every row / column sum holds its positive, 2^-FIXED_REF, so the entries that flush to zero
# (< 2^-126 each) are < 2^-32 of it together.
FIXED_REF_BITS = 72.0
FIXED_REF = gl.constexpr(FIXED_REF_BITS) if gl is not None else FIXED_REF_BITS
FIXED_LIMIT = 172.0
FIXED_MAX_TERMS = 1 << 22  # the terms one sum may hold (rows or columns): the bound's premise
FIXED_DEFAULT = "auto"  # "auto": where ``fixed_flag`` holds; "off": always the running max


@dataclass(frozen=True)
class GluonFwdConfig:
    """Tile of one consumer: BM rows (A resident) x BN columns, K in BK chunks through a ring
    of ``stages`` B chunks (0: as many as fit ``SMEM_BYTES``); 4 warps per consumer; regs:
    the consumer worker's register budget (setmaxnreg; the default partition gets the rest
    of ``maxnreg`` x 12 warps)."""

    BM: int = 64
    BN: int = 128
    BK: int = 64
    stages: int = 0
    regs: int = 240
    maxnreg: int = 168


def smem_bytes(cfg: GluonFwdConfig, k: int, stages: int, esize: int = 2) -> int:
    """Shared memory of the kernel's buffers: resident A block + the B ring (+ reserve)."""
    return (cfg.BM * k + stages * cfg.BN * cfg.BK) * esize + SMEM_RESERVE


def pick_stages(cfg: GluonFwdConfig, k: int, esize: int = 2) -> int:
    """Ring depth: ``cfg.stages`` if set, else the most B chunks that fit beside the resident A
    block (capped at MAX_STAGES); 0 if fewer than 2 fit (the kernel does not apply)."""
    if cfg.stages:
        return cfg.stages if smem_bytes(cfg, k, cfg.stages, esize) <= SMEM_BYTES else 0
    free = SMEM_BYTES - SMEM_RESERVE - cfg.BM * k * esize
    stages = min(MAX_STAGES, free // (cfg.BN * cfg.BK * esize))
    return stages if stages >= 2 else 0


def default_config(k: int) -> GluonFwdConfig:
    """BM = 64 rows keep A resident up to K = 1024; BN = 128: m64n128 wgmmas."""
    return GluonFwdConfig()


def tune_candidates(k: int, esize: int = 2) -> list[GluonFwdConfig]:
    """The configs the forward's tuner times (``ops.TritonTileOps``), those that fit K.

    H200, bf16, forward alone (``scripts/tools/check_gluon_fwd.py``): BM 128 x BN 64 (10 stages at
    K = 512) 1.24-1.28x the Triton forward at c = 512, b = 8k-64k; at K = 768 it keeps only
    2 stages (0.70x) and does not fit at K = 1024, where BM 64 x BN 128 is 1.03-1.12x."""
    cands = [GluonFwdConfig(BM=128, BN=64), GluonFwdConfig(BM=64, BN=128)]
    return [c for c in cands if pick_stages(c, k, esize) >= 3]


def column_chunks(m: int, n: int, bm: int, bn: int, budget: int = PART_BUDGET_BYTES) -> list[tuple[int, int]]:
    """[(c0, c1)]: the launches' column ranges, each a multiple of bn columns (but the last)
    with its fp32 col_part (cdiv(m, bm), c1 - c0) within ``budget`` bytes (``lse_forward``'s rule)."""
    nrb = cdiv(m, bm)
    chunk = max(bn, budget // (4 * nrb) // bn * bn)
    return [(c0, min(c0 + chunk, n)) for c0 in range(0, n, chunk)]


def gluon_available(a: Tensor, b: Tensor, cfg: GluonFwdConfig | None = None) -> bool:
    """Whether ``lse_forward_gluon`` applies: ``gluon_common.sm90_16bit`` (sm_90, Gluon, 16-bit,
    TMA-able rows, K a multiple of BK) and the A block with a ring of >= 2 stages fitting
    shared memory."""
    cfg = cfg or default_config(a.shape[1])
    return gc.sm90_16bit(a, b) and pick_stages(cfg, a.shape[1]) > 0


# -- kernel ------------------------------------------------------------------------------------

@jit
def _producer(a_desc, b_desc, a_smem, b_smem, a_bar, ready, empty, row0, lo, n_tiles,
              NK: gl.constexpr, STAGES: gl.constexpr):
    """1 warp: TMA loads of the resident A block, then every B chunk of the column range in
    ring order (chunk g = t * NK + k into slot g % STAGES once the slot is released)."""
    BN: gl.constexpr = b_desc.block_type.shape[0]
    BK: gl.constexpr = b_desc.block_type.shape[1]
    mbarrier.expect(a_bar, NK * a_desc.block_type.nbytes)
    for k in gl.static_range(NK):
        tma.async_copy_global_to_shared(a_desc, [row0, k * BK], a_bar, a_smem.index(k))
    for g in range(n_tiles * NK):
        slot = g % STAGES
        # A fresh barrier counts as having completed phase 1: round 0 passes at once.
        mbarrier.wait(empty.index(slot), ((g // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(b_desc, [lo + (g // NK) * BN, (g % NK) * BK], ready.index(slot),
                                        b_smem.index(slot))


@jit
def _consumer(a_smem, b_smem, a_bar, ready, empty, turn, scale_ptr, off_a_ptr, off_b_ptr, row_part_ptr,
              col_part_ptr, M, pid_m, pid_s, row0, lo, hi, n_tiles, col_start, stride_cp, gid_a_ptr, gid_b_ptr,
              band_ptr, fixed_ptr, C: gl.constexpr, NK: gl.constexpr, STAGES: gl.constexpr, BM: gl.constexpr,
              BN: gl.constexpr, HAS_DIAG: gl.constexpr, BAND: gl.constexpr, FIXED: gl.constexpr):
    """One warpgroup: the column tiles t = C, C + 2, ... of the range (module docs). FIXED:
    fixed_ptr[0] != 0 selects the fixed-reference epilogue for the whole program (module docs)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    s2 = gl.load(scale_ptr).to(gl.float32) * LOG2E
    rows = row0 + gl.arange(0, BM, layout=row_l)
    row_ok = rows < M
    oa2 = gl.load(off_a_ptr + gl.minimum(rows, M - 1)) * s2
    cn = gl.arange(0, BN, layout=col_l)
    fixed = False
    if FIXED:
        fixed = gl.load(fixed_ptr) != 0
    # The running row max; under ``fixed`` the constant reference FIXED_REF for every tile.
    m_i = gl.full([BM], float("-inf"), gl.float32, layout=row_l)
    if fixed:
        m_i = gl.full([BM], FIXED_REF, gl.float32, layout=row_l)
    l_i = gl.zeros([BM], gl.float32, layout=row_l)
    acc = gl.zeros([BM, BN], gl.float32, layout=mma)
    if BAND:  # the rows' group ids and w, once (the columns' ids: in the band's tiles only)
        gid_a = gl.load(gid_a_ptr + gl.minimum(rows, M - 1))
        w = gl.load(band_ptr)
    mbarrier.wait(a_bar, 0)
    for t in range(C, n_tiles, 2):
        j0 = lo + t * BN
        cols = j0 + cn
        ob2 = gl.load(off_b_ptr + gl.minimum(cols, hi - 1)) * s2  # issued before the MMA: latency hidden
        # -- compute tile --: wait for the turn (tile t - 1's wgmmas issued), then the NK chunks.
        acc = mma_turn(a_smem, b_smem, ready, empty, turn, acc, t, C, NK, STAGES, False)
        # -- epilogue --: base-2 logits less the offsets; fixes only on the edge / diagonal tiles.
        edge = (j0 + BN > hi) | (row0 + BM > M)
        diag = False
        if HAS_DIAG:
            diag = (j0 < row0 + BM) & (j0 + BN > row0)
        band = False
        if BAND:  # a tile within w of the diagonal: duplicates leave both directions (-inf dot products,
            # which shift and scale to -inf: ``kernels._fwd_step``'s select), before _fix puts i == j back
            band = (j0 < row0 + BM + w) & (j0 + BN > row0 - w)  # ``kernels._in_band``
            if band:
                acc = gl.where(_same_group(gid_a, gid_b_ptr, cols, hi), float("-inf"), acc)
        if fixed:  # one FMA and one exp2 per entry and direction: no max, no rescale (module docs)
            xr = acc * s2 - (oa2 + FIXED_REF)[:, None]
            if edge | diag:
                xr = _fix(xr, rows, cols, cols < hi, 1, HAS_DIAG, -FIXED_REF)
            l_i = l_i + gl.sum(gl.exp2(xr), 1)
            xc = acc * s2 - (ob2 + FIXED_REF)[None, :]
            if edge | diag:
                xc = _fix(xc, rows, cols, row_ok, 0, HAS_DIAG, -FIXED_REF)
            cpart = FIXED_REF + gl.log2(gl.sum(gl.exp2(xc), 0))
        else:
            xr = acc * s2 - oa2[:, None]
            if edge | diag:
                xr = _fix(xr, rows, cols, cols < hi, 1, HAS_DIAG)
            m_new = gl.maximum(m_i, gl.max(xr, 1))
            m_use = m_new
            if band:  # a row with no entry yet (all dropped): any finite base gives l = 0, not NaN
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * gl.exp2(m_i - m_use) + gl.sum(gl.exp2(xr - m_use[:, None]), 1)
            m_i = m_new
            xc = acc * s2 - ob2[None, :]
            if edge | diag:
                xc = _fix(xc, rows, cols, row_ok, 0, HAS_DIAG)
            cm = gl.max(xc, 0)
            if band:  # an all-dropped column: its partial is log2(0) = -inf
                cm = gl.where(cm == float("-inf"), 0.0, cm)
            cpart = cm + gl.log2(gl.sum(gl.exp2(xc - cm[None, :]), 0))
        gl.store(col_part_ptr + pid_m * stride_cp + (cols - col_start), cpart * LN2, mask=cols < hi)
    # A consumer without tiles stores -inf (m = -inf, l = 0): nothing, for the host's logsumexp.
    gl.store(row_part_ptr + (2 * pid_s + C) * M + rows, (m_i + gl.log2(l_i)) * LN2, mask=row_ok)


@jit
def _same_group(gid_a, gid_b_ptr, cols, hi):
    """(BM, BN) bool: the tile's entries whose row and column share a group id
    (``kernels._group_drop``; i == j too, put back by ``_fix``); the columns' ids loaded here
    by a masked load (past hi: -inf by ``_fix``), whose addresses stay one base plus constant
    offsets (clamped ones take a register pair each: ``gluon_strip._same_group``)."""
    gid_b = gl.load(gid_b_ptr + cols, mask=cols < hi, other=0)
    return gid_a[:, None] == gid_b[None, :]


@jit
def _fix(x, rows, cols, ok, AXIS: gl.constexpr, HAS_DIAG: gl.constexpr, diag_value=0.0):
    """x with the diagonal entries (rows == cols) set to ``diag_value`` (HAS_DIAG: the
    positives' dot products are the offsets, so x_ii - s o_i = 0 exactly; less the reference
    under the fixed-reference epilogue) and the entries outside ``ok`` (columns when AXIS = 1,
    rows when AXIS = 0) set to -inf."""
    if HAS_DIAG:
        x = gl.where(rows[:, None] == cols[None, :], diag_value, x)
    if AXIS == 1:
        x = gl.where(ok[None, :], x, float("-inf"))
    else:
        x = gl.where(ok[:, None], x, float("-inf"))
    return x


@jit
def _lse_fwd_ws_kernel(a_desc, b_desc, scale_ptr, off_a_ptr, off_b_ptr, row_part_ptr, col_part_ptr,
                       M, col_start, col_stop, cols_per_split, stride_cp, gid_a_ptr, gid_b_ptr, band_ptr,
                       fixed_ptr, K: gl.constexpr, STAGES: gl.constexpr, HAS_DIAG: gl.constexpr, REGS: gl.constexpr,
                       BAND: gl.constexpr = False, FIXED: gl.constexpr = False):
    """row_part[2 pid_s + c, rows], col_part[pid_m, cols - col_start]: partial LSEs (natural,
    relative to s * offsets) of rows pid_m * BM.. over the columns of split pid_s (module docs).
    BAND: int32 group ids (rows gid_a, columns gid_b) of a batch sorted by group and w =
    band_ptr[0]; the tiles within w of the diagonal drop same-group entries (module docs).
    Without it the three pointers are None (the kernel of before). FIXED (with HAS_DIAG): the
    fixed-reference epilogue wherever fixed_ptr[0] != 0 (module docs); off: fixed_ptr None."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    NK: gl.constexpr = K // BK
    pid_m = gl.program_id(0)
    pid_s = gl.program_id(1)
    row0 = pid_m * BM
    lo = col_start + pid_s * cols_per_split
    hi = gl.minimum(lo + cols_per_split, col_stop)
    n_tiles = gl.cdiv(hi - lo, BN)

    a_smem = gl.allocate_shared_memory(a_desc.dtype, [NK, BM, BK], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    a_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(a_bar, count=1)
    ready, empty, turn = turn_barriers(STAGES)
    fence_async_shared()  # the inits visible to the TMA unit and the other partitions

    # Argument tuples written out whole: tuple arithmetic in a Gluon function would turn the
    # constexprs into plain ints, which a worker partition's arguments reject.
    gl.warp_specialize([
        (_consumer, (a_smem, b_smem, a_bar, ready, empty, turn, scale_ptr, off_a_ptr, off_b_ptr, row_part_ptr,
                     col_part_ptr, M, pid_m, pid_s, row0, lo, hi, n_tiles, col_start, stride_cp, gid_a_ptr,
                     gid_b_ptr, band_ptr, fixed_ptr, gl.constexpr(0), NK, STAGES, BM, BN, HAS_DIAG, BAND, FIXED)),
        (_consumer, (a_smem, b_smem, a_bar, ready, empty, turn, scale_ptr, off_a_ptr, off_b_ptr, row_part_ptr,
                     col_part_ptr, M, pid_m, pid_s, row0, lo, hi, n_tiles, col_start, stride_cp, gid_a_ptr,
                     gid_b_ptr, band_ptr, fixed_ptr, gl.constexpr(1), NK, STAGES, BM, BN, HAS_DIAG, BAND, FIXED)),
        (_producer, (a_desc, b_desc, a_smem, b_smem, a_bar, ready, empty, row0, lo, n_tiles, NK, STAGES)),
    ], [4, 1], [REGS, 24])


# -- host --------------------------------------------------------------------------------------

def fixed_flag(a: Tensor, b: Tensor, scale: Tensor, off_a: Tensor, off_b: Tensor) -> Tensor:
    """int32 (1,) on the device, no host sync: 1 where the fixed-reference epilogue is exact
    for this square pair, i.e. every base-2 entry s log2(e) (<a_i, b_j> - o) of both
    directions is at most ``FIXED_LIMIT`` (Cauchy-Schwarz: <a_i, b_j> <= |a_i| max |b|, the
    norms rounded up by 2^-7 for their bf16 rounding), and s > 0. With unit features that is
    s (1.016 - o_i) <= 119 for every positive o_i: always at s <= 59, at s = 100 while every
    positive's cosine is above -0.17. Otherwise 0: the running-max epilogue."""
    na = torch.linalg.vector_norm(a, dim=1).float() * (1 + 2 ** -7)  # (fp32 accumulation; no fp32 copy)
    nb = torch.linalg.vector_norm(b, dim=1).float() * (1 + 2 ** -7)
    s2 = scale.float().reshape(()) * math.log2(math.e)
    top = torch.maximum((na * nb.max() - off_a).amax(), (nb * na.max() - off_b).amax())
    return ((s2 > 0) & (s2 * top <= FIXED_LIMIT)).to(torch.int32).reshape(1)


def _descriptors(a: Tensor, b: Tensor, cfg: GluonFwdConfig):
    dt = gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16
    a_layout = gl.NVMMASharedLayout.get_default_for([cfg.BM, cfg.BK], dt)
    b_layout = gl.NVMMASharedLayout.get_default_for([cfg.BN, cfg.BK], dt)
    return (TensorDescriptor.from_tensor(a, [cfg.BM, cfg.BK], a_layout),
            TensorDescriptor.from_tensor(b, [cfg.BN, cfg.BK], b_layout))


def lse_forward_gluon(a: Tensor, b: Tensor, scale: Tensor, off_a: Tensor | None, off_b: Tensor | None,
                      has_diag: bool, cfg: GluonFwdConfig | None = None, alloc=torch.empty,
                      gid_a: Tensor | None = None, gid_b: Tensor | None = None,
                      band: Tensor | None = None, fixed: str | None = None) -> tuple[Tensor, Tensor]:
    """(row_lse (m,), col_lse (n,)) fp32, natural log, relative to s * offsets: the final
    values ``launch.lse_forward(a, b, scale, cfg, prec, off_a=off_a, off_b=off_b,
    diag=has_diag, gid_a=gid_a, gid_b=gid_b, band=band)`` returns for 16-bit inputs (its
    HAS_OFF == 2 path; group ids only with the band: ``gluon_common.band_args``). Offsets None (no
    diagonal then): zeros, which shift nothing (the same logits).
    ``gluon_available(a, b, cfg)`` must hold. alloc: as ``lse_forward`` (poisoned buffers in tests).
    fixed: "auto" (default ``FIXED_DEFAULT``) takes the fixed-reference epilogue with the
    diagonal where ``fixed_flag`` holds (decided on the device), "off" never."""
    m, k = a.shape
    n = b.shape[0]
    cfg = cfg or default_config(k)
    if not gluon_available(a, b, cfg):
        raise ValueError(f"the Gluon forward does not apply here ({GLUON_ERROR or 'see gluon_available'})")
    if has_diag and (m != n or off_a is None):
        raise ValueError(f"has_diag needs a square block pair and the offsets, got {m} x {n}"
                         + ("" if off_a is not None else " without offsets"))
    bnd = gc.band_args(gid_a, gid_b, band, m, n, has_diag)
    stages = pick_stages(cfg, k)
    off_a = torch.zeros(m, device=a.device) if off_a is None else off_a.float().contiguous()
    off_b = torch.zeros(n, device=a.device) if off_b is None else off_b.float().contiguous()
    fixed = FIXED_DEFAULT if fixed is None else fixed
    if fixed not in ("auto", "off"):
        raise ValueError(f"fixed must be 'auto' or 'off', got {fixed!r}")
    use_fixed = fixed == "auto" and bool(has_diag) and max(m, n) <= FIXED_MAX_TERMS
    flag = fixed_flag(a, b, scale, off_a, off_b) if use_fixed else None
    a_desc, b_desc = _descriptors(a, b, cfg)
    nrb = cdiv(m, cfg.BM)
    row_lse, col_lse = None, alloc(n, device=a.device, dtype=torch.float32)
    for c0, c1 in column_chunks(m, n, cfg.BM, cfg.BN):
        length = c1 - c0
        # One 220 KB program per SM: column_splits' 4 programs per SM are ~4 waves here.
        splits, per = column_splits(nrb, length, cfg.BN, a.device)
        row_part = alloc(2 * splits, m, device=a.device, dtype=torch.float32)
        col_part = alloc(nrb, length, device=a.device, dtype=torch.float32)
        _lse_fwd_ws_kernel[(nrb, splits)](
            a_desc, b_desc, scale, off_a, off_b, row_part, col_part, m, c0, c1, per, length, bnd["gid_a_ptr"],
            bnd["gid_b_ptr"], bnd["band_ptr"], flag, K=k, STAGES=stages, HAS_DIAG=bool(has_diag), REGS=cfg.regs,
            BAND=bnd["BAND"], FIXED=use_fixed, num_warps=4, maxnreg=cfg.maxnreg,
        )
        part = torch.logsumexp(row_part, 0)
        row_lse = part if row_lse is None else torch.logaddexp(row_lse, part)
        col_lse[c0:c1] = torch.logsumexp(col_part, 0)
    return row_lse, col_lse


__all__ = ["gluon", "GLUON_ERROR", "GluonFwdConfig", "fixed_flag", "FIXED_LIMIT", "FIXED_REF_BITS", "gluon_available", "tune_candidates", "lse_forward_gluon", "pick_stages", "smem_bytes",
           "column_chunks", "default_config", "compile_info", "flops"]
