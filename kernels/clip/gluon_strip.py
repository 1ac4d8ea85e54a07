"""Hopper (sm_90) strip fill of the CLIP backward in Gluon: warp-specialized, ping-pong consumers.

Writes what ``launch._fill_tma`` writes for its common case -- P = s * dX[row_start:row_start + R]
(R, N) into a 16-bit scratch, and the strip's d scale partials -- for 16-bit A (M, K) and B
(N, K), the offsets' one-FMA shift (HAS_OFF == 2), optionally the positives (HAS_DIAG, folded
into P: FOLD), and group ids only in the band case (BAND: duplicates "mask" on one process,
the batch sorted by group, see below). Written against triton 3.6's Gluon API
(``triton.experimental.gluon``, as ``gluon_fwd``); importing this module never fails (no GPU,
no Gluon: the kernel is simply not available, see ``gluon_strip_available``).

Why: the persistent Triton kernel (``kernels._dx_strip_tma_kernel``) runs each tile's exp2
epilogue and P store after the tile's MMAs, so the tensor cores idle through them (~270
TFLOP/s on an H200 at K = 512). Here two consumer warpgroups take alternate tiles and
ping-pong (FA3's scheme, as ``gluon_fwd``): one's epilogue runs while the other's wgmmas do.

Design (one persistent program per SM, tiles t = pid, pid + P, pid + 2P, ... of the strip's
cdiv(R, BM) x cdiv(N, BN) tiles in ``tiles.grouped_tile`` order, GROUP row tiles per group):
  * Both operands stream (the tiles are GEMM-shaped): ring slot i holds one (BM, BK) chunk of
    A and one (BN, BK) chunk of B, filled together (one ``ready`` barrier, both byte counts).
    Chunk g = local_tile * NK + k (NK = K / BK) goes to slot g % STAGES, phase (g // STAGES) & 1.
  * Partitions (``gl.warp_specialize``): a 1-warp producer issues every TMA load, the chunks of
    the program's tiles in order, each after its slot's ``empty`` barrier; consumer 0 (the
    default partition, 4 warps) takes the program's even local tiles, consumer 1 (a 4-warp
    worker) the odd ones. A consumer's tile: wait for its turn, issue the NK async wgmmas
    (a slot is released once the wgmma after it retires), hand the turn to the other consumer
    (once the last is issued: ``gluon_common.mma_turn``), wait for the last, then run the
    epilogue while the other consumer's wgmmas run.
  * Turn-taking (``turn`` barriers) runs the MMA phases strictly in tile order: the ping-pong,
    and what makes one shared FIFO ring sound (a ``ready`` wait never meets a barrier two
    phases behind; ``gluon_fwd``'s argument, unchanged).
  * Epilogue (registers, per consumer; ``kernels._strip_epilogue`` with HAS_OFF == 2, FOLD,
    written out in the same fp32 operations and order): xr = s2 dot - s2 o_a, xc = s2 dot -
    s2 o_b (s2 = s log2 e); pr = g_a 2^(xr - lse_a), pc = g_b 2^(xc - lse_b) (base-2 LSEs);
    p = pr + pc, q = pr xr + pc xc; entries past R / N set to 0 on the edge tiles only (a
    uniform runtime branch); on the tiles that cross the diagonal (HAS_DIAG) q_ii = 0, p_ii =
    the folded fp32 dX_ii (``_positive_dx``) and the positives' e_o = (g_a + g_b - g_d) o_a s2
    join the row sums. P = (p * s) rounded once to the input dtype, staged in shared memory
    (one (BM, BN) buffer per consumer) and written by a TMA store (``tma.async_copy_shared_to_
    global``; the scratch descriptor covers scratch[:R, :N], so rows / columns past the strip
    are clipped by the TMA unit); the buffer's previous store is waited for (``tma.store_wait``)
    only when the next tile's P is ready to go in.
  * Band (BAND; ``kernels._strip_epilogue`` with HAS_GID and BAND): int32 group ids of a batch
    sorted by group and w (a (1,) device tensor, every same-group pair within w of the
    diagonal). A tile within w of the diagonal (``kernels._in_band``'s test, one uniform branch
    per tile) loads its rows' and columns' ids and zeroes p and q where they match, before the
    positives' fold puts i == j back; any other tile loads and compares nothing. BAND off: the
    id pointers are None and the kernel compiles to the PTX of before (checked, sm_90a).
  * d scale: each consumer sums sum_j q_ij (+ e_o) per row slot over its tiles in fp32 and
    stores sum / s2 once, at ``ds_part[pid + C * P]`` -- the index of its first tile -- and only
    if it had a tile. So the slots written are exactly [0, min(tiles, 2 P)), all below the
    strip's tile count: ``launch.grad_rows_strips``' ``per = cdiv(rows, BM) * cdiv(n, BN)``
    slots per strip (the Gluon config's BM / BN) cover them, and unwritten slots stay the zeros
    that buffer starts with. (The Triton kernel sums per tile and per program in another
    order: ds agrees to fp32 rounding. P should agree bit for bit: the same m64 wgmmas over
    the same BK chunks in K order, and the same fp32 operations, which LLVM contracts alike
    in both kernels -- e.g. x - lse log2 e as one FMA -- per their sm_90a PTX under triton 3.6.)

Cost of independent tiles: each consumer streams its own A and B chunks, 24 KB of L2 -> shared
memory traffic per 64 x 128 x 64 step, 1.5x the bytes per FLOP of the Triton kernel's 128 x 128
tiles (whose two warpgroups share each B chunk). Sharing chunks between ping-ponging consumers
would need a tile's whole K extent resident (else the ring deadlocks, see ``gluon_fwd``); if the
H200 shows this kernel L2-bound, the next step is ``gluon_fwd``'s layout: a resident A row
block per program and only B streamed.

Invariants / shapes: a (M, K), b (N, K) contiguous 16-bit of one dtype with TMA-able rows
(``launching.tma_ok``), K a multiple of BK = 64; scratch (rows >= R, N) contiguous of a's dtype
with N * 2 bytes a multiple of 16 (its TMA store descriptor); lse_a, g_a, off_a (M,), lse_b,
g_b, off_b (N,), g_d (M,) fp32 contiguous (lse base e, relative to s * off); scale a 0-d CUDA
tensor (read on the device). HAS_DIAG needs M == N (rows are global indices row_start + i,
columns j, the positives at i == j). Shared memory: STAGES x (BM + BN) x BK x 2 bytes of ring
+ 2 x BM x BN x 2 of P staging + ``SMEM_RESERVE`` within ``SMEM_BYTES``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ..launching import cdiv, sm_count

from . import gluon_common as gc
from .gluon_common import (GLUON_ERROR, LN2, LOG2E, MAX_STAGES, SMEM_BYTES, SMEM_RESERVE, TensorDescriptor,
                           compile_info, fence_async_shared, flops, gl, gluon, jit, mbarrier, mma_turn, tma,
                           turn_barriers)

MIN_STAGES = 3  # fewer chunks in flight than this leave the wgmmas waiting on TMA


@dataclass(frozen=True)
class GluonStripConfig:
    """One consumer's P tile: BM rows x BN columns (a 4-warp warpgroup; its fp32 accumulator
    BM * BN / 128 registers a thread), K in BK = 64 chunks through a ring of ``stages`` (A, B)
    chunk pairs (0: as many as fit ``SMEM_BYTES``). GROUP: row tiles per L2 group of the tile
    order (``grouped_tile``; 16 x 64 = 8 x 128 = 1024 rows, the Triton kernel's 8 x 128).
    regs: the consumer worker's register budget (setmaxnreg); maxnreg: the kernel's cap (the
    default partition gets what 12 warps x maxnreg leave), as ``gluon_fwd.GluonFwdConfig``."""

    BM: int = 64
    BN: int = 128
    GROUP: int = 16
    stages: int = 0
    regs: int = 240
    maxnreg: int = 168
    # Duck-typed beside ``launch.StripConfig`` (what grad_rows_strips reads): not fields.
    BK: ClassVar[int] = gc.BK  # K chunk: 128 bytes of 16-bit inputs, the widest TMA swizzle
    tma: ClassVar[bool] = True
    fast_off: ClassVar[bool] = True  # HAS_OFF == 2 only

    def __post_init__(self):
        if self.BM not in (64, 128):
            raise ValueError(f"GluonStripConfig.BM must be 64 or 128 (m64 wgmmas, 4 warps), got {self.BM}")
        if self.BN not in (64, 128):
            raise ValueError(f"GluonStripConfig.BN must be 64 or 128 (one wgmma's N), got {self.BN}")
        if self.BM * self.BN > 8192:  # triton 3.6, sm_90a: 128 x 128 spills ~3.6 KB a thread at 240 registers
            raise ValueError(f"GluonStripConfig: BM * BN <= 8192 (a 64-register accumulator a thread; larger "
                             f"tiles spill), got {self.BM} x {self.BN}")
        if self.GROUP < 1 or self.stages < 0:
            raise ValueError(f"GluonStripConfig: GROUP >= 1 and stages >= 0 needed, got {self.GROUP}, {self.stages}")
        if self.regs % 8 or not 24 <= self.regs <= 256 or self.maxnreg % 8 or not 24 <= self.maxnreg <= 256:
            raise ValueError(f"GluonStripConfig.regs / maxnreg: multiples of 8 in [24, 256], got "
                             f"{self.regs}, {self.maxnreg}")


def smem_bytes(cfg: GluonStripConfig, stages: int, esize: int = 2) -> int:
    """Shared memory of the kernel's buffers: the (A, B) chunk ring + two P staging tiles (+ reserve)."""
    return (stages * (cfg.BM + cfg.BN) * cfg.BK + 2 * cfg.BM * cfg.BN) * esize + SMEM_RESERVE


def pick_stages(cfg: GluonStripConfig, esize: int = 2) -> int:
    """Ring depth: ``cfg.stages`` if it fits, else the most chunk pairs that fit beside the P
    staging (capped at MAX_STAGES); 0 if fewer than 2 fit (the kernel does not apply)."""
    if cfg.stages:
        return cfg.stages if smem_bytes(cfg, cfg.stages, esize) <= SMEM_BYTES else 0
    free = SMEM_BYTES - SMEM_RESERVE - 2 * cfg.BM * cfg.BN * esize
    stages = min(MAX_STAGES, free // ((cfg.BM + cfg.BN) * cfg.BK * esize))
    return stages if stages >= 2 else 0


def default_config(k: int) -> GluonStripConfig:
    """BM 64 x BN 128: m64n128 wgmmas (96 B/clk of shared memory per warpgroup, within Hopper's
    128), a 64-register accumulator, 7 ring stages."""
    return GluonStripConfig()


def tune_candidates(k: int, esize: int = 2) -> list[GluonStripConfig]:
    """The configs a strip tuner would time beside ``launch.strip_candidates`` (those that fit):
    64 x 128 (the default) and 128 x 64 (fewer column-vector registers: 4 rows x 16 columns a
    thread instead of 2 x 32). H200, ``scripts/tools/check_gluon_strip.py`` (commit 4221a99): on
    4,096-row strips 64 x 128 was the faster at c = 768 / 1024, 128 x 64 at c = 512, and
    the tuner picked each somewhere. The feature dim does not change the shared memory (the
    ring holds K chunks), only the chunks per tile."""
    if k % GluonStripConfig.BK:
        return []
    cands = [GluonStripConfig(BM=64, BN=128, GROUP=16), GluonStripConfig(BM=128, BN=64, GROUP=8)]
    return [c for c in cands if pick_stages(c, esize) >= MIN_STAGES]


def strip_tiles(r: int, n: int, cfg: GluonStripConfig) -> int:
    """Tiles of a strip of r rows x n columns."""
    return cdiv(r, cfg.BM) * cdiv(n, cfg.BN)


def strip_programs(tiles: int, sms: int) -> int:
    """Persistent programs: one per SM (~210 KB of shared memory each), at most one per tile."""
    return max(1, min(tiles, sms))


def ds_slots(tiles: int, programs: int) -> int:
    """ds partial slots a fill writes: [0, this) (consumer C of program p writes slot p + C * P
    iff it had a tile, i.e. p + C * P < tiles). Always <= tiles, the slots
    ``grad_rows_strips`` reserves per strip."""
    return min(tiles, 2 * programs)


def gluon_strip_available(a: Tensor, b: Tensor, cfg: GluonStripConfig | None = None) -> bool:
    """Whether ``fill_strip_gluon`` applies to (a, b): ``gluon_common.sm90_16bit`` (sm_90,
    Gluon, 16-bit, TMA-able rows, K a multiple of 64), N * 2 bytes a multiple of 16 (the
    scratch's rows: its TMA store) and a ring of >= 2 stages fitting."""
    cfg = cfg or default_config(a.shape[1])
    return gc.sm90_16bit(a, b) and (b.shape[0] * 2) % 16 == 0 and pick_stages(cfg, a.element_size()) > 0


# -- kernel ------------------------------------------------------------------------------------

@jit
def _tile_origin(tile, n_m, n_n, BM: gl.constexpr, BN: gl.constexpr, GROUP: gl.constexpr):
    """(r0, j0): strip-relative first row and first column of tile ``tile`` in
    ``tiles.grouped_tile`` order (groups of GROUP row tiles)."""
    per_group = GROUP * n_n
    first_m = (tile // per_group) * GROUP
    group_m = gl.minimum(n_m - first_m, GROUP)
    pid_m = first_m + (tile % per_group) % group_m
    pid_n = (tile % per_group) // group_m
    return pid_m * BM, pid_n * BN


@jit
def _producer(a_desc, b_desc, a_smem, b_smem, ready, empty, row_start, n_m, n_n, n_tiles,
              NK: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr):
    """1 warp: the (A, B) chunk pairs of the program's tiles, in ring order (chunk g into slot
    g % STAGES once the slot is released)."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BKC: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    g = 0
    for tile in range(pid, n_tiles, nprog):
        r0, j0 = _tile_origin(tile, n_m, n_n, BM, BN, GROUP)
        for k in range(NK):
            slot = g % STAGES
            # A fresh barrier counts as having completed phase 1: round 0 passes at once.
            mbarrier.wait(empty.index(slot), ((g // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [row_start + r0, k * BKC], ready.index(slot), a_smem.index(slot))
            tma.async_copy_global_to_shared(b_desc, [j0, k * BKC], ready.index(slot), b_smem.index(slot))
            g += 1


@jit
def _expm1(u):
    """exp(u) - 1 without cancellation near 0: ``kernels._expm1``, term for term."""
    series = u * (1.0 + u * (0.5 + u * (1.0 / 6 + u * (1.0 / 24 + u * (1.0 / 120 + u * (
        1.0 / 720 + u * (1.0 / 5040 + u * (1.0 / 40320))))))))
    return gl.where(gl.abs(u) < 0.25, series, gl.exp(u) - 1.0)


@jit
def _positives(p, q, lse_a, g_a, rows, cols, row_ok, j0, idx, off_a_ptr, lse_b_ptr, g_b_ptr, g_d_ptr, s2,
               BN: gl.constexpr):
    """(p, q, ds_row) of a tile that crosses the diagonal (``kernels._strip_epilogue`` with
    HAS_DIAG and FOLD): p_ii = the folded fp32 dX_ii (``kernels._positive_dx``, g_mul = 1),
    q_ii = 0, ds_row = e_o = (g_a + g_b - g_d) o_a s2 on the rows whose diagonal is in the
    tile (``_take_positives``). idx: the rows' clamped global indices (loads)."""
    g_d = gl.load(g_d_ptr + idx)
    lse_bd = gl.load(lse_b_ptr + idx) * LOG2E
    g_bd = gl.load(g_b_ptr + idx)
    d_ii = g_a * _expm1(-lse_a * LN2) + g_bd * _expm1(-lse_bd * LN2) + (
        (g_a + g_bd) - g_d)
    e_o = ((g_a + g_bd) - g_d) * gl.load(off_a_ptr + idx) * s2
    has = row_ok & (rows >= j0) & (rows < j0 + BN)
    ds_row = gl.where(has, e_o, 0.0)
    on = rows[:, None] == cols[None, :]
    return gl.where(on, d_ii[:, None], p), gl.where(on, 0.0, q), ds_row


@jit
def _same_group(gid_a_ptr, gid_b_ptr, r_idx, cols, N):
    """(BM, BN) bool: the tile's entries whose row and column share a group id
    (``kernels._group_drop``), the ids loaded here: the rows' at their clamped indices, the
    columns' by a masked load (past N: never stored), whose addresses stay one base plus
    constant offsets (clamped ones take a register pair each: at 64 x 128 the band tiles'
    epilogue then spilled 580 bytes, none this way; triton 3.6, sm_90a)."""
    gid_b = gl.load(gid_b_ptr + cols, mask=cols < N, other=0)
    return gl.load(gid_a_ptr + r_idx)[:, None] == gid_b[None, :]


@jit
def _consumer(a_smem, b_smem, p_smem, ready, empty, turn, p_desc, scale_ptr, lse_a_ptr, lse_b_ptr, off_a_ptr,
              off_b_ptr, g_a_ptr, g_b_ptr, g_d_ptr, ds_ptr, R, row_start, N, n_m, n_n, n_tiles, gid_a_ptr,
              gid_b_ptr, band_ptr, C: gl.constexpr, NK: gl.constexpr, STAGES: gl.constexpr, BM: gl.constexpr,
              BN: gl.constexpr, GROUP: gl.constexpr, HAS_DIAG: gl.constexpr, BAND: gl.constexpr):
    """One warpgroup: the program's local tiles C, C + 2, ... (module docs)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    s = gl.load(scale_ptr).to(gl.float32)
    s2 = s * LOG2E
    rr = gl.arange(0, BM, layout=row_l)
    cn = gl.arange(0, BN, layout=col_l)
    ds_acc = gl.zeros([BM], gl.float32, layout=row_l)
    acc = gl.zeros([BM, BN], gl.float32, layout=mma)
    if BAND:
        w = gl.load(band_ptr)
    n_my = gl.cdiv(n_tiles - pid, nprog)
    for t in range(C, n_my, 2):
        r0, j0 = _tile_origin(pid + t * nprog, n_m, n_n, BM, BN, GROUP)
        row0 = row_start + r0
        r_idx = row0 + gl.minimum(rr, R - 1 - r0)  # clamped for loads; masked below
        c_idx = j0 + gl.minimum(cn, N - 1 - j0)
        # The tile's vectors, issued before the MMAs: their latency hides behind the turn wait.
        lse_a = gl.load(lse_a_ptr + r_idx) * LOG2E
        g_a = gl.load(g_a_ptr + r_idx)
        oa2 = gl.load(off_a_ptr + r_idx) * s2
        lse_b = gl.load(lse_b_ptr + c_idx) * LOG2E
        g_b = gl.load(g_b_ptr + c_idx)
        ob2 = gl.load(off_b_ptr + c_idx) * s2
        # -- compute tile --: wait for the turn (local tile t - 1's wgmmas issued), then NK chunks.
        acc = mma_turn(a_smem, b_smem, ready, empty, turn, acc, t, C, NK, STAGES, True)
        # -- epilogue --: ``_strip_epilogue`` (HAS_OFF == 2): base-2 logits less the offsets, s dX.
        xr = acc * s2 - oa2[:, None]
        xc = acc * s2 - ob2[None, :]
        pr = g_a[:, None] * gl.exp2(xr - lse_a[:, None])
        pc = g_b[None, :] * gl.exp2(xc - lse_b[None, :])
        p = pr + pc
        q = pr * xr + pc * xc
        if (r0 + BM > R) | (j0 + BN > N):  # edge tile: entries past the strip / the columns are 0
            ok = (r0 + rr < R)[:, None] & (j0 + cn < N)[None, :]
            p = gl.where(ok, p, 0.0)
            q = gl.where(ok, q, 0.0)
        if BAND:  # duplicates are not negatives: dX = 0 where the ids match, compared only in the tiles
            # within w of the diagonal (``kernels._in_band``; i == j too, put back just below)
            if (j0 < row0 + BM + w) & (j0 + BN > row0 - w):
                drop = _same_group(gid_a_ptr, gid_b_ptr, r_idx, j0 + cn, N)
                p = gl.where(drop, 0.0, p)
                q = gl.where(drop, 0.0, q)
        if HAS_DIAG:
            if (j0 < row0 + BM) & (j0 + BN > row0):  # the tile crosses the diagonal i == j
                p, q, ds_row = _positives(p, q, lse_a, g_a, row0 + rr, j0 + cn, r0 + rr < R, j0, r_idx, off_a_ptr,
                                          lse_b_ptr, g_b_ptr, g_d_ptr, s2, BN)
                ds_acc += ds_row
        ds_acc += gl.sum(q, 1)
        p16 = (p * s).to(p_desc.dtype)
        tma.store_wait(pendings=0)  # this consumer's previous P store has left the buffer
        p_smem.store(p16)
        fence_async_shared()
        tma.async_copy_shared_to_global(p_desc, [r0, j0], p_smem)
    tma.store_wait(pendings=0)
    if n_my > C:  # the slot of this consumer's first tile (ds_slots); none without a tile
        gl.store(ds_ptr + pid + C * nprog, gl.sum(ds_acc, 0) / s2)


@jit
def _dx_strip_ws_kernel(a_desc, b_desc, p_desc, scale_ptr, lse_a_ptr, lse_b_ptr, off_a_ptr, off_b_ptr, g_a_ptr,
                        g_b_ptr, g_d_ptr, ds_ptr, R, row_start, N, gid_a_ptr, gid_b_ptr, band_ptr,
                        K: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr, HAS_DIAG: gl.constexpr,
                        REGS: gl.constexpr, BAND: gl.constexpr = False):
    """P[i, j] = s dX[row_start + i, j] for the strip's tiles pid, pid + P, ...; ds_part slots
    of this program's consumers (module docs). BAND: int32 group ids (rows gid_a, global
    indices, columns gid_b) of a batch sorted by group and w = band_ptr[0]; the tiles within
    w of the diagonal zero same-group entries (module docs). Without it the three pointers
    are None (the kernel of before)."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BKC: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    NK: gl.constexpr = K // BKC
    n_m = gl.cdiv(R, BM)
    n_n = gl.cdiv(N, BN)
    n_tiles = n_m * n_n

    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BKC], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BKC], b_desc.layout)
    p_smem = gl.allocate_shared_memory(p_desc.dtype, [2, BM, BN], p_desc.layout)
    ready, empty, turn = turn_barriers(STAGES)
    fence_async_shared()  # the inits visible to the TMA unit and the other partitions

    # Argument tuples written out whole (as gluon_fwd: tuple arithmetic would turn the
    # constexprs into plain ints, which a worker partition's arguments reject).
    gl.warp_specialize([
        (_consumer, (a_smem, b_smem, p_smem.index(0), ready, empty, turn, p_desc, scale_ptr, lse_a_ptr, lse_b_ptr,
                     off_a_ptr, off_b_ptr, g_a_ptr, g_b_ptr, g_d_ptr, ds_ptr, R, row_start, N, n_m, n_n, n_tiles,
                     gid_a_ptr, gid_b_ptr, band_ptr, gl.constexpr(0), NK, STAGES, BM, BN, GROUP, HAS_DIAG, BAND)),
        (_consumer, (a_smem, b_smem, p_smem.index(1), ready, empty, turn, p_desc, scale_ptr, lse_a_ptr, lse_b_ptr,
                     off_a_ptr, off_b_ptr, g_a_ptr, g_b_ptr, g_d_ptr, ds_ptr, R, row_start, N, n_m, n_n, n_tiles,
                     gid_a_ptr, gid_b_ptr, band_ptr, gl.constexpr(1), NK, STAGES, BM, BN, GROUP, HAS_DIAG, BAND)),
        (_producer, (a_desc, b_desc, a_smem, b_smem, ready, empty, row_start, n_m, n_n, n_tiles, NK, STAGES,
                     GROUP)),
    ], [4, 1], [REGS, 24])


