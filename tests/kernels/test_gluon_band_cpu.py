"""The Gluon kernels' band variant (duplicates "mask" on one process: ids sorted by group, the
kernels' BAND): what a CPU can check.

The argument checks (``gluon_common.band_args``: int32 ids with a band, on the positives'
square pair; the ring's ids without a band refused), the launches (the ids and w reach the
kernels with BAND on; without ids the three pointers are None and BAND off, the kernels of
before), the dispatch (``TritonTileOps`` sends the sorted-band case to the Gluon kernels only
when forced, never under "auto" until a GPU check passes; the ring never; tuner kinds of its
own) and the strip path passing the band through; and a CPU model of the kernels' band tiles
(their per-tile arithmetic transcribed, below) against the float64 masked reference. The
kernels' own numbers: the GPU scripts ``check_gluon_fwd.py --band`` and ``check_gluon_strip.py
--band``.
"""

import pytest
import torch

from infclip.kernels.clip import gluon_common, gluon_fwd, gluon_strip, launch, ops as ops_mod
from infclip.kernels.clip.ops import GLUON_MIN_ROWS, TritonTileOps
from infclip.loss.duplicates import sort_groups

I32 = torch.int32
F = torch.nn.functional


def _ids(m: int, dtype=I32) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted ids (groups of 2) and their band w = 1."""
    return (torch.arange(m) // 2).to(dtype), torch.ones(1, dtype=I32)


def test_band_args_take_the_sorted_band_case_only():
    ids, band = _ids(8)
    assert gluon_common.band_args(None, None, None, 8, 8, True) == dict(gid_a_ptr=None, gid_b_ptr=None,
                                                                        band_ptr=None, BAND=False)
    got = gluon_common.band_args(ids, ids, band, 8, 8, True)
    assert got["BAND"] and got["gid_a_ptr"] is ids and got["gid_b_ptr"] is ids and got["band_ptr"] is band
    with pytest.raises(ValueError, match="sorted by group"):  # the ring: ids without a band
        gluon_common.band_args(ids, ids, None, 8, 8, True)
    with pytest.raises(ValueError, match="sorted by group"):
        gluon_common.band_args(ids, None, band, 8, 8, True)
    with pytest.raises(ValueError, match="square"):
        gluon_common.band_args(ids, ids, band, 8, 8, False)
    with pytest.raises(ValueError, match="square"):
        gluon_common.band_args(ids, ids[:6], band, 8, 6, True)
    with pytest.raises(ValueError, match="int32"):
        gluon_common.band_args(ids.long(), ids.long(), band, 8, 8, True)
    with pytest.raises(ValueError, match="band must be"):
        gluon_common.band_args(ids, ids, band.long(), 8, 8, True)
    with pytest.raises(ValueError, match="gid_b must be"):
        gluon_common.band_args(ids, torch.arange(16, dtype=I32)[::2], band, 8, 8, True)


class _Kernel:
    """Stands in for a Gluon kernel: records the launch (grid, args, kwargs)."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


@pytest.mark.parametrize("banded", [True, False])
def test_forward_launch_passes_the_ids_and_w(monkeypatch, banded):
    kern = _Kernel()
    monkeypatch.setattr(gluon_fwd, "gluon_available", lambda a, b, cfg=None: True)
    monkeypatch.setattr(gluon_fwd, "_descriptors", lambda a, b, cfg: ("a_desc", "b_desc"))
    monkeypatch.setattr(gluon_fwd, "column_splits", lambda nrb, length, bn, device: (1, length))
    monkeypatch.setattr(gluon_fwd, "_lse_fwd_ws_kernel", kern)
    m, k = 300, 512
    a = torch.zeros(m, k, dtype=torch.bfloat16)
    ids, band = _ids(m)
    kw = dict(gid_a=ids, gid_b=ids, band=band) if banded else {}
    gluon_fwd.lse_forward_gluon(a, a, torch.tensor(1.0), torch.zeros(m), torch.zeros(m), True, **kw)
    (_, args, kwargs), = kern.calls
    assert kwargs["BAND"] is banded
    want = (ids, ids, band) if banded else (None, None, None)
    assert all(x is y for x, y in zip(args[-4:-1], want))
    # then the fixed-reference epilogue's device flag (with the diagonal): on here (zero features)
    assert kwargs["FIXED"] is True and args[-1].dtype == torch.int32 and args[-1].tolist() == [1]
    with pytest.raises(ValueError, match="sorted by group"):  # the ring's ids: the Triton forward's
        gluon_fwd.lse_forward_gluon(a, a, torch.tensor(1.0), torch.zeros(m), torch.zeros(m), True, gid_a=ids,
                                    gid_b=ids)
    with pytest.raises(ValueError, match="square"):  # the band lives on the positives' pair
        gluon_fwd.lse_forward_gluon(a, a, torch.tensor(1.0), torch.zeros(m), torch.zeros(m), False, gid_a=ids,
                                    gid_b=ids, band=band)


