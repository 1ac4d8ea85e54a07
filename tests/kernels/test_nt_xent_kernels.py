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


# -- strip path: symmetric own-block backward, persistent TMA kernel, fallback --------------

def own_block(rows: int, c: int, s: float, dtype, seed: int = 8):
    """(f, offsets, row_lse, g) of an own block with positives i <-> i + rows/2: the LSEs in
    float64 (relative to s * offsets, positives' dot products = the offsets), rounded to fp32."""
    from infclip.loss.nt_xent import TorchMaskedLSEOps

    f = feats(rows, c, seed, dtype)
    f64 = f.double().cpu()
    off = (f64 * f64.roll(rows // 2, 0)).sum(-1)
    lse = TorchMaskedLSEOps().forward(f64, f64, torch.tensor(s, dtype=torch.float64), True, offsets=off)
    g = torch.rand(rows, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64) / rows
    return f, off.float().to(DEV), lse, g


def own_reference(f, off, lse, g, s: float):
    """float64 (da + db, ds) of ``backward(f, f, ..., mask_diag=True)`` (PyTorch tiles)."""
    from infclip.loss.nt_xent import TorchMaskedLSEOps

    f64 = f.double().cpu()
    da, db, ds = TorchMaskedLSEOps().backward(f64, f64, torch.tensor(s, dtype=torch.float64), lse, g, True,
                                              offsets=off.double().cpu())
    return da + db, ds


def strip_ops(monkeypatch, cfg, **kw) -> TritonMaskedLSEOps:
    """Strip-path ops with one config forced, 24-row strips (ragged last strip), poisoned buffers."""
    from infclip.kernels.clip import launch
    from infclip.kernels.nt_xent import ops as ops_mod

    monkeypatch.setattr(launch, "strip_rows", lambda *args, **kwargs: 24)
    monkeypatch.setattr(launch, "STRIP_MIN_ROWS", 16)
    monkeypatch.setattr(launch, "_TUNED", {})
    monkeypatch.setattr(ops_mod.TritonMaskedLSEOps, "_strip_candidates", staticmethod(lambda k, esize: [cfg]))
    return TritonMaskedLSEOps(strips="always", poison=True, **kw)


@pytest.mark.parametrize("positives", ["fold", "fixup"])
@pytest.mark.parametrize("dtype,c", [(torch.float32, 40), (torch.bfloat16, 200), (torch.bfloat16, 40)])
def test_backward_own_matches_float64(monkeypatch, dtype, c, positives):
    """One symmetric pass s (dX + dX^T) f (b = 74 rows: not a multiple of the tile) equals
    da + db of the two-direction backward and the float64 truth; fp32 inputs take the pointer
    kernel, bf16 the TMA kernel (both with the positives folded or fixed up in fp32)."""
    from infclip.kernels.clip.launch import StripConfig

    s = 10.0
    f, off, lse, g = own_block(74, c, s, dtype)
    ops = strip_ops(monkeypatch, StripConfig(16, 16, 16, 2, 1, 1, tma=True), strip_positives=positives)
    sc = torch.tensor(s, device=DEV)
    df, ds = ops.backward_own(f, sc, lse.float().to(DEV), g.float().to(DEV), offsets=off, out_dtype=torch.float32)
    da, db, ds2 = ops.backward(f, f, sc, lse.float().to(DEV), g.float().to(DEV), True, offsets=off)
    want, want_ds = own_reference(f, off, lse, g, s)
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    assert torch.isfinite(df).all()
    assert rel(df, want) < tol and rel(ds, want_ds) < 1e-5
    assert rel(da + db, want) < tol and rel(ds2, want_ds) < 1e-5


@pytest.mark.parametrize("sym", [False, True])
def test_strip_tma_kernel_matches_pointer_kernel(monkeypatch, sym):
    """The persistent TMA strip kernel (3 programs striding over the tiles off CUDA; ragged
    24-row strips; b = 74, c = 40) gives the pointer kernel's gradients and d scale, bf16,
    both directions and the symmetric pass, positives folded."""
    from infclip.kernels.clip.launch import StripConfig

    s = 10.0
    f, off, lse, g = own_block(74, 40, s, torch.bfloat16)
    sc, lse, g = torch.tensor(s, device=DEV), lse.float().to(DEV), g.float().to(DEV)
    out = []
    for tma in (False, True):
        ops = strip_ops(monkeypatch, StripConfig(16, 16, 16, 2, 1, 1, tma=tma))
        if sym:
            out.append(ops.backward_own(f, sc, lse, g, offsets=off, out_dtype=torch.bfloat16))
        else:
            out.append(ops.backward(f, f, sc, lse, g, True, offsets=off))
    for x, y in zip(*out):
        assert torch.isfinite(y.float()).all()
        torch.testing.assert_close(y.float(), x.float(), rtol=1e-5, atol=1e-6)
    want, _ = own_reference(f, off, lse.double().cpu(), g.double().cpu(), s)
    got = out[1][0] if sym else out[1][0] + out[1][1]
    assert rel(got, want) < 2**-7


def test_unaligned_rows_fall_back_to_pointer_loads(monkeypatch):
    """bf16 rows of 36 features (72 bytes, not 16-byte aligned) cannot be TMA operands: the
    TMA config runs the pointer kernel (the TMA kernel is never launched), same gradients."""
    from infclip.kernels.clip.launch import StripConfig
    from infclip.kernels.nt_xent import ops as ops_mod

    class Refuse:
        def __getitem__(self, grid):
            raise AssertionError("TMA kernel launched on unaligned rows")

    monkeypatch.setattr(ops_mod, "_masked_strip_tma_kernel", Refuse())
    s = 10.0
    f, off, lse, g = own_block(50, 36, s, torch.bfloat16)
    ops = strip_ops(monkeypatch, StripConfig(16, 16, 16, 2, 1, 1, tma=True))
    df, ds = ops.backward_own(f, torch.tensor(s, device=DEV), lse.float().to(DEV), g.float().to(DEV), offsets=off)
    want, want_ds = own_reference(f, off, lse, g, s)
    assert rel(df, want) < 2**-7 and rel(ds, want_ds) < 1e-5


def test_nt_xent_loss_own_pass_equals_torch_tiles_bf16():
    """The loss through ``backward_own`` (strip path forced: the symmetric TMA kernel under
    the interpreter) against the PyTorch tiles, bf16, with a temperature gradient."""
    from infclip.loss.nt_xent import TorchMaskedLSEOps, _NTXentRows

    f = feats(46, 40, 5, torch.bfloat16)
    out = []
    for ops in (TorchMaskedLSEOps(), TritonMaskedLSEOps(strips="always", poison=True)):
        x = f.clone().requires_grad_()
        t = torch.tensor(0.1, device=DEV, requires_grad=True)
        loss = _NTXentRows.apply(x, 1 / t, ops, None).mean()
        out.append((loss.detach(), *torch.autograd.grad(loss, (x, t))))
    assert out[1][1].dtype == torch.bfloat16
    for x, w in zip(out[1], out[0]):
        assert rel(x, w.double().cpu()) < 2**-7


# -- one-pass block-pair backward ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("m,n,c,mask", [(37, 50, 33, False), (50, 37, 20, False), (37, 37, 16, True)])
def test_onepass_block_pair_matches_twopass_and_float64(monkeypatch, m, n, c, mask, dtype):
    """``backward="onepass"`` (one strip fill of P = s dX, da[strip] = P @ b and an fp32 db
    accumulator += P^T @ a[strip]) against float64 and the two-pass path: fp32 within 1e-5;
    bf16 no worse than two-pass (1.25x); fresh fp32 outputs and accumulation into given fp32
    buffers (the ring's); 24-row strips, NaN-poisoned buffers."""
    from infclip.kernels.clip.launch import StripConfig

    cfg = StripConfig(16, 16, 16, 2, 1, 1, tma=True)
    a, b = feats(m, c, 11, dtype), feats(n, c, 12, dtype)
    g = torch.rand(m, generator=torch.Generator().manual_seed(13)).to(DEV)
    sc = torch.tensor(8.0, device=DEV)
    lse, da, db, ds = reference(a, b, 8.0, mask, g)
    got = {}
    for path in ("twopass", "onepass"):
        ops = strip_ops(monkeypatch, cfg, backward=path)
        got[path] = ops.backward(a, b, sc, lse.float().to(DEV), g, mask)
        base_a, base_b = torch.ones(m, c, device=DEV), torch.full((n, c), 2.0, device=DEV)
        acc = ops.backward(a, b, sc, lse.float().to(DEV), g, mask, base_a.clone(), base_b.clone())
        got[path + " acc"] = (acc[0] - base_a, acc[1] - base_b, acc[2])
    errs = {k: [rel(x, w) for x, w in zip(v, (da, db, ds))] for k, v in got.items()}
    for path in ("onepass", "onepass acc"):
        if dtype == torch.float32:
            assert max(errs[path]) < 1e-5, errs
        else:
            two = errs[path.replace("one", "two")]
            assert all(e1 <= 1.25 * e2 + 1e-6 for e1, e2 in zip(errs[path], two)), errs


@pytest.mark.parametrize("positives", ["fold", "fixup"])
def test_onepass_own_block_with_positives(monkeypatch, positives):
    """The own block through ``backward(f, f, ..., mask_diag=True, offsets=)`` one-pass: the
    positives folded into P, or fixed up in fp32 in both products (da's and db's column
    pos(i)), equal the float64 da + db."""
    from infclip.kernels.clip.launch import StripConfig

    s = 10.0
    f, off, lse, g = own_block(50, 40, s, torch.float32)
    ops = strip_ops(monkeypatch, StripConfig(16, 16, 16, 2, 1, 1, tma=True), strip_positives=positives,
                    backward="onepass")
    da, db, ds = ops.backward(f, f, torch.tensor(s, device=DEV), lse.float().to(DEV), g.float().to(DEV), True,
                              offsets=off)
    want, want_ds = own_reference(f, off, lse, g, s)
    assert rel(da + db, want) < 1e-5 and rel(ds, want_ds) < 1e-5


def test_onepass_option_checked():
    from infclip.kernels.nt_xent import ops as ops_mod

    assert ops_mod.AUTO_BACKWARD == "twopass" and TritonMaskedLSEOps().backward_path == "twopass"
    with pytest.raises(ValueError, match="backward must be"):
        TritonMaskedLSEOps(backward="fused")
    with pytest.raises(ValueError, match="strip path"):
        TritonMaskedLSEOps(backward="onepass", strips="never")
