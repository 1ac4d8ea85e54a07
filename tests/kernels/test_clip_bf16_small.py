"""bf16 at small b, every component (loss, d image, d text, d scale) within
2x vanilla bf16's error (plus a small floor), over many random draws.

The path is the one CUDA takes at small b (the CUDA graphs replay it): the strip backward
with the positives folded into P, two-pass (``strips="always"``; the interpreter's auto would
take the fused kernel), and the one-pass strip path. Ground truth: float64 of the same bf16
inputs, written without cancellation (LSEs relative to the positives, p_ii - 1 by expm1, d
scale from off-diagonal differences): float64 vanilla loses everything below ~1e-16 of the
loss and of d scale in peaked draws, where ours is exact to fp32. Vanilla bf16 as in
``test_clip_kernels._vanilla`` (logits in bf16, products with fp32 accumulation).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from infclip.kernels.clip import TritonTileOps, clip_loss_triton  # noqa: E402
from infclip.kernels.tiles import to_16  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
F = torch.nn.functional
FLOOR = 1e-5  # relative error allowed whatever vanilla's (fp32 noise; vanilla lucky on a scalar)


def exact(img, txt, s):
    """(loss, d img, d txt, d scale) in float64 without cancellation."""
    b = img.shape[0]
    d = img @ txt.T
    dd = d.diag()
    zr, zc = s * (d - dd[:, None]), s * (d - dd[None, :])  # diagonals exactly 0

    def lse(z, dim):  # log1p of the off-diagonal sum where the positive is the max
        off = z.clone().fill_diagonal_(float("-inf"))
        return torch.where(z.amax(dim) > 0, torch.logsumexp(z, dim), torch.log1p(off.exp().sum(dim)))

    lr, lc = lse(zr, 1), lse(zc, 0)
    p, q = (zr - lr[:, None]).exp().fill_diagonal_(0), (zc - lc[None, :]).exp().fill_diagonal_(0)
    dx = (p + q + torch.diag(torch.expm1(-lr) + torch.expm1(-lc))) / (2 * b)
    ds = ((p * (d - dd[:, None])).sum() + (q * (d - dd[None, :])).sum()) / (2 * b)
    return 0.5 * (lr.mean() + lc.mean()), s * dx @ txt, s * dx.T @ img, ds


def vanilla(img, txt, scale):
    """open_clip's ClipLoss in bf16; on CPU each product as a GPU GEMM does it."""
    if img.is_cuda:
        logits = scale.to(img.dtype) * img @ txt.T
    else:
        logits = ((scale.to(img.dtype) * img).float() @ txt.float().T).to(img.dtype)
    labels = torch.arange(img.shape[0], device=img.device)
    return (0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels))).float()


def _grads(fn, img, txt, s):
    i, t = (x.detach().bfloat16().requires_grad_() for x in (img, txt))
    sc = s.detach().float().requires_grad_()
    loss = fn(i, t, sc)
    loss.backward()
    return loss.detach().double(), i.grad.double(), t.grad.double(), sc.grad.double()


def _draw(b, c, seed, correlated):
    """L2-normalized bf16 features (text random or image + noise), scale uniform in [1, 100]."""
    g = torch.Generator().manual_seed(seed)
    img = F.normalize(torch.randn(b, c, generator=g, dtype=torch.float64), dim=-1)
    noise = torch.randn(b, c, generator=g, dtype=torch.float64)
    u = torch.rand(2, generator=g, dtype=torch.float64)
    txt = F.normalize(img + (0.3 + 3 * u[1]) * noise / c ** 0.5 if correlated else noise, dim=-1)
    img, txt = (x.bfloat16().double().to(DEV) for x in (img, txt))
    return img, txt, torch.tensor(float(1 + 99 * u[0]), dtype=torch.float64, device=DEV)


def _rel(x, r):
    return ((x - r).norm() / r.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("backward", ["twopass", "onepass"])
def test_bf16_small_b_within_2x_vanilla(backward):
    bad = []
    for b in (3, 17, 67, 129):
        for seed in range(3):
            for correlated in (False, True):
                img, txt, s = _draw(b, 16, 1000 * b + seed, correlated)
                ref = exact(img, txt, s)
                van = [_rel(x, r) for x, r in zip(_grads(vanilla, img, txt, s), ref)]
                ops = TritonTileOps(strips="always", backward=backward, poison=True)
                got = [_rel(x, r) for x, r in zip(_grads(lambda i, t, sc: clip_loss_triton(i, t, sc, ops=ops),
                                                         img, txt, s), ref)]
                bad += [f"b={b} seed={seed} corr={correlated} s={s.item():.1f} {name}: {e:.3g} vs vanilla {v:.3g}"
                        for name, e, v in zip(("loss", "dimg", "dtxt", "ds"), got, van) if e > 2 * v + FLOOR]
    assert not bad, "\n".join(bad)


@triton.jit
def _store_bf16(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y_ptr + i, to_16(tl.load(x_ptr + i), tl.bfloat16))


def test_to_16_rounds_to_nearest_even_as_torch():
    """``tiles.to_16`` (every bf16 store of the CLIP kernels) rounds fp32 to the nearest bf16,
    ties to even, as the GPU and torch do -- also under Triton's interpreter, whose own cast
    truncates (which made the CPU tests measure a rounding the GPU never does)."""
    g = torch.Generator().manual_seed(5)
    mag = torch.exp(torch.empty(1000).uniform_(-60, 60, generator=g))
    x = mag * torch.where(torch.rand(1000, generator=g) < 0.5, -1.0, 1.0)
    # ties: exactly half-way between two bf16 values, below and above an even mantissa
    ties = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.0 + 2**-7, 0.0, -0.0, 1.0, 65504.0])
    x = torch.cat([x, ties, torch.zeros(1024 - 1000 - len(ties))]).float().to(DEV)  # (a power of 2)
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=DEV)
    _store_bf16[(1,)](x, y, N=x.numel())
    want = x.to(torch.bfloat16)
    assert torch.equal(y.view(torch.int16), want.view(torch.int16)), (x[y != want][:5], y[y != want][:5])
