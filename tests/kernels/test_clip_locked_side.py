"""A locked tower's features (LiT): the Triton CLIP backward forms only the wanted feature
gradient (``need``), bit-identical to the same gradient of a call that wants both, with no
product for the other (interpreter on CPU, real kernels on GPU)."""

from __future__ import annotations

import pytest
import torch

from infclip.kernels import launching
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


@pytest.mark.parametrize("need", [(False, True), (True, False), (False, False)], ids=["txt", "img", "scale"])
@pytest.mark.parametrize("path", ["onepass", "twopass"])
@pytest.mark.parametrize("positives", ["fold", "fixup"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("b,c,scale", [(37, 40, 10.0), (70, 200, 100.0)])
def test_only_the_wanted_gradient_is_formed_and_it_is_the_full_call_s(strips16, b, c, scale, dtype, positives,
                                                                       path, need):
    img, txt, s, row, col, pos, g, ref = _problem(b, c, scale, dtype)
    ops = TritonTileOps(poison=True, strips="always", strip_positives=positives, backward=path)
    kw = dict(out_dtype=dtype, g_diag=g[0] + g[1], offsets=(pos, pos))
    full = ops.backward(img, txt, s, row, col, g[0], g[1], **kw)
    got = ops.backward(img, txt, s, row, col, g[0], g[1], need=need, **kw)
    for k in (0, 1):
        if need[k]:
            assert torch.equal(got[k], full[k]), (k, _rel(got[k], full[k].double()))
        else:
            assert got[k] is None or (need == (False, False) and k == 0)  # (scale alone: one pass runs)
    # d scale: the same pass's sum, or (dtxt alone) the other direction's: equal up to summation order
    assert abs(got[2].item() - ref[2].item()) <= 1e-5 * max(1.0, abs(ref[2].item())) + abs(full[2] - ref[2]).item()


def test_the_one_pass_backward_skips_the_locked_side_s_product(strips16, monkeypatch):
    """dtxt alone: every strip is filled once and its P^T @ img accumulated; no P @ txt."""
    img, txt, s, row, col, pos, g, _ = _problem(70, 40, 10.0, torch.bfloat16)
    products, accumulated = [], []
    real_product, real_addmm = launching.product_into, launch.addmm_f32_
    monkeypatch.setattr(launching, "product_into", lambda *a, **k: products.append(1) or real_product(*a, **k))
    monkeypatch.setattr(launch, "addmm_f32_", lambda *a, **k: accumulated.append(1) or real_addmm(*a, **k))
    ops = TritonTileOps(strips="always", backward="onepass")
    ops.backward(img, txt, s, row, col, g[0], g[1], out_dtype=img.dtype, g_diag=g[0] + g[1], offsets=(pos, pos),
                 need=(False, True))
    assert products == [] and len(accumulated) == 5  # 70 rows in 16-row strips
    ops.backward(img, txt, s, row, col, g[0], g[1], out_dtype=img.dtype, g_diag=g[0] + g[1], offsets=(pos, pos))
    assert len(products) == 5 and len(accumulated) == 10


@pytest.mark.parametrize("path", ["onepass", "twopass"])
def test_a_locked_image_side_through_autograd(strips16, path):
    """clip_loss_triton with image features that need no gradient (LiT): the text gradient
    and d scale of a call where both need one; the image side gets none."""
    img, txt = (x.bfloat16() for x in _pair(70, 40, seed=3))
    ops = TritonTileOps(strips="always", backward=path, cuda_graphs="never")
    both = [x.detach().clone().requires_grad_() for x in (img, txt)]
    s_both = torch.tensor(14.0, device=DEV, requires_grad=True)
    clip_loss_triton(*both, s_both, ops=ops).backward()
    locked, t = img.detach().clone(), txt.detach().clone().requires_grad_()
    s = torch.tensor(14.0, device=DEV, requires_grad=True)
    loss = clip_loss_triton(locked, t, s, ops=ops)
    loss.backward()
    assert locked.grad is None
    assert torch.equal(t.grad, both[1].grad)
    assert abs(s.grad.item() - s_both.grad.item()) <= 1e-5 * max(1.0, abs(s_both.grad.item()))
