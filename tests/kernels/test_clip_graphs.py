"""CUDA graphs of the one-GPU CLIP loss (``infclip.kernels.clip.graphs``).

CPU: the memory arithmetic (static inputs + scratch within the loss's rule) and that
nothing off CUDA is graphed. CUDA (the GPU machine): the graphed loss equals the eager one
for fresh inputs every call, interleaved forwards, retained graphs, and returned gradients
that something still holds are never overwritten.
"""

import pytest
import torch

from infclip.kernels.clip import TritonTileOps, graphs, launch

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="CUDA graphs need CUDA (CPU tests above)")
RULE = lambda b: 1024 * b + (64 << 20)  # noqa: E731 -- the rule's room beyond the two gradients


@pytest.mark.parametrize("esize", [2, 4])
@pytest.mark.parametrize("c", [40, 200, 512, 640, 768, 1024])
@pytest.mark.parametrize("b", [1, 777, 4096, 8192, 12288, 16384])
def test_strip_budget_keeps_static_inputs_within_the_rule(b, c, esize):
    for strips in (True, False):
        budget = graphs.strip_budget(b, c, esize, strips)
        if budget is None:
            assert 2 * b * c * esize + graphs.reserve_bytes(b) + (launch.STRIP_MIN_ROWS * b * esize if strips else 0) \
                > RULE(b)
            continue
        assert 2 * b * c * esize + budget + graphs.reserve_bytes(b) <= RULE(b)
        if strips:
            assert launch.strip_rows(b, esize, budget=budget, k=c, temp=False) >= min(b, launch.STRIP_MIN_ROWS)


def test_strip_budget_where_graphs_fit():
    assert graphs.strip_budget(8192, 1024, 2, True) is not None  # 32 MB of static gradients
    assert graphs.strip_budget(16384, 512, 2, True) is not None
    assert graphs.strip_budget(16384, 1024, 2, True) is None  # 64 MB of gradients leave < 384 rows
    fixup = graphs.strip_budget(8192, 512, 2, True, temp=True)
    assert fixup == graphs.strip_budget(8192, 512, 2, True) - launch.STRIP_TEMP_BYTES


