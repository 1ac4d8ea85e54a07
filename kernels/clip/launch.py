"""Launch wrappers of the CLIP LSE kernels: block configs, column chunking, tuning.

``lse_forward`` (both LSEs, partial buffers capped at 32 MB), ``grad_rows`` (fused
backward of one direction), ``grad_rows_strips`` (strip backward: s * dX for R rows
into a 48 MB + 768 B x b scratch, then a cuBLAS product) and ``grad_onepass_strips`` (the
one-pass backward: the same fill feeds both directions' products, dB summed in an fp32
accumulator) take plain tensors and explicit configs; ``pick_config``
chooses a config per problem class (feature dim, dtype, precision, size bucket) by timing
the candidates once on the GPU (under ``TRITON_INTERPRET=1`` or with
``INFCLIP_TRITON_TUNE=0`` it takes the first candidate that fits).
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from ..launching import addmm_f32_, cdiv, column_splits, sm_count, strip_backward, tma_ok, tma_programs
from . import gluon_fwd, gluon_strip
from .kernels import _dx_strip_kernel, _dx_strip_tma_kernel, _grad_kernel, _lse_fwd_kernel

PART_BUDGET_BYTES = 32 << 20  # cap on the forward's partial-LSE buffers (fixed, any b)
TUNE_ROWS = 65536  # tuning runs on at most this many rows/columns (same config class)
SMEM_BYTES = 220 << 10  # usable shared memory per block on Hopper, minus slack


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class FwdConfig:
    """Forward tile: BM rows x BN columns, K streamed in BK chunks; ws: warp-specialize the
    column loops; fast_off: 16-bit inputs shift by the offsets with one FMA (``_shifted``)."""

    BM: int
    BN: int
    BK: int
    num_warps: int = 4
    num_stages: int = 3
    ws: bool = False
    fast_off: bool = True


@dataclass(frozen=True)
class BwdConfig:
    """Backward tile: BM rows, BN columns per step, DC feature columns of the accumulator.

    resident: the (BM, K) row block stays on chip (needs DC >= K); else logits stream over K.
    """

    BM: int
    BN: int
    BK: int
    DC: int
    resident: bool
    num_warps: int = 4
    num_stages: int = 3


def _dot_f32(t: Tensor) -> bool:
    """The interpreter's 16-bit tl.dot is wrong (triton 3.8): upcast operands there."""
    return interpreting() and t.element_size() == 2


def _pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(x, 1))))


def fwd_candidates(k: int, esize: int) -> list[FwdConfig]:
    """Forward configs worth timing; the first is the default when not tuning.

    H200, bf16, with the offsets and positives of the CLIP loss (commit cdd7513): c = 512,
    b = 64k: 256x128 BK 32 (4 stages) 15.95 ms (276 TFLOP/s), BK 64 16.9, 128x128 18.9,
    64x128 (4 warps) 17.7; c = 1024, b = 16k: 64x128 1.65 ms, 128x128 1.76, 256x128 1.86-1.95
    (the wide tiles spill 24-150 registers; fewer row blocks mean fewer column partials).
    Earlier sweeps: 128x256, BK=128, 16 warps and the flattened loop were 5-35 % slower;
    256x256 does not compile (registers)."""
    if interpreting():
        return [FwdConfig(32, 32, 32)]
    if esize == 4:  # fp32: half the K chunk keeps the pipelined operands in shared memory
        return [FwdConfig(128, 128, 32, 8, 3), FwdConfig(64, 128, 32, 4, 3)]
    return [FwdConfig(256, 128, 32, 8, 4), FwdConfig(256, 128, 64, 8, 3), FwdConfig(128, 128, 64, 8, 3),
            FwdConfig(64, 128, 64, 4, 3)]


def _bwd_smem(c: BwdConfig, k: int, esize: int) -> int:
    if c.resident:
        return (c.BM + c.num_stages * c.BN) * c.DC * esize
    return (c.num_stages * (c.BM + c.BN) * c.BK + c.BN * c.DC) * esize