# -- host --------------------------------------------------------------------------------------

def _descriptors(a: Tensor, b: Tensor, p: Tensor, cfg: GluonStripConfig):
    dt = gl.bfloat16 if a.dtype == torch.bfloat16 else gl.float16
    a_layout = gl.NVMMASharedLayout.get_default_for([cfg.BM, cfg.BK], dt)
    b_layout = gl.NVMMASharedLayout.get_default_for([cfg.BN, cfg.BK], dt)
    p_layout = gl.NVMMASharedLayout.get_default_for([cfg.BM, cfg.BN], dt)
    return (TensorDescriptor.from_tensor(a, [cfg.BM, cfg.BK], a_layout),
            TensorDescriptor.from_tensor(b, [cfg.BN, cfg.BK], b_layout),
            TensorDescriptor.from_tensor(p, [cfg.BM, cfg.BN], p_layout))


def fill_strip_gluon(a, b, scale, lse_a, lse_b, o_a, o_b, g_a, g_b, gd, scratch, ds_part, d_vec, r, r0, cfg, prec,
                     fold, flags, tiles=None, gid_a=None, gid_b=None, band=None) -> None:
    """``launch._fill_tma``'s effects for its common case, by the Gluon kernel: scratch[:r] =
    s dX[r0:r0 + r] (a's dtype), ds_part[:ds_slots(tiles, programs)] = the strip's d scale
    partials (the rest untouched: ``grad_rows_strips`` zeroes its buffer). Same arguments as
    ``_fill_tma`` (band: ``launch._band``'s tensor, or None); it applies where
    ``gluon_strip_available(a, b, cfg)``, flags["HAS_OFF"] == 2, group ids only with the band
    (int32, the sorted batch: ``gluon_common.band_args``; flags["HAS_GID"] says whether they
    are given), and the positives (flags["HAS_DIAG"], square a, b) folded (``fold``). d_vec
    and prec are unused (folded positives; 16-bit inputs always run bf16/fp16 wgmmas); tiles,
    when given, must be the strip's tile count for cfg's BM x BN (the caller sized ds_part by
    it); cfg None: ``default_config``."""
    if cfg is None:
        cfg = default_config(a.shape[1])
    if not isinstance(cfg, GluonStripConfig):  # its BM x BN sized the caller's ds slots: no silent swap
        raise TypeError(f"fill_strip_gluon needs a GluonStripConfig (or None: the default), got {cfg!r}")
    if not gluon_strip_available(a, b, cfg):
        raise ValueError(f"the Gluon strip fill does not apply here ({GLUON_ERROR or 'see gluon_strip_available'})")
    has_diag = bool(flags.get("HAS_DIAG", False))
    if flags.get("HAS_OFF") != 2 or bool(flags.get("HAS_GID")) != (gid_a is not None):
        raise ValueError(f"the Gluon strip fill needs HAS_OFF == 2 and HAS_GID as the ids given, got {flags}")
    if has_diag and (not fold or a.shape[0] != b.shape[0]):
        raise ValueError("the Gluon strip fill applies the positives folded (fold=True), on a square pair only")
    bnd = gc.band_args(gid_a, gid_b, band, a.shape[0], b.shape[0], has_diag)
    n = b.shape[0]
    want = strip_tiles(r, n, cfg)
    if tiles is not None and tiles != want:
        raise ValueError(f"tiles = {tiles}, but a {r} x {n} strip has {want} tiles of {cfg.BM} x {cfg.BN}")
    if scratch.dtype != a.dtype or scratch.shape[1] != n or not scratch.is_contiguous() or scratch.shape[0] < r:
        raise ValueError(f"scratch must be contiguous {a.dtype} (>= {r}, {n}), got {scratch.dtype} "
                         f"{tuple(scratch.shape)}")
    if r0 < 0 or r0 + r > a.shape[0]:
        raise ValueError(f"the strip [{r0}, {r0 + r}) lies outside a's {a.shape[0]} rows")
    if r == 0 or n == 0:
        return
    progs = strip_programs(want, sm_count(a.device))
    if ds_part.dtype != torch.float32 or ds_part.numel() < ds_slots(want, progs):
        raise ValueError(f"ds_part must be fp32 with >= {ds_slots(want, progs)} slots, got {ds_part.dtype} "
                         f"{ds_part.numel()}")
    vecs = [v.float().contiguous() for v in (lse_a, lse_b, o_a, o_b, g_a, g_b)]
    g_d = gd.float().contiguous() if has_diag else vecs[4]  # (never read without HAS_DIAG)
    a_desc, b_desc, p_desc = _descriptors(a, b, scratch[:r], cfg)
    _dx_strip_ws_kernel[(progs,)](
        a_desc, b_desc, p_desc, scale, *vecs, g_d, ds_part, r, r0, n, bnd["gid_a_ptr"], bnd["gid_b_ptr"],
        bnd["band_ptr"], K=a.shape[1], STAGES=pick_stages(cfg, a.element_size()), GROUP=cfg.GROUP,
        HAS_DIAG=has_diag, REGS=cfg.regs, BAND=bnd["BAND"], num_warps=4, maxnreg=cfg.maxnreg,
    )


__all__ = ["gluon", "GLUON_ERROR", "GluonStripConfig", "gluon_strip_available", "fill_strip_gluon", "tune_candidates", "default_config",
           "pick_stages", "smem_bytes", "strip_tiles", "strip_programs", "ds_slots", "compile_info", "flops"]
