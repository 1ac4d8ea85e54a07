"""duplicates="mask" on one process with the Triton kernels: the pairs sorted by group and the
group compare confined to the band of tiles within w (the largest group's size less one) of
the diagonal (``infclip.loss.duplicates.sort_groups``, ``infclip.loss.function._SortedMask``,
the kernels' BAND).

Ground truth: the float64 masked reference. The layouts scatter every group over the whole
batch (members far apart in the caller's order), so the band is right only after the sort:
``test_band_without_the_sort_is_wrong`` checks that these layouts would catch a missing sort.
The band itself is invisible: on a sorted batch the kernels with the band give the very
values of the kernels that compare on every tile (bit for bit). Interpreter tiles are 32 x 32,
so a group of 100 spans several tiles (w > BM, BN).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from _same_sums import assert_same_sums  # noqa: E402

from infclip.loss import clip_loss  # noqa: E402
from infclip.loss import duplicates  # noqa: E402
from infclip.loss.duplicates import reference_loss, sort_groups  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
F = torch.nn.functional


def _layout(name: str, b: int, g: torch.Generator) -> torch.Tensor:
    """(b,) int64 group ids, members of a group scattered over the batch."""
    if name == "big":  # one group of 100 (w = 99 > 32-row tiles) among singletons
        ids = torch.where(torch.arange(b) < 100, 0, torch.arange(b))
    elif name == "small":  # many groups of 2-4 and singletons
        ids = torch.randint(0, b // 2, (b,), generator=g)
    elif name == "one":  # one caption for the whole batch: w = b - 1, every tile in the band
        ids = torch.zeros(b, dtype=torch.int64)
    else:  # "spread": a few groups of 5-10 plus singletons
        grouped = torch.rand(b, generator=g) < 0.4
        ids = torch.where(grouped, torch.randint(0, 6, (b,), generator=g), 100 + torch.arange(b))
    return (ids[torch.randperm(b, generator=g)] * 7919 - 31).to(torch.int64)


def _batch(name: str, b: int, c: int, scale: float, seed: int, dtype=torch.float32):
    """(img, txt, scale, ids): normalized features, images and texts of one group near one
    shared direction (duplicates' logits among a row's largest: the mask matters), rounded
    to ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    ids = _layout(name, b, g)
    cap = torch.randn(b, c, generator=g, dtype=torch.float64)[torch.unique(ids, return_inverse=True)[1]]
    img = F.normalize(cap + 0.5 * torch.randn(b, c, generator=g, dtype=torch.float64), dim=-1)
    txt = F.normalize(img + 0.3 * torch.randn(b, c, generator=g, dtype=torch.float64), dim=-1)
    return img.to(dtype).to(DEV), txt.to(dtype).to(DEV), torch.tensor(scale, device=DEV), ids.to(DEV)


def _grads(fn, img, txt, s):
    i, t, sc = (x.detach().clone().requires_grad_() for x in (img, txt, s))
    loss = fn(i, t, sc)
    loss.backward()
    return loss.detach(), i.grad, t.grad, sc.grad


def _reference(img, txt, s, ids):
    return _grads(lambda i, t, sc: reference_loss(i, t, sc, ids, "mask"), img.double(), txt.double(), s.double())


def _rel_errors(got, want) -> list[float]:
    return [float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-3)) for a, b in zip(got, want)]


def _mask_loss(i, t, sc, ids):
    return clip_loss(i, t, sc, impl="triton", group_ids=ids, duplicates="mask")


def _use_backward(monkeypatch, backward: str, strips: str = "auto") -> None:
    """The ops clip_loss builds: ``backward`` on CPU too (its "auto" resolves to two-pass there),
    and the two-pass path's ``strips`` choice (strip kernels or the fused ``_grad_kernel``)."""
    from infclip.kernels.clip import ops as ops_mod

    monkeypatch.setattr(ops_mod.TritonTileOps, "path_for", lambda self, t: backward)
    monkeypatch.setattr(ops_mod.TritonTileOps, "_use_strips",
                        lambda self, a, out, acc, rows: {"always": True, "never": False}[strips])


