"""Triton SigLIP kernels vs the float64 reference (interpreter on CPU, real kernels on GPU).

Tiny odd shapes exercise every tail mask and clamped load; both the diagonal (own block)
and the all-negative (remote block) variants; bf16 inputs; extreme logits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infclip.kernels.siglip import TritonSigmoidOps, sigmoid_grad_reference, sigmoid_rows_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 1, 16), (37, 37, 16), (37, 50, 33), (50, 37, 20)]


def feats(n: int, c: int, seed: int, dtype=torch.float32, near=None, noise: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g, dtype=torch.float64)
    if near is not None:
        x = near.double().cpu()[:n] + noise * x / c**0.5
    return F.normalize(x, dim=-1).to(dtype).to(DEV)


def scalars(s: float = 10.0, t: float = -10.0):
    return torch.tensor(s, device=DEV), torch.tensor(t, device=DEV)


def rel(x, ref) -> float:
    return float((x.double().cpu() - ref.cpu()).abs().max() / ref.abs().max().clamp_min(1e-300))


@pytest.mark.parametrize("strips", ["never", "always"])
@pytest.mark.parametrize("m,n,c", SHAPES)
def test_forward_and_backward_match_float64(m, n, c, strips, small_strips):
    """Fused backward and strip backward (s * dX into a scratch, then a GEMM); outputs poisoned."""
    a, b = feats(m, c, 1), feats(n, c, 2, near=None)
    s, t = scalars()
    ops = TritonSigmoidOps(strips=strips, poison=True)
    g = torch.rand(m, generator=torch.Generator().manual_seed(3)).to(DEV)
    for diag in (True, False) if m == n else (False,):
        assert rel(ops.forward(a, b, s, t, diag), sigmoid_rows_reference(a, b, s, t, diag)) < 1e-5
        got = ops.backward(a, b, s, t, g, diag)
        want = sigmoid_grad_reference(a, b, s, t, g, diag)
        for name, x, w in zip(("dA", "dB", "ds", "dt"), got, want):
            assert rel(x, w) < 1e-5, (name, diag)


@pytest.mark.parametrize("strips", ["never", "always"])
def test_backward_accumulates_into_given_buffers(strips, small_strips):
    a, b = feats(20, 24, 4), feats(20, 24, 5)
    s, t = scalars()
    g = torch.full((20,), 0.05, device=DEV)
    base_a, base_b = torch.ones(20, 24, device=DEV), torch.full((20, 24), 2.0, device=DEV)
    ops = TritonSigmoidOps(strips=strips)
    da, db, _, _ = ops.backward(a, b, s, t, g, True, dimg=base_a.clone(), dtxt=base_b.clone())
    want = sigmoid_grad_reference(a, b, s, t, g, True)
    assert rel(da - base_a, want[0]) < 1e-5 and rel(db - base_b, want[1]) < 1e-5


@pytest.mark.parametrize("case", ["peaked", "saturated"])
def test_extreme_logits(case):
    """peaked: near-duplicate pairs at s = 100 (sigmoid of the positives -> 1, negatives -> 0);
    saturated: |x| ~ 100 where sigmoid and softplus must not overflow or lose the small side."""
    a = feats(33, 32, 6)
    b = feats(33, 32, 7, near=a, noise=0.05)
    s, t = scalars(100.0, -10.0) if case == "peaked" else scalars(100.0, 50.0)
    g = torch.full((33,), 1 / 33, device=DEV)
    ops = TritonSigmoidOps()
    rows = ops.forward(a, b, s, t, True)
    assert torch.isfinite(rows).all()
    assert rel(rows, sigmoid_rows_reference(a, b, s, t, True)) < 1e-5
    for x, w in zip(ops.backward(a, b, s, t, g, True), sigmoid_grad_reference(a, b, s, t, g, True)):
        assert torch.isfinite(x).all() and rel(x, w) < 1e-4


@pytest.mark.parametrize("strips", ["never", "always"])
def test_bf16_inputs_fp32_accumulation(strips, small_strips):
    a, b = feats(40, 48, 8, torch.bfloat16), feats(40, 48, 9, torch.bfloat16)
    s, t = scalars()
    g = torch.full((40,), 1 / 40, device=DEV)
    ops = TritonSigmoidOps(strips=strips, poison=True)
    assert rel(ops.forward(a, b, s, t, True), sigmoid_rows_reference(a, b, s, t, True)) < 1e-5
    got, want = ops.backward(a, b, s, t, g, True), sigmoid_grad_reference(a, b, s, t, g, True)
    for x, w in zip(got, want):  # dX is rounded to bf16 before the tensor-core product
        assert rel(x, w) < 2**-7


def test_siglip_loss_triton_equals_torch_tiles():
    from infclip.loss import siglip_loss

    img, txt = feats(45, 40, 10), feats(45, 40, 11)
    out = {}
    for impl in ("torch", "triton"):
        xs = [img.clone().requires_grad_(), txt.clone().requires_grad_(),
              torch.tensor(10.0, device=DEV, requires_grad=True), torch.tensor(-10.0, device=DEV, requires_grad=True)]
        loss = siglip_loss(*xs, impl=impl)
        out[impl] = (loss.detach(), *torch.autograd.grad(loss, xs))
    for x, w in zip(out["triton"], out["torch"]):
        assert rel(x, w.double()) < 1e-5


def test_backend_options_are_checked_and_auto_uses_strips_only_for_16bit_cuda():
    from infclip.kernels.nt_xent import TritonMaskedLSEOps

    for cls in (TritonSigmoidOps, TritonMaskedLSEOps):
        with pytest.raises(ValueError, match="strips"):
            cls(strips="sometimes")
        with pytest.raises(ValueError, match="fp32_precision"):
            cls(fp32_precision="fp16")
        bf16_cpu = torch.zeros(4, 8, dtype=torch.bfloat16)
        assert not cls()._use_strips(bf16_cpu)  # auto: CUDA 16-bit only
        assert cls(strips="always")._use_strips(bf16_cpu) and not cls(strips="never")._use_strips(bf16_cpu)
        if torch.cuda.is_available():
            assert cls()._use_strips(bf16_cpu.cuda()) and not cls()._use_strips(bf16_cpu.float().cuda())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m,n,c", [(37, 37, 16), (37, 50, 33), (1, 1, 16)])
def test_onepass_backward_matches_twopass_and_float64(m, n, c, dtype, small_strips):
    """The one-pass backward for SigLIP: one strip fill per strip of rows feeds both gradients
    (dimg = P @ txt, fp32 dtxt += P^T @ img); ds and dt summed once; fresh and accumulated
    outputs; the two-pass strip backward beside it (16-row strips, poisoned buffers)."""
    a, b = feats(m, c, 11, dtype), feats(n, c, 12, dtype, near=None)
    s, t = scalars(10.0, -5.0)
    g = torch.rand(m, generator=torch.Generator().manual_seed(13)).to(DEV)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for diag in (True, False) if m == n else (False,):
        want = sigmoid_grad_reference(a, b, s, t, g, diag)
        got = {path: TritonSigmoidOps(strips="always", poison=True, backward=path).backward(a, b, s, t, g, diag)
               for path in ("twopass", "onepass")}
        for name, x, y, w in zip(("dA", "dB", "ds", "dt"), got["onepass"], got["twopass"], want):
            assert rel(x, w) < (1e-5 if name in ("ds", "dt") else tol), (name, diag)
            assert rel(x, w) <= 1.25 * rel(y, w) + 1e-6, (name, diag)
    base_a, base_b = torch.full((m, c), 1e-3, device=DEV), torch.full((n, c), 2e-3, device=DEV)  # (~ the grads)
    ops = TritonSigmoidOps(strips="always", backward="onepass")
    da, db, _, _ = ops.backward(a, b, s, t, g, False, dimg=base_a.clone(), dtxt=base_b.clone())
    want = sigmoid_grad_reference(a, b, s, t, g, False)
    assert rel(da - base_a, want[0]) < tol and rel(db - base_b, want[1]) < tol
    with pytest.raises(ValueError, match="strip path"):
        TritonSigmoidOps(strips="never", backward="onepass")
    from infclip.kernels.siglip import ops as ops_mod

    auto = TritonSigmoidOps()  # "auto": one-pass on the strip path (16-bit CUDA), measured faster there
    assert auto.backward_path == "auto" and ops_mod.AUTO_BACKWARD == "onepass"
    assert auto.path_for(a.float().cpu()) == "twopass"
    assert TritonSigmoidOps(strips="always").path_for(a) == "onepass"
    assert TritonSigmoidOps(strips="never").path_for(a) == "twopass"
