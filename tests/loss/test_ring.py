"""The ring loss on W gloo ranks equals one process on the concatenated global batch.

Each test launches 3 or 4 processes that run this file as a script (``case`` argument);
the assertions run inside the ranks and a failing rank exits non-zero with its traceback.
Every launch has a wall-clock bound, so a deadlocked ring fails instead of hanging CI.
Ground truth: the full b x b matrix in float64 on every rank (the data are seeded).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _gloo_launch import init_rank, launch  # noqa: E402

C = 37  # feature dim, not a power of two


def test_ring_matches_single_process_w2_w3_w4_and_subgroups(tmp_path):
    launch(__file__, "equivalence", 4, tmp_path)


def test_ring_errors_slow_ranks_and_triton_tiles(tmp_path):
    """Errors, lagging ranks, and the ring with ``TritonTileOps`` (the CUDA path's tiles) run
    on CPU by the Triton interpreter, on the subgroup {0, 2}."""
    launch(__file__, "robustness", 3, tmp_path)


@pytest.mark.parametrize("world, m, tile", [(1, 5, 1024), (3, 7, 3), (4, 6, 4)])
def test_loopback_ring_equals_w_copies_of_the_batch(world, m, tile):
    """One process, no communication: the ring schedule on W identical ranks (float64)."""
    from infclip.loss import _tiled_loss
    from infclip.loss.ring import LoopbackRing
    from infclip.loss.tiled import TorchTileOps

    img, txt, scale = global_batch(1, m, seed=world)
    ref_loss, ref_di, ref_dt, ref_ds = reference(img.repeat(world, 1), txt.repeat(world, 1), scale, world)
    i, t, s = (x.double().requires_grad_() for x in (img, txt, scale))
    loss = _tiled_loss(i, t, s, TorchTileOps(tile=tile), LoopbackRing(world))
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(i.grad, ref_di[:m], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(t.grad, ref_dt[:m], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s.grad * world, ref_ds, rtol=1e-10, atol=0)  # W ranks' parts


@pytest.mark.parametrize("world, m, tile", [(2, 7, 3), (3, 5, 1024)])
def test_last_tile_in_chunks_sends_each_chunk_home_before_the_next(monkeypatch, world, m, tile):
    """With chunking on (``HOME_CHUNK_MIN_ROWS`` = 2 here) the backward's last tile runs in
    column chunks and each chunk's finished dT is posted home before the next chunk's tile
    (the hop overlaps compute); the result is still the float64 reference's."""
    from infclip.loss import _tiled_loss, ring
    from infclip.loss.tiled import TorchTileOps

    monkeypatch.setattr(ring, "HOME_CHUNK_MIN_ROWS", 2)
    events = []

    class Spy(TorchTileOps):
        def backward(self, img, txt, *a, **kw):
            events.append(("tile", txt.shape[0]))
            return super().backward(img, txt, *a, **kw)

    class SpyRing(ring.LoopbackRing):
        def post(self, sends, recvs):
            events.append(("post", tuple(x.shape[0] for x in sends)))
            return super().post(sends, recvs)

    img, txt, scale = global_batch(1, m, seed=world + m)
    ref_loss, ref_di, ref_dt, ref_ds = reference(img.repeat(world, 1), txt.repeat(world, 1), scale, world)
    i, t, s = (x.double().requires_grad_() for x in (img, txt, scale))
    loss = _tiled_loss(i, t, s, Spy(tile=tile), SpyRing(world))
    events.clear()
    loss.backward()
    cuts = ring.home_cuts(m)
    n, widths = len(cuts) - 1, [b - a for a, b in zip(cuts, cuts[1:])]
    assert n >= 2
    tail = [e for w in widths for e in (("tile", w), ("post", (w,)))]
    assert events[-2 * n:] == tail, events  # tile j, then its hop, then tile j + 1
    assert [e for e in events if e[0] == "tile"][:world - 1] == [("tile", m)] * (world - 1)  # earlier tiles whole
    torch.testing.assert_close(i.grad, ref_di[:m], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(t.grad, ref_dt[:m], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s.grad * world, ref_ds, rtol=1e-10, atol=0)


@pytest.mark.parametrize("m, min_rows, want", [
    (131072, 8192, [0, 65536, 98304, 114688, 131072]),  # 4 chunks: m/2, m/4, m/8, m/8
    (32768, 8192, [0, 16384, 24576, 32768]),  # 3: the narrowest stays >= 8192
    (16384, 8192, [0, 8192, 16384]),
    (16383, 8192, [0, 16383]),  # the tile whole
    (7, 2, [0, 4, 7]),
    (33, 2, [0, 17, 25, 29, 33]),
])
def test_home_cuts_halve_down_to_the_narrowest_chunk(monkeypatch, m, min_rows, want):
    from infclip.loss import ring

    monkeypatch.setattr(ring, "HOME_CHUNK_MIN_ROWS", min_rows)
    assert ring.home_cuts(m) == want


@pytest.mark.parametrize("world", [1, 3])
def test_one_pass_tiles_sum_into_the_rings_fp32_buffers(monkeypatch, world):
    """A one-pass backend (here ``TorchTileOps``) gets the ring's fp32 dI sum (the same buffer
    at every step) and a zeroed fp32 dT buffer per tile, and the pool holds three (m, c) dT
    buffers at most (arriving, leaving, the tile's): no fresh per-tile gradient."""
    from infclip.loss import _tiled_loss, ring
    from infclip.loss.tiled import TorchTileOps

    seen, made = [], []

    class Spy(TorchTileOps):
        def backward(self, img, txt, scale, row_lse, col_lse, g_row, g_col, dimg=None, dtxt=None, **kw):
            seen.append((dimg, dtxt, float(dtxt.abs().max()) if dtxt is not None else None))
            return super().backward(img, txt, scale, row_lse, col_lse, g_row, g_col, dimg, dtxt, **kw)

    take = ring._Pool.take
    monkeypatch.setattr(ring._Pool, "take", lambda self, zero: made.append(not self.free) or take(self, zero))
    img, txt, scale = global_batch(1, 6, seed=2)
    i, t, s = (x.clone().requires_grad_() for x in (img, txt, scale))
    _tiled_loss(i, t, s, Spy(tile=4), ring.LoopbackRing(world)).backward()
    assert len(seen) == world and all(d is seen[0][0] and d.dtype == torch.float32 for d, _, _ in seen)
    assert all(dt.dtype == torch.float32 and mx == 0 for _, dt, mx in seen)
    assert sum(made) == min(world, 3)  # world 1: the tile's buffer is the result


def rule_bytes(m: int, c: int, esize: int) -> int:
    """The extra-memory rule for m rows: the two feature gradients + fp32 accumulators of
    both (4 c bytes per sample each) + 1 KB x m + 64 MB."""
    return 2 * m * c * esize + 2 * 4 * m * c + 1024 * m + (64 << 20)


@pytest.mark.parametrize("c", [512, 1024])
def test_ring_backward_extra_memory_per_rank(c):
    """Arithmetic of ``ring.backward_extra_bytes`` (bf16, m local rows): the one-pass ring holds
    the rule's fp32 accumulators (its dI sum and the tile's dT) and, beyond the rule, only its
    communication buffers (two text blocks and two fp32 dT accumulators in flight: the price
    of never waiting for a transfer) and its tiles' taller strips (4 c bytes a row: the room of
    the second accumulator the one-pass tiles never allocate). The plain strip scratch (64 MB +
    768 B x m) fits the rule's 64 MB + 1 KB x m. Without the strip room it holds 4 c bytes per
    row less than the one-pass tiles did when they wrote fresh bf16 gradients (plus their own
    fp32 dT accumulator) for the ring to sum."""
    from infclip.kernels.clip import launch as strips
    from infclip.loss.ring import backward_extra_bytes

    for m in (1024, 16384, 65536, 262144, 1 << 20):
        one = backward_extra_bytes(m, c, 2, in_place=True)
        comm = one["text receive buffers (2)"] + one["fp32 dT arriving + leaving"]
        room = one["strip room of the tile"]
        assert room == strips.onepass_spare_bytes(m, m, c, True)
        scratch = (64 << 20) + 768 * m
        grads = 2 * m * c * 2  # the returned bf16 feature gradients, made after the ring from its fp32 sums
        assert sum(one.values()) - comm - room + scratch + grads <= rule_bytes(m, c, 2), (m, c, one)
        old_onepass = sum(backward_extra_bytes(m, c, 2, in_place=False).values()) + 4 * m * c
        assert sum(one.values()) - room == old_onepass - 4 * m * c


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_loopback_ring_triton_onepass_in_place(monkeypatch, dtype):
    """The ring with the one-pass Triton tiles (interpreted; 16-row strips, NaN-poisoned buffers)
    summing into its fp32 buffers, against float64: fp32 within 1e-5; bf16 no worse than the
    same tiles writing fresh bf16 gradients that the ring sums (the path before). Summing in
    place, every tile's strips are offered the spare accumulator room (``spare_room``), as the
    fresh tiles' are."""
    from infclip.kernels.clip import TritonTileOps, launch
    from infclip.loss import _tiled_loss, ring

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(launch, "strip_rows", lambda *args, **kwargs: 16)
    offered = []  # onepass_spare_bytes' ``roomy``: whether the strips may take the room
    monkeypatch.setattr(launch, "onepass_spare_bytes", lambda m, n, k, roomy, in_place=True: offered.append(roomy) or 0)
    world, m = 2, 37
    img, txt, scale = global_batch(1, m, seed=4)
    ref = reference(img.repeat(world, 1), txt.repeat(world, 1), scale, world)
    ops = TritonTileOps(poison=True, strips="always", backward="onepass", cuda_graphs="never")
    errs = {}
    for name, in_place in (("in place", True), ("fresh", False)):
        monkeypatch.setattr(ring, "sums_in_place", lambda ops, img, v=in_place: v)
        i, t = (x.to(dtype, copy=True).requires_grad_() for x in (img, txt))
        s = scale.clone().requires_grad_()
        loss = _tiled_loss(i, t, s, ops, ring.LoopbackRing(world))
        offered.clear()
        loss.backward()
        assert len(offered) == world and all(offered), (name, offered)
        errs[name] = [rel_err(loss.detach(), ref[0][0], 1.0), rel_err(i.grad, ref[1][:m]),
                      rel_err(t.grad, ref[2][:m]), rel_err(s.grad * world, ref[3], world)]
    if dtype == torch.float32:
        assert max(errs["in place"]) < 1e-5, errs
    else:
        assert max(errs["in place"]) < 2e-2, errs
        for e1, e2 in zip(errs["in place"], errs["fresh"]):
            assert e1 <= 1.1 * e2 + 1e-6, errs


@pytest.mark.parametrize("chunked", [False, True], ids=["last_tile_whole", "last_tile_in_chunks"])
@pytest.mark.parametrize("dup", [None, "mask"])
@pytest.mark.parametrize("in_place", [True, False], ids=["onepass_in_place", "twopass_fresh"])
def test_loopback_ring_forms_no_image_gradient_for_locked_images(monkeypatch, in_place, dup, chunked):
    """LiT on a ring: image features without gradient. The Triton tiles form no dI (one-pass:
    no P @ T product at all; two-pass: half the products), and the text gradient and d scale
    are those of the same ring with both sides wanted: bit-identical dT, d scale up to
    summation order; also with duplicates masked, and with the last tile in column chunks
    (2 of 19 and 18 texts; duplicates keep it whole)."""
    from infclip.kernels import launching
    from infclip.kernels.clip import TritonTileOps, launch
    from infclip.loss import _tiled_loss, ring
    from infclip.loss.duplicates import Duplicates

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(launch, "strip_rows", lambda *args, **kwargs: 16)
    monkeypatch.setattr(ring, "sums_in_place", lambda ops, img: in_place)
    if chunked:
        monkeypatch.setattr(ring, "HOME_CHUNK_MIN_ROWS", 16)
    products = []
    real = launching.product_into
    monkeypatch.setattr(launching, "product_into", lambda *a, **k: products.append(1) or real(*a, **k))
    world, m = 2, 37
    img, txt, scale = global_batch(1, m, seed=5)
    ids = Duplicates("mask", torch.arange(m) // 3) if dup else None  # groups of three
    ops = TritonTileOps(poison=True, strips="always", backward="onepass" if in_place else "twopass",
                        cuda_graphs="never")
    img, txt = img.bfloat16(), txt.bfloat16()
    both = [x.clone().requires_grad_() for x in (img, txt, scale)]
    _tiled_loss(*both, ops, ring.LoopbackRing(world), ids).backward()
    made_both = len(products)
    locked, t, s = img.clone(), txt.clone().requires_grad_(), scale.clone().requires_grad_()
    _tiled_loss(locked, t, s, ops, ring.LoopbackRing(world), ids).backward()
    assert torch.equal(t.grad, both[1].grad)
    assert abs(s.grad.item() - both[2].grad.item()) <= 1e-5 * max(1.0, abs(both[2].grad.item()))
    if chunked and dup is None:  # the last tile as 2 chunk tiles of 3 image strips each
        strips, text_strips = 3 + 2 * 3, 3 + 2 * 2  # text strips: 3 of 37 rows, then 2 of 19 and 2 of 18
        assert (made_both, len(products) - made_both) == ((strips, 0) if in_place else
                                                          (strips + text_strips, text_strips))
        return
    strips = world * 3  # block pairs x 16-row strips of 37 rows
    assert (made_both, len(products) - made_both) == ((strips, 0) if in_place else (2 * strips, strips))


# -- ranks (child side) ---------------------------------------------------------------------


def global_batch(world: int, m: int, seed: int, *, peaked: bool = False):
    """Seeded (b, C) float32 images/texts (L2-normalized) and scale; same on every rank."""
    g = torch.Generator().manual_seed(seed)
    img = torch.nn.functional.normalize(torch.randn(world * m, C, generator=g), dim=-1)
    noise = torch.randn(world * m, C, generator=g)
    txt = torch.nn.functional.normalize(img + (0.3 if peaked else 3.0) * noise, dim=-1)
    scale = torch.tensor(50.0 if peaked else 1 / 0.07)
    return img, txt, scale


def reference(img, txt, scale, world: int, dtype=torch.float64):
    """Per-rank losses L_q and the gradients of sum_q L_q (the DDP-summed objective), one process."""
    i, t, s = (x.to(dtype).requires_grad_() for x in (img, txt, scale))
    x = s * i @ t.T
    per_row = 0.5 * (x.logsumexp(1) + x.logsumexp(0)) - x.diagonal()
    losses = per_row.view(world, -1).mean(1)
    losses.sum().backward()
    return losses.detach(), i.grad, t.grad, s.grad


def rel_err(got, want, floor: float = 0.0) -> float:
    """max |got - want| / max(max |want|, floor)."""
    got, want = got.double(), want.double()
    return float((got - want).abs().max() / max(float(want.abs().max()), floor, 1e-30))


def run_case(loss_fn, img, txt, scale, group, tag: str, tol: float = 1e-5):
    """One rank's loss + grads vs the float64 reference; scale grads summed over the group.

    Tolerance ``tol``, relative; feature gradients relative to the whole global gradient's
    max (one rank's slice can be tiny when its pairs are nearly solved). A loss, or d(sum L)/ds, can be a small difference of large
    terms (near-duplicate pairs, tiny batches), which no float32 code resolves to 1e-5 of
    itself; so their errors are relative to at least 1 (a loss) and W (d(sum_q L_q)/ds is a
    sum of W per-rank terms, each a difference of means of |<I_i, T_j>| <= 1).
    """
    import torch.distributed as dist

    from infclip.loss import global_mean_loss

    world, r = dist.get_world_size(group), dist.get_rank(group)
    m = img.shape[0] // world
    ref_loss, ref_di, ref_dt, ref_ds = reference(img, txt, scale, world)
    i, t = (x[r * m:(r + 1) * m].clone().requires_grad_() for x in (img, txt))
    s = scale.clone().requires_grad_()
    loss = loss_fn(i, t, s, group)
    loss.backward()
    ds = s.grad.clone()
    dist.all_reduce(ds, group=group)  # what DDP's average gives, times W
    sl = slice(r * m, (r + 1) * m)
    errs = {
        "loss": rel_err(loss.detach(), ref_loss[r], 1.0),
        "global_mean": rel_err(global_mean_loss(loss, group), ref_loss.mean(), 1.0),
        "dimg": rel_err(i.grad, ref_di[sl], float(ref_di.abs().max())),
        "dtxt": rel_err(t.grad, ref_dt[sl], float(ref_dt.abs().max())),
        "dscale(sum over ranks)": rel_err(ds, ref_ds, world),
    }
    bad = {k: f"{v:.2e}" for k, v in errs.items() if not v <= tol}
    assert not bad, f"{tag} (W={world}, group rank {r}, m={m}): rel errors {bad} > {tol}"


def _impls():
    from infclip.loss import _tiled_loss, clip_loss
    from infclip.loss.tiled import TorchTileOps

    return {
        "ring": lambda i, t, s, g: clip_loss(i, t, s, impl="torch", group=g),
        "ring_tile3": lambda i, t, s, g: _tiled_loss(i, t, s, TorchTileOps(tile=3), g),
        "vanilla": lambda i, t, s, g: clip_loss(i, t, s, impl="vanilla", group=g),
        "local": lambda i, t, s, g: clip_loss(i, t, s, impl="local", group=g),
    }


def with_chunked_home(fn):
    """Runs ``fn`` with the backward's last tile in column chunks down to 2 texts."""
    from infclip.loss import ring

    keep, ring.HOME_CHUNK_MIN_ROWS = ring.HOME_CHUNK_MIN_ROWS, 2
    try:
        fn()
    finally:
        ring.HOME_CHUNK_MIN_ROWS = keep


def case_equivalence():
    """W = 2, 3, 4 (prefix groups) and the non-contiguous subgroup {1, 3}; odd m, C = 37."""
    import torch.distributed as dist

    rank, _ = init_rank()
    groups = [(members, dist.new_group(members)) for members in ([0, 1], [0, 1, 2], [0, 1, 2, 3], [1, 3])]
    for members, group in groups:
        if rank not in members:
            continue
        world = len(members)
        for m, peaked in ((5, False), (7, True), (1, False)):
            img, txt, scale = global_batch(world, m, seed=10 * world + m, peaked=peaked)
            for name, fn in _impls().items():
                run_case(fn, img, txt, scale, group, f"{name} members={members} peaked={peaked}")
            with_chunked_home(lambda: run_case(_impls()["ring_tile3"], img, txt, scale, group,
                                               f"ring_tile3, last tile in chunks, members={members} m={m}"))
        home_hop_in_the_gradients_dtype(group, world)
        with_chunked_home(lambda: home_hop_in_the_gradients_dtype(group, world))
    dist.barrier()


def home_hop_in_the_gradients_dtype(group, world: int) -> None:
    """bf16 features: the finished dT accumulator makes its last hop in bf16 (the sends of the
    backward's last post), and the text gradient is bit for bit the fp32 accumulator rounded to
    bf16, as when the hop was fp32; SigLIP's ring the same. The image gradient never travels.
    (Run once whole and once with the last tile in chunks: m = 6, 3 chunks of 2.)"""
    import torch.distributed as dist

    from infclip.loss import clip_loss, ring, siglip_loss
    from infclip.loss.function import positive_dots
    from infclip.loss.tiled import TorchTileOps

    r, m = dist.get_rank(group), 6
    img, txt, scale = global_batch(world, m, seed=77 + world)
    i, t = (x[r * m:(r + 1) * m].bfloat16().contiguous() for x in (img, txt))
    ops, pos = TorchTileOps(tile=4), positive_dots(i, t)
    row, col, _, _ = ring.ring_forward(i, t, scale, ops, group, pos)
    g = torch.full_like(row, 0.5 / m)
    posts, post = [], ring.Ring.post
    ring.Ring.post = lambda self, sends, recvs: posts.append([x.dtype for x in sends]) or post(self, sends, recvs)
    try:
        di32, dt32, ds32 = ring.ring_backward(i, t, scale, row, col, g, g, ops, group, pos)
        home32 = posts[-1]
        di, dt, ds = ring.ring_backward(i, t, scale, row, col, g, g, ops, group, pos, dtxt_dtype=torch.bfloat16)
        home16 = posts[-1]
        for fn in (lambda a, b: clip_loss(a, b, scale, impl="torch", group=group),
                   lambda a, b: siglip_loss(a, b, torch.tensor(10.0), torch.tensor(-10.0), impl="torch", group=group)):
            a, b = (x.clone().requires_grad_() for x in (i, t))
            fn(a, b).backward()
            assert b.grad.dtype == torch.bfloat16 and posts[-1] == [torch.bfloat16], posts[-1]
    finally:
        ring.Ring.post = post
    assert home32 == [torch.float32] and home16 == [torch.bfloat16], (home32, home16)
    assert dt32.dtype == torch.float32 and dt.dtype == torch.bfloat16
    assert torch.equal(dt, dt32.to(torch.bfloat16)) and torch.equal(di, di32) and torch.equal(ds, ds32)


class SlowOps:
    """TorchTileOps that sleeps before every tile: this rank lags mid-ring."""

    def __init__(self, delay: float):
        from infclip.loss.tiled import TorchTileOps

        self.inner, self.delay = TorchTileOps(tile=4), delay

    def forward(self, *args, **kwargs):
        time.sleep(self.delay)
        return self.inner.forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        time.sleep(self.delay)
        return self.inner.backward(*args, **kwargs)


def _expect_value_error(fn, match: str):
    with pytest.raises(ValueError, match=match):
        fn()


def case_robustness():
    """Unequal shapes raise ValueError on every rank (no hang); slow ranks don't deadlock."""
    import torch.distributed as dist

    from infclip.loss import _tiled_loss, clip_loss

    rank, world = init_rank()
    group = dist.group.WORLD
    img, txt, scale = global_batch(world, 4, seed=1)
    m_bad = 4 + (rank == 1)  # rank 1 has one extra row
    for impl in ("torch", "local", "vanilla"):
        x = torch.randn(m_bad, C)
        _expect_value_error(lambda: clip_loss(x, x, scale, impl=impl, group=group), "same local batch shape")
    y = torch.randn(4, C + rank)
    _expect_value_error(lambda: clip_loss(y, y, scale, impl="torch", group=group), "same local batch shape")
    _expect_value_error(lambda: clip_loss(txt[:4], txt[:4], scale + rank, group=group), "logit_scale differs")
    # Ranks reach the loss at different times and one is slow inside every tile.
    time.sleep(0.5 * rank)
    ops = SlowOps(0.3 if rank == 0 else 0.0)
    run_case(lambda i, t, s, g: _tiled_loss(i, t, s, ops, g), img, txt, scale, group, "slow ranks")
    if rank == 2:
        time.sleep(1.0)  # late into the next call: the others wait in the ring, then finish
    run_case(_impls()["ring"], img, txt, scale, group, "after errors and delays")
    triton_interpreted(rank)
    dist.barrier()


def triton_interpreted(rank: int) -> None:
    """``run_case`` with Triton tiles (interpreted, so small shapes) on the subgroup {0, 2}:
    the fused backward kernel and the strip path (scratch s * dX, then a matmul)."""
    import torch.distributed as dist

    from infclip.kernels.clip import TritonTileOps
    from infclip.loss import _tiled_loss, clip_loss

    group = dist.new_group([0, 2])
    if rank not in (0, 2):
        return
    img, txt, scale = global_batch(2, 33, seed=3)
    fn = lambda i, t, s, g: clip_loss(i, t, s, impl="triton", group=g)  # noqa: E731
    run_case(fn, img, txt, scale, group, "triton tiles (interpreted)")
    strips = TritonTileOps(strips="always")
    fn = lambda i, t, s, g: _tiled_loss(i, t, s, strips, g)  # noqa: E731
    run_case(fn, img, txt, scale, group, "triton strip backward (interpreted)")
    onepass = TritonTileOps(backward="onepass", poison=True)  # sums into the ring's fp32 buffers
    fn = lambda i, t, s, g: _tiled_loss(i, t, s, onepass, g)  # noqa: E731
    run_case(fn, img, txt, scale, group, "triton one-pass backward (interpreted)")
    for ops, tag in ((onepass, "one-pass"), (strips, "strip"), (TritonTileOps(), "fused")):  # 33 rows: 17, 8, 4, 4
        fn = lambda i, t, s, g, ops=ops: _tiled_loss(i, t, s, ops, g)  # noqa: E731
        with_chunked_home(lambda: run_case(fn, img, txt, scale, group, f"triton {tag}, last tile in chunks"))


if __name__ == "__main__":
    import os

    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: Triton tiles on CPU
    torch.manual_seed(0)
    {"equivalence": case_equivalence, "robustness": case_robustness}[sys.argv[1]]()
    import torch.distributed as dist

    dist.destroy_process_group()
