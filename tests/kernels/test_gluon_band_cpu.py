"""The Gluon kernels' band variant (duplicates "mask" on one process: ids sorted by group, the
kernels' BAND): what a CPU can check.

The argument checks (``gluon_common.band_args``: int32 ids with a band, on the positives'
square pair; the ring's ids without a band refused), the launches (the ids and w reach the
kernels with BAND on; without ids the three pointers are None and BAND off, the kernels of
before), the dispatch (``TritonTileOps`` sends the sorted-band case to the Gluon kernels only
when forced, never under "auto" until a GPU check passes; the ring never; tuner kinds of its
own) and the strip path passing the band through. The kernels' numbers: the GPU scripts
``check_gluon_fwd.py --band`` and ``check_gluon_strip.py --band``.
"""

import pytest
import torch

from infclip.kernels.clip import gluon_common, gluon_fwd, gluon_strip, launch, ops as ops_mod
from infclip.kernels.clip.ops import GLUON_MIN_ROWS, TritonTileOps

I32 = torch.int32


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
    assert all(x is y for x, y in zip(args[-3:], want))
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


def test_forward_dispatch_takes_gluon_for_the_band_only_when_forced(monkeypatch):
    monkeypatch.delenv("INFCLIP_FORWARD_KERNEL", raising=False)
    monkeypatch.setattr(gluon_fwd, "gluon_available", lambda a, b, cfg=None: True)
    big = torch.zeros(GLUON_MIN_ROWS, 512, dtype=torch.bfloat16)
    band = dict(has_gid=True, positives=True, offsets=True, band=True)
    ring = {**band, "band": False}
    plain = {**band, "has_gid": False, "band": False}
    auto, forced = TritonTileOps(), TritonTileOps(forward_kernel="gluon")
    assert not ops_mod.GLUON_BAND_AUTO  # until check_gluon_fwd.py --band passes on a GPU
    assert auto._forward_candidates(big, big, **band)[0] == "fwd"
    assert auto._forward_candidates(big, big, **plain)[0] == "fwd_gluon"  # without ids: as before
    kind, cands = forced._forward_candidates(big, big, **band)
    assert kind == "fwd_band_gluon_first" and isinstance(cands[0], gluon_fwd.GluonFwdConfig)
    assert kind != forced._forward_candidates(big, big, **plain)[0]  # tuner keys of its own
    assert forced._forward_candidates(big, big, **ring)[0] == "fwd"  # the ring: Triton only
    assert forced._forward_candidates(big, big, **{**band, "positives": False})[0] == "fwd"
    assert TritonTileOps(forward_kernel="triton")._forward_candidates(big, big, **band)[0] == "fwd"
    monkeypatch.setenv("INFCLIP_FORWARD_KERNEL", "gluon")
    assert TritonTileOps()._forward_candidates(big, big, **band)[0] == "fwd_band_gluon_first"
    monkeypatch.setattr(ops_mod, "GLUON_BAND_AUTO", True)  # the switch, once the GPU check passed
    assert auto._forward_candidates(big, big, **band)[0] == "fwd_band_gluon"


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


def test_strip_dispatch_takes_gluon_for_the_band_only_when_forced(monkeypatch):
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
    assert not auto._gluon_strip_ok(gd, off, ids, band)  # "auto": the Triton fills, tuned as before
    monkeypatch.setattr(ops_mod, "GLUON_BAND_AUTO", True)
    assert auto._gluon_strip_ok(gd, off, ids, band)  # the switch, once the GPU check passed
    monkeypatch.setattr(ops_mod, "GLUON_BAND_AUTO", False)
    assert auto._strip_candidates(big, big, True, banded=True)[0] == "strip"  # "auto": Triton until checked
    assert auto._strip_candidates(big, big, True)[0] == "strip_gluon"  # without ids: as before
    kind, cands = forced._strip_candidates(big, big, True, banded=True)
    assert kind == "strip_band_gluon_first" and isinstance(cands[0], gluon_strip.GluonStripConfig)
    assert forced._strip_candidates(big, big, True)[0] == "strip_gluon_first"  # a key of its own
    assert forced._strip_candidates(big, big, False, banded=True)[0] == "strip"  # gluon_ok False (the ring)
    monkeypatch.setenv("INFCLIP_STRIP_KERNEL", "gluon")
    assert TritonTileOps()._strip_candidates(big, big, True, banded=True)[0] == "strip_band_gluon_first"