def bwd_candidates(k: int, esize: int) -> list[BwdConfig]:
    """Backward configs that fit shared memory and registers for feature dim ``k``.

    The (BM, DC) fp32 accumulator lives in registers, so BM = 64 with DC = 512 (8 warps)
    is the largest tile; wider K goes in DC = 512 chunks (logits recomputed per chunk).
    Sweeps on an H200 (b = 64k, bf16): streamed 64x128 (BK 64, 3-4 stages) 240 TFLOP/s at
    c = 512; the resident row block 206-217; 64x64, BK 32/128, 16 warps, DC = 256 and the
    flattened loop were slower."""
    kp = _pow2(k)
    if interpreting():  # streamed in the forward's K chunks: the same fp32 dot products as the forward
        return [BwdConfig(32, 32, 32, min(kp, 256), False)]
    if esize == 4:
        cands = [BwdConfig(64, 64, 32, min(kp, 256), False, 8, 2), BwdConfig(64, 32, 32, min(kp, 128), False, 4, 2)]
    else:
        dc = min(kp, 512)
        cands = [BwdConfig(64, 128, 64, dc, False, 8, 3), BwdConfig(64, 128, 64, dc, False, 8, 4)]
        if kp <= 512:
            cands.append(BwdConfig(64, 64, 64, kp, True, 8, 2))
    return [c for c in cands if _bwd_smem(c, k, esize) <= SMEM_BYTES]


@dataclass(frozen=True)
class StripConfig:
    """Strip backward: P tiles of BM x BN (K in BK chunks), GROUP row tiles per L2 group.

    tma: the persistent kernel with TMA (tensor-descriptor) loads, ``per_sm`` programs per SM
    (``_dx_strip_tma_kernel``; 16-bit inputs, c a multiple of 8); ws: warp-specialize its
    tile loop; fast_off: as ``FwdConfig``."""

    BM: int
    BN: int
    BK: int
    GROUP: int = 8
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = False
    ws: bool = False
    per_sm: int = 1
    fast_off: bool = True


# The loss's extra-memory rule: at most the two feature gradients + 1 KB x b + 64 MB. The
# strip scratch (s * dX for R rows, input dtype) takes 48 MB + 768 B per column of the
# block: R = 384 + 48 MB / (2 b) rows in bf16 at any b (768 at 64k, 576 -> 512 at 128k,
# 408 -> 384 at 1M), so the strip path serves every b (the fused kernel, at 18-27 % of
# peak past 64k, was the cliff). The rest of the rule's room: the positives' fp32 product
# temporary (R x c fp32, <= 16 MB, see ``strip_rows``), partial LSEs (<= 32 MB, forward
# only) and O(b) vectors (~40 B x b). With the positives folded into the scratch (no
# temporary) the scratch takes those 16 MB too: 64 MB + 768 B x b (2 strips instead of 3
# at b = 8k, where the step is bound by the host's launches).
# The one-pass backward (``grad_onepass_strips``) keeps this scratch and adds one
# fp32 (n, c) accumulator for dB, which the memory rule allows beside it (the feature
# gradients' fp32 accumulators, 4 c bytes per sample each). The second accumulator's room
# (dA needs none: each strip's rows are written once) goes to the scratch when the call owns
# it (fresh gradients, ``ops._grad_onepass``: ``spare``): taller strips, so the dB product
# reads and writes its fp32 accumulator fewer times (b / R passes of 8 b c bytes each).
STRIP_BUDGET_BYTES = 48 << 20  # fixed part of the strip scratch
STRIP_BYTES_PER_COLUMN = 768  # O(b) part of the strip scratch
STRIP_TEMP_BYTES = 16 << 20  # cap on the fp32 (R, c) product temporary of the positives' fixup
STRIP_MIN_ROWS = 384  # below this cuBLAS's (R, n) @ (n, c) product gets too skinny to pay