def _strip_fill(monkeypatch, kern, gid, band, has_gid, diag=True):
    monkeypatch.setattr(gluon_strip, "gluon_strip_available", lambda a, b, cfg=None: True)
    monkeypatch.setattr(gluon_strip, "_descriptors", lambda a, b, p, cfg: ("a", "b", "p"))
    monkeypatch.setattr(gluon_strip, "sm_count", lambda device: 4)
    monkeypatch.setattr(gluon_strip, "_dx_strip_ws_kernel", kern)
    n, k, r = 256, 512, 64
    a = torch.zeros(n, k, dtype=torch.bfloat16)
    v = torch.zeros(n)
    flags = dict(HAS_OFF=2, HAS_DIAG=diag, HAS_GID=has_gid)
    gluon_strip.fill_strip_gluon(a, a, torch.tensor(1.0), v, v, v, v, v, v, v, torch.empty(r, n, dtype=a.dtype),
                                 torch.zeros(64), v, r, 0, None, "tf32", True, flags, None, gid, gid, band=band)


def test_strip_launch_passes_the_ids_and_w(monkeypatch):
    ids, band = _ids(256)
    kern = _Kernel()
    _strip_fill(monkeypatch, kern, ids, band, True)
    _strip_fill(monkeypatch, kern, None, None, False)
    (_, args, kwargs), (_, args0, kwargs0) = kern.calls
    assert kwargs["BAND"] and all(x is y for x, y in zip(args[-3:], (ids, ids, band)))
    assert not kwargs0["BAND"] and args0[-3:] == (None, None, None)
    with pytest.raises(ValueError, match="HAS_GID"):  # flags and ids must agree
        _strip_fill(monkeypatch, kern, ids, band, False)
    with pytest.raises(ValueError, match="sorted by group"):  # the ring's ids
        _strip_fill(monkeypatch, kern, ids, None, True)
    with pytest.raises(ValueError, match="square"):  # the band with the positives only
        _strip_fill(monkeypatch, kern, ids, band, True, diag=False)
    assert len(kern.calls) == 2


def test_grad_rows_strips_hands_the_band_to_the_gluon_fill(monkeypatch):
    seen = []

    def fake_fill(*args, band=None):
        seen.append((args[18]["HAS_GID"], args[-2], args[-1], band))
        args[10].zero_()

    monkeypatch.setattr(gluon_strip, "fill_strip_gluon", fake_fill)
    monkeypatch.setattr(launch, "sm_count", lambda device: 2)
    m = 10
    a = torch.randn(m, 64, dtype=torch.bfloat16)
    ids, band = _ids(m)
    z, one = torch.zeros(m), torch.ones(m)
    launch.grad_rows_strips(a, a, torch.tensor(2.0), z, z, one, one, torch.empty_like(a), 4,
                            gluon_strip.GluonStripConfig(), "tf32", g_d=2 * one, off_a=z, off_b=z, fold=True,
                            gid_a=ids, gid_b=ids, band=band)
    assert len(seen) == 3 and all(h and ga is ids and gb is ids and b is band for h, ga, gb, b in seen)