def _gpu_fwd_tiles(k: int, esize: int) -> list:
    """The forward tiles the GPU's tuner may pick for feature dim k (the interpreter has one)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launch, "interpreting", lambda: False)
        return launch.fwd_candidates(k, esize)


def _partials(b, tile) -> int:
    """The column partial LSEs ``launch.lse_forward`` allocates for one chunk with this tile."""
    nrb = -(-b // tile.BM)
    chunk = max(tile.BN, launch.PART_BUDGET_BYTES // (4 * nrb) // tile.BN * tile.BN)
    return nrb * min(chunk, b) * 4


@pytest.mark.parametrize("esize", [2, 4])
@pytest.mark.parametrize("c", [40, 200, 512, 640, 768, 1024])
@pytest.mark.parametrize("b", [1, 777, 4096, 8192, 12288, 16384])
def test_arena_holds_the_gradients_and_every_large_temporary(b, c, esize):
    """Whatever forward tile the tuner picks, its partials (and logsumexp's temporary of
    their size) fit the arena beside the static gradients, as do the backward's scratch, the
    fixup's product and the one-pass accumulator: no 1-10 MB temporary takes a 20 MB segment
    of its own (84 MB kept against 72 at c = 1024, b = 8k, H200, with a 64/128-row tile)."""
    tiles = _gpu_fwd_tiles(c, esize)
    assert min(t.BM for t in tiles) >= graphs.MIN_FWD_ROWS
    grads = 2 * b * c * esize if b * c * esize > graphs.SMALL_BLOCK_BYTES else 0
    paths = [(True, False, False), (True, True, False), (True, False, True), (False, False, False)]
    for strips, temp, onepass in paths:  # (strip path, fixup's fp32 product, one-pass accumulator)
        budget = graphs.strip_budget(b, c, esize, strips, temp)
        if budget is None:
            continue
        arena = graphs.arena_bytes(b, c, esize, budget, strips, temp, onepass)
        for tile in tiles:
            part = _partials(b, tile)
            assert part <= graphs.partial_bytes(b)
            if part > graphs.SMALL_BLOCK_BYTES:
                assert grads + 2 * part <= arena
        if strips:
            rows = min(b, launch.strip_rows(b, esize, budget=budget, k=c, temp=temp))
            scratch = rows * b * esize + (4 * rows * c if temp else 0) + (4 * b * c if onepass and esize == 2 else 0)
            assert scratch <= graphs.SMALL_BLOCK_BYTES or grads + scratch <= arena
        assert arena == 0 or arena >= graphs.SEGMENT_MIN_BYTES  # (a 1-10 MB one would take 20 MB)


@pytest.mark.parametrize("c", [512, 768, 1024])
def test_arena_of_the_default_loss_at_8k(c):
    """bf16, b = 8k (the benchmarks' graphed batches): graphed, the arena exactly the static
    gradients + the strip scratch (the forward's partials fit in the scratch's room), and what
    the pool keeps within the rule's 1 KB x b + 64 MB."""
    b = 8192
    img = torch.empty(b, c, dtype=torch.bfloat16, device="meta")
    ops = TritonTileOps()
    budget = graphs._budget(ops, img)
    assert budget is not None
    rows = launch.strip_rows(b, 2, budget=budget, k=c, temp=False)
    arena = graphs._arena(ops, img, budget)
    assert arena == 2 * b * c * 2 + rows * b * 2 >= 2 * b * c * 2 + 2 * graphs.partial_bytes(b)
    assert graphs.pool_bytes(b, c, 2, arena) <= RULE(b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("c", [64, 512, 640, 768, 1024])
@pytest.mark.parametrize("b", [777, 4096, 8192, 12544, 16384])
def test_graphed_only_where_the_pool_keeps_within_the_rule(b, c, dtype):
    """Where an arena the forward's partials size (no strip scratch, or a small one) would not
    fit beside the static gradients, the problem stays eager."""
    img = torch.empty(b, c, dtype=dtype, device="meta")
    for ops in (TritonTileOps(), TritonTileOps(strip_positives="fixup"), TritonTileOps(backward="onepass")):
        budget = graphs._budget(ops, img)
        if budget is None:
            continue
        acc = 4 * b * c if graphs._onepass(ops) and dtype == torch.bfloat16 else 0
        assert graphs.pool_bytes(b, c, img.element_size(), graphs._arena(ops, img, budget)) <= RULE(b) + acc


def test_forward_sized_arena_that_does_not_fit_stays_eager():
    """bf16 without strips at b = 16k, c = 768: a 64-row tile's partials and logsumexp's
    temporary of them (2 x 16 MB) do not fit beside 48 MB of static gradients (84 MB kept
    against 80 with that tile before the arena), though ``strip_budget`` leaves room."""
    img = torch.empty(16384, 768, dtype=torch.bfloat16, device="meta")
    assert graphs.strip_budget(16384, 768, 2, False) is not None
    assert graphs._budget(TritonTileOps(strips="never"), img) is None


def test_not_graphed_off_cuda_or_when_turned_off(monkeypatch):
    x = torch.randn(8, 16)
    assert not graphs.eligible(TritonTileOps(), x, x)
    with pytest.raises(ValueError, match="cuda_graphs"):
        TritonTileOps(cuda_graphs="always")
    with pytest.raises(ValueError, match="strip_budget must be a positive"):
        TritonTileOps(strip_budget=0)
    if CUDA:
        y = x.cuda().bfloat16()
        assert graphs.eligible(TritonTileOps(), y, y)
        assert not graphs.eligible(TritonTileOps(cuda_graphs="never"), y, y)
        monkeypatch.setenv("INFCLIP_CUDA_GRAPHS", "0")
        assert not graphs.eligible(TritonTileOps(), y, y)


# -- CUDA ---------------------------------------------------------------------------------------

def _inputs(b, c, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    img = torch.randn(b, c, device="cuda", generator=g)
    txt = 0.3 * img + torch.randn(b, c, device="cuda", generator=g)
    img = img.to(dtype).requires_grad_()
    txt = txt.to(dtype).requires_grad_()
    log_s = torch.tensor(2.0 + seed / 10, device="cuda", requires_grad=True)
    return img, txt, log_s


def _refill(bufs, seed):
    """New values in the same buffers (a training loop's features: replayed once captured)."""
    with torch.no_grad():
        for buf, new in zip(bufs, _inputs(bufs[0].shape[0], bufs[0].shape[1], bufs[0].dtype, seed)):
            buf.copy_(new)
            buf.grad = None


def _eager(ops, img, txt, log_s):
    """(loss, dimg, dtxt, dlog_s) from the eager kernels with the graphs' strip budget and
    backward (two-pass under "auto": eager "auto" takes the one-pass backward in bf16, which
    rounds differently, so comparing against it measured the path choice, not the graphs)."""
    eager = TritonTileOps(strip_budget=graphs._budget(ops, img), cuda_graphs="never",
                          backward=graphs._backward(ops))
    i, t, s = (x.detach().clone().requires_grad_() for x in (img, txt, log_s))
    loss = eager.fused_loss(i, t, s.exp())
    loss.backward()
    return loss.detach(), i.grad, t.grad, s.grad


def _check(got, want):
    """Same kernels, same inputs: equal up to one rounding of the output dtype (the fp32
    accumulations may sum in another order: one bf16 gradient entry in 155,400 was one ulp
    apart, H200)."""
    for g, w in zip(got, want):
        rtol = 2 ** -7 if g.dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(g.float(), w.float(), rtol=rtol, atol=1e-6)


def _replayed(loss) -> bool:
    return type(loss.grad_fn).__name__.startswith("GraphedCLIPLoss")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,c", [(777, 200), (1000, 640)])
def test_graphed_loss_matches_eager_for_new_values(b, c, dtype):
    graphs.release()
    ops = TritonTileOps()
    bufs = _inputs(b, c, dtype, 0)
    for seed in range(4):  # eager, capture + replay, replay, replay
        _refill(bufs, seed)
        img, txt, log_s = bufs
        loss = ops.fused_loss(img, txt, log_s.exp())
        assert _replayed(loss) == (seed > 0)
        loss.backward()
        _check((loss.detach(), img.grad, txt.grad, log_s.grad), _eager(ops, img, txt, log_s))


@needs_cuda
def test_moving_buffers_run_eagerly():
    graphs.release()
    ops = TritonTileOps()
    alive = []  # every pair kept alive: each call at new addresses
    for seed in range(3):
        img, txt, log_s = _inputs(256, 64, torch.bfloat16, seed)
        alive.append((img, txt))
        assert not _replayed(ops.fused_loss(img, txt, log_s.exp()))


@needs_cuda
def test_interleaved_forwards_and_retained_graph():
    graphs.release()
    ops = TritonTileOps()
    bufs = _inputs(640, 128, torch.bfloat16, 0)
    ops.fused_loss(bufs[0], bufs[1], bufs[2].exp()).backward()  # eager: captured from the next call on
    _refill(bufs, 1)
    img, txt, log_s = bufs
    s1 = log_s.exp()
    loss1 = ops.fused_loss(img, txt, s1)
    with torch.no_grad():
        log_s.add_(0.5)  # the second forward: another scale, same features
    loss2 = ops.fused_loss(img, txt, log_s.exp())
    assert _replayed(loss1) and _replayed(loss2)
    counts = loss1.grad_fn.graphs.counts
    want1 = _eager(ops, img, txt, log_s - 0.5)
    want2 = _eager(ops, img, txt, log_s)
    g1 = [g.clone() for g in torch.autograd.grad(loss1, (img, txt), retain_graph=True)]  # restores call 1
    assert counts == {"forward": 2, "backward": 1, "eager_backward": 0, "restored": 1}
    g2 = [g.clone() for g in torch.autograd.grad(loss2, (img, txt))]  # restores call 2 from its stash
    assert counts == {"forward": 2, "backward": 2, "eager_backward": 0, "restored": 2}
    _check((loss1.detach(), *g1), want1[:3])
    _check((loss2.detach(), *g2), want2[:3])
    g1_again = torch.autograd.grad(loss1, (img, txt))  # a finished call again: its stash, replayed
    assert counts == {"forward": 2, "backward": 3, "eager_backward": 0, "restored": 3}
    _check(g1_again, want1[1:3])


@needs_cuda
@pytest.mark.parametrize("b,c", [(640, 128), (8192, 512)])
def test_returned_gradients_still_held_are_not_overwritten(b, c):
    """Neither a backward replay nor a forward replay writes into a gradient still held (at
    8192 x 512 a shared pool put the gradients where the forward's partial LSEs had been)."""
    graphs.release()
    ops = TritonTileOps()
    bufs = _inputs(b, c, torch.bfloat16, 0)
    kept = []  # (the gradient a hook kept, its value when the hook saw it)
    for step in range(4):
        _refill(bufs, step)
        img, txt, log_s = bufs
        feats = img.view(img.shape)  # a non-leaf at img's address: the hook sees the returned tensor
        feats.register_hook(lambda g: kept.append((g, g.clone())))
        loss = ops.fused_loss(feats, txt, log_s.exp())
        assert _replayed(loss) == (step > 0)
        with torch.no_grad():  # forward replays while the gradients are held
            ops.fused_loss(feats, txt, log_s.exp())
        loss.backward()
        torch.testing.assert_close(kept[-1][0].float(), _eager(ops, img, txt, log_s)[1].float(), rtol=1e-5,
                                   atol=1e-6)
        for held, value in kept:
            assert torch.equal(held, value)  # no earlier step's kept gradient was overwritten


@needs_cuda
def test_leaf_gradients_are_not_aliased_and_large_batches_not_graphed():
    graphs.release()
    ops = TritonTileOps()
    bufs = _inputs(512, 64, torch.bfloat16, 0)
    held = []
    for seed in range(3):
        _refill(bufs, seed)
        ops.fused_loss(bufs[0], bufs[1], bufs[2].exp()).backward()
        held.append((bufs[0].grad, bufs[0].grad.clone()))
    for g, copy in held:
        assert torch.equal(g, copy)
    big = torch.randn(graphs.MAX_ROWS + 1, 64, device="cuda", dtype=torch.bfloat16)
    assert not graphs.eligible(ops, big, big)
    most = torch.empty(8192, 1024, device="cuda", dtype=torch.bfloat16)
    assert graphs.eligible(ops, most, most)  # b^2 c = MAX_WORK
    more = torch.empty(16384, 512, device="cuda", dtype=torch.bfloat16)
    assert not graphs.eligible(ops, more, more)  # twice the work: the GPU, not the host, bounds it


def _warm_capture_stream(ops):
    """One capture on a small problem: the capture stream's cuBLAS workspace (allocated once
    per process, as autograd's backward thread allocates its own) exists before a measurement."""
    warm = _inputs(1024, 64, torch.bfloat16, 0)
    for _ in range(2):
        ops.fused_loss(warm[0], warm[1], warm[2].exp()).backward()
    graphs.release()


@needs_cuda
@pytest.mark.parametrize("c", [512, 1024])
def test_graphed_loss_memory_within_the_rule(c):
    """Peak memory beyond the inputs, per phase (eager call, capture, replays): the two
    feature gradients (.grad) + 1 KB x b + 64 MB; the eager call's one-pass backward (bf16
    "auto") also the rule's two fp32 accumulators (4 c B per sample each, one per feature
    gradient): it allocates one, for d text, and its strip scratch may take the other's room
    (``launch.onepass_spare_bytes``: fresh gradients, an in-place fp32 addmm), so the eager
    peak may reach both. The graphs' two-pass backward takes neither."""
    graphs.release()
    b = 8192
    ops = TritonTileOps()
    _warm_capture_stream(ops)
    img, txt, log_s = _inputs(b, c, torch.bfloat16, 0)
    ops.fused_loss(img, txt, log_s.exp()).backward()  # compiles / tunes outside the measurement
    img.grad = txt.grad = log_s.grad = None
    graphs.release()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()  # the cached graphs' memory counts from here on
    peaks = []
    for _ in range(4):  # eager, capture + replay, replay, replay
        img.grad = txt.grad = log_s.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        loss = ops.fused_loss(img, txt, log_s.exp())
        loss.backward()
        torch.cuda.synchronize()
        peaks.append((torch.cuda.max_memory_allocated() - base) / 2**20)
    assert _replayed(loss)
    allowed = (2 * b * c * 2 + RULE(b)) / 2**20
    eager_allowed = allowed + (2 * 4 * b * c / 2**20 if ops.path_for(img) == "onepass" else 0)
    assert peaks[0] <= eager_allowed, (peaks, eager_allowed)
    assert max(peaks[1:]) <= allowed, (peaks, allowed)


@needs_cuda
@pytest.mark.parametrize("c", [512, 1024])
def test_graph_memory_pool_within_the_rule(c):
    """What a captured problem keeps (its private pool: static gradients, scratch, partial
    buffers, vectors; freed blocks of a graph's pool count as reserved, not allocated) is at
    most the rule's 1 KB x b + 64 MB. (Measured as reserved memory once the capture stream's
    one-per-process cuBLAS workspace exists and the ordinary cache is emptied.)"""
    b = 8192
    kept = _pool_kept(TritonTileOps(), b, c)
    assert 0 < kept <= RULE(b), (kept / 2**20, RULE(b) / 2**20)


@needs_cuda
def test_graph_memory_pool_does_not_depend_on_the_forward_tile(monkeypatch):
    """The forward's partial LSEs follow the tuned tile (b = 8k: 1 MB at 256 rows, 4 MB at
    64; the tuner's pick varies between processes where timings are close): with each tile in
    turn the pool keeps the same arena, up to the small pool's 2 MB segments (a 256-row tile's
    1 MB partials are small blocks), and stays within the rule. Before the arena a 64- or
    128-row tile's partials took a 20 MB segment of their own at c = 1024 (84 MB kept)."""
    b, c = 8192, 1024
    kept = {}
    for tile in launch.fwd_candidates(c, 2):
        monkeypatch.setattr(launch, "fwd_candidates", lambda k, esize, tile=tile: [tile])
        monkeypatch.setattr(launch, "_TUNED", {})  # (the tile is picked anew for every shape)
        kept[tile] = _pool_kept(TritonTileOps(), b, c)
    mb = {f"{t.BM}x{t.BN}x{t.BK}": v / 2**20 for t, v in kept.items()}
    assert max(kept.values()) <= RULE(b), mb
    assert max(kept.values()) - min(kept.values()) <= 4 << 20, mb


def _pool_kept(ops, b: int, c: int) -> int:
    """Reserved bytes a captured (b, c) bf16 problem keeps: eager call, capture + replay,
    replay, then the ordinary cache emptied; its release gives them all back."""
    graphs.release()
    _warm_capture_stream(ops)
    img, txt, log_s = _inputs(b, c, torch.bfloat16, 0)
    ops.fused_loss(img, txt, log_s.exp()).backward()  # eager: compiles and tunes for this shape
    graphs.release()
    img.grad = txt.grad = log_s.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    for _ in range(3):  # eager, capture + replay, replay
        img.grad = txt.grad = log_s.grad = None
        loss = ops.fused_loss(img, txt, log_s.exp())
        loss.backward()
    assert _replayed(loss)
    del loss  # (its autograd graph references the captured problem)
    img.grad = txt.grad = log_s.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    kept = torch.cuda.memory_reserved() - base
    graphs.release()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() <= base  # released with the graphs
    return kept


@needs_cuda
def test_failed_capture_runs_eagerly_once_warned(monkeypatch):
    graphs.release()
    ops = TritonTileOps()
    img, txt, log_s = _inputs(512, 64, torch.bfloat16, 0)

    def broken(*args, **kwargs):
        raise RuntimeError("capture refused")

    monkeypatch.setattr(graphs, "LossGraphs", broken)
    stream = torch.cuda.current_stream()
    with pytest.warns(RuntimeWarning, match="capture refused"):
        for _ in range(2):
            loss = ops.fused_loss(img, txt, log_s.exp())
    assert not _replayed(loss) and torch.cuda.current_stream() == stream
    img.grad = txt.grad = log_s.grad = None
    loss.backward()
    _check((loss.detach(), img.grad, txt.grad, log_s.grad), _eager(ops, img, txt, log_s))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the key is not retried
        assert not _replayed(ops.fused_loss(img, txt, log_s.exp()))


@needs_cuda
def test_not_graphed_under_inference_mode():
    graphs.release()
    ops = TritonTileOps()
    img, txt, log_s = _inputs(512, 64, torch.bfloat16, 0)
    with torch.inference_mode():
        for _ in range(2):
            ops.fused_loss(img, txt, log_s.exp())
    assert not graphs._CACHE
    for _ in range(2):
        loss = ops.fused_loss(img, txt, log_s.exp())
    assert _replayed(loss)


@needs_cuda
def test_tma_strip_kernel_runs_from_any_thread():
    """triton's allocator (the TMA kernel's descriptors need it) lives in a per-thread context
    variable: autograd runs backward in its own thread, graph capture in the caller's."""
    import threading

    b, c = 512, 64
    a, bb = (torch.randn(b, c, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    vec = lambda v: torch.full((b,), v, device="cuda")  # noqa: E731
    cfg = launch.StripConfig(128, 128, 64, 8, 8, 4, tma=True)
    scale = torch.tensor(10.0, device="cuda")

    def run(out):
        out.append(launch.grad_rows_strips(a, bb, scale, vec(5.0), vec(5.0), vec(1.0), vec(1.0),
                                           torch.empty_like(a), 256, cfg, "tf32"))

    results = []
    worker = threading.Thread(target=run, args=(results,))
    worker.start()
    worker.join()
    run(results)  # this thread's allocator was never set by the worker
    assert len(results) == 2 and torch.equal(results[0], results[1])
