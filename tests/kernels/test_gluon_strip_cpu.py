"""The Gluon strip fill (``infclip.kernels.clip.gluon_strip``): what a CPU can check.

The module imports without a GPU, refuses CPU tensors, and its host arithmetic is right:
ring depth within shared memory, the persistent grid and the d scale slots (each tile filled
by exactly one consumer, the slots written all below the strip's tile count, so within
``grad_rows_strips``' per-strip reservation). The kernel's mbarrier protocol (one shared ring,
turn-taking consumers) is checked on a model of its code: random interleavings of a producer,
two consumers and out-of-order TMA completions never deadlock, never read a slot before its
chunk landed and never overwrite one before it was released. On a CUDA machine one test
compares it with the Triton fill at a small shape (or checks that it refuses where it does not
apply). The full grid and timings: ``scripts/tools/check_gluon_strip.py``.
"""

import random

import pytest
import torch

from infclip.kernels.clip import gluon_strip
from infclip.kernels.clip.launch import SMEM_BYTES, StripConfig
from infclip.kernels.launching import cdiv


def test_module_imports_and_refuses_cpu_tensors():
    a = torch.zeros(256, 512, dtype=torch.bfloat16)
    assert not gluon_strip.gluon_strip_available(a, a)
    flags = dict(HAS_OFF=2, HAS_DIAG=False, HAS_GID=False)
    v = torch.zeros(256)
    with pytest.raises(ValueError, match="does not apply"):
        gluon_strip.fill_strip_gluon(a, a, torch.tensor(1.0), v, v, v, v, v, v, v, torch.empty(64, 256, dtype=a.dtype),
                                     torch.zeros(8), v, 64, 0, gluon_strip.default_config(512), "tf32", True, flags)


def test_budget_matches_the_triton_launcher():
    assert gluon_strip.SMEM_BYTES == SMEM_BYTES


@pytest.mark.parametrize("bm, bn", [(128, 128), (64, 256), (32, 128), (64, 96)])
def test_configs_that_spill_or_do_not_map_to_wgmma_are_refused(bm, bn):
    with pytest.raises(ValueError, match="GluonStripConfig"):
        gluon_strip.GluonStripConfig(BM=bm, BN=bn)
    with pytest.raises(ValueError, match="regs"):
        gluon_strip.GluonStripConfig(regs=100)


def test_config_reads_like_a_strip_config():
    """grad_rows_strips reads BM, BN (ds slots per strip), BK, tma, fast_off of its config."""
    cfg = gluon_strip.GluonStripConfig()
    ref = StripConfig(128, 128, 64, tma=True)
    for name in ("BM", "BN", "BK", "tma", "fast_off"):
        assert type(getattr(cfg, name)) is type(getattr(ref, name))
    assert cfg.BK == 64 and cfg.tma and cfg.fast_off


@pytest.mark.parametrize("bm, bn", [(64, 128), (128, 64), (64, 64)])
def test_ring_depth_fits_shared_memory(bm, bn):
    cfg = gluon_strip.GluonStripConfig(BM=bm, BN=bn)
    stages = gluon_strip.pick_stages(cfg)
    assert 2 <= stages <= gluon_strip.MAX_STAGES
    assert gluon_strip.smem_bytes(cfg, stages) <= SMEM_BYTES
    assert stages == gluon_strip.MAX_STAGES or gluon_strip.smem_bytes(cfg, stages + 1) > SMEM_BYTES
    assert gluon_strip.pick_stages(gluon_strip.GluonStripConfig(BM=bm, BN=bn, stages=3)) == 3
    assert gluon_strip.pick_stages(gluon_strip.GluonStripConfig(BM=bm, BN=bn, stages=40)) == 0


def test_tune_candidates():
    for k in (512, 768, 1024, 4096):  # the ring holds K chunks: any K that is a multiple of 64
        cands = gluon_strip.tune_candidates(k)
        assert [(c.BM, c.BN) for c in cands] == [(64, 128), (128, 64)]
        assert all(gluon_strip.pick_stages(c) == 7 for c in cands)  # compiled for sm_90a at these (triton 3.6)
        assert all(c.BM * c.GROUP == 1024 for c in cands)  # the Triton kernel's 8 x 128 rows per L2 group
    assert gluon_strip.tune_candidates(520) == []