def test_forward_dispatch_tunes_gluon_for_the_band_and_forces_it_first(monkeypatch):
    monkeypatch.delenv("INFCLIP_FORWARD_KERNEL", raising=False)
    monkeypatch.setattr(gluon_fwd, "gluon_available", lambda a, b, cfg=None: True)
    big = torch.zeros(GLUON_MIN_ROWS, 512, dtype=torch.bfloat16)
    band = dict(has_gid=True, positives=True, offsets=True, band=True)
    ring = {**band, "band": False}
    plain = {**band, "has_gid": False, "band": False}
    auto, forced = TritonTileOps(), TritonTileOps(forward_kernel="gluon")
    assert ops_mod.GLUON_BAND_AUTO  # check_gluon_fwd.py --band passed on an H200 (commit 640e884)
    kind, cands = auto._forward_candidates(big, big, **band)
    assert kind == "fwd_band_gluon" and not isinstance(cands[0], gluon_fwd.GluonFwdConfig)  # joined, Triton first
    assert any(isinstance(c, gluon_fwd.GluonFwdConfig) for c in cands)
    small = torch.zeros(GLUON_MIN_ROWS - 1, 512, dtype=torch.bfloat16)
    assert auto._forward_candidates(small, small, **band)[0] == "fwd"  # below GLUON_MIN_ROWS: Triton
    assert auto._forward_candidates(big, big, **plain)[0] == "fwd_gluon"  # without ids: as before
    kind, cands = forced._forward_candidates(big, big, **band)
    assert kind == "fwd_band_gluon_first" and isinstance(cands[0], gluon_fwd.GluonFwdConfig)
    assert kind != forced._forward_candidates(big, big, **plain)[0]  # tuner keys of its own
    assert forced._forward_candidates(big, big, **ring)[0] == "fwd"  # the ring: Triton only
    assert forced._forward_candidates(big, big, **{**band, "positives": False})[0] == "fwd"
    assert TritonTileOps(forward_kernel="triton")._forward_candidates(big, big, **band)[0] == "fwd"
    monkeypatch.setenv("INFCLIP_FORWARD_KERNEL", "gluon")
    assert TritonTileOps()._forward_candidates(big, big, **band)[0] == "fwd_band_gluon_first"
    monkeypatch.setattr(ops_mod, "GLUON_BAND_AUTO", False)  # the switch off: "auto" keeps Triton
    assert auto._forward_candidates(big, big, **band)[0] == "fwd"


def test_forward_sends_sorted_ids_to_gluon_and_the_ring_to_triton(monkeypatch):
    """TritonTileOps.forward end to end (untuned: the first candidate): with the forced
    Gluon forward the sorted batch's int32 ids and band reach ``lse_forward_gluon``; two-element
    groups (the ring) and int64 ids go to the Triton forward."""
    calls = []
    monkeypatch.setenv("INFCLIP_TRITON_TUNE", "0")
    monkeypatch.setattr(gluon_fwd, "gluon_available", lambda a, b, cfg=None: True)

    def fake_gluon(a, b, scale, off_a, off_b, square, cfg=None, alloc=None, gid_a=None, gid_b=None, band=None):
        calls.append(("gluon", square, gid_a, band))
        return torch.zeros(a.shape[0]), torch.zeros(b.shape[0])

    def fake_triton(a, b, scale, cfg, prec, alloc=None, off_a=None, off_b=None, diag=False, gid_a=None, gid_b=None,
                    band=None):
        calls.append(("triton", diag, gid_a, band))
        return torch.zeros(a.shape[0]), torch.zeros(b.shape[0])

    monkeypatch.setattr(gluon_fwd, "lse_forward_gluon", fake_gluon)
    monkeypatch.setattr(launch, "lse_forward", fake_triton)
    launch._TUNED.clear()
    m = 96
    x = torch.zeros(m, 512, dtype=torch.bfloat16)
    ids, band = _ids(m)
    pos = torch.zeros(m)
    forced, auto = TritonTileOps(forward_kernel="gluon"), TritonTileOps(forward_kernel="auto")
    forced.forward(x, x, torch.tensor(1.0), offsets=(pos, pos), diag=True, groups=(ids, ids, band))
    forced.forward(x, x, torch.tensor(1.0), offsets=(pos, pos), diag=True, groups=(ids, ids))
    forced.forward(x, x, torch.tensor(1.0), offsets=(pos, pos), diag=True, groups=(ids.long(), ids.long(), band))
    auto.forward(x, x, torch.tensor(1.0), offsets=(pos, pos), diag=True, groups=(ids, ids, band))
    launch._TUNED.clear()
    assert [c[0] for c in calls] == ["gluon", "triton", "triton", "triton"]
    assert calls[0][1] and torch.equal(calls[0][2], ids) and calls[0][3] is band
    assert calls[1][3] is None and calls[3][3] is band


