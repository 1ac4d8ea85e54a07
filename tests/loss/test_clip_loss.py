"""``clip_loss`` on one process: input validation, float64 ground truth, all impls agree.

Triton runs through its interpreter on CPU (TRITON_INTERPRET=1, set below before the
kernels are imported), so shapes stay tiny and odd.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from infclip.loss import clip_loss  # noqa: E402
from infclip.loss.reference import vanilla_loss  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = ["vanilla", "local", "torch", "triton"]


def _feats(b: int, c: int, dtype=torch.float32, norm: float = 1.0) -> torch.Tensor:
    x = torch.nn.functional.normalize(torch.randn(b, c, dtype=torch.float64), dim=-1)
    return (norm * x).to(dtype).to(DEV)


def _ground_truth(img, txt, scale):
    """open_clip's ClipLoss in float64 and its gradients (img, txt, scale)."""
    i, t, s = (x.detach().double().requires_grad_() for x in (img, txt, scale))
    logits = s * i @ t.T
    labels = torch.arange(i.shape[0], device=i.device)
    ce = torch.nn.functional.cross_entropy
    loss = 0.5 * (ce(logits, labels) + ce(logits.T, labels))
    loss.backward()
    return loss.detach(), i.grad, t.grad, s.grad


def _run(impl, img, txt, scale):
    i, t, s = (x.detach().clone().requires_grad_() for x in (img, txt, scale))
    loss = clip_loss(i, t, s, impl=impl)
    loss.backward()
    return loss.detach(), i.grad, t.grad, s.grad


def _rel(x, ref) -> float:
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


# -- API validation ---------------------------------------------------------------------------
def _bad_inputs():
    f, s = _feats(4, 8), torch.tensor(10.0, device=DEV)
    return [
        ((f, f[:3], s), "same shape"),
        ((f[0], f[0], s), "2-D"),
        ((f[:0], f[:0], s), "empty batch"),
        ((f, f.double().to(torch.float16), s), "dtype mismatch"),
        ((f.int(), f.int(), s), "unsupported"),
        ((f, f, torch.tensor([10.0], device=DEV)), "0-dim"),
        ((f, f, 10.0), "0-dim"),
        ((f, f, torch.tensor(-1.0, device=DEV)), "positive"),
        ((f, f, torch.tensor(0.0, device=DEV)), "positive"),
        ((f, f, torch.tensor(3, device=DEV)), "floating"),
        ((f, [[1.0]], s), "torch.Tensor"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_inputs())))
def test_bad_inputs_raise_value_error(case):
    args, match = _bad_inputs()[case]
    with pytest.raises(ValueError, match=match):
        clip_loss(*args)


def test_bad_options_raise_value_error():
    f, s = _feats(4, 8), torch.tensor(10.0, device=DEV)
    with pytest.raises(ValueError, match="unknown impl"):
        clip_loss(f, f, s, impl="cuda")
    with pytest.raises(ValueError, match="fp32_precision"):
        clip_loss(f, f, s, fp32_precision="fp16")


def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    f, s = _feats(4, 8).cpu(), torch.tensor(10.0)
    with pytest.raises(ValueError, match="CUDA"):
        clip_loss(f, f, s, impl="triton")


# -- exactness against float64 ----------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("b,c", [(1, 16), (37, 16), (130, 200)])
def test_fp32_matches_float64(impl, b, c):
    img, txt = _feats(b, c), _feats(b, c)
    scale = torch.tensor(1 / 0.07, device=DEV)
    ref = _ground_truth(img, txt, scale)
    got = _run(impl, img, txt, scale)
    assert got[0].dtype == torch.float32 and got[0].dim() == 0
    # b = 1: the loss is exactly 0, but fp32 logits carry ~1e-7 * s absolute error.
    assert abs(got[0].item() - ref[0].item()) <= 1e-5 * abs(ref[0].item()) + 2e-7 * scale.item()
    for g, r in zip(got[1:], ref[1:]):
        assert g.dtype == torch.float32
        # Relative 1e-5. At b = 1 the exact gradient is 0 (two O(s) terms cancel), so the
        # bound there is absolute: fp32 rounding of those terms.
        atol = 1e-6 * scale.item() * r.numel() ** 0.5 if b == 1 else 0.0
        assert (g.double() - r).norm().item() <= 1e-5 * r.norm().item() + atol


def test_impls_agree_with_each_other():
    img, txt = _feats(130, 200), _feats(130, 200)
    scale = torch.tensor(30.0, device=DEV)
    runs = {impl: _run(impl, img, txt, scale) for impl in ("vanilla", "torch", "triton")}
    for impl in ("torch", "triton"):
        for got, van in zip(runs[impl], runs["vanilla"]):
            torch.testing.assert_close(got, van, rtol=2e-5, atol=1e-7)


def test_auto_runs_tiled_on_this_device():
    img, txt = _feats(37, 16), _feats(37, 16)
    scale = torch.tensor(10.0, device=DEV)
    torch.testing.assert_close(clip_loss(img, txt, scale), clip_loss(img, txt, scale, impl="vanilla"),
                               rtol=1e-5, atol=0)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("need", [(1, 1, 1), (1, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1), (0, 0, 0)])