def _assignment(tiles: int, progs: int) -> dict:
    """{(program, consumer): [tiles]} as the kernel assigns them: program p's local tiles
    p, p + P, ... alternate between its consumers (0: even local index, 1: odd)."""
    out = {}
    for p in range(progs):
        mine = list(range(p, tiles, progs))
        for c in (0, 1):
            out[(p, c)] = mine[c::2]
    return out


@pytest.mark.parametrize("sms", [1, 3, 132])
@pytest.mark.parametrize("r, n", [(1, 1), (63, 1000), (1000, 1000), (1000, 65536), (4096, 1000), (896, 8)])
@pytest.mark.parametrize("bm, bn", [(64, 128), (128, 64)])
def test_each_tile_once_and_ds_slots_within_the_strips_reservation(sms, r, n, bm, bn):
    cfg = gluon_strip.GluonStripConfig(BM=bm, BN=bn)
    tiles = gluon_strip.strip_tiles(r, n, cfg)
    progs = gluon_strip.strip_programs(tiles, sms)
    assert 1 <= progs <= min(tiles, sms)
    work = _assignment(tiles, progs)
    assert sorted(t for ts in work.values() for t in ts) == list(range(tiles))
    # Consumer C of program p writes slot p + C * P iff it had a tile (the kernel's n_my > C).
    slots = [p + c * progs for (p, c), ts in work.items() if ts]
    assert len(set(slots)) == len(slots)
    assert sorted(slots) == list(range(gluon_strip.ds_slots(tiles, progs)))
    # grad_rows_strips reserves cdiv(rows, BM) * cdiv(n, BN) slots per strip; a strip has r <= rows.
    for rows in (r, r + 1, 4 * r):
        assert gluon_strip.ds_slots(tiles, progs) <= cdiv(rows, cfg.BM) * cdiv(n, cfg.BN)


# -- the kernel's barrier protocol, on a model ---------------------------------------------------

class _Barrier:
    """An mbarrier of count 1: phase = completed phases; wait(parity) passes once the phase
    with that parity completed (a fresh barrier: parity 1 counts as completed)."""

    def __init__(self):
        self.phase = 0

    def passes(self, parity: int) -> bool:
        return self.phase % 2 != parity

    def arrive(self):
        self.phase += 1