def test_strip_dispatch_tunes_gluon_for_the_band_and_forces_it_first(monkeypatch):
    monkeypatch.delenv("INFCLIP_STRIP_KERNEL", raising=False)
    monkeypatch.setattr(gluon_strip, "gluon_strip_available", lambda a, b, cfg=None: True)
    big = torch.zeros(GLUON_MIN_ROWS, 512, dtype=torch.bfloat16)
    off, gd = torch.zeros(4), torch.ones(4)
    ids, band = _ids(4)
    auto, forced = TritonTileOps(), TritonTileOps(strip_kernel="gluon")
    assert forced._gluon_strip_ok(gd, off, ids, band)  # sorted int32 ids with the band and the positives
    assert not forced._gluon_strip_ok(gd, off, ids, None)  # the ring
    assert not forced._gluon_strip_ok(gd, off, ids.long(), band)  # int64 ids: the Triton fill
    assert not forced._gluon_strip_ok(None, off, ids, band)  # the band lives on the positives' pair
    assert not TritonTileOps(strip_positives="fixup")._gluon_strip_ok(gd, off, ids, band)
    assert auto._gluon_strip_ok(gd, off, ids, band)  # "auto" too (check_gluon_strip.py --band passed)
    kind, cands = auto._strip_candidates(big, big, True, banded=True)
    assert kind == "strip_band_gluon" and not isinstance(cands[0], gluon_strip.GluonStripConfig)
    assert any(isinstance(c, gluon_strip.GluonStripConfig) for c in cands)
    monkeypatch.setattr(ops_mod, "GLUON_BAND_AUTO", False)
    assert not auto._gluon_strip_ok(gd, off, ids, band)  # the switch off: the Triton fills
    assert auto._strip_candidates(big, big, True, banded=True)[0] == "strip"
    assert auto._strip_candidates(big, big, True)[0] == "strip_gluon"  # without ids: as before
    kind, cands = forced._strip_candidates(big, big, True, banded=True)
    assert kind == "strip_band_gluon_first" and isinstance(cands[0], gluon_strip.GluonStripConfig)
    assert forced._strip_candidates(big, big, True)[0] == "strip_gluon_first"  # a key of its own
    assert forced._strip_candidates(big, big, False, banded=True)[0] == "strip"  # gluon_ok False (the ring)
    monkeypatch.setenv("INFCLIP_STRIP_KERNEL", "gluon")
    assert TritonTileOps()._strip_candidates(big, big, True, banded=True)[0] == "strip_band_gluon_first"


# -- the band tiles' arithmetic, modelled on the CPU ---------------------------------------------
#
# The Gluon kernels cannot run here. These models transcribe, operation for operation and in
# fp32, the per-tile epilogues of ``gluon_fwd._consumer`` and ``gluon_strip._consumer`` with
# their BAND branches (which tiles are band tiles, the -inf / zero selects, the all-dropped
# row / column guards, the order of the drop and the diagonal fix, the online (max, sum) with
# m_use, the column partials, the strip's zeroing before the positives' fold), over the
# kernels' own programs, consumers (tiles C, C + 2, ...), column splits / chunks and the
# host's merge. They are checked against the float64 masked reference on small batches:
# b not a multiple of the tile, w = 0, small w, w spanning several tiles, a group covering
# whole rows of a tile, one group for the batch, tiles at the batch's edge. What this covers:
# the band logic as written (a transcription: a kernel line that differs from it is not
# caught here; the "mutants" below show which slips of that logic the check would catch).
# The kernels' layouts, loads and MMAs: the GPU scripts (``check_gluon_*.py --band``).

