"""model.patch_dropout (FLIP): the gradient cache keeps the same patches in both passes, so a
cached step equals the full-batch step; eval drops nothing; bad values are refused."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from engine_testutils import assert_grads_close, batch, config, engine_for, grads_of, reference_grads
from open_clip.transformer import PatchDropout
from test_config import _compose

from infclip.config import ConfigError, ModelConfig, validate
from infclip.model import ModelError, build_model

LOCAL = 8


def _micro(patch_dropout: float) -> torch.nn.Module:
    """infclip-micro (32 px, 8-px patches: 16 patches + CLS) built through model.patch_dropout."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="infclip-micro", patch_dropout=patch_dropout)).model
    model.output_dict = False  # tuples, as engine_testutils.reference_grads reads them
    return model


def _kept_tokens(model: torch.nn.Module, log: list) -> None:
    """Log (grad enabled?, PatchDropout output) for every patch-dropout call."""
    for m in model.modules():
        if isinstance(m, PatchDropout):
            m.register_forward_hook(lambda _m, _i, out: log.append((torch.is_grad_enabled(), out.detach().clone())))


@pytest.mark.parametrize("k", [2, 4])
def test_cached_step_equals_full_batch_step_with_patch_dropout_half(k):
    """patch_dropout=0.5, K micro-batches: the replay keeps exactly the cache pass's patches
    (torch.equal), and gradients and loss equal the full-batch step drawing the same patches
    (engine_testutils.reference_grads: every micro-batch forwarded with grad, one backward),
    to the cached-vs-uncached tolerance of test_engine.py. A reference drawing other patches
    is outside that tolerance, so the comparison can fail."""
    model = _micro(0.5).train()
    ref, other = copy.deepcopy(model), copy.deepcopy(model)
    images, tokens = batch(LOCAL)
    torch.manual_seed(123)
    ref_loss, ref_grads = reference_grads(ref, images, tokens, LOCAL // k)
    log: list = []
    _kept_tokens(model, log)
    torch.manual_seed(123)
    out = engine_for(config(LOCAL, LOCAL // k, grad_cache="on"), model).step(images, tokens)

    cache, replay = [v for g, v in log if not g], [v for g, v in log if g]
    assert len(cache) == len(replay) == k
    assert all(torch.equal(a, b) for a, b in zip(cache, replay))
    assert cache[0].shape[1] == 1 + 8, "half of the 16 patches (plus CLS) must be kept"
    torch.testing.assert_close(out.loss, ref_loss, atol=1e-6, rtol=1e-6)
    assert_grads_close(grads_of(model), ref_grads)
    torch.manual_seed(124)
    _, other_grads = reference_grads(other, images, tokens, LOCAL // k)
    with pytest.raises(AssertionError):
        assert_grads_close(other_grads, ref_grads)


def test_eval_drops_nothing_and_train_does():
    """Same weights: in eval a patch_dropout=0.5 model's embeddings equal a patch_dropout=0
    model's bit for bit; in training they differ (patches are dropped)."""
    dropping, plain = _micro(0.5), _micro(0.0)
    plain.load_state_dict(dropping.state_dict())
    images = torch.rand(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(dropping.eval().encode_image(images), plain.eval().encode_image(images))
        assert not torch.equal(dropping.train().encode_image(images), plain.train().encode_image(images))


@pytest.mark.parametrize("overrides, match", [
    (["model.patch_dropout=1.0"], r"model.patch_dropout=1.0 must be in \[0, 1\).*model.patch_dropout=0.5"),
    (["model.patch_dropout=-0.1"], r"model.patch_dropout=-0.1 must be in \[0, 1\)"),
    (["model.patch_dropout=0.5", "model.lock_image=true"], r"model.patch_dropout=0.5 with model.lock_image=true"),
])
def test_bad_patch_dropout_is_refused_naming_the_key_and_fix(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(_compose(*overrides), 1)


def test_patch_dropout_on_a_tower_without_patches_is_refused(tmp_path):
    """A ResNet image tower has no PatchDropout: refused rather than silently ignored."""
    cfg = {"embed_dim": 16, "vision_cfg": {"image_size": 32, "layers": [1, 1, 1, 1], "width": 8},
           "text_cfg": {"context_length": 16, "vocab_size": 1000, "width": 16, "heads": 2, "layers": 1}}
    path = tmp_path / "tiny-rn.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=r"model.patch_dropout=0.5: the image tower .* no open_clip PatchDropout"):
        build_model(ModelConfig(config_file=str(path), patch_dropout=0.5))