def _simulate(n_tiles: int, nk: int, stages: int, seed: int) -> list:
    """Run the producer and both consumers of one program (module docs) in a random
    interleaving, TMA loads completing in random order; returns the MMA phases' tile order."""
    ready = [_Barrier() for _ in range(stages)]
    empty = [_Barrier() for _ in range(stages)]
    turn = [_Barrier(), _Barrier()]
    slot_chunk = [None] * stages  # the chunk a slot holds (set when its TMA load lands)
    released = set()  # chunks whose slot went back to the producer
    pending = []  # (slot, chunk) loads in flight
    mma_order = []

    def producer():
        for g in range(n_tiles * nk):
            slot = g % stages
            yield empty[slot], ((g // stages) & 1) ^ 1
            assert g < stages or g - stages in released, f"chunk {g} overwrites chunk {g - stages} in use"
            pending.append((slot, g))

    def consumer(c):
        for t in range(c, n_tiles, 2):
            if t > 0:
                yield turn[c], (max(t - 1, 0) // 2) & 1
            mma_order.append(t)
            for k in range(nk):
                g = t * nk + k
                slot = g % stages
                yield ready[slot], (g // stages) & 1
                assert slot_chunk[slot] == g, f"chunk {g} read from a slot holding {slot_chunk[slot]}"
                if k > 0:  # the previous chunk's wgmma retired (wait(num_outstanding=1)): release it
                    released.add(g - 1)
                    empty[(g - 1) % stages].arrive()
            released.add(t * nk + nk - 1)
            empty[(t * nk + nk - 1) % stages].arrive()
            turn[1 - c].arrive()

    rng = random.Random(seed)
    agents = {"p": producer(), "c0": consumer(0), "c1": consumer(1)}
    waiting = {name: next(gen, None) for name, gen in agents.items()}
    while any(w is not None for w in waiting.values()) or pending:
        runnable = [name for name, w in waiting.items() if w is not None and w[0].passes(w[1])]
        choices = runnable + (["tma"] if pending else [])
        assert choices, "deadlock"
        pick = rng.choice(choices)
        if pick == "tma":
            slot, g = pending.pop(rng.randrange(len(pending)))
            slot_chunk[slot] = g
            ready[slot].arrive()
        else:
            waiting[pick] = next(agents[pick], None)
    return mma_order


@pytest.mark.parametrize("nk, stages", [(8, 7), (12, 7), (16, 7), (8, 12), (2, 3), (1, 2), (16, 2)])
@pytest.mark.parametrize("n_tiles", [1, 2, 5, 8])
def test_ring_and_turn_protocol_on_a_model(nk, stages, n_tiles):
    for seed in range(20):
        assert _simulate(n_tiles, nk, stages, seed) == list(range(n_tiles))


# -- GPU ---------------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares with the Triton strip fill on the GPU")
@pytest.mark.parametrize("diag", [True, False])
def test_gluon_matches_triton_on_the_gpu(diag):
    from infclip.kernels.clip import launch
    from infclip.kernels.clip.ops import TritonTileOps
    from infclip.loss.function import positive_dots

    torch.manual_seed(0)
    m, n, k, r, r0 = 1000, 1000 if diag else 776, 512, 300, 411
    img = torch.nn.functional.normalize(torch.randn(m, k, device="cuda"), dim=1)
    txt = torch.nn.functional.normalize(img + 0.7 * torch.randn_like(img), dim=1)
    img, txt = img.bfloat16(), txt[:n].bfloat16().contiguous()
    pos_a = positive_dots(img[:n], txt)
    o_a = torch.cat([pos_a, pos_a[: m - n]]) if m > n else pos_a
    o_b = pos_a[:n].contiguous()
    s = torch.tensor(1 / 0.07, device="cuda")
    lse_a, lse_b = TritonTileOps(forward_kernel="triton").forward(img, txt, s, offsets=(o_a, o_b), diag=diag)
    g_a, g_b = torch.full((m,), 1 / (2 * m), device="cuda"), torch.full((n,), 1 / (2 * m), device="cuda")
    off_a, off_b, gd, flags = launch._vecs(img, o_a, o_b, (g_a + g_b) if diag else None, True)
    flags["HAS_GID"] = False
    cfg = gluon_strip.default_config(k)
    if not gluon_strip.gluon_strip_available(img, txt, cfg):  # not sm_90 / no Gluon here: it must refuse
        with pytest.raises(ValueError):
            scratch = torch.empty(r, n, device="cuda", dtype=img.dtype)
            gluon_strip.fill_strip_gluon(img, txt, s, lse_a, lse_b, off_a, off_b, g_a, g_b, gd, scratch,
                                         torch.zeros(64, device="cuda"), s, r, r0, cfg, "tf32", True, flags)
        return

    def run(fill, c):
        p = torch.full((r, n), float("nan"), device="cuda", dtype=img.dtype)
        ds = torch.zeros(cdiv(r, c.BM) * cdiv(n, c.BN), device="cuda")
        fill(img, txt, s, lse_a, lse_b, off_a, off_b, g_a, g_b, gd, p, ds, s, r, r0, c, "tf32", True, flags,
             cdiv(r, c.BM) * cdiv(n, c.BN))
        return p, ds.sum()

    want_p, want_ds = run(launch._fill_tma, launch.strip_candidates(k, 2)[0])
    got_p, got_ds = run(gluon_strip.fill_strip_gluon, cfg)
    assert not got_p.isnan().any()
    torch.testing.assert_close(got_p.float(), want_p.float(), rtol=2 ** -7, atol=1e-6)
    torch.testing.assert_close(got_ds, want_ds, rtol=1e-5, atol=0)


def test_strip_kernel_option(monkeypatch):
    from infclip.kernels.clip.ops import GLUON_MIN_ROWS, STRIP_KERNEL_DEFAULT, TritonTileOps

    assert STRIP_KERNEL_DEFAULT == "auto"  # scripts/tools/check_gluon_strip.py passed on an H200 (commit 4221a99)
    with pytest.raises(ValueError, match="strip_kernel"):
        TritonTileOps(strip_kernel="cutlass")
    monkeypatch.setenv("INFCLIP_STRIP_KERNEL", "triton")
    assert TritonTileOps().strip_kernel == "triton"
    big = torch.zeros(GLUON_MIN_ROWS, 512, dtype=torch.bfloat16)
    monkeypatch.setattr(gluon_strip, "gluon_strip_available", lambda a, b, cfg=None: True)
    assert TritonTileOps()._strip_candidates(big, big, True)[0] == "strip"  # "triton": Triton only
    monkeypatch.delenv("INFCLIP_STRIP_KERNEL")
    assert TritonTileOps().strip_kernel == "auto"
    auto = TritonTileOps()
    kind, cands = auto._strip_candidates(big, big, True)
    assert kind == "strip_gluon" and isinstance(cands[-1], gluon_strip.GluonStripConfig)
    assert not isinstance(cands[0], gluon_strip.GluonStripConfig)
    assert auto._strip_candidates(big, big, False)[0] == "strip"  # group ids / unfolded positives / no offsets
    assert auto._strip_candidates(big, big[:100], True)[0] == "strip"  # few columns: the graph regime
    kind, cands = TritonTileOps(strip_kernel="gluon")._strip_candidates(big, big[:100], True)
    assert kind == "strip_gluon_first" and isinstance(cands[0], gluon_strip.GluonStripConfig)


def test_gluon_strip_ok_follows_the_fill_kinds():
    from infclip.kernels.clip.ops import TritonTileOps

    off, gd, gid = torch.zeros(4), torch.ones(4), torch.zeros(4, dtype=torch.int32)
    fold, fixup = TritonTileOps(), TritonTileOps(strip_positives="fixup")
    assert fold._gluon_strip_ok(gd, off, None) and fold._gluon_strip_ok(None, off, None)
    assert not fold._gluon_strip_ok(gd, None, None)  # no offsets: the kernel's shift is the offsets'
    assert not fold._gluon_strip_ok(gd, off, gid)  # the ring's group ids (no band): the Triton fill only
    assert not fixup._gluon_strip_ok(gd, off, None) and fixup._gluon_strip_ok(None, off, None)


def test_grad_rows_strips_dispatches_a_gluon_config(monkeypatch):
    from infclip.kernels.clip import launch

    calls = []

    def fake_fill(a, b, scale, lse_a, lse_b, o_a, o_b, g_a, g_b, gd, scratch, ds_part, d_vec, r, r0, cfg, prec,
                  fold, flags, tiles, gid_a, gid_b, band=None):
        calls.append((r0, r, cfg, tiles, flags["HAS_OFF"]))
        scratch[:r].zero_()
        ds_part[0] = 1.0

    monkeypatch.setattr(gluon_strip, "fill_strip_gluon", fake_fill)
    monkeypatch.setattr(launch, "sm_count", lambda device: 2)  # a CPU tensor: no SMs to count
    a, b = torch.randn(10, 64, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)
    cfg = gluon_strip.GluonStripConfig()
    out = torch.empty_like(a)
    ds = launch.grad_rows_strips(a, b, torch.tensor(2.0), torch.zeros(10), torch.zeros(8), torch.ones(10),
                                 torch.ones(8), out, 4, cfg, "tf32", off_a=torch.zeros(10), off_b=torch.zeros(8))
    assert [c[:2] for c in calls] == [(0, 4), (4, 4), (8, 2)]  # strips of 4 rows, each through the Gluon fill
    assert all(c[2] is cfg and c[3] == gluon_strip.strip_tiles(c[1], 8, cfg) and c[4] == 2 for c in calls)
    assert float(ds) == 3.0 and (out == 0).all()


def test_ds_slots_per_strip_are_what_the_fills_write(monkeypatch):
    """One slot per program for the persistent kernels, not one per tile: at b = 1M, c = 1024
    one per 64 x 128 tile would be 512 MB beside the strip scratch."""
    from infclip.kernels.clip import launch

    monkeypatch.setattr(launch, "sm_count", lambda device: 132)
    dev = torch.device("cpu")
    tiles = launch.cdiv(6656, 64) * launch.cdiv(1 << 20, 128)  # one 1M-column strip of 6,656 rows
    glu = launch._ds_slots(gluon_strip.GluonStripConfig(), tiles, dev, use_tma=True)
    assert glu == gluon_strip.ds_slots(tiles, 132) == 264  # two consumers per program
    tma_cfg = launch.strip_candidates(512, 2)[0]
    assert launch._ds_slots(tma_cfg, tiles, dev, use_tma=True) == launch.tma_programs(dev, tiles, tma_cfg.per_sm)
    assert launch._ds_slots(tma_cfg, tiles, dev, use_tma=True) < 100  # 3 "SMs" off CUDA (tma_programs)
    assert launch._ds_slots(tma_cfg, tiles, dev, use_tma=False) == tiles  # the pointer kernel: one per tile
    assert launch._ds_slots(gluon_strip.GluonStripConfig(), 3, dev, use_tma=True) == 3  # fewer tiles than programs