LOG2E, LN2 = 1.4426950408889634, 0.6931471805599453  # gluon_common's (there Gluon constexprs)
F32 = torch.float32
NEG = float("-inf")


def _padded_dots(a: torch.Tensor, b: torch.Tensor, pad: int) -> torch.Tensor:
    """fp32 a @ b.T with zero rows / columns past the ends (TMA's zero fill), ``pad`` of each."""
    d = torch.zeros(a.shape[0] + pad, b.shape[0] + pad, dtype=F32)
    d[:a.shape[0], :b.shape[0]] = (a.double() @ b.double().T).float()
    return d


def _fix(x, rows, cols, ok, axis):
    """``gluon_fwd._fix`` with HAS_DIAG."""
    x = torch.where(rows[:, None] == cols[None, :], torch.zeros((), dtype=F32), x)
    okb = ok[None, :] if axis == 1 else ok[:, None]
    return torch.where(okb, x, torch.full((), NEG, dtype=F32))


def _fwd_model(a, b, s, pos, gid, w, bm, bn, chunk, per, mutant=None):
    """(row_lse, col_lse): ``lse_forward_gluon``'s launches (column chunks of ``chunk``
    columns, splits of ``per``) with BAND and HAS_DIAG, each program's two consumers as
    ``gluon_fwd._consumer`` computes them, merged as the host does."""
    m = n = a.shape[0]
    dots = _padded_dots(a, b, max(bm, bn))
    s2 = torch.tensor(s, dtype=F32) * LOG2E
    rn, cn = torch.arange(bm), torch.arange(bn)
    row_lse, col_lse = None, torch.empty(n, dtype=F32)
    for c0 in range(0, n, chunk):
        c1 = min(c0 + chunk, n)
        nrb, splits = launch.cdiv(m, bm), launch.cdiv(c1 - c0, per)
        row_part = torch.full((2 * splits, m), float("nan"))
        col_part = torch.full((nrb, c1 - c0), float("nan"))
        for pid_m in range(nrb):
            row0 = pid_m * bm
            rows = row0 + rn
            row_ok = rows < m
            oa2 = pos[rows.clamp(max=m - 1)] * s2
            gid_a = gid[rows.clamp(max=m - 1)]
            for pid_s in range(splits):
                lo = c0 + pid_s * per
                hi = min(lo + per, c1)
                n_tiles = launch.cdiv(hi - lo, bn)
                for c in (0, 1):
                    m_i = torch.full((bm,), NEG, dtype=F32)
                    l_i = torch.zeros(bm, dtype=F32)
                    for t in range(c, n_tiles, 2):
                        j0 = lo + t * bn
                        cols = j0 + cn
                        ob2 = pos[cols.clamp(max=hi - 1)] * s2
                        acc = dots[rows][:, cols].clone()
                        edge = (j0 + bn > hi) or (row0 + bm > m)
                        diag = (j0 < row0 + bm) and (j0 + bn > row0)
                        band = (j0 < row0 + bm + w) and (j0 + bn > row0 - w)
                        if mutant == "band_without_w":
                            band = diag
                        if band:  # _same_group: the columns' ids by a masked load (other=0)
                            gid_b = torch.where(cols < hi, gid[cols.clamp(max=n - 1)], 0)
                            acc = torch.where(gid_a[:, None] == gid_b[None, :], torch.full((), NEG), acc)
                        xr = acc * s2 - oa2[:, None]
                        if edge or diag:
                            xr = _fix(xr, rows, cols, cols < hi, 1)
                        m_new = torch.maximum(m_i, xr.amax(1))
                        m_use = m_new
                        if band and mutant != "no_row_guard":
                            m_use = torch.where(m_new == NEG, torch.zeros((), dtype=F32), m_new)
                        l_i = l_i * torch.exp2(m_i - m_use) + torch.exp2(xr - m_use[:, None]).sum(1)
                        m_i = m_new
                        xc = acc * s2 - ob2[None, :]
                        if edge or diag:
                            xc = _fix(xc, rows, cols, row_ok, 0)
                        cm = xc.amax(0)
                        if band and mutant != "no_col_guard":
                            cm = torch.where(cm == NEG, torch.zeros((), dtype=F32), cm)
                        cl = torch.exp2(xc - cm[None, :]).sum(0)
                        ok = cols < hi
                        col_part[pid_m, (cols - c0)[ok]] = ((cm + torch.log2(cl)) * LN2)[ok]
                    row_part[2 * pid_s + c, rows[row_ok]] = ((m_i + torch.log2(l_i)) * LN2)[row_ok]
        part = torch.logsumexp(row_part, 0)
        row_lse = part if row_lse is None else torch.logaddexp(row_lse, part)
        col_lse[c0:c1] = torch.logsumexp(col_part, 0)
    return row_lse, col_lse


