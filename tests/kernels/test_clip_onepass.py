"""The one-pass backward of the Triton CLIP tiles against the two-pass
backward and float64 (interpreter on CPU, real kernels on GPU).

``TritonTileOps(backward="onepass")`` fills each strip's P = s dX once and forms both feature
gradients from it (dimg[strip] = P @ txt, an fp32 dtxt accumulator += P^T @ img[strip]).
Shapes are tiny and odd, with 16-row strips (several strips and a ragged last one), every
buffer the kernels write poisoned with NaN; positives folded into P and by the fp32 fixup;
peaked softmax (s = 100, near-duplicate rows); fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

from infclip.kernels.clip import TritonTileOps, clip_loss_reference, clip_loss_triton, launch, lse_grad_reference
from infclip.kernels.clip import ops as clip_ops
from infclip.kernels.clip.function import loss_backward, loss_forward
from test_clip_kernels import _vanilla  # open_clip's ClipLoss in the input dtype, GPU-like 16-bit products

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CUDA = DEV == "cuda"


@pytest.fixture
def strips16(monkeypatch):
    monkeypatch.setattr(launch, "strip_rows", lambda *args, **kwargs: 16)


def _pair(b: int, c: int, seed: int, peaked: bool = False):
    """(img, txt) float64 on DEV, L2-normalized; peaked: near-duplicate rows, texts close to
    their images."""
    g = torch.Generator().manual_seed(seed)
    img = torch.nn.functional.normalize(torch.randn(b, c, generator=g, dtype=torch.float64), dim=-1)
    if peaked and b > 4:
        img[1:5] = torch.nn.functional.normalize(img[0] + 1e-3 * torch.randn(4, c, generator=g, dtype=torch.float64),
                                                 dim=-1)
    noise = (0.3 if peaked else 3.0) * torch.randn(b, c, generator=g, dtype=torch.float64)
    txt = torch.nn.functional.normalize(img + noise / c ** 0.5 * (4 if not peaked else 1), dim=-1)
    return img.to(DEV), txt.to(DEV)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error; at b = 1 the exact gradients are 0 (float64 leaves ~1e-17): floor 1e-9."""
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-9)).item()


def _clip_case(img, txt, s, g_row, g_col, g_d):
    """(row, col, pos) as the loss passes them (LSEs relative to s pos, pos in fp32) and the
    float64 (dimg, dtxt, ds) of sum g_row row + g_col col - sum g_d x_ii."""
    pos = (img.double() * txt.double()).sum(-1).float()
    x = s.double() * img.double() @ txt.double().T
    x.diagonal().copy_(s.double() * pos.double())  # the positives' logits are the offsets
    spos = s.double() * pos.double()
    row, col = torch.logsumexp(x, 1) - spos, torch.logsumexp(x, 0) - spos
    dx = g_row.double()[:, None] * torch.softmax(x, 1) + g_col.double()[None, :] * torch.softmax(x, 0)
    dx.diagonal().sub_(g_d.double())
    dots = img.double() @ txt.double().T
    dots.diagonal().copy_(pos.double())
    ref = (s.double() * dx @ txt.double(), s.double() * dx.T @ img.double(), (dx * dots).sum())
    return row.float(), col.float(), pos, ref


CASES = [(1, 16, 10.0), (37, 40, 10.0), (37, 40, 100.0), (70, 200, 30.0)]


