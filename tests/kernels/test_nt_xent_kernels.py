"""Triton NT-Xent (masked self-similarity LSE) kernels vs float64 full matrices
(interpreter on CPU, real kernels on GPU): odd shapes, own block (masked) and remote block."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infclip.kernels.nt_xent import TritonMaskedLSEOps

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(2, 2, 16), (37, 37, 16), (37, 50, 33), (50, 37, 20)]


def feats(n: int, c: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, c, generator=g, dtype=torch.float64), dim=-1).to(dtype).to(DEV)


def reference(a, b, s: float, mask: bool, g):
    """float64 (lse, dA, dB, ds) of sum_i g_i lse_i with the (i, i) pairs excluded if ``mask``."""
    a64, b64 = (x.double().cpu().requires_grad_() for x in (a, b))
    s64 = torch.tensor(s, dtype=torch.float64, requires_grad=True)
    x = s64 * a64 @ b64.T
    if mask:
        x = x.masked_fill(torch.eye(*x.shape, dtype=torch.bool), float("-inf"))
    lse = x.logsumexp(1)
    return (lse.detach(), *torch.autograd.grad((g.double().cpu() * lse).sum(), (a64, b64, s64)))


def rel(x, ref) -> float:
    return float((x.double().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


@pytest.mark.parametrize("strips", ["never", "always"])
@pytest.mark.parametrize("m,n,c", SHAPES)
@pytest.mark.parametrize("s", [2.0, 20.0])
def test_masked_lse_and_grads_match_float64(m, n, c, s, strips, small_strips):
    """Fused backward and strip backward (s * dX into a scratch, then a GEMM); outputs poisoned."""
    a, b = feats(m, c, 1), feats(n, c, 2)
    g = torch.rand(m, generator=torch.Generator().manual_seed(3)).to(DEV)
    ops, sc = TritonMaskedLSEOps(strips=strips, poison=True), torch.tensor(s, device=DEV)
    for mask in (True, False) if m == n else (False,):
        lse, da, db, ds = reference(a, b, s, mask, g)
        assert rel(ops.forward(a, b, sc, mask), lse) < 1e-5
        got = ops.backward(a, b, sc, lse.float().to(DEV), g, mask)
        for name, x, w in zip(("dA", "dB", "ds"), got, (da, db, ds)):
            assert rel(x, w) < 1e-5, (name, mask)


@pytest.mark.parametrize("strips", ["never", "always"])
def test_backward_accumulates_bf16(strips, small_strips):
    """Accumulation into given fp32 buffers (the ring), from bf16 blocks: dX rounds to bf16."""
    a, b = feats(40, 48, 6, torch.bfloat16), feats(40, 48, 7, torch.bfloat16)
    g = torch.full((40,), 1 / 40, device=DEV)
    lse, da, db, ds = reference(a, b, 5.0, False, g)
    base_a, base_b = torch.ones(40, 48, device=DEV), torch.full((40, 48), 2.0, device=DEV)
    got_a, got_b, got_s = TritonMaskedLSEOps(strips=strips).backward(
        a, b, torch.tensor(5.0, device=DEV), lse.float().to(DEV), g, False, base_a.clone(), base_b.clone())
    assert rel(got_a - base_a, da) < 2**-7 and rel(got_b - base_b, db) < 2**-7 and rel(got_s, ds) < 2**-7


def test_single_row_fully_masked_is_minus_inf_not_nan():
    a = feats(1, 16, 4)
    lse = TritonMaskedLSEOps().forward(a, a, torch.tensor(10.0, device=DEV), True)
    assert torch.isneginf(lse).all()


def test_nt_xent_loss_triton_equals_torch_tiles_fp32_and_bf16():
    from infclip.loss import nt_xent_loss

    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2**-7)):
        f = feats(46, 40, 5, dtype)
        out = {}
        for impl in ("torch", "triton"):
            x = f.clone().requires_grad_()
            t = torch.tensor(0.1, device=DEV, requires_grad=True)
            loss = nt_xent_loss(x, t, impl=impl)
            out[impl] = (loss.detach(), *torch.autograd.grad(loss, (x, t)))
        for x, w in zip(out["triton"], out["torch"]):
            assert rel(x, w.double().cpu()) < tol, dtype