def test_sort_groups():
    """order: a stable sort by id; inverse: its inverse; ids: equal exactly where the sorted
    ids are, each group contiguous; band: the largest group's size less one."""
    ids = torch.tensor([9, 4, 9, 1, 4, 9, 7])
    srt = sort_groups(ids)
    assert srt.order.tolist() == [3, 1, 4, 6, 0, 2, 5]
    assert torch.equal(srt.order[srt.inverse], torch.arange(7))
    assert srt.ids.dtype == torch.int32 and srt.band.dtype == torch.int32 and srt.band.tolist() == [2]
    s = ids[srt.order]
    assert torch.equal(srt.ids[:, None] == srt.ids[None, :], s[:, None] == s[None, :])
    same = torch.nonzero(s[:, None] == s[None, :])
    assert int((same[:, 0] - same[:, 1]).abs().max()) <= int(srt.band)
    assert sort_groups(torch.arange(5)).band.tolist() == [0]
    assert sort_groups(torch.zeros(6, dtype=torch.int64)).band.tolist() == [5]


CASES = [("big", 230, 100.0), ("small", 77, 100.0), ("one", 40, 30.0), ("spread", 101, 50.0)]


@pytest.mark.parametrize("layout, b, scale", CASES)
@pytest.mark.parametrize("backward, strips", [("onepass", "always"), ("twopass", "always"),
                                              ("twopass", "never")])