def test_requires_grad_combinations(impl, need):
    base = [_feats(37, 16), _feats(37, 16), torch.tensor(14.0, device=DEV)]
    xs = [x.clone().requires_grad_(bool(r)) for x, r in zip(base, need)]
    ref = _ground_truth(*base)
    loss = clip_loss(*xs, impl=impl)
    assert abs(loss.item() - ref[0].item()) <= 1e-5 * abs(ref[0].item())
    if not any(need):
        assert not loss.requires_grad
        return
    loss.backward()
    for x, r, g in zip(xs, need, ref[1:]):
        assert (x.grad is None) == (not r)
        if r:
            assert _rel(x.grad, g) < 1e-5


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("case", ["peaked", "flat", "large_norm"])
def test_peaked_flat_and_large_norm(impl, case):
    """Peaked: s=100 with near-duplicate rows; flat: s=1; unnormalized norms ~30 (logits ~1e3).

    Nothing may overflow. The tiled loss subtracts a separately computed diagonal, so where
    the softmax is nearly one-hot two O(L) terms cancel (L = max |logit|) and fp32 leaves
    ~L * 1e-7 relative error on them; vanilla cancels within one logits matrix. The bound
    is the larger of 2x vanilla fp32's error and that rounding of the cancelling terms."""
    b, c = 37, 16
    img = _feats(b, c)
    if case == "peaked":
        img[1:6] = img[0] + 1e-3 * torch.randn(5, c, device=DEV)
    txt = img + 0.1 * _feats(b, c)
    norm, s = {"peaked": (1.0, 100.0), "flat": (1.0, 1.0), "large_norm": (30.0, 1.0)}[case]
    img, txt, scale = img * norm, txt * norm, torch.tensor(s, device=DEV)
    ref = _ground_truth(img, txt, scale)
    got, van = _run(impl, img, txt, scale), _run("vanilla", img, txt, scale)
    assert all(torch.isfinite(g).all() for g in got)
    big = (s * img.double() @ txt.double().T).abs().max().item()
    terms = [5 * big, s * txt.norm().item() / b, s * img.norm().item() / b, big / s]
    for g, v, r, term in zip(got, van, ref, terms):
        err, err_van = (g.double() - r).norm().item(), (v.double() - r).norm().item()
        assert err <= max(2 * err_van, 1e-6 * r.norm().item(), 2e-7 * big * term), (err, err_van)


# -- 16-bit inputs ------------------------------------------------------------------------------
def _vanilla_lowp(img, txt, scale):
    """Vanilla (open_clip) in the input dtype; on CPU each GEMM is emulated as on a GPU
    (fp32 accumulation, output rounded to the dtype), as CPU 16-bit GEMMs may be missing."""
    if img.is_cuda:
        return clip_loss(img, txt, scale, impl="vanilla")
    dt = img.dtype
    logits = ((scale.to(dt) * img).float() @ txt.float().T).to(dt)
    labels = torch.arange(img.shape[0])
    ce = torch.nn.functional.cross_entropy
    return (0.5 * (ce(logits, labels) + ce(logits.T, labels))).float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_low_precision_no_worse_than_vanilla(impl, dtype):
    b, c = 130, 200
    img64, txt64 = _feats(b, c, torch.float64), _feats(b, c, torch.float64)
    scale = torch.tensor(30.0, device=DEV)
    img, txt = img64.to(dtype), txt64.to(dtype)
    ref = _ground_truth(img, txt, scale)
    errs = {}
    for name, fn in ((impl, lambda i, t, s: clip_loss(i, t, s, impl=impl)), ("vanilla", _vanilla_lowp)):
        i, t, s = (x.detach().clone().requires_grad_() for x in (img, txt, scale))
        loss = fn(i, t, s)
        loss.backward()
        assert loss.dtype == torch.float32 and i.grad.dtype == dtype and t.grad.dtype == dtype
        errs[name] = [abs(loss.item() - ref[0].item()) / ref[0].item(), _rel(i.grad, ref[1]),
                      _rel(t.grad, ref[2]), abs(s.grad.item() - ref[3].item()) / abs(ref[3].item())]
    for ours, van in zip(errs[impl], errs["vanilla"]):
        assert ours <= 1.25 * van + 1e-4, errs


def test_row_dot_chunks_match_direct(monkeypatch):
    """The chunked diagonal <I_i, T_i> (no fp32 (b, c) copies) and its gradients."""
    from infclip.loss import tiled

    monkeypatch.setattr(tiled, "ROW_DOT_CHUNK", 3 * 16)  # 3 rows per chunk
    for dtype in (torch.float32, torch.bfloat16):
        a, b = (_feats(37, 16, dtype).requires_grad_() for _ in range(2))
        g = torch.randn(37, device=DEV)
        d = tiled.row_dot(a, b)
        assert d.dtype == torch.float32
        torch.testing.assert_close(d, (a.float() * b.float()).sum(-1), rtol=1e-6, atol=1e-6)
        ga, gb = torch.autograd.grad(d, (a, b), g)
        assert ga.dtype == dtype
        torch.testing.assert_close(ga, (g[:, None] * b.float()).to(dtype))
        torch.testing.assert_close(gb, (g[:, None] * a.float()).to(dtype))


def test_torch_tiles_capped_by_tile_elements(monkeypatch):
    """The PyTorch tiles shrink with n (fixed working set) and the loss is unchanged."""
    import infclip.loss.tiled as tiled

    monkeypatch.setattr(tiled, "TILE_ELEMENTS", 40)  # n = 13 -> 3 rows per tile
    g = torch.Generator().manual_seed(11)
    img = torch.randn(13, 24, generator=g, dtype=torch.float64, requires_grad=True)
    txt = torch.randn(13, 24, generator=g, dtype=torch.float64, requires_grad=True)
    s = torch.tensor(4.0, dtype=torch.float64, requires_grad=True)
    ref = vanilla_loss(img, txt, s)
    ours = clip_loss(img, txt, s, impl="torch")
    assert torch.allclose(ours, ref, rtol=1e-12)
    for a, b in zip(torch.autograd.grad(ours, (img, txt, s)), torch.autograd.grad(ref, (img, txt, s))):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