def strip_rows(n: int, esize: int, budget: int | None = None, k: int = 0, temp: bool = True,
               spare: int = 0) -> int:
    """Rows per strip that fit the scratch budget (a multiple of 128 when >= 128): with
    ``temp`` (the positives' fp32 fixup) 48 MB + 768 B x n by default and an fp32 (rows, k)
    temporary within 16 MB; without it 64 MB + 768 B x n. spare: bytes added to the default
    budget (the one-pass backward's unused accumulator room, ``onepass_spare_bytes``); an
    explicit ``budget`` is taken as it is."""
    n = max(n, 1)
    if budget is None:
        budget = STRIP_BUDGET_BYTES + STRIP_BYTES_PER_COLUMN * n + (0 if temp else STRIP_TEMP_BYTES) + spare
    rows = budget // (esize * n)
    if k and temp:
        rows = min(rows, max(STRIP_TEMP_BYTES // (4 * k), STRIP_MIN_ROWS))
    return rows // 128 * 128 if rows >= 128 else rows


def onepass_spare_bytes(m: int, n: int, k: int, roomy: bool, in_place: bool = True) -> int:
    """The room the memory rule gives the one-pass backward's second fp32 accumulator (4 k
    bytes per sample of the smaller side), which it never allocates: the strip scratch may
    take it (``roomy``) when the call's gradients are fresh and it has no group ids (the
    one-GPU loss), or when its caller's rule counts that room (the ring's tiles, which sum into
    the ring's fp32 buffers: ``spare_room``). Another call that sums into given buffers gets 0
    (the buffers are its caller's), and so does the sorted mask's (its sorted feature copies, 2 b c
    elements, hold that room: ``docs/objectives.md``). in_place: whether the d text product
    sums into its fp32 accumulator with no temporary (``addmm_f32_``'s one cuBLAS call, torch
    >= 2.8); without it the product's chunked fp32 temporary (<= ``ADDMM_CHUNK_BYTES`` and
    its 16-bit copy) lives in that room: 0."""
    return 4 * k * min(m, n) if roomy and in_place else 0


def strip_candidates(k: int, esize: int) -> list[StripConfig]:
    """Strip-kernel configs (the tuner times them all; the first is the untuned default).
    H200, bf16, one direction (fill + cuBLAS), commit f0c96f3: c = 512, b = 64k: persistent
    TMA 128x128 (8 warps, 4 stages, no spills) 22.7 ms, pointer 128x128 25.2, 128x256
    (78 registers spilled) 26.8, 256x128 30.9; c = 1024, b = 16k: TMA 128x128 2.36 ms,
    128x256 3.36. 64-row tiles, 4 warps (commit cdd7513): TMA 64x128 at 2 programs per SM
    22.5 ms / 2.40 ms (kept), 64x256 32.3 / 3.20 (dropped)."""
    if interpreting():
        return [StripConfig(32, 32, 32, 2)]
    if esize == 4:
        return [StripConfig(128, 128, 32, 8, 8, 3)]
    return [StripConfig(128, 128, 64, 8, 8, 4, tma=True), StripConfig(128, 256, 64, 8, 8, 3),
            StripConfig(128, 128, 64, 8, 8, 4), StripConfig(64, 128, 64, 8, 4, 3, tma=True, per_sm=2)]


def _vecs(a: Tensor, off_a: Tensor | None, off_b: Tensor | None, g_d: Tensor | None, fast: bool = False):
    """(off_a, off_b, g_d) pointers for the kernels (a dummy where absent) and the flags;
    HAS_OFF = 2 (the one-FMA shift of ``kernels._shifted``) for 16-bit inputs when ``fast``."""
    has_off = off_a is not None
    if has_off != (off_b is not None):
        raise ValueError("give both offsets (rows and columns) or neither")
    if g_d is not None and not has_off:
        raise ValueError("g_d (the positives) needs the offsets: the positives' dot products")
    dummy = g_d if g_d is not None else (off_a if has_off else torch.empty(1, device=a.device))
    return (off_a if has_off else dummy, off_b if has_off else dummy, g_d if g_d is not None else dummy,
            dict(HAS_OFF=(2 if fast and a.element_size() == 2 else 1) if has_off else 0, HAS_DIAG=g_d is not None))


def _gids(gid_a: Tensor | None, gid_b: Tensor | None) -> tuple:
    """(gid_a, gid_b, HAS_GID) for the kernels: both int64 group-id vectors or neither (None
    pointers: the flag off compiles the kernels of the plain loss)."""
    if (gid_a is None) != (gid_b is None):
        raise ValueError("give both group-id vectors (rows and columns) or neither")
    return gid_a, gid_b, gid_a is not None


def _band(band: Tensor | None, gid_a: Tensor | None, m: int, n: int) -> dict:
    """dict(band_ptr=, BAND=) for the kernels. band: None (every tile compares group ids) or a
    (1,) int32 device tensor w such that every same-group pair (i, j) of this square block
    pair has |i - j| <= w (ids sorted by group, w the largest group's size less one): only
    tiles within w of the diagonal compare. Read by the kernels: no host sync."""
    if band is None:
        return dict(band_ptr=None, BAND=False)
    if gid_a is None or m != n:
        raise ValueError(f"band needs group ids and a square block pair (the sorted batch), got {m} x {n}"
                         + ("" if gid_a is not None else " without group ids"))
    if band.dtype != torch.int32 or band.shape != (1,) or band.device != gid_a.device:
        raise ValueError(f"band must be a (1,) int32 tensor on {gid_a.device}, got {band.dtype} "
                         f"{tuple(band.shape)} on {band.device}")
    return dict(band_ptr=band, BAND=True)


def _ds_slots(cfg, tiles: int, device: torch.device, use_tma: bool) -> int:
    """ds partial slots one strip of ``tiles`` tiles writes: one per program of the persistent
    kernels (Gluon: ``gluon_strip.ds_slots``; TMA: ``tma_programs``), one per tile for the
    pointer kernel. Not one per tile for all: at b = 1M, c = 1024, 64-row tiles that would be
    512 MB of slots beside the scratch (the memory rule), where the fills write ~3 MB."""
    if isinstance(cfg, gluon_strip.GluonStripConfig):
        return gluon_strip.ds_slots(tiles, gluon_strip.strip_programs(tiles, sm_count(device)))
    if use_tma:
        return tma_programs(device, tiles, cfg.per_sm)
    return tiles


def grad_rows_strips(a: Tensor, b: Tensor, scale: Tensor, lse_a: Tensor, lse_b: Tensor, g_a: Tensor,
                     g_b: Tensor, out: Tensor | None, rows: int, cfg: StripConfig, prec: str,
                     alloc=torch.empty, g_d: Tensor | None = None, off_a: Tensor | None = None,
                     off_b: Tensor | None = None, fold: bool = False, gid_a: Tensor | None = None,
                     gid_b: Tensor | None = None, accumulate: bool = False, then=None,
                     band: Tensor | None = None) -> Tensor:
    """out = s * dX @ b, ``rows`` rows at a time through a scratch P = s * dX[strip] (input
    dtype) and a cuBLAS product; returns ds. ``out`` must have the input dtype (None: no
    product, only the fills for ``then`` and ds). g_d, off_a,
    off_b: as in ``grad_rows``. fold (with g_d): the positives' folded fp32 s dX_ii go into
    P (one rounding to the input dtype, then the plain product into ``out``) instead of
    an fp32 product per strip plus the host's fp32 fixup + s dX_ii b_i. gid_a (m,), gid_b (n,):
    int64 group ids; same-group entries (not i == j with g_d) get dX = 0 (duplicates); band:
    only tiles within band[0] of the diagonal compare them (``_band``).
    accumulate: out += (any dtype; the two-pass path passes fresh outputs of the input
    dtype). then(r0, r, scratch, dv): called after each strip's product, dv the strip's fp32
    s dX_ii (the fixup's; None when folded or without positives): ``grad_onepass_strips``."""
    m, k, n = a.shape[0], a.shape[1], b.shape[0]
    o_a, o_b, gd, flags = _vecs(a, off_a, off_b, g_d, cfg.fast_off)
    gid_a, gid_b, flags["HAS_GID"] = _gids(gid_a, gid_b)
    bnd = _band(band, gid_a, m, n)
    fixup = g_d is not None and not fold
    rows = max(1, min(rows, m))
    d_vec = alloc(rows, device=a.device, dtype=torch.float32) if fixup else scale
    if cfg.tma and a.element_size() != 2:
        raise ValueError("the TMA strip kernel needs 16-bit inputs (bf16/fp16)")
    use_tma = cfg.tma and tma_ok(a, b)  # else (a row not 16-byte aligned) the same tiles by pointers
    # One buffer of ds partials for all strips, summed once at the end (not a reduction
    # launch per strip); zeros: a short last strip leaves some of its slots unwritten.
    per = _ds_slots(cfg, cdiv(rows, cfg.BM) * cdiv(n, cfg.BN), a.device, use_tma)
    ds_all = torch.zeros(cdiv(m, rows) * per, device=a.device, dtype=torch.float32)

    def fill(r0: int, r: int, scratch: Tensor) -> None:
        grid = cdiv(r, cfg.BM) * cdiv(n, cfg.BN)
        ds_part = ds_all[r0 // rows * per:]
        if isinstance(cfg, gluon_strip.GluonStripConfig):  # chosen only where it applies (ops)
            gluon_strip.fill_strip_gluon(a, b, scale, lse_a, lse_b, o_a, o_b, g_a, g_b, gd, scratch, ds_part, d_vec,
                                         r, r0, cfg, prec, fold, flags, grid, gid_a, gid_b, band=bnd["band_ptr"])
            return
        if use_tma:
            _fill_tma(a, b, scale, lse_a, lse_b, o_a, o_b, g_a, g_b, gd, scratch, ds_part, d_vec, r, r0, cfg,
                      prec, fold, flags, grid, gid_a, gid_b, bnd)
            return
        _dx_strip_kernel[(grid,)](
            a, b, scale, lse_a, lse_b, o_a, o_b, g_a, g_b, gd, scratch, ds_part, d_vec, r, r0, n, k,
            a.stride(0), b.stride(0), scratch.stride(0), gid_a, gid_b, bnd["band_ptr"],
            BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP=cfg.GROUP, EVEN_K=k % cfg.BK == 0, PREC=prec,
            DOT_F32=_dot_f32(a), FOLD=fold, BAND=bnd["BAND"], num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **flags,
        )

    def positives(r0: int, r: int, prod: Tensor) -> None:  # + s dX_ii b_i, fp32, before the rounding
        prod.addcmul_(d_vec[:r, None], b[r0:r0 + r])

    after = None if then is None else (lambda r0, r, scratch: then(r0, r, scratch, d_vec if fixup else None))
    strip_backward(a, b, out, rows, accumulate, fill, alloc, positives if fixup else None, after)
    return ds_all.sum()


def grad_onepass_strips(a: Tensor, b: Tensor, scale: Tensor, lse_a: Tensor, lse_b: Tensor, g_a: Tensor,
                        g_b: Tensor, out_a: Tensor | None, acc_b: Tensor, rows: int, cfg: StripConfig, prec: str,
                        alloc=torch.empty, g_d: Tensor | None = None, off_a: Tensor | None = None,
                        off_b: Tensor | None = None, fold: bool = False, accumulate: bool = False,
                        gid_a: Tensor | None = None, gid_b: Tensor | None = None,
                        band: Tensor | None = None) -> Tensor:
    """The one-pass backward: out_a (+)= s dX @ b and acc_b += s dX^T @ a from one fill of
    each strip's P = s dX[strip] (``grad_rows_strips``' kernels and scratch); returns ds,
    summed once. acc_b (n, k) fp32 (fp64 never reaches the kernels): the caller zeroes it
    for fresh gradients. Each logits tile is computed once: 8 b^2 c FLOPs for forward +
    backward instead of 10. The positives (g_d): folded into P (``fold``), both products
    carry them; otherwise (fixup) P's diagonal is zero and s dX_ii a_i is added to
    acc_b[i] in fp32 here, as s dX_ii b_i is to out_a's fp32 product. out_a None: a's
    gradient is not wanted (a locked tower): its product is skipped, 6 b^2 c in all."""
    if acc_b.dtype != torch.float32 or acc_b.shape != b.shape:
        raise ValueError(f"acc_b must be an fp32 {tuple(b.shape)} accumulator, got {acc_b.dtype} {tuple(acc_b.shape)}")

    def second(r0: int, r: int, scratch: Tensor, dv: Tensor | None) -> None:
        a_s = a[r0:r0 + r]
        addmm_f32_(acc_b, scratch[:r].T, a_s)  # (n, r) @ (r, k): fp32 accumulate into acc_b
        if dv is not None:  # square pair: P's column i is text row i
            acc_b[r0:r0 + r].addcmul_(dv[:r, None], a_s)

    return grad_rows_strips(a, b, scale, lse_a, lse_b, g_a, g_b, out_a, rows, cfg, prec, alloc=alloc, g_d=g_d,
                            off_a=off_a, off_b=off_b, fold=fold, accumulate=accumulate, then=second,
                            gid_a=gid_a, gid_b=gid_b, band=band)


def _fill_tma(a, b, scale, lse_a, lse_b, o_a, o_b, g_a, g_b, gd, scratch, ds_part, d_vec, r, r0, cfg, prec, fold,
              flags, tiles, gid_a=None, gid_b=None, bnd=None):
    """One strip through the persistent TMA kernel (``tma_ok(a, b)`` checked by the caller);
    its programs' ds partials into ds_part. bnd: ``_band``'s (None: no band)."""
    progs = tma_programs(a.device, tiles, cfg.per_sm)
    bnd = bnd or _band(None, gid_a, 0, 0)
    _dx_strip_tma_kernel[(progs,)](
        a, b, scale, lse_a, lse_b, o_a, o_b, g_a, g_b, gd, scratch, ds_part, d_vec, r, r0, a.shape[0],
        b.shape[0], a.shape[1], a.stride(0), b.stride(0), scratch.stride(0), gid_a, gid_b, bnd["band_ptr"],
        BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP=cfg.GROUP, NUM_PROGS=progs, FOLD=fold, WS=cfg.ws, PREC=prec,
        DOT_F32=_dot_f32(a), BAND=bnd["BAND"], num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags,
    )


def lse_forward(a: Tensor, b: Tensor, scale: Tensor, cfg: FwdConfig, prec: str,
                alloc=torch.empty, off_a: Tensor | None = None, off_b: Tensor | None = None,
                diag: bool = False, gid_a: Tensor | None = None, gid_b: Tensor | None = None,
                band: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(row_lse (m,), col_lse (n,)) fp32 over the block pair (a, b); partial buffers <= 32 MB.

    off_a (m,), off_b (n,) fp32: the LSEs come out relative to s * off (computed from
    s (<a_i, b_j> - off)); diag (square pair, off_a is off_b): the diagonal's dot products
    are taken to be the offsets (the positives' <a_i, b_i>, see the kernels' docs).
    gid_a (m,), gid_b (n,): int64 group ids; same-group entries (but the diagonal's i == j)
    leave both LSEs (duplicates; a row or column may end up empty: LSE -inf). band (with
    diag): only the column tiles within band[0] of the diagonal compare them (``_band``)."""
    m, k = a.shape
    n = b.shape[0]
    o_a, o_b, _, flags = _vecs(a, off_a, off_b, None, cfg.fast_off)
    gid_a, gid_b, has_gid = _gids(gid_a, gid_b)
    if diag and not (flags["HAS_OFF"] and m == n):
        raise ValueError(f"diag needs a square block pair and the offsets, got {m} x {n}")
    bnd = _band(band, gid_a, m, n)
    if band is not None and not diag:
        raise ValueError("band needs diag (its column loops are split around the diagonal's tiles)")
    nrb = cdiv(m, cfg.BM)
    chunk = max(cfg.BN, PART_BUDGET_BYTES // (4 * nrb) // cfg.BN * cfg.BN)
    row_lse, col_lse = None, alloc(n, device=a.device, dtype=torch.float32)
    for c0 in range(0, n, chunk):
        c1 = min(c0 + chunk, n)
        length = c1 - c0
        splits, per = column_splits(nrb, length, cfg.BN, a.device)
        row_part = alloc(splits, m, device=a.device, dtype=torch.float32)
        col_part = alloc(nrb, length, device=a.device, dtype=torch.float32)
        _lse_fwd_kernel[(nrb, splits)](
            a, b, scale, o_a, o_b, row_part, col_part, m, n, k, a.stride(0), b.stride(0), c0, c1, per, length,
            gid_a, gid_b, bnd["band_ptr"],
            BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, EVEN_K=k % cfg.BK == 0, HAS_OFF=flags["HAS_OFF"], HAS_DIAG=diag,
            PREC=prec, DOT_F32=_dot_f32(a), WS=cfg.ws, HAS_GID=has_gid, BAND=bnd["BAND"], num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        part = torch.logsumexp(row_part, 0)
        row_lse = part if row_lse is None else torch.logaddexp(row_lse, part)
        col_lse[c0:c1] = torch.logsumexp(col_part, 0)
    return row_lse, col_lse


def grad_rows(a: Tensor, b: Tensor, scale: Tensor, lse_a: Tensor, lse_b: Tensor, g_a: Tensor,
              g_b: Tensor, out: Tensor, accumulate: bool, compute_ds: bool, cfg: BwdConfig,
              prec: str, g_d: Tensor | None = None, off_a: Tensor | None = None,
              off_b: Tensor | None = None, threshold: float | None = None,
              kept: list | None = None, gid_a: Tensor | None = None, gid_b: Tensor | None = None,
              band: Tensor | None = None) -> Tensor | None:
    """out (+)= s * dX @ b for the rows of ``a``; returns ds (0-d fp32) if ``compute_ds``.

    off_a (m,), off_b (n,): lse_a / lse_b are relative to s * off (see ``lse_forward``).
    g_d (m,) (square block pair, with the offsets = the positives' dot products): the
    gradient of -sum_i g_d_i x_ii, folded into dX_ii in fp32 (ds includes it).
    threshold (gradient filtering; None: off): tiles whose softmax entries are all below it
    skip their update product; ``kept`` = [kept tiles (0-d tensor), all tiles (int)] is
    incremented. gid_a (m,), gid_b (n,), band: group ids and band, as ``grad_rows_strips``."""
    m, k = a.shape
    n = b.shape[0]
    if cfg.resident and cfg.DC < k:
        raise ValueError(f"resident config needs DC >= K, got DC={cfg.DC}, K={k}")
    o_a, o_b, gd, flags = _vecs(a, off_a, off_b, g_d)
    gid_a, gid_b, flags["HAS_GID"] = _gids(gid_a, gid_b)
    bnd = _band(band, gid_a, m, n)
    gnorm = torch.maximum(g_a.abs().max(), g_b.abs().max())
    if g_d is not None:
        gnorm = torch.maximum(gnorm, g_d.abs().max())
    gnorm = _pow2_scale(gnorm)
    nrb, ncb = cdiv(m, cfg.BM), cdiv(k, cfg.DC)
    ds_part = torch.empty(nrb * ncb if compute_ds else 1, device=a.device, dtype=torch.float32)
    filt = threshold is not None
    kept_part = torch.empty(nrb * ncb if filt else 1, device=a.device, dtype=torch.int32)
    log2_thr = math.log2(threshold) if filt and threshold > 0 else float("-inf")
    args = (a, b, scale, gnorm, lse_a, lse_b, o_a, o_b, g_a, g_b, gd, out, ds_part, kept_part, log2_thr,
            m, n, k, a.stride(0), b.stride(0), out.stride(0), gid_a, gid_b, bnd["band_ptr"])
    meta = dict(BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, DC=cfg.DC, EVEN_K=k % cfg.BK == 0, ACCUM=accumulate,
                COMPUTE_DS=compute_ds, FILTER=filt, PREC=prec, DOT_F32=_dot_f32(a), BAND=bnd["BAND"],
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags)
    _grad_kernel[(nrb, ncb)](*args, RESIDENT=cfg.resident, **meta)
    if filt and kept is not None:  # running counts, on the device (no host sync)
        kept[0] = kept[0] + kept_part.sum()
        kept[1] += nrb * ncb * cdiv(n, cfg.BN)
    return ds_part.sum() if compute_ds else None


def _pow2_scale(gmax: Tensor) -> Tensor:
    """[g, 1 / g] fp32 with g the power of two >= gmax (>= 2^-100): the kernels' gradient
    scalings by g and 1 / g are then exact (no rounding, none of the GPU's approximate
    division), on the device (no host sync)."""
    g = torch.exp2(torch.ceil(torch.log2(gmax.float().clamp_min(2.0 ** -100))))
    return torch.stack([g, 1.0 / g])


_TUNED: dict[tuple, object] = {}


def _bucket(x: int) -> int:
    return _pow2(min(x, TUNE_ROWS))


def pick_config(kind: str, a: Tensor, b: Tensor, prec: str, candidates: list, run) -> object:
    """Fastest candidate for this problem class; ``run(cfg, a_sub, b_sub)`` launches it once."""
    key = (kind, a.shape[1], a.dtype, prec, _bucket(a.shape[0]), _bucket(b.shape[0]), str(a.device))
    if key in _TUNED:
        return _TUNED[key]
    if interpreting() or a.device.type != "cuda" or os.environ.get("INFCLIP_TRITON_TUNE", "1") == "0":
        _TUNED[key] = candidates[0]
        return candidates[0]
    a_sub, b_sub = a[:TUNE_ROWS], b[:TUNE_ROWS]
    best, best_ms = None, float("inf")
    for cfg in candidates:
        try:
            ms = _time(lambda: run(cfg, a_sub, b_sub))
        except Exception as err:  # noqa: BLE001 -- out of resources / compile error: skip config
            if not _skippable(err):
                raise
            if isinstance(cfg, (gluon_fwd.GluonFwdConfig, gluon_strip.GluonStripConfig)):
                warnings.warn(f"{kind}: the Gluon candidate {cfg} did not run ({type(err).__name__}: {err}); "
                              f"the Triton kernels stand in", stacklevel=2)
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is None:
        raise RuntimeError(f"no {kind} Triton config compiled for K={a.shape[1]}, {a.dtype}")
    _TUNED[key] = best
    return best


def _skippable(err: Exception) -> bool:
    """Whether a candidate's failure only rules that candidate out (out of resources, a compile
    error, a refusal): a CUDA fault is sticky (every later call would fail with an unrelated
    error), so it propagates."""
    text = f"{type(err).__name__}: {err}"
    return not any(mark in text for mark in ("AcceleratorError", "CUDA error", "illegal memory access",
                                              "misaligned address", "device-side assert"))


def _time(fn, reps: int = 3, rounds: int = 3) -> float:
    """ms per call: the fastest of ``rounds`` rounds of ``reps`` calls, after one warm-up call
    (compiles). The fastest round, not one round's mean: the tuner's candidates can lie within
    10 % of each other (the Gluon strip fill's two tiles at c = 512, b = 65,536 were picked
    differently in two processes on two machines at commit 1853948, the step 42.3 vs 40.3 ms), and
    the minimum of several rounds is the steadier estimate of which is faster."""
    fn()  # compile + warm up
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / reps)
    return best


def tuned_configs() -> dict:
    """The configs chosen so far (for benchmark reports)."""
    return dict(_TUNED)
