"""A locked tower's features (LiT with SigLIP): the Triton sigmoid backward forms only the
wanted feature gradient (``need``), bit-identical to the same gradient of a call that wants
both, with no product for the other (interpreter on CPU, real kernels on GPU)."""

from __future__ import annotations

import pytest
import torch

from infclip.kernels.siglip import TritonSigmoidOps
from infclip.loss.siglip import siglip_loss
from test_siglip_kernels import DEV, feats, scalars


@pytest.mark.parametrize("need", [(False, True), (True, False), (False, False)], ids=["txt", "img", "scale"])
@pytest.mark.parametrize("path,strips", [("onepass", "always"), ("twopass", "always"), ("twopass", "never")])
@pytest.mark.parametrize("given", [False, True], ids=["fresh", "accumulate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_only_the_wanted_gradient_is_formed_and_it_is_the_full_call_s(small_strips, dtype, given, path, strips,
                                                                       need):
    m, c = 37, 40
    a, b = feats(m, c, 1, dtype), feats(m, c, 2, dtype)
    s, t = scalars()
    g = torch.rand(m, generator=torch.Generator().manual_seed(3)).to(DEV)
    ops = TritonSigmoidOps(strips=strips, poison=True, backward=path)

    def bufs():
        if not given:
            return {}
        gen = torch.Generator().manual_seed(7)
        return {"dimg": torch.randn(m, c, generator=gen).to(DEV), "dtxt": torch.randn(m, c, generator=gen).to(DEV)}

    full = ops.backward(a, b, s, t, g, True, **bufs())
    got = ops.backward(a, b, s, t, g, True, **bufs(), need=need)
    for k in (0, 1):
        assert torch.equal(got[k], full[k]) if need[k] else got[k] is None
    for k in (2, 3):  # ds, dt: the same pass's sums, or the other direction's (summation order)
        assert abs(got[k].item() - full[k].item()) <= 1e-5 * max(1.0, abs(full[k].item()))


@pytest.mark.parametrize("path", ["onepass", "twopass"])
def test_a_locked_image_side_through_siglip_loss(small_strips, products, monkeypatch, path):
    """siglip_loss (Triton) with image features that need no gradient: the text gradient and
    d scale / d bias of a call where both need one, from fewer products (one-pass: none of
    P @ txt; two-pass: the text pass's only)."""
    import infclip.loss.siglip as sl

    ops = TritonSigmoidOps(strips="always", backward=path)
    monkeypatch.setattr(sl, "sigmoid_ops", lambda impl, like: ops)
    a, b = feats(37, 40, 1, torch.bfloat16), feats(37, 40, 2, torch.bfloat16)

    def run(img, txt):
        s, t = (x.clone().requires_grad_() for x in scalars())
        siglip_loss(img, txt, s, t, impl="triton").backward()
        return s.grad, t.grad

    both = [x.clone().requires_grad_() for x in (a, b)]
    grads_both = run(*both)
    made_both = len(products)
    locked, txt = a.clone(), b.clone().requires_grad_()
    grads_locked = run(locked, txt)
    assert torch.equal(txt.grad, both[1].grad)
    for x, y in zip(grads_locked, grads_both):
        assert abs(x.item() - y.item()) <= 1e-5 * max(1.0, abs(y.item()))
    made_locked = len(products) - made_both
    assert made_both > 0 and made_locked == (0 if path == "onepass" else made_both // 2)
