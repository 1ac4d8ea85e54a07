"""Triton CLIP-LSE kernels vs the float64 reference (interpreter on CPU, real kernels on GPU).

Shapes are tiny and odd (b = 1, 37, 130; c = 16, 200) so that every tail mask and the
clamped loads are exercised; every buffer the kernels write is poisoned with NaN first.
"""

from __future__ import annotations

import pytest
import torch

from infclip.kernels.clip import (
    TritonTileOps, clip_loss_reference, clip_loss_triton, launch, lse_grad_reference, lse_pair_reference,
)
from infclip.kernels.clip.launch import BwdConfig, FwdConfig

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 1, 16), (37, 37, 16), (130, 37, 200), (37, 130, 200)]


def _feats(n: int, c: int, dtype=torch.float32, norm: float = 1.0, seed: int | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    x = torch.randn(n, c, generator=gen, dtype=torch.float64)
    return (norm * torch.nn.functional.normalize(x, dim=-1)).to(dtype).to(DEV)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("m,n,c", SHAPES)
def test_forward_matches_float64(m, n, c):
    a, b = _feats(m, c), _feats(n, c)
    s = torch.tensor(20.0, device=DEV)
    row, col = TritonTileOps(poison=True).forward(a, b, s)
    ref_row, ref_col = lse_pair_reference(a, b, s)
    assert row.dtype == col.dtype == torch.float32 and row.shape == (m,) and col.shape == (n,)
    torch.testing.assert_close(row.double(), ref_row, rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(col.double(), ref_col, rtol=1e-6, atol=2e-6)


def test_forward_column_chunks_and_splits(monkeypatch):
    """A tiny partial budget forces several column launches and splits; same result."""
    monkeypatch.setattr(launch, "PART_BUDGET_BYTES", 4 * 5 * 64)  # 5 row blocks x 64 columns
    a, b = _feats(130, 16), _feats(200, 16)
    s = torch.tensor(5.0, device=DEV)
    poison = TritonTileOps(poison=True)
    row, col = launch.lse_forward(a, b, s, FwdConfig(32, 32, 16), "ieee", alloc=poison._alloc)
    ref_row, ref_col = lse_pair_reference(a, b, s)
    torch.testing.assert_close(row.double(), ref_row, rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(col.double(), ref_col, rtol=1e-6, atol=2e-6)


RESIDENT = BwdConfig(32, 32, 32, 256, True)  # row block on chip; K tail masked for c=200
STREAM = BwdConfig(32, 32, 32, 64, False)  # streamed logits, several feature chunks for c=200
STREAM16 = BwdConfig(16, 16, 16, 16, False)  # K multiple of BK (EVEN_K path) for c=16
STREAM2 = BwdConfig(32, 32, 32, 128, False)  # 2 feature chunks for c=200
GRAD_CASES = [(cfg, shape) for shape in SHAPES for cfg in (RESIDENT, STREAM)] + [
    (STREAM16, (37, 37, 16)), (STREAM16, (1, 1, 16)), (STREAM2, (130, 37, 200)), (STREAM2, (37, 130, 200))]


@pytest.mark.parametrize("cfg,shape", GRAD_CASES)
def test_grad_rows_matches_float64(cfg, shape):
    m, n, c = shape
    a, b = _feats(m, c), _feats(n, c)
    s = torch.tensor(10.0, device=DEV)
    row, col = (v.float() for v in lse_pair_reference(a, b, s))
    g_row, g_col = torch.randn(m, device=DEV), torch.randn(n, device=DEV)
    out = torch.full((m, c), float("nan"), device=DEV)
    ds = launch.grad_rows(a, b, s, row, col, g_row, g_col, out, False, True, cfg, "ieee")
    ref_a, _, ref_ds = lse_grad_reference(a, b, s, g_row, g_col)
    assert _rel(out, ref_a) < 1e-5
    assert abs(ds.item() - ref_ds.item()) <= 1e-5 * (abs(ref_ds.item()) + (s * 0 + 1).item())


@pytest.mark.parametrize("m,n,c", [(37, 130, 200), (1, 37, 16)])
def test_backward_protocol_accumulates(m, n, c):
    a, b = _feats(m, c), _feats(n, c)
    s = torch.tensor(7.0, device=DEV)
    ops = TritonTileOps(poison=True)
    row, col = (v.float() for v in lse_pair_reference(a, b, s))
    g_row, g_col = torch.rand(m, device=DEV), torch.rand(n, device=DEV)
    base_a, base_b = torch.randn(m, c, device=DEV), torch.randn(n, c, device=DEV)
    dimg, dtxt, ds = ops.backward(a, b, s, row, col, g_row, g_col, base_a.clone(), base_b.clone())
    ref_a, ref_b, ref_ds = lse_grad_reference(a, b, s, g_row, g_col)
    assert dimg.dtype == dtxt.dtype == ds.dtype == torch.float32 and ds.dim() == 0
    assert _rel(dimg - base_a, ref_a) < 1e-5 and _rel(dtxt - base_b, ref_b) < 1e-5
    assert abs(ds.item() - ref_ds.item()) < 1e-5 * max(1.0, abs(ref_ds.item()))


@pytest.mark.parametrize("case", ["peaked", "flat", "large_norm"])
def test_extreme_logits(case):
    """Peaked: s=100, near-duplicate rows; flat: s=1; large norms: logits ~ 1e3 (no overflow)."""
    b, c = 37, 16
    img = _feats(b, c)
    if case == "peaked":
        img[1:5] = img[0] + 1e-3 * torch.randn(4, c, device=DEV)
    txt = img + 0.05 * _feats(b, c)
    norm, s = {"peaked": (1.0, 100.0), "flat": (1.0, 1.0), "large_norm": (30.0, 2.0)}[case]
    img, txt = img * norm, txt * norm
    scale = torch.tensor(s, device=DEV)
    ops = TritonTileOps(poison=True)
    row, col = ops.forward(img, txt, scale)
    ref_row, ref_col = lse_pair_reference(img, txt, scale)
    assert torch.isfinite(row).all() and torch.isfinite(col).all()
    tol = 1e-6 * float(ref_row.abs().max())
    torch.testing.assert_close(row.double(), ref_row, rtol=1e-6, atol=max(tol, 2e-6))
    g = torch.full((b,), 0.5 / b, device=DEV)
    dimg, dtxt, ds = ops.backward(img, txt, scale, ref_row.float(), ref_col.float(), g, g)
    ref_a, ref_b, ref_ds = lse_grad_reference(img, txt, scale, g, g)
    # fp32 logits of magnitude L carry ~L * 6e-8 absolute error, which exp() turns relative.
    bound = 2e-5 * max(1.0, float(ref_row.abs().max()))
    assert _rel(dimg, ref_a) < bound and _rel(dtxt, ref_b) < bound
    assert abs(ds.item() - ref_ds.item()) < bound * max(1.0, abs(ref_ds.item()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_no_worse_than_vanilla(dtype):
    """bf16/fp16 inputs: loss and gradients at least as close to float64 as vanilla's."""
    b, c = 130, 200
    img64, txt64 = _feats(b, c, torch.float64), _feats(b, c, torch.float64)
    scale = torch.tensor(30.0, device=DEV, dtype=torch.float64)
    img, txt = img64.to(dtype), txt64.to(dtype)
    errs = {}
    for name, fn in (("ours", clip_loss_triton), ("vanilla", _vanilla)):
        i, t, s = (x.detach().clone().requires_grad_() for x in (img, txt, scale.float()))
        loss = fn(i, t, s)
        loss.backward()
        i64, t64, s64 = (x.detach().double().requires_grad_() for x in (img, txt, scale))
        ref = clip_loss_reference(i64, t64, s64)
        ref.backward()
        errs[name] = [abs(loss.item() - ref.item()) / abs(ref.item()), _rel(i.grad, i64.grad),
                      _rel(t.grad, t64.grad), abs(s.grad.item() - s64.grad.item()) / abs(s64.grad.item())]
    assert i.grad.dtype == dtype
    for ours, van in zip(errs["ours"], errs["vanilla"]):
        assert ours <= 1.25 * van + 1e-4, errs


def _vanilla(img, txt, scale):
    """open_clip's ClipLoss in the input dtype. On CPU (whose 16-bit GEMM may be missing)
    each product is emulated as a GPU GEMM does it: fp32 accumulation, output rounded."""
    dt = img.dtype
    if img.is_cuda or dt == torch.float32:
        logits = scale.to(dt) * img @ txt.T
    else:
        logits = ((scale.to(dt) * img).float() @ txt.float().T).to(dt)
    labels = torch.arange(img.shape[0], device=img.device)
    ce = torch.nn.functional.cross_entropy
    return (0.5 * (ce(logits, labels) + ce(logits.T, labels))).float()


@pytest.mark.parametrize("need", [(1, 1, 1), (1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 0), (0, 1, 1)])
def test_autograd_function_requires_grad_combinations(need):
    b, c = 37, 16
    base = [_feats(b, c), _feats(b, c), torch.tensor(14.0, device=DEV)]
    ours = [x.clone().requires_grad_(bool(r)) for x, r in zip(base, need)]
    ref = [x.double().clone().requires_grad_(bool(r)) for x, r in zip(base, need)]
    loss = clip_loss_triton(*ours)
    ref_loss = clip_loss_reference(*ref)
    assert abs(loss.item() - ref_loss.item()) < 1e-5 * abs(ref_loss.item())
    loss.backward()
    ref_loss.backward()
    for x, r in zip(ours, ref):
        if r.requires_grad:
            assert _rel(x.grad, r.grad) < 1e-5
        else:
            assert x.grad is None


def test_fp32_precision_option():
    with pytest.raises(ValueError, match="fp32_precision"):
        TritonTileOps("fp16")
    a = _feats(37, 16)
    s = torch.tensor(3.0, device=DEV)
    row, _ = TritonTileOps("tf32").forward(a, a, s)  # runs; tf32 only changes GPU dots
    assert torch.isfinite(row).all()


@pytest.mark.parametrize("ws", [False, True], ids=["plain", "ws"])
@pytest.mark.parametrize("bk", [32, 16], ids=["k_tail", "even_k"])
@pytest.mark.parametrize("m,n,c", [(37, 130, 200), (1, 37, 16)])
def test_forward_kernel_variants(bk, m, n, c, ws):
    a, b = _feats(m, c), _feats(n, c)
    s = torch.tensor(20.0, device=DEV)
    alloc = TritonTileOps(poison=True)._alloc
    row, col = launch.lse_forward(a, b, s, FwdConfig(32, 32, bk, ws=ws), "ieee", alloc=alloc)
    ref_row, ref_col = lse_pair_reference(a, b, s)
    torch.testing.assert_close(row.double(), ref_row, rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(col.double(), ref_col, rtol=1e-6, atol=2e-6)


@pytest.mark.parametrize("m,n,c", [(130, 37, 200), (37, 130, 16), (1, 37, 16)])
def test_strip_backward_matches_float64(monkeypatch, m, n, c):
    """Strip path: s * dX for a few rows at a time into a scratch, then a GEMM per strip."""
    monkeypatch.setattr(launch, "strip_rows", lambda *args, **kwargs: 40)  # 40-row strips
    a, b = _feats(m, c), _feats(n, c)
    s = torch.tensor(10.0, device=DEV)
    row, col = (v.float() for v in lse_pair_reference(a, b, s))
    g_row, g_col = torch.randn(m, device=DEV), torch.randn(n, device=DEV)
    ops = TritonTileOps(poison=True, strips="always")
    dimg, dtxt, ds = ops.backward(a, b, s, row, col, g_row, g_col)
    ref_a, ref_b, ref_ds = lse_grad_reference(a, b, s, g_row, g_col)
    assert _rel(dimg, ref_a) < 1e-5 and _rel(dtxt, ref_b) < 1e-5
    assert abs(ds.item() - ref_ds.item()) < 1e-5 * max(1.0, abs(ref_ds.item()))


def test_strip_path_policy():
    ops = TritonTileOps()
    a = torch.zeros(4, 8)
    assert not ops._use_strips(a, torch.zeros(4, 8), False, 512)  # auto: CUDA bf16 only
    assert not TritonTileOps(strips="always")._use_strips(a, torch.zeros(4, 8), True, 512)  # accumulate
    assert TritonTileOps(strips="always")._use_strips(a, torch.zeros(4, 8), False, 512)
    with pytest.raises(ValueError, match="strips"):
        TritonTileOps(strips="sometimes")


@pytest.mark.parametrize("strips", ["never", "always"])
def test_positive_pair_gradient_folded_into_dx(strips):
    """g_diag: the backward of sum g_row.row_lse + g_col.col_lse - sum g_diag_i x_ii, with
    the LSEs relative to the offsets s <a_i, t_i> (the positives' dot products)."""
    b, c = 37, 200
    a, t = _feats(b, c), _feats(b, c)
    s = torch.tensor(10.0, device=DEV)
    pos = (a * t).sum(-1)
    row, col = (v.float() - s * pos for v in lse_pair_reference(a, t, s))
    g_row, g_col, g_d = (torch.randn(b, device=DEV) for _ in range(3))
    ops = TritonTileOps(poison=True, strips=strips)
    dimg, dtxt, ds = ops.backward(a, t, s, row, col, g_row, g_col, g_diag=g_d, offsets=(pos, pos))
    ref_a, ref_b, ref_ds = lse_grad_reference(a, t, s, g_row, g_col)
    ref_a = ref_a - s.double() * g_d.double()[:, None] * t.double()
    ref_b = ref_b - s.double() * g_d.double()[:, None] * a.double()
    ref_ds = ref_ds - (g_d.double() * (a.double() * t.double()).sum(-1)).sum()
    assert _rel(dimg, ref_a) < 1e-5 and _rel(dtxt, ref_b) < 1e-5
    assert abs(ds.item() - ref_ds.item()) < 1e-5 * max(1.0, abs(ref_ds.item()))
    with pytest.raises(ValueError, match="offsets"):
        ops.backward(a, t, s, row, col, g_row, g_col, g_diag=g_d)
    with pytest.raises(ValueError, match="square"):
        ops.backward(a, t[:5], s, row, col[:5], g_row, g_col[:5], g_diag=g_d, offsets=(pos, pos[:5]))


@pytest.mark.parametrize("c", [512, 768, 1024])
def test_strip_path_fits_the_memory_rule_at_every_b(c):
    """The bf16 strip backward (the fast path) gets >= STRIP_MIN_ROWS rows
    at every b, and its scratch + fp32 fixup temporary + O(b) vectors stay within the
    loss's rule of 1 KB x b + 64 MB beyond the two feature gradients."""
    for b in (1024, 8192, 16384, 65536, 131072, 262144, 1 << 20, 4 << 20):
        for temp in (True, False):  # positives by fp32 fixup (temporary) / folded (none)
            rows = launch.strip_rows(b, 2, k=c, temp=temp)
            assert rows >= min(b, launch.STRIP_MIN_ROWS), (b, c, rows)
            extra = 2 * min(rows, b) * b + temp * 4 * min(rows, b) * c + 64 * b  # scratch, temp, vectors
            assert extra <= 1024 * b + (64 << 20), (b, c, rows, extra)


def _filter_case(b: int, c: int, eps: float):
    """(exact grads through the fused kernel, filtered grads, ops) of the CLIP loss on peaked
    features (texts = perturbed images, s = 100: late training)."""
    from infclip.loss.filtering import filtered_clip_loss

    g = torch.Generator().manual_seed(9)
    img = torch.nn.functional.normalize(torch.randn(b, c, generator=g), dim=-1)
    txt = torch.nn.functional.normalize(img + 0.5 * torch.randn(b, c, generator=g) / c ** 0.5, dim=-1)
    img, txt, s = img.to(DEV), txt.to(DEV), torch.tensor(100.0, device=DEV)
    ops = TritonTileOps(poison=True, grad_filter=(eps, b))
    out = []
    for fn in (lambda *x: clip_loss_triton(*x, ops=TritonTileOps(strips="never")),
               lambda *x: filtered_clip_loss(*x, eps=eps, impl="triton", ops=ops)):
        xs = [v.clone().requires_grad_() for v in (img, txt, s)]
        loss = fn(*xs)
        loss.backward()
        out.append((loss.detach(), *(v.grad for v in xs)))
    return out, ops, (img, txt, s)


def test_triton_grad_filter_off_at_eps_zero_is_exact():
    """Gradient filtering with eps = 0 keeps every tile; the gradients equal the unfiltered ones bit for bit."""
    (exact, got), ops, _ = _filter_case(96, 16, 0.0)
    assert all(torch.equal(a, b) for a, b in zip(exact, got))
    kept, total = int(ops.kept[0]), ops.kept[1]
    assert kept == total > 0


def test_triton_grad_filter_skips_tiles_within_the_bound(monkeypatch):
    """Peaked softmax: most tiles skip their update product; the gradients stay within the
    documented bound (``infclip.loss.filtering.error_bound``); the loss value is exact.
    32 x 32 tiles on CPU and GPU alike (the GPU's own fp32 tiles are 64 x 64: 4 x 4 of them
    at b = 256, too coarse to skip half)."""
    from infclip.loss.filtering import error_bound

    monkeypatch.setattr(launch, "bwd_candidates", lambda k, esize: [BwdConfig(32, 32, 16, 16, False)])
    monkeypatch.setattr(launch, "_TUNED", {})
    b, eps = 256, 2 ** -7
    (exact, got), ops, (img, txt, s) = _filter_case(b, 16, eps)
    kept, total = int(ops.kept[0]), ops.kept[1]
    assert kept < total / 2, (kept, total)
    assert torch.equal(exact[0], got[0])
    g = torch.full((b,), 0.5 / b, device=DEV)
    bound = error_bound(img, txt, s, g, g, eps)
    errs = ((got[1] - exact[1]).norm(dim=-1).max(), (got[2] - exact[2]).norm(dim=-1).max(),
            (got[3] - exact[3]).abs())
    for err, bnd in zip(errs, bound):
        assert float(err) <= bnd + 1e-7, (float(err), bnd)
    assert not torch.equal(exact[1], got[1])  # something was dropped


@pytest.mark.parametrize("ws", [False, True])
@pytest.mark.parametrize("positives", ["fixup", "fold"])
def test_strip_tma_kernel_matches_pointer_kernel(monkeypatch, ws, positives):
    """The persistent TMA strip kernel (ragged 37-row strips, 3
    programs striding over the tiles off CUDA) gives the pointer kernel's gradients and
    d scale, bf16, positives folded in; fp32 inputs are refused."""
    from infclip.kernels.clip.launch import StripConfig

    monkeypatch.setattr(launch, "strip_rows", lambda *args, **kwargs: 37)  # ragged 37-row strips
    b, c = 101, 48
    a, t = _feats(b, c).bfloat16(), _feats(b, c).bfloat16()
    s = torch.tensor(10.0, device=DEV)
    pos = (a.float() * t.float()).sum(-1)
    row, col = (v.float() - s * pos for v in lse_pair_reference(a.double(), t.double(), s))
    g = torch.full((b,), 0.5 / b, device=DEV)
    out = []
    for tma in (False, True):
        cfg = StripConfig(32, 32, 16, 2, tma=tma, ws=ws)
        monkeypatch.setattr(launch, "strip_candidates", lambda k, esize, cfg=cfg: [cfg])
        monkeypatch.setattr(launch, "_TUNED", {})
        ops = TritonTileOps(poison=True, strips="always", strip_positives=positives)
        out.append(ops.backward(a, t, s, row, col, g, g, out_dtype=a.dtype, g_diag=2 * g, offsets=(pos, pos)))
    for x, y in zip(*out):
        assert torch.isfinite(y.float()).all()
        torch.testing.assert_close(y.float(), x.float(), rtol=1e-5, atol=1e-6)
    ref_a, _, _ = lse_grad_reference(a.double(), t.double(), s, g, g)
    ref_a = ref_a - s.double() * 2 * g.double()[:, None] * t.double()
    assert _rel(out[1][0], ref_a) < 2e-2  # bf16 rounding of P and of the result
    with pytest.raises(ValueError, match="TMA"):
        launch.grad_rows_strips(a.float(), t.float(), s, row, col, g, g, torch.empty(b, c, device=DEV), 37,
                                StripConfig(32, 32, 16, tma=True), "ieee")


@pytest.mark.parametrize("strips", ["never", "always"])
def test_positives_exact_for_any_gradient_weights(strips):
    """The folded positive term g_row + g_col - g_diag must stay exactly 0 when g_diag is
    exactly g_row + g_col, whatever the weights: the fused kernel's rescaling by the
    gradients' norm is by a power of two. A rounded rescaling left ~1e-7 g_diag per row,
    which dominates d scale once the softmax is peaked (here loss ~ 4e-3): d scale and
    the feature gradients within 1e-5 of float64."""
    b, c = 37, 40
    gen = torch.Generator().manual_seed(7)
    a = torch.nn.functional.normalize(torch.randn(b, c, generator=gen, dtype=torch.float64), dim=-1)
    t = torch.nn.functional.normalize(a + 1.3 * torch.randn(b, c, generator=gen, dtype=torch.float64) / c ** 0.5,
                                      dim=-1)
    a, t = a.float().to(DEV), t.float().to(DEV)
    s = torch.tensor(100.0, device=DEV)
    # weights k / 2^16 (k = 300..1299): g_row + g_col is exact, so the positive term's
    # g_row + g_col - g_d is truly 0, and max |g| is no power of two
    g_row, g_col = (torch.randint(300, 1300, (b,), generator=gen).float().to(DEV) / 2 ** 16 for _ in range(2))
    g_d = g_row + g_col
    pos = (a.double() * t.double()).sum(-1).float()
    x = s.double() * a.double() @ t.double().T
    x.diagonal().copy_(s.double() * pos.double())
    spos = s.double() * pos.double()
    row, col = torch.logsumexp(x, 1) - spos, torch.logsumexp(x, 0) - spos
    assert 1e-3 < (0.5 * (row.mean() + col.mean())).item() < 1e-2  # peaked
    p, q = torch.softmax(x, 1), torch.softmax(x, 0)
    dx = g_row.double()[:, None] * p + g_col.double()[None, :] * q
    # the diagonal without cancellation: g_row (p_ii - 1) + g_col (q_ii - 1), g_d = g_row + g_col
    dx.diagonal().copy_(g_row.double() * torch.expm1(-row) + g_col.double() * torch.expm1(-col))
    dots = a.double() @ t.double().T
    dots.diagonal().copy_(pos.double())
    ref = (s.double() * dx @ t.double(), s.double() * dx.T @ a.double(), (dx * dots).sum())
    ops = TritonTileOps(poison=True, strips=strips)
    got = ops.backward(a, t, s, row.float(), col.float(), g_row, g_col, g_diag=g_d, offsets=(pos, pos))
    errs = [_rel(x, r) for x, r in zip(got, ref)]
    assert max(errs) < 1e-5, errs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_row_dot_fp32_accumulation(dtype):
    """The positives' dot products (offsets of every pass): fp32 accumulation of the exact
    16-bit products (one batched product on CUDA, fp32 chunks elsewhere), b not a multiple
    of anything, within fp32 rounding of float64."""
    from infclip.kernels.clip.reference import row_dot

    a, t = _feats(1037, 200, dtype), _feats(1037, 200, dtype)
    got = row_dot(a, t)
    ref = (a.double() * t.double()).sum(-1)
    assert got.dtype == torch.float32 and got.shape == (1037,)
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-6)