def _expm1(u):
    """``gluon_strip._expm1``."""
    series = u * (1.0 + u * (0.5 + u * (1.0 / 6 + u * (1.0 / 24 + u * (1.0 / 120 + u * (
        1.0 / 720 + u * (1.0 / 5040 + u * (1.0 / 40320))))))))
    return torch.where(u.abs() < 0.25, series, torch.exp(u) - 1.0)


def _strip_model(a, b, s, lse_a, lse_b, pos, g_a, g_b, g_d, gid, w, r, row_start, bm, bn, mutant=None):
    """(P (r, n) fp32 = s dX[row_start:row_start + r] before its rounding, ds): the strip's
    tiles as ``gluon_strip._consumer`` computes them with BAND, HAS_DIAG (folded)."""
    n = b.shape[0]
    dots = _padded_dots(a, b, max(bm, bn))
    s = torch.tensor(s, dtype=F32)
    s2 = s * LOG2E
    rr, cn = torch.arange(bm), torch.arange(bn)
    out = torch.full((r, n), float("nan"))
    ds = torch.zeros((), dtype=F32)
    zero = torch.zeros((), dtype=F32)
    for r0 in range(0, r, bm):
        for j0 in range(0, n, bn):
            row0 = row_start + r0
            r_idx = row0 + torch.clamp(rr, max=r - 1 - r0)
            c_idx = j0 + torch.clamp(cn, max=n - 1 - j0)
            la, ga, oa2 = lse_a[r_idx] * LOG2E, g_a[r_idx], pos[r_idx] * s2
            lb, gb, ob2 = lse_b[c_idx] * LOG2E, g_b[c_idx], pos[c_idx] * s2
            acc = dots[row0 + rr][:, j0 + cn]
            xr = acc * s2 - oa2[:, None]
            xc = acc * s2 - ob2[None, :]
            pr = ga[:, None] * torch.exp2(xr - la[:, None])
            pc = gb[None, :] * torch.exp2(xc - lb[None, :])
            p, q = pr + pc, pr * xr + pc * xc
            if (r0 + bm > r) or (j0 + bn > n):
                ok = (r0 + rr < r)[:, None] & (j0 + cn < n)[None, :]
                p, q = torch.where(ok, p, zero), torch.where(ok, q, zero)

            def drop_band(p, q):
                if (j0 < row0 + bm + w) and (j0 + bn > row0 - w):
                    gid_b = torch.where(j0 + cn < n, gid[c_idx], 0)
                    drop = gid[r_idx][:, None] == gid_b[None, :]
                    p, q = torch.where(drop, zero, p), torch.where(drop, zero, q)
                return p, q

            if mutant != "drop_after_positives":
                p, q = drop_band(p, q)
            ds_row = torch.zeros(bm, dtype=F32)
            if (j0 < row0 + bm) and (j0 + bn > row0):  # _positives
                rows, cols = row0 + rr, j0 + cn
                lbd, gbd = lse_b[r_idx] * LOG2E, g_b[r_idx]
                d_ii = ga * _expm1(-la * LN2) + gbd * _expm1(-lbd * LN2) + ((ga + gbd) - g_d[r_idx])
                e_o = ((ga + gbd) - g_d[r_idx]) * pos[r_idx] * s2
                has = (r0 + rr < r) & (rows >= j0) & (rows < j0 + bn)
                ds_row = torch.where(has, e_o, zero)
                on = rows[:, None] == cols[None, :]
                p, q = torch.where(on, d_ii[:, None], p), torch.where(on, zero, q)
            if mutant == "drop_after_positives":
                p, q = drop_band(p, q)
            ds = ds + (ds_row + q.sum(1)).sum()
            keep_r, keep_c = min(bm, r - r0), min(bn, n - j0)
            out[r0:r0 + keep_r, j0:j0 + keep_c] = (p * s)[:keep_r, :keep_c]
    return out, ds / s2