@pytest.mark.parametrize("positives", ["fold", "fixup"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("b,c,scale", CASES)
def test_onepass_matches_twopass_and_float64(strips16, b, c, scale, dtype, positives):
    """The CLIP backward (positives folded, g_diag = g_row + g_col, fresh gradients in the
    input dtype): one-pass and two-pass within fp32 rounding of float64 for fp32 inputs;
    in bf16 the one-pass error no worse than the two-pass one (both: P rounded once to
    bf16, an fp32-accumulated product, one rounding of the result); d scale summed once."""
    img, txt = _pair(b, c, seed=b + c + int(scale), peaked=scale >= 100)
    img, txt = img.to(dtype), txt.to(dtype)
    s = torch.tensor(scale, device=DEV)
    gen = torch.Generator().manual_seed(b)
    g = (torch.randint(256, 1024, (2, b), generator=gen).float() / 2 ** 10 / b).to(DEV)  # g_row + g_col exact
    g_row, g_col = g[0], g[1]
    g_d = g_row + g_col
    row, col, pos, ref = _clip_case(img, txt, s, g_row, g_col, g_d)
    got = {}
    for path in ("twopass", "onepass"):
        ops = TritonTileOps(poison=True, strips="always", strip_positives=positives, backward=path)
        got[path] = ops.backward(img, txt, s, row, col, g_row, g_col, out_dtype=dtype, g_diag=g_d, offsets=(pos, pos))
    one, two = got["onepass"], got["twopass"]
    assert one[0].dtype == one[1].dtype == dtype and one[2].dim() == 0
    errs = {k: [_rel(x, r) for x, r in zip(v, ref)] for k, v in got.items()}
    if dtype == torch.float32:
        # peaked (s = 100): fp32 logits of magnitude ~100 carry ~6e-6 absolute error (as test_extreme_logits)
        assert max(errs["onepass"]) < (1e-5 if scale < 100 else 3e-5), errs
        assert max(_rel(x, y.double()) for x, y in zip(one, two)) < 1e-5  # (summation orders differ)
    else:
        for e1, e2 in zip(errs["onepass"], errs["twopass"]):
            assert e1 <= 1.25 * e2 + 1e-6, errs
        assert max(errs["onepass"][:2]) < 2e-2 and errs["onepass"][2] < 1e-4, errs  # ds from the fp32 dX


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m,n,c", [(37, 70, 40), (70, 37, 200)])
def test_onepass_block_pair_without_positives_accumulates(strips16, m, n, c, dtype):
    """A ring block pair (m != n, no positives, plain LSEs): fresh fp32 gradients, then
    accumulated into given fp32 buffers (the protocol's), and into given bf16 buffers."""
    a = _pair(m, c, seed=m)[0].to(dtype)
    t = _pair(n, c, seed=n + 1)[0].to(dtype)
    s = torch.tensor(12.0, device=DEV)
    x = s.double() * a.double() @ t.double().T
    row, col = torch.logsumexp(x, 1).float(), torch.logsumexp(x, 0).float()
    g_row, g_col = torch.randn(m, device=DEV), torch.randn(n, device=DEV)
    ref_a, ref_b, ref_ds = lse_grad_reference(a.double(), t.double(), s, g_row, g_col)
    ops = TritonTileOps(poison=True, strips="always", backward="onepass")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    da, db, ds = ops.backward(a, t, s, row, col, g_row, g_col)
    assert da.dtype == db.dtype == torch.float32
    assert _rel(da, ref_a) < tol and _rel(db, ref_b) < tol
    assert abs(ds.item() - ref_ds.item()) < 1e-5 * max(1.0, abs(ref_ds.item()))
    for buf_dtype in (torch.float32, dtype):
        base_a, base_b = torch.randn(m, c, device=DEV), torch.randn(n, c, device=DEV)
        da, db, _ = ops.backward(a, t, s, row, col, g_row, g_col, base_a.to(buf_dtype, copy=True),
                                  base_b.to(buf_dtype, copy=True))
        assert da.dtype == db.dtype == buf_dtype
        assert _rel(da.double() - base_a.double(), ref_a) < 2 * tol + (buf_dtype != torch.float32) * 0.1
        assert _rel(db.double() - base_b.double(), ref_b) < 2 * tol + (buf_dtype != torch.float32) * 0.1


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("b,c,scale", [(130, 200, 30.0), (67, 40, 100.0)])
def test_onepass_loss_bf16_no_worse_than_vanilla(monkeypatch, b, c, scale, seed):
    """The whole CLIP loss (``clip_loss_triton``) in bf16 with the one-pass backward: loss,
    d image, d text and d scale no further from float64 than vanilla bf16's (the loss's bar
    is 2x; the kernels' tests hold 1.25x); 48-row strips."""
    monkeypatch.setattr(launch, "strip_rows", lambda *args, **kwargs: 48)
    img64, txt64 = _pair(b, c, seed=seed + 10 * b, peaked=scale >= 100)
    s64 = torch.tensor(scale, device=DEV, dtype=torch.float64)
    img, txt = img64.bfloat16(), txt64.bfloat16()
    ops = TritonTileOps(strips="always", backward="onepass", cuda_graphs="never")
    errs = {}
    for name, fn in (("ours", lambda *x: clip_loss_triton(*x, ops=ops)), ("vanilla", _vanilla)):
        i, t, s = (x.detach().clone().requires_grad_() for x in (img, txt, s64.float()))
        loss = fn(i, t, s)
        loss.backward()
        i64, t64, sr = (x.detach().double().requires_grad_() for x in (img, txt, s64))
        ref = clip_loss_reference(i64, t64, sr)
        ref.backward()
        errs[name] = [abs(loss.item() - ref.item()) / abs(ref.item()), _rel(i.grad, i64.grad),
                      _rel(t.grad, t64.grad), abs(s.grad.item() - sr.grad.item()) / abs(sr.grad.item())]
    for ours, van in zip(errs["ours"], errs["vanilla"]):
        assert ours <= 1.25 * van + 1e-4, errs


def test_backward_choice():
    """"auto" takes ``AUTO_BACKWARD`` (one-pass, measured faster on the H200) only where the
    two-pass path would take strips (fresh bf16 on CUDA, no filter, strips allowed), else
    two-pass; the one-pass path is refused with gradient filtering or without strips;
    unknown names are refused."""
    from types import SimpleNamespace

    cuda_bf16 = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)  # path_for reads only these
    assert clip_ops.AUTO_BACKWARD == "onepass"
    assert TritonTileOps().path_for(cuda_bf16) == "onepass"
    assert TritonTileOps().path_for(SimpleNamespace(is_cuda=True, dtype=torch.float32)) == "twopass"
    assert TritonTileOps().path_for(torch.zeros(2, dtype=torch.bfloat16)) == "twopass"  # CPU / interpreter
    assert TritonTileOps(grad_filter=(1e-3, 64)).path_for(cuda_bf16) == "twopass"
    assert TritonTileOps(strips="never").path_for(cuda_bf16) == "twopass"
    assert TritonTileOps(backward="twopass").path_for(cuda_bf16) == "twopass"
    assert TritonTileOps(backward="onepass").path_for(torch.zeros(2)) == "onepass"
    with pytest.raises(ValueError, match="backward must be one of"):
        TritonTileOps(backward="fused")
    with pytest.raises(ValueError, match="grad_filter=None"):
        TritonTileOps(backward="onepass", grad_filter=(1e-3, 64))
    with pytest.raises(ValueError, match="strips"):
        TritonTileOps(backward="onepass", strips="never")


def test_onepass_loss_through_function_and_ring(strips16):
    """``loss_forward`` / ``loss_backward`` (the path of the CUDA graphs) and the ring's block
    backward (``LoopbackRing``: the diagonal block with its positives, then a block without)
    give the two-pass results with the one-pass backward (fp32, float64 ground truth)."""
    from infclip.loss import _tiled_loss
    from infclip.loss.ring import LoopbackRing

    b, c, world = 37, 40, 2
    img, txt = (x.float() for x in _pair(b, c, seed=3))
    s = torch.tensor(20.0, device=DEV)
    outs = {}
    for path in ("twopass", "onepass"):
        ops = TritonTileOps(poison=True, strips="always", backward=path, cuda_graphs="never")
        loss, row, col, pos = loss_forward(ops, img, txt, s)
        grads = loss_backward(ops, img, txt, s, row, col, pos, torch.tensor(1.0, device=DEV))
        i, t, sc = (x.clone().requires_grad_() for x in (img, txt, s))
        ring_loss = _tiled_loss(i, t, sc, ops, LoopbackRing(world))
        ring_loss.backward()
        outs[path] = (loss, *grads, ring_loss.detach(), i.grad, t.grad, sc.grad)
    for x, y in zip(outs["onepass"], outs["twopass"]):
        torch.testing.assert_close(x.float(), y.float(), rtol=1e-5, atol=1e-6 * float(y.abs().max()))
    i64, t64, s64 = (x.double().requires_grad_() for x in (img, txt, s))
    ref = clip_loss_reference(i64, t64, s64)
    ref.backward()
    for got, want in zip(outs["onepass"][1:4], (i64.grad, t64.grad, s64.grad)):
        assert _rel(got, want) < 1e-5


# -- memory: the loss's extra-memory rule -----------------------------------------------------

def rule_bytes(b: int, c: int, esize: int) -> int:
    """The extra-memory rule: the two feature gradients + fp32 accumulators of both
    (4 c bytes per sample each) + 1 KB x b + 64 MB."""
    return 2 * b * c * esize + 2 * 4 * b * c + 1024 * b + (64 << 20)


@pytest.mark.parametrize("c", [512, 768, 1024])
@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("fresh", [True, False])
def test_onepass_fits_the_rule_at_every_b(c, fold, fresh):
    """The one-pass backward's extra memory at every b: the two bf16 feature gradients, the
    strip scratch (``launch.strip_rows``; fresh gradients: with the unused second accumulator's
    room, ``launch.onepass_spare_bytes``), the positives' fp32 temporary (fixup only, <= 16
    MB), one fp32 (b, c) accumulator for d text and O(b) vectors: within the rule (summing
    into given buffers: with that accumulator's room, 4 c bytes per sample, to spare)."""
    for b in (1024, 8192, 16384, 65536, 131072, 262144, 1 << 20, 4 << 20):
        spare = launch.onepass_spare_bytes(b, b, c, fresh)
        rows = min(b, launch.strip_rows(b, 2, k=c, temp=not fold, spare=spare))
        assert rows >= min(b, launch.STRIP_MIN_ROWS)
        extra = 2 * b * c * 2 + 2 * rows * b + (0 if fold else 4 * rows * c) + 4 * b * c + 64 * b
        assert extra + (0 if fresh else 4 * b * c) <= rule_bytes(b, c, 2), (b, c, rows, extra)


def test_onepass_spare_room_makes_taller_strips():
    """Fresh gradients take the second accumulator's room: at b = 65,536, c = 512 the strip is
    1,920 rows, not 896 (the dT accumulator read and written 35 times instead of 74); a call
    summing into given buffers keeps the plain scratch, and so does a torch whose d text product
    needs an fp32 temporary (no in-place fp32 addmm); an explicit budget is taken as given."""
    b, c = 65536, 512
    plain = launch.strip_rows(b, 2, k=c, temp=False)
    tall = launch.strip_rows(b, 2, k=c, temp=False, spare=launch.onepass_spare_bytes(b, b, c, True))
    assert (plain, tall) == (896, 1920)
    assert launch.onepass_spare_bytes(b, b, c, False) == 0
    assert launch.onepass_spare_bytes(b, b, c, True, in_place=False) == 0  # (the product's fp32 temporary)
    assert launch.strip_rows(b, 2, budget=1 << 20, k=c, temp=False, spare=1 << 30) == 8


@pytest.mark.skipif(not CUDA, reason="allocator peak: CUDA")
@pytest.mark.parametrize("c", [512, 1024])
def test_onepass_peak_memory_within_the_rule(c):
    """Measured: peak allocation of one eager one-pass backward (bf16, b = 16384, fresh
    gradients in bf16) beyond its inputs and O(b) vectors, against the rule."""
    b = 16384
    img, txt = (x.bfloat16() for x in _pair(b, c, seed=5))
    s = torch.tensor(1 / 0.07, device=DEV)
    ops = TritonTileOps(backward="onepass", cuda_graphs="never")
    loss, row, col, pos = loss_forward(ops, img, txt, s)
    g = torch.tensor(1.0, device=DEV)
    loss_backward(ops, img, txt, s, row, col, pos, g)  # compile, tune, probe
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = loss_backward(ops, img, txt, s, row, col, pos, g)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert grads[0].dtype == torch.bfloat16
    assert peak <= rule_bytes(b, c, 2), (peak / 2**20, rule_bytes(b, c, 2) / 2**20)
