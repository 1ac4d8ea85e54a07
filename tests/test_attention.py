"""The towers' attention on SDPA (infclip.attention): same keys and numbers as nn.MultiheadAttention,
the text tower's causal mask as is_causal, exact gradient-cache replay, and the backend report."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent / "train"))
from engine_testutils import (  # noqa: E402
    assert_grads_close, assert_replay_exact_and_cached_step_full, batch, config, grads_of, normalize, tiny_clip,
)

from infclip.attention import (  # noqa: E402
    SdpaSelfAttention, backends_in, is_causal_mask, sdpa_attention, sdpa_backends,
)


def _pair(**kw):
    model = tiny_clip(dropout=0.0, patch_dropout=0.0, **kw).train()
    new = copy.deepcopy(model)
    counts = sdpa_attention(new)
    return model, new, counts


def test_reclassing_keeps_parameters_and_keys_and_matches_multihead_attention():
    """Every tower attention re-classed (2 ViT blocks, 2 causal text blocks); the same
    Parameters under the same names; embeddings and gradients equal the nn.MultiheadAttention
    path to fp32 summation order."""
    old, new, counts = _pair()
    assert counts == {"visual": 2, "text (causal)": 2}
    assert list(old.state_dict()) == list(new.state_dict())
    assert [n for n, _ in old.named_parameters()] == [n for n, _ in new.named_parameters()]
    images, tokens = batch(6)
    outs = []
    for m in (old, new):
        img, txt, _ = m(image=normalize(images), text=tokens)
        (img * txt).sum().backward()
        outs.append((img, txt, grads_of(m)))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-6, rtol=1e-5)
    assert_grads_close(outs[0][2], outs[1][2])


def test_text_tower_attends_with_is_causal_and_no_mask_tensor(monkeypatch):
    """In training, the text blocks call SDPA with is_causal=True and no mask (flash-eligible);
    the ViT blocks with neither."""
    _, model, _ = _pair()
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append((q.shape[-2], attn_mask is None, is_causal))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    images, tokens = batch(3)
    model.encode_text(tokens)
    assert calls == [(tokens.shape[1], True, True)] * 2
    calls.clear()
    model.encode_image(normalize(images))
    assert calls == [(calls[0][0], True, False)] * 2 and calls[0][0] == 17  # 16 patches + class token


def test_eval_mode_keeps_open_clips_own_numbers():
    """Eval mode runs nn.MultiheadAttention's own forward: bit for bit the unmodified model's."""
    old, new, _ = _pair()
    old.eval(), new.eval()
    images, tokens = batch(4)
    with torch.no_grad():
        a, b = old(image=normalize(images), text=tokens), new(image=normalize(images), text=tokens)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_only_a_true_causal_mask_becomes_is_causal():
    _, model, _ = _pair()
    assert is_causal_mask(model.attn_mask)
    assert not is_causal_mask(torch.zeros(4, 4))
    assert not is_causal_mask(torch.full((4, 4), float("-inf")).triu(2))
    free = tiny_clip(dropout=0.0, patch_dropout=0.0)
    free.attn_mask = torch.zeros_like(free.attn_mask)  # a tower whose mask is no causal mask
    assert sdpa_attention(free) == {"visual": 2, "text": 2}


def test_grad_cache_replays_attention_dropout_bit_for_bit():
    """Attention dropout (SDPA's dropout_p) and MLP dropout on: the replay's embeddings equal
    the cache pass's bit for bit under the recorded RNG, and the cached step's gradients
    equal the full-batch step's."""
    model = tiny_clip(dropout=0.1, patch_dropout=0.25).train()
    assert sdpa_attention(model)
    for m in model.modules():
        if isinstance(m, SdpaSelfAttention):
            m.dropout = 0.2
    assert_replay_exact_and_cached_step_full(model, seed=5)


def test_build_model_uses_sdpa_attention_by_default_and_open_clips_own_when_switched_off():
    from infclip.config import ModelConfig
    from infclip.model import build_model

    assert ModelConfig().sdpa_attention is True
    on = build_model(ModelConfig(name="infclip-micro")).model
    off = build_model(ModelConfig(name="infclip-micro", sdpa_attention=False)).model
    assert {type(m) for m in on.modules() if isinstance(m, nn.MultiheadAttention)} == {SdpaSelfAttention}
    assert {type(m) for m in off.modules() if isinstance(m, nn.MultiheadAttention)} == {nn.MultiheadAttention}
    assert list(on.state_dict()) == list(off.state_dict())


@pytest.mark.parametrize("names, want", [
    (["aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention"], "flash"),
    (["aten::_scaled_dot_product_efficient_attention_backward"], "efficient"),
    (["aten::_scaled_dot_product_cudnn_attention"], "cudnn"),
    (["aten::_scaled_dot_product_attention_math", "aten::softmax"], "math"),
    (["aten::_scaled_dot_product_flash_attention_for_cpu"], "flash (cpu)"),
    (["aten::_native_multi_head_attention", "aten::_scaled_dot_product_efficient_attention"], "native MHA+efficient"),
    (["aten::linear"], "none"),
])
def test_backend_names_from_profiler_ops(names, want):
    assert backends_in(names) == want


def test_sdpa_backends_reports_every_tower_and_pass_on_cpu():
    _, model, _ = _pair()
    images, tokens = batch(2)
    res = sdpa_backends(model, normalize(images), tokens)
    assert set(res) == {"image", "text"}
    for passes in res.values():
        assert set(passes) == {"cache", "replay", "backward"}
        assert all(v in ("flash (cpu)", "math") for v in passes.values()), res
    assert all(p.grad is None for p in model.parameters())


def test_in_bf16_the_sdpa_path_agrees_within_bf16_rounding():
    """Under bf16 autocast the two paths round differently (is_causal vs a float mask, other
    GEMM layouts): the embeddings agree to a few bf16 ulps, far below the fp32 model's distance."""
    old, new, _ = _pair()
    images, tokens = batch(6)
    with torch.no_grad():
        exact = old(image=normalize(images), text=tokens)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a, b = old(image=normalize(images), text=tokens), new(image=normalize(images), text=tokens)
    for i in (0, 1):
        gap = (a[i].float() - b[i].float()).norm() / a[i].float().norm()
        rounding = (a[i].float() - exact[i]).norm() / exact[i].norm()
        assert gap <= 2 * rounding + 1e-3, (i, gap, rounding)