def _sorted_case(layout: str, n: int, seed: int, k: int = 16):
    """(a, b, pos, ids int32 (sorted batch: each group's first position), w, raw): fp32 features,
    a sample's image and text near their group's shared direction."""
    g = torch.Generator().manual_seed(seed)
    if layout == "unique":  # w = 0: only the diagonal's tiles compare
        raw = torch.arange(n)
    elif layout == "small":  # groups of 2-3
        raw = torch.randint(0, max(1, (2 * n) // 5), (n,), generator=g)
    elif layout == "big":  # one group wider than a tile (a row of a tile all dropped) among singletons
        raw = torch.where(torch.rand(n, generator=g) < 0.6, -1, torch.arange(n))
    else:  # "one": a single group, every off-diagonal pair dropped
        raw = torch.zeros(n, dtype=torch.int64)
    srt = sort_groups(raw)
    cap = torch.randn(n, k, generator=g, dtype=torch.float64)[torch.unique(raw, return_inverse=True)[1]][srt.order]
    img = F.normalize(cap + 0.5 * torch.randn(n, k, generator=g, dtype=torch.float64), dim=-1).float()
    txt = F.normalize(img.double() + 0.3 * torch.randn(n, k, generator=g, dtype=torch.float64), dim=-1).float()
    pos = (img * txt).sum(1)
    return img, txt, pos, srt.ids, int(srt.band.item())


def _masked64(img, txt, s, pos, ids):
    """float64 (row_lse, col_lse, P = softmax rows, Q = softmax columns, dots, kept) of the masked
    logits relative to s * pos, the diagonal's dot products the offsets."""
    dot = img.double() @ txt.double().T
    dot.diagonal().copy_(pos.double())
    same = ids[:, None] == ids[None, :]
    same.fill_diagonal_(False)
    o = pos.double()
    xr = torch.where(same, float("-inf"), s * (dot - o[:, None]))
    xc = torch.where(same, float("-inf"), s * (dot - o[None, :]))
    lr, lc = torch.logsumexp(xr, 1), torch.logsumexp(xc, 0)
    return lr, lc, torch.exp(xr - lr[:, None]), torch.exp(xc - lc[None, :]), dot, ~same


SCALE = 1 / 0.07  # the loss's logit scale in the model tests
LAYOUTS = ["unique", "small", "big", "one"]  # _sorted_case's group layouts

# (b, BM, BN, column chunk, split): b off the tiles; the forward's chunks and splits cut the band
FWD_SHAPES = [(45, 8, 16, 32, 16), (100, 16, 8, 48, 24), (77, 16, 32, 64, 32), (150, 64, 128, 256, 128)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", FWD_SHAPES)
def test_forward_band_model_matches_float64_reference(layout, shape):
    b, bm, bn, chunk, per = shape
    img, txt, pos, ids, w = _sorted_case(layout, b, seed=b + bm)
    want_r, want_c = _masked64(img, txt, SCALE, pos, ids)[:2]
    got_r, got_c = _fwd_model(img, txt, SCALE, pos, ids, w, bm, bn, chunk, per)
    assert torch.isfinite(got_r).all() and torch.isfinite(got_c).all()
    torch.testing.assert_close(got_r.double(), want_r, rtol=0, atol=2e-5)
    torch.testing.assert_close(got_c.double(), want_c, rtol=0, atol=2e-5)
    if layout == "one":  # nothing but the positive left: exactly 0
        assert (got_r == 0).all() and (got_c == 0).all()


@pytest.mark.parametrize("mutant", ["no_row_guard", "no_col_guard", "band_without_w"])
def test_forward_band_model_catches_the_slips(mutant):
    """The reference check above fails on each slip of the band logic (NaN from an all-dropped
    row / column partial; duplicates outside the diagonal's tiles kept)."""
    b, bm, bn, chunk, per = FWD_SHAPES[1]
    img, txt, pos, ids, w = _sorted_case("big", b, seed=3)
    assert w >= 2 * max(bm, bn)
    want_r, want_c = _masked64(img, txt, SCALE, pos, ids)[:2]
    got_r, got_c = _fwd_model(img, txt, SCALE, pos, ids, w, bm, bn, chunk, per, mutant=mutant)
    bad = ~torch.isclose(got_r.double(), want_r, rtol=0, atol=2e-5).all()
    bad |= ~torch.isclose(got_c.double(), want_c, rtol=0, atol=2e-5).all()
    assert bad


STRIP_SHAPES = [(45, 45, 0, 8, 16), (100, 37, 29, 16, 8), (77, 50, 27, 16, 32), (150, 83, 67, 64, 128)]


def _strip_reference(img, txt, s, pos, ids, g_a, g_b, g_d, r, row_start):
    """float64 (s dX[strip], ds of the strip) by ``_dx_tile``'s formula (duplicates 0, the
    positives folded), from the float64 masked LSEs."""
    lr, lc, p, q, dot, kept = _masked64(img, txt, s, pos, ids)
    o = pos.double()
    ga, gb, gd = g_a.double()[:, None], g_b.double()[None, :], g_d.double()
    dx = torch.where(kept, ga * p + gb * q, 0.0)
    dx.diagonal().copy_(ga[:, 0] * p.diagonal() + g_b.double() * q.diagonal() - gd)
    qv = torch.where(kept, ga * p * (dot - o[:, None]) + gb * q * (dot - o[None, :]), 0.0)
    qv.diagonal().zero_()
    sl = slice(row_start, row_start + r)
    ds = qv[sl].sum() + ((g_a.double() + g_b.double() - gd) * o)[sl].sum()
    return s * dx[sl], ds, lr.float(), lc.float()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", STRIP_SHAPES)
def test_strip_band_model_matches_float64_reference(layout, shape):
    n, r, row_start, bm, bn = shape
    img, txt, pos, ids, w = _sorted_case(layout, n, seed=n + bn)
    g = torch.Generator().manual_seed(n)
    # the weights in few bits: g_a + g_b - g_d is 0 in fp32 and float64 alike (CLIP's g_d)
    g_a, g_b = (torch.randint(1, 64, (n,), generator=g) / 8192 for _ in range(2))
    g_d = g_a + g_b
    want, want_ds, lse_a, lse_b = _strip_reference(img, txt, SCALE, pos, ids, g_a, g_b, g_d, r, row_start)
    got, ds = _strip_model(img, txt, SCALE, lse_a, lse_b, pos, g_a, g_b, g_d, ids, w, r, row_start, bm, bn)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5 * float(want.abs().max()))
    torch.testing.assert_close(ds.double(), want_ds, rtol=1e-4, atol=1e-6)
    dup = (ids[row_start:row_start + r, None] == ids[None, :])
    dup[torch.arange(r), torch.arange(row_start, row_start + r)] = False
    assert (got[dup] == 0).all()  # duplicates: exactly 0 (not negatives)


def test_strip_band_model_catches_the_fold_order():
    """Zeroing the duplicates after the positives' fold zeroes P's diagonal: the check fails."""
    n, r, row_start, bm, bn = STRIP_SHAPES[1]
    img, txt, pos, ids, w = _sorted_case("small", n, seed=5)
    g_a = g_b = torch.full((n,), 1 / n)
    g_d = g_a + g_b
    want, _, lse_a, lse_b = _strip_reference(img, txt, SCALE, pos, ids, g_a, g_b, g_d, r, row_start)
    got, _ = _strip_model(img, txt, SCALE, lse_a, lse_b, pos, g_a, g_b, g_d, ids, w, r, row_start, bm, bn,
                          mutant="drop_after_positives")
    assert not torch.isclose(got.double(), want, rtol=0, atol=2e-5 * float(want.abs().max())).all()