def test_fp32_band_matches_float64_reference(layout, b, scale, backward, strips, monkeypatch):
    """fp32: loss, d image, d text, d scale within 2e-4 / 2e-5 of float64, through the forward
    (three column loops: plain, band, plain), the strip fill (one-pass and two-pass) and the fused ``_grad_kernel``
    (strips never), b not a multiple of the 32-row tiles."""
    _use_backward(monkeypatch, backward, strips)
    img, txt, s, ids = _batch(layout, b, 8, scale, seed=b)
    loss = _mask_loss(img.clone().requires_grad_(), txt, s, ids)
    assert type(loss.grad_fn).__name__ == "_SortedMaskBackward"
    got = _grads(lambda i, t, sc: _mask_loss(i, t, sc, ids), img, txt, s)
    want = _reference(img, txt, s, ids)
    for name, a, w in zip(("loss", "d image", "d text", "d scale"), got, want):
        torch.testing.assert_close(a.double(), w, rtol=2e-4, atol=2e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("layout, b, scale", [("big", 230, 100.0), ("small", 77, 100.0)])
def test_bf16_band_within_bf16_rounding(layout, b, scale, monkeypatch):
    """bf16 (the training dtype; the one-pass strip path with the positives folded): within
    bf16's rounding of the float64 reference on the same rounded inputs, gradients in bf16."""
    _use_backward(monkeypatch, "onepass", "always")
    img, txt, s, ids = _batch(layout, b, 16, scale, seed=b + 1, dtype=torch.bfloat16)
    got = _grads(lambda i, t, sc: _mask_loss(i, t, sc, ids), img, txt, s)
    assert got[1].dtype == torch.bfloat16 and got[2].dtype == torch.bfloat16
    errs = _rel_errors(got, _reference(img, txt, s, ids))
    assert max(errs) < 2e-2, errs


@pytest.mark.parametrize("layout, b", [("big", 230), ("small", 77)])
def test_band_without_the_sort_is_wrong(layout, b, monkeypatch):
    """The layouts above catch a missing sort: with the identity order but the same band (the
    kernels then skip the compare on tiles that hold same-group pairs), the loss is off. The
    forward's 32 x 32 tiles (the interpreter's) on a GPU too: its default 128-row tiles cover
    b = 230 in two row blocks, every tile in the band, and nothing would be skipped."""
    from infclip.kernels.clip import launch

    monkeypatch.setattr(launch, "fwd_candidates", lambda k, esize: [launch.FwdConfig(32, 32, 32)])
    monkeypatch.setattr(launch, "_TUNED", {})
    img, txt, s, ids = _batch(layout, b, 8, 100.0, seed=b)

    def unsorted(ids):  # the identity order, its int32 ranks, the real band
        real = sort_groups(ids)
        n = ids.numel()
        same = torch.arange(n, device=ids.device)  # (on the ids' device: the GPU's gather needs it there)
        return duplicates.GroupSort(same, same, duplicates.dense_ids(ids), real.band)

    monkeypatch.setattr(duplicates, "sort_groups", unsorted)
    wrong = _mask_loss(img, txt, s, ids)
    want = reference_loss(img.double(), txt.double(), s.double(), ids, "mask")
    assert abs(float(wrong) - float(want)) > 1e-2 * abs(float(want))


@pytest.mark.parametrize("backward, strips", [("onepass", "always"), ("twopass", "always"),
                                              ("twopass", "never")])
@pytest.mark.parametrize("band_of", ["w", "large"])
def test_band_is_invisible_on_a_sorted_batch(backward, strips, band_of, monkeypatch):
    """On a batch already sorted by group, the kernels with the band (w, or w forced to b: every
    tile in the band) give the values of the kernels that compare on every tile (no band):
    loss, LSEs and all gradients bit for bit (outside the band the compare drops nothing); on the
    GPU within a few fp32 roundings (``_same_sums``: separately compiled variants)."""
    from infclip.kernels.clip import TritonTileOps
    from infclip.kernels.clip.function import loss_backward, loss_forward

    _use_backward(monkeypatch, backward, strips)
    img, txt, s, ids = _batch("spread", 101, 8, 100.0, seed=5)
    srt = sort_groups(ids)
    img, txt = img[srt.order].contiguous(), txt[srt.order].contiguous()
    band = srt.band if band_of == "w" else torch.tensor([101], dtype=torch.int32, device=DEV)
    ops = TritonTileOps()
    runs = []
    for bnd in (band, None):
        loss, row, col, pos = loss_forward(ops, img, txt, s, srt.ids, bnd)
        grads = loss_backward(ops, img, txt, s, row, col, pos, torch.tensor(1.0, device=DEV), groups=srt.ids,
                              band=bnd)
        runs.append((loss, row, col, *grads))
    for name, a, b in zip(("loss", "row LSE", "col LSE", "d image", "d text", "d scale"), *runs):
        assert_same_sums(a, b, name)


def test_band_refused_where_it_cannot_apply():
    """The band needs group ids and the square block pair (the ring's blocks take none)."""
    from infclip.kernels.clip import TritonTileOps

    img, txt, s, ids = _batch("small", 40, 8, 10.0, seed=2)
    ops = TritonTileOps()
    band = torch.zeros(1, dtype=torch.int32)
    gid = ids.to(torch.int32)
    with pytest.raises(ValueError, match="square block pair"):
        ops.forward(img, txt[:33], s, groups=(gid, gid[:33], band))
    with pytest.raises(ValueError, match=r"\(1,\) int32"):
        ops.forward(img, txt, s, offsets=(ids.float(), ids.float()), diag=True,
                    groups=(gid, gid, band.to(torch.int64)))


def test_no_double_backward_through_the_kernels():
    """The fused nodes' gradients are not differentiable again (``once_differentiable``): the
    first-order gradient comes back without a graph, so a second backward raises instead of
    returning a silently wrong result or an unclear error from inside the node."""
    img, txt, s, ids = _batch("small", 77, 8, 100.0, seed=3)
    img = img.clone().requires_grad_()
    (d_img,) = torch.autograd.grad(_mask_loss(img, txt, s, ids), img, create_graph=True)
    with pytest.raises(RuntimeError, match="does not require grad|once_differentiable|twice"):
        d_img.square().sum().backward()


def test_band_across_the_forwards_column_chunks(monkeypatch):
    """The forward launched over column chunks (col_start > 0: the partials' 32 MB cap, made
    tiny here) keeps the band right: fp32 against float64 as above."""
    from infclip.kernels.clip import launch

    monkeypatch.setattr(launch, "PART_BUDGET_BYTES", 4 * 8 * 64)  # 8 row blocks of 32 x 64 columns a chunk
    _use_backward(monkeypatch, "onepass", "always")
    img, txt, s, ids = _batch("big", 230, 8, 100.0, seed=11)
    got = _grads(lambda i, t, sc: _mask_loss(i, t, sc, ids), img, txt, s)
    for name, a, w in zip(("loss", "d image", "d text", "d scale"), got, _reference(img, txt, s, ids)):
        torch.testing.assert_close(a.double(), w, rtol=2e-4, atol=2e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif(DEV != "cuda", reason="allocator peaks: CUDA")
@pytest.mark.parametrize("c", [512, 1024])
def test_mask_passes_fit_the_memory_rule(c):
    """Measured: each pass of the sorted mask loss (bf16, b = 32768, 1 % duplicates) allocates
    at most the rule's extra memory: the two feature gradients + their fp32 accumulators
    (4 c bytes a sample each) + 1 KB x b + 64 MB. The sorted feature copies (2 b c elements
    inside each pass) take the place of the fp32 accumulator the one-pass backward leaves
    unused (``docs/objectives.md``): zero b c margin, so this is the check."""
    b = 32768
    g = torch.Generator(device=DEV).manual_seed(c)
    img, txt = (torch.nn.functional.normalize(torch.randn(b, c, device=DEV, generator=g), dim=1).bfloat16()
                .requires_grad_() for _ in range(2))
    s = torch.tensor(1 / 0.07, device=DEV, requires_grad=True)
    ids = torch.arange(b, device=DEV)
    ids[torch.randperm(b, device=DEV, generator=g)[:b // 100]] = torch.randint(0, b, (b // 100,), device=DEV,
                                                                                generator=g)
    rule = 2 * b * c * 2 + 2 * 4 * b * c + 1024 * b + (64 << 20)
    _mask_loss(img, txt, s, ids).backward()  # compile, tune
    img.grad = txt.grad = s.grad = None
    for phase in ("forward", "backward"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        if phase == "forward":
            loss = _mask_loss(img, txt, s, ids)
        else:
            loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        assert peak <= rule, (phase, peak / 2**20, rule / 2**20)


@pytest.mark.parametrize("mode", ["off", "mask"])
def test_only_calls_without_group_ids_take_the_spare_room(mode, monkeypatch):
    """The one-pass backward of fresh gradients gives the unused second fp32 accumulator's room
    to the strips (``launch.onepass_spare_bytes``), but not under "mask": the sorted feature
    copies hold that room there (``test_mask_passes_fit_the_memory_rule`` measures it on the
    GPU). Recorded here from the calls the loss makes, one-pass path forced on the CPU."""
    from infclip.kernels.clip import launch

    _use_backward(monkeypatch, "onepass", "always")
    seen = []
    real = launch.onepass_spare_bytes
    monkeypatch.setattr(launch, "onepass_spare_bytes",
                        lambda m, n, k, roomy, in_place=True: seen.append(roomy) or real(m, n, k, roomy, in_place))
    img, txt, s, ids = _batch("small", 40, 8, 10.0, seed=3)
    img, txt, s = (x.to(DEV).requires_grad_() for x in (img, txt, s))
    kw = {} if mode == "off" else {"group_ids": ids.to(DEV), "duplicates": "mask"}
    clip_loss(img, txt, s, impl="triton", **kw).backward()
    assert seen == [mode == "off"], seen
