"""A locked tower's features (LiT): the Triton CLIP backward forms only the wanted feature
gradient (``need``), bit-identical to the same gradient of a call that wants both, with no
product for the other (interpreter on CPU, real kernels on GPU)."""

from __future__ import annotations

import pytest
import torch

from infclip.kernels.clip import TritonTileOps, clip_loss_triton, launch
from test_clip_onepass import DEV, _clip_case, _pair, _rel


@pytest.fixture
def strips16(monkeypatch):
    monkeypatch.setattr(launch, "strip_rows", lambda *args, **kwargs: 16)


def _problem(b: int, c: int, scale: float, dtype):
    img, txt = (x.to(dtype) for x in _pair(b, c, seed=b + c, peaked=scale >= 100))
    s = torch.tensor(scale, device=DEV)
    gen = torch.Generator().manual_seed(b)
    g = (torch.randint(256, 1024, (2, b), generator=gen).float() / 2 ** 10 / b).to(DEV)
    row, col, pos, ref = _clip_case(img, txt, s, g[0], g[1], g[0] + g[1])
    return img, txt, s, row, col, pos, g, ref


OUTPUTS = ["fresh", "fresh_fp32", "accumulate_fp32"]


@pytest.mark.parametrize("need", [(False, True), (True, False), (False, False)], ids=["txt", "img", "scale"])
@pytest.mark.parametrize("path", ["onepass", "twopass"])
@pytest.mark.parametrize("strips", ["always", "auto"])
@pytest.mark.parametrize("output", OUTPUTS)
@pytest.mark.parametrize("positives", ["fold", "fixup"])
@pytest.mark.parametrize("dtype,b,c,scale", [(torch.float32, 37, 40, 10.0), (torch.bfloat16, 37, 40, 10.0),
                                             (torch.bfloat16, 70, 200, 100.0)], ids=["fp32", "bf16", "bf16_peaked"])
def test_only_the_wanted_gradient_is_formed_and_it_is_the_full_call_s(strips16, dtype, b, c, scale, positives,
                                                                       output, strips, path, need):
    img, txt, s, row, col, pos, g, ref = _problem(b, c, scale, dtype)
    ops = TritonTileOps(poison=True, strips=strips, strip_positives=positives, backward=path)
    out_dtype = dtype if output == "fresh" else torch.float32
    kw = dict(out_dtype=out_dtype, g_diag=g[0] + g[1], offsets=(pos, pos))

    def bufs():  # the given fp32 buffers of "accumulate_fp32" (fresh copies per call)
        if output != "accumulate_fp32":
            return None, None
        gen = torch.Generator().manual_seed(7)
        return (torch.randn(b, c, generator=gen).to(DEV), torch.randn(b, c, generator=gen).to(DEV))

    full = ops.backward(img, txt, s, row, col, g[0], g[1], *bufs(), **kw)
    got = ops.backward(img, txt, s, row, col, g[0], g[1], *bufs(), need=need, **kw)
    for k in (0, 1):
        if need[k]:
            assert torch.equal(got[k], full[k]), (k, _rel(got[k], full[k].double()))
        else:
            assert got[k] is None
    # d scale: the same pass's sum, or (dtxt alone) the other direction's: equal up to summation order
    assert abs(got[2].item() - ref[2].item()) <= 1e-5 * max(1.0, abs(ref[2].item())) + abs(full[2] - ref[2]).item()


@pytest.mark.parametrize("need, made", [((True, True), 5), ((False, True), 0), ((True, False), 5),
                                        ((False, False), 0)])
def test_the_one_pass_backward_makes_only_the_wanted_products(strips16, monkeypatch, products, need, made):
    """Every strip is filled once; P @ txt only for dimg, P^T @ img only for dtxt."""
    img, txt, s, row, col, pos, g, _ = _problem(70, 40, 10.0, torch.bfloat16)
    accumulated = []
    real_addmm = launch.addmm_f32_
    monkeypatch.setattr(launch, "addmm_f32_", lambda *a, **k: accumulated.append(1) or real_addmm(*a, **k))
    ops = TritonTileOps(strips="always", backward="onepass")
    ops.backward(img, txt, s, row, col, g[0], g[1], out_dtype=img.dtype, g_diag=g[0] + g[1], offsets=(pos, pos),
                 need=need)
    assert len(products) == made and len(accumulated) == (5 if need[1] else 0)  # 70 rows in 16-row strips


@pytest.mark.parametrize("path", ["onepass", "twopass"])
def test_a_locked_image_side_through_autograd(strips16, products, path):
    """clip_loss_triton with image features that need no gradient (LiT): the text gradient
    and d scale of a call where both need one, from fewer products (one-pass: none of
    P @ txt; two-pass: the text pass's only)."""
    img, txt = (x.bfloat16() for x in _pair(70, 40, seed=3))
    ops = TritonTileOps(strips="always", backward=path, cuda_graphs="never")
    both = [x.detach().clone().requires_grad_() for x in (img, txt)]
    s_both = torch.tensor(14.0, device=DEV, requires_grad=True)
    clip_loss_triton(*both, s_both, ops=ops).backward()
    made_both = len(products)
    locked, t = img.detach().clone(), txt.detach().clone().requires_grad_()
    s = torch.tensor(14.0, device=DEV, requires_grad=True)
    clip_loss_triton(locked, t, s, ops=ops).backward()
    assert torch.equal(t.grad, both[1].grad)
    assert abs(s.grad.item() - s_both.grad.item()) <= 1e-5 * max(1.0, abs(s_both.grad.item()))
    made_locked = len(products) - made_both
    assert (made_both, made_locked) == ((5, 0) if path == "onepass" else (10, 5))


@pytest.mark.parametrize("output", ["fresh", "accumulate_fp32"])
def test_a_two_pass_text_gradient_alone_is_the_full_call_s_in_fp32(output):
    """fp32, the two-pass path without strips (the fused row kernel): d text alone is the full
    call's bit for bit (on the GPU the variant that forms no d scale had compiled to other
    last bits)."""
    img, txt, s, row, col, pos, g, _ = _problem(37, 40, 10.0, torch.float32)
    ops = TritonTileOps(strips="auto", backward="twopass")
    kw = dict(out_dtype=torch.float32, g_diag=g[0] + g[1], offsets=(pos, pos))

    def bufs():
        if output == "fresh":
            return None, None
        gen = torch.Generator().manual_seed(7)
        return torch.randn(37, 40, generator=gen).to(DEV), torch.randn(37, 40, generator=gen).to(DEV)

    full = ops.backward(img, txt, s, row, col, g[0], g[1], *bufs(), **kw)
    got = ops.backward(img, txt, s, row, col, g[0], g[1], *bufs(), need=(False, True), **kw)
    assert got[0] is None and torch.equal(got[1], full[1])
