"""The positive pairs are exact (CLIP on one process and on a ring, all backends).

Every case draws fresh random inputs and compares the loss and all three gradients
(d image, d text, d scale) with float64 open_clip. fp32: within 1e-5 relative; the peaked
case (normalized, text = normalize(image + sigma noise), s = 100, loss ~ 0.02) is the one
the old kernels failed (the positive term was subtracted after dX ~ 1 had been rounded and
multiplied, and d scale was a difference of two near-equal sums). bf16: no worse than
vanilla bf16 (times a small slack). b = 1 in bf16: loss and gradients exactly zero.
Triton runs through its interpreter on CPU (shapes scaled down).
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
F = torch.nn.functional


def _inputs(case: str, b: int, c: int, seed: int, dtype=torch.float32):
    """(img, txt, scale) float64 on DEV for a named case (fresh random draw per seed), the
    features already rounded to ``dtype`` (the ground truth sees the inputs the loss sees)."""
    g = torch.Generator().manual_seed(seed)
    img = torch.randn(b, c, generator=g, dtype=torch.float64)
    noise = torch.randn(b, c, generator=g, dtype=torch.float64)
    if case == "peaked":  # loss ~ 0.01-0.1 at s = 100: the end of a CLIP training run
        img = F.normalize(img, dim=-1)
        sigma = 1.2 if c < 64 else 2.6
        txt, s = F.normalize(img + sigma * noise / c ** 0.5, dim=-1), 100.0
    elif case == "flat":
        img = F.normalize(img, dim=-1)
        txt, s = F.normalize(noise, dim=-1), 10.0
    else:  # unnormalized, correlated: random row norms, text = 0.3 image + noise
        norms = torch.rand(b, 1, generator=g, dtype=torch.float64) + 0.5
        img = img * norms / c ** 0.5
        txt, s = 0.3 * img + noise / c ** 0.5, 30.0
    img, txt = (x.to(dtype).double().to(DEV) for x in (img, txt))
    return img, txt, torch.tensor(s, dtype=torch.float64, device=DEV)


def _grads(fn, img, txt, scale, dtype):
    i, t = (x.detach().to(dtype).requires_grad_() for x in (img, txt))
    s = scale.detach().float().requires_grad_() if dtype != torch.float64 else scale.clone().requires_grad_()
    loss = fn(i, t, s)
    loss.backward()
    return loss.detach().double(), i.grad.double(), t.grad.double(), s.grad.double()


def _truth(img, txt, scale):
    return _grads(vanilla_loss, img, txt, scale, torch.float64)


def _errs(got, ref) -> list[float]:
    return [((x - r).norm() / r.norm().clamp_min(1e-300)).item() for x, r in zip(got, ref)]


# b not a multiple of any tile; c = 200 and 64 stand in for the GPU's 640 / 200 widths.
SHAPES = [(37, 40), (70, 200)]
CASES = ["peaked", "flat", "unnormalized"]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("b,c", SHAPES)
def test_fp32_within_1e5_of_float64(impl, case, b, c):
    """1e-5 relative; where vanilla fp32 itself misses that (peaked: the fp32 dot products'
    own rounding, ~1e-7 * s, moves every p_ij by ~1e-5 relative) no worse than 2x vanilla."""
    img, txt, s = _inputs(case, b, c, seed=0)
    ref = _truth(img, txt, s)
    if case == "peaked":
        assert 0.01 < ref[0].item() < 0.1, f"peaked case drew loss {ref[0].item()}"
    van = _errs(_grads(vanilla_loss, img, txt, s, torch.float32), ref)
    got = _grads(lambda i, t, sc: clip_loss(i, t, sc, impl=impl), img, txt, s, torch.float32)
    errs = _errs(got, ref)
    for name, e, v in zip(("loss", "dimg", "dtxt", "ds"), errs, van):
        assert e < max(1e-5, 2 * v), f"{impl} {case} {name}: rel err {e:.3g} (vanilla fp32 {v:.3g})"


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("case", ["peaked", "unnormalized"])
def test_bf16_no_worse_than_vanilla_bf16(impl, case):
    _check_bf16_vs_vanilla(lambda i, t, sc: clip_loss(i, t, sc, impl=impl), case, impl)


def _check_bf16_vs_vanilla(loss_fn, case: str, label: str) -> None:
    """bf16 (b = 70, c = 64): loss and every gradient no worse than vanilla bf16 (x 1.25)."""
    img, txt, s = _inputs(case, 70, 64, seed=11, dtype=torch.bfloat16)
    ref = _truth(img, txt, s)
    van = _errs(_grads(vanilla_loss, img, txt, s, torch.bfloat16), ref)
    got = _errs(_grads(loss_fn, img, txt, s, torch.bfloat16), ref)
    for name, e, v in zip(("loss", "dimg", "dtxt", "ds"), got, van):
        assert e <= 1.25 * v + 1e-6, f"{label} {case} {name}: ours {e:.3g} vanilla bf16 {v:.3g}"


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_single_pair_gives_exact_zeros(impl, dtype):
    """b = 1: the loss is log(1) = 0 for any logit; every gradient must be exactly 0."""
    img, txt, s = _inputs("unnormalized", 1, 40, seed=3, dtype=dtype)
    loss, di, dt, ds = _grads(lambda i, t, sc: clip_loss(i, t, sc, impl=impl), img, txt, s * 3, dtype)
    assert loss.item() == 0.0 and ds.item() == 0.0
    assert torch.count_nonzero(di) == 0 and torch.count_nonzero(dt) == 0


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_ring_diagonal_block_exact(impl):
    """The ring's path (ring_forward / ring_backward, the step-0 tile holding the positives)
    on a one-rank loopback ring: the peaked fp32 case as above, b = 1 bf16 exactly zero."""
    from infclip.loss import _tiled_loss, tile_ops
    from infclip.loss.ring import LoopbackRing

    def ring_loss(i, t, sc):
        return _tiled_loss(i, t, sc, tile_ops(impl, i.device), LoopbackRing(1))

    _check_peaked_and_b1(ring_loss)



def _check_peaked_and_b1(loss_fn) -> None:
    """Peaked fp32 (b = 70, c = 200) within max(1e-5, 2x vanilla fp32) of float64 in loss and
    every gradient; b = 1 in bf16 gives a loss and gradients of exactly zero."""
    img, txt, s = _inputs("peaked", 70, 200, seed=0)
    ref = _truth(img, txt, s)
    van = _errs(_grads(vanilla_loss, img, txt, s, torch.float32), ref)
    errs = _errs(_grads(loss_fn, img, txt, s, torch.float32), ref)
    assert all(e < max(1e-5, 2 * v) for e, v in zip(errs, van)), (errs, van)
    img, txt, s = _inputs("unnormalized", 1, 40, seed=3, dtype=torch.bfloat16)
    loss, di, dt, ds = _grads(loss_fn, img, txt, s * 3, torch.bfloat16)
    assert loss.item() == 0.0 and ds.item() == 0.0 and not di.any() and not dt.any()

def _nt_inputs(n: int, c: int, seed: int, sigma: float, dtype=torch.float32):
    """(2n, c) views [x; normalize(x + sigma noise)] rounded to dtype, as float64."""
    g = torch.Generator().manual_seed(seed)
    x = F.normalize(torch.randn(n, c, generator=g, dtype=torch.float64), dim=-1)
    y = F.normalize(x + sigma * torch.randn(n, c, generator=g, dtype=torch.float64) / c ** 0.5, dim=-1)
    return torch.cat([x, y]).to(dtype).double().to(DEV)


def _nt_grads(impl, f, t, dtype):
    from infclip.loss import nt_xent_loss

    x = f.detach().to(dtype).requires_grad_()
    temp = torch.tensor(t, dtype=torch.float64 if dtype == torch.float64 else torch.float32, device=DEV,
                        requires_grad=True)
    loss = nt_xent_loss(x, temp, impl=impl)
    loss.backward()
    return loss.detach().double(), x.grad.double(), temp.grad.double()


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("peaked", [True, False])
def test_nt_xent_positives_exact(impl, peaked):
    """NT-Xent's positives (i <-> i + n) folded into the tiles: fp32 within 1e-5 of float64
    (or 2x vanilla fp32 where vanilla misses it); bf16 no worse than vanilla bf16."""
    n, c, t = 35, 40, 0.01 if peaked else 0.5  # s = 100: loss ~ 0.05
    f = _nt_inputs(n, c, seed=5, sigma=1.2 if peaked else 3.0)
    ref = _nt_grads("vanilla", f, t, torch.float64)
    if peaked:
        assert 0.005 < ref[0].item() < 0.2, ref[0].item()
    van = _errs(_nt_grads("vanilla", f, t, torch.float32), ref)
    got = _errs(_nt_grads(impl, f, t, torch.float32), ref)
    for name, e, v in zip(("loss", "df", "dtemp"), got, van):
        assert e < max(1e-5, 2 * v), f"{impl} fp32 {name}: {e:.3g} (vanilla {v:.3g})"
    f16 = f.to(torch.bfloat16).double()
    ref16 = _nt_grads("vanilla", f16, t, torch.float64)
    van16 = _errs(_nt_grads("vanilla", f16, t, torch.bfloat16), ref16)
    got16 = _errs(_nt_grads(impl, f16, t, torch.bfloat16), ref16)
    for name, e, v in zip(("loss", "df", "dtemp"), got16, van16):
        assert e <= 1.25 * v + 1e-6, f"{impl} bf16 {name}: {e:.3g} (vanilla {v:.3g})"


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_siglip_positives_already_folded(impl):
    """SigLIP needs no change: its tiles form dX_ii = -sigmoid(-x_ii) g directly (no
    p - 1 difference) and d scale / d bias from that dX. Checked on the peaked case (a
    confident model: s = 100, t = -10) against float64: fp32 within 1e-5 or 2x vanilla."""
    from infclip.loss.siglip import siglip_loss, siglip_reference

    img, txt, s = _inputs("peaked", 37, 40, seed=0)
    bias = torch.tensor(-10.0, dtype=torch.float64, device=DEV)

    def run(fn, dtype):
        i, t = (x.detach().to(dtype).requires_grad_() for x in (img, txt))
        sc, bi = (x.detach().to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
                  for x in (s, bias))
        loss = fn(i, t, sc, bi)
        loss.backward()
        return [x.double() for x in (loss.detach(), i.grad, t.grad, sc.grad, bi.grad)]

    ref = run(siglip_reference, torch.float64)
    van = _errs(run(siglip_reference, torch.float32), ref)
    got = _errs(run(lambda *a: siglip_loss(*a, impl=impl), torch.float32), ref)
    for name, e, v in zip(("loss", "dimg", "dtxt", "ds", "dbias"), got, van):
        assert e < max(1e-5, 2 * v), f"{impl} {name}: {e:.3g} (vanilla fp32 {v:.3g})"


@pytest.mark.parametrize("strips,positives", [("always", "fixup"), ("always", "fold"), ("never", "fixup")])
def test_triton_both_backward_paths_exact_and_poisoned(strips, positives, monkeypatch):
    """The strip backward (s dX into a scratch, then a GEMM; positives added in fp32 before
    the rounding, or folded into the scratch) and the fused one, every output buffer
    NaN-poisoned first: peaked fp32 as above (several ragged strips), b = 1 bf16 exactly zero."""
    from infclip.kernels.clip import TritonTileOps, clip_loss_triton, launch

    monkeypatch.setattr(launch, "strip_rows", lambda *args, **kwargs: 32)  # 3 strips, the last ragged
    ops = TritonTileOps(poison=True, strips=strips, strip_positives=positives)

    def fn(i, t, sc):
        return clip_loss_triton(i, t, sc, ops=ops)

    _check_peaked_and_b1(fn)


@pytest.mark.parametrize("positives", ["fixup", "fold"])
@pytest.mark.parametrize("case", ["peaked", "unnormalized"])
def test_bf16_strip_path_no_worse_than_vanilla_bf16(positives, case, monkeypatch):
    """The strip path (the GPU's bf16 path; forced here, 32-row strips) with either way of
    applying the positives: bf16 no worse than vanilla bf16, as the test above."""
    from infclip.kernels.clip import TritonTileOps, clip_loss_triton, launch

    monkeypatch.setattr(launch, "strip_rows", lambda *args, **kwargs: 32)  # 3 strips, the last ragged
    ops = TritonTileOps(poison=True, strips="always", strip_positives=positives)
    _check_bf16_vs_vanilla(lambda i, t, sc: clip_loss_triton(i, t, sc, ops=ops), case, positives)


def test_triton_d_scale_robust_to_forward_backward_dot_order(monkeypatch):
    """On the GPU the forward and the backward may sum a dot product in different orders
    (other tiles). Emulated here with a forward in K chunks of 16 (tl.dot's smallest on the GPU)
    and a backward in chunks of 32: d scale must stay within 2x vanilla, as must the feature
    gradients."""
    from infclip.kernels.clip import launch
    from infclip.kernels.clip.launch import FwdConfig

    monkeypatch.setattr(launch, "fwd_candidates", lambda k, esize: [FwdConfig(32, 32, 16)])
    monkeypatch.setattr(launch, "_TUNED", {})
    for b, c in SHAPES:
        img, txt, s = _inputs("peaked", b, c, seed=0)
        ref = _truth(img, txt, s)
        van = _errs(_grads(vanilla_loss, img, txt, s, torch.float32), ref)
        got = _errs(_grads(lambda i, t, sc: clip_loss(i, t, sc, impl="triton"), img, txt, s, torch.float32), ref)
        for name, e, v in zip(("loss", "dimg", "dtxt", "ds"), got, van):
            assert e < max(1e-5, 2 * v), f"{b}x{c} {name}: {e:.3g} (vanilla fp32 {v:.3g})"


def test_nt_xent_d_temperature_robust_to_dot_order(monkeypatch):
    """As the CLIP test above: NT-Xent's forward in K chunks of 32, its backward in 16 (a guard:
    this draw passed with the earlier sum p dot form too)."""
    from infclip.kernels import objective
    from infclip.kernels.clip import launch
    from infclip.kernels.clip.launch import FwdConfig

    monkeypatch.setattr(objective, "fwd_candidates", lambda esize: [FwdConfig(16, 16, 32, 1, 1)])
    monkeypatch.setattr(launch, "_TUNED", {})
    f = _nt_inputs(35, 40, seed=5, sigma=1.2)
    ref = _nt_grads("vanilla", f, 0.01, torch.float64)
    van = _errs(_nt_grads("vanilla", f, 0.01, torch.float32), ref)
    got = _errs(_nt_grads("triton", f, 0.01, torch.float32), ref)
    for name, e, v in zip(("loss", "df", "dtemp"), got, van):
        assert e < max(1e-5, 2 * v), f"{name}: {e:.3g} (vanilla fp32 {v:.3g})"
