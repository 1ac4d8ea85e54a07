"""Gradient cache == plain full-batch step; RNG replay; GradScaler; logit scale once."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from engine_testutils import (
    assert_grads_close, batch, config, engine_for, grads_of, reference_grads, tiny_clip,
)
from open_clip.transformer import PatchDropout
from torch import nn

from infclip.config import ConfigError

LOCAL = 10


@pytest.mark.parametrize("k", [1, 2, 5])
def test_grad_cache_equals_full_batch_step_with_dropout(k):
    """fp32, dropout + patch dropout on: same gradients, loss and final RNG state."""
    model = tiny_clip().train()
    ref = copy.deepcopy(model)
    images, tokens = batch(LOCAL)
    torch.manual_seed(123)
    ref_loss, ref_grads = reference_grads(ref, images, tokens, LOCAL // k)
    ref_rng = torch.get_rng_state()

    torch.manual_seed(123)
    out = engine_for(config(LOCAL, LOCAL // k, grad_cache="on"), model).step(images, tokens)
    assert torch.equal(torch.get_rng_state(), ref_rng), "the replay must not perturb the RNG stream"
    torch.testing.assert_close(out.loss, ref_loss, atol=1e-6, rtol=1e-6)
    assert_grads_close(grads_of(model), ref_grads)
    assert set(out.timings) == {"cache_pass", "loss", "replay"}
    assert torch.equal(out.global_loss, out.loss)


def test_five_micro_batches_equal_one_literal_forward_without_dropout():
    """No randomness: K=5 cached step == one forward of the whole batch."""
    model = tiny_clip(dropout=0.0, patch_dropout=0.0).train()
    ref = copy.deepcopy(model)
    images, tokens = batch(LOCAL)
    _, ref_grads = reference_grads(ref, images, tokens, LOCAL)
    engine_for(config(LOCAL, 2), model).step(images, tokens)
    assert_grads_close(grads_of(model), ref_grads)


def test_one_micro_batch_plain_path_equals_cached_path():
    images, tokens = batch(LOCAL)
    grads = []
    for mode in ("off", "on"):
        model = tiny_clip().train()
        torch.manual_seed(7)
        engine_for(config(LOCAL, LOCAL, grad_cache=mode), model).step(images, tokens)
        grads.append(grads_of(model))
    assert_grads_close(*grads)


def _record(model: nn.Module, log: list) -> None:
    """Log (grad enabled?, dropout mask / patch-dropout output) for every random module call."""
    def hook(mod, _inp, out):
        value = (out == 0) if isinstance(mod, nn.Dropout) else out
        log.append((torch.is_grad_enabled(), value.detach().clone()))

    for m in model.modules():
        if isinstance(m, (nn.Dropout, PatchDropout)):
            m.register_forward_hook(hook)


def test_dropout_masks_replayed_exactly():
    model = tiny_clip().train()
    log: list = []
    _record(model, log)
    engine_for(config(LOCAL, 2), model).step(*batch(LOCAL))
    cache = [v for grad, v in log if not grad]
    replay = [v for grad, v in log if grad]
    assert len(cache) == len(replay) > 5
    for a, b in zip(cache, replay):
        assert torch.equal(a, b)
    masks = [v for v in cache if v.dtype == torch.bool]
    assert any(m.any() for m in masks), "dropout was not active: the test would prove nothing"
    assert not torch.equal(masks[0], masks[len(masks) // 5]), "micro-batches must draw different masks"


def test_grad_scaler_scales_every_gradient_consistently():
    images, tokens = batch(LOCAL)
    grads = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=1024.0)):
        model = tiny_clip().train()
        torch.manual_seed(3)
        engine_for(config(LOCAL, 5), model, scaler=scaler).step(images, tokens)
        grads.append(grads_of(model))
    assert_grads_close({n: g / 1024.0 for n, g in grads[1].items()}, grads[0], atol=1e-7, rtol=1e-5)


def test_logit_scale_gets_its_gradient_exactly_once():
    model = tiny_clip().train()
    calls = []
    model.logit_scale.register_post_accumulate_grad_hook(lambda p: calls.append(1))
    engine = engine_for(config(LOCAL, 2), model)
    engine.step(*batch(LOCAL))
    assert len(calls) == 1
    engine.step(*batch(LOCAL, seed=2))
    assert len(calls) == 2


def test_bf16_cache_close_to_fp32():
    images, tokens = batch(LOCAL)
    grads = []
    for dtype in ("fp32", "bf16"):
        model = tiny_clip(dropout=0.0, patch_dropout=0.0).train()
        engine_for(config(LOCAL, 5, cache_dtype=dtype), model).step(images, tokens)
        grads.append(grads_of(model))
    for name in grads[0]:
        ref = grads[0][name]
        assert (grads[1][name] - ref).norm() <= 0.05 * ref.norm() + 1e-6, name


def test_siglip_bias_gets_its_gradient_once_and_matches_reference():
    """A model with logit_bias: the loss gets (img, txt, scale, bias); both scalars exact."""
    from infclip.loss import siglip_loss

    loss_fn = functools.partial(siglip_loss, impl="torch")
    model = tiny_clip(init_logit_bias=-10.0).train()
    ref = copy.deepcopy(model)
    images, tokens = batch(LOCAL)
    torch.manual_seed(9)
    _, ref_grads = reference_grads(ref, images, tokens, 2, loss_fn=loss_fn)
    calls = []
    model.logit_bias.register_post_accumulate_grad_hook(lambda p: calls.append(1))
    torch.manual_seed(9)
    engine_for(config(LOCAL, 2), model, loss_fn=loss_fn).step(images, tokens)
    assert calls == [1]
    assert_grads_close(grads_of(model), ref_grads)


def test_grad_cache_off_with_micro_batches_is_rejected():
    with pytest.raises(ConfigError, match="grad_cache=off"):
        engine_for(config(LOCAL, 5, grad_cache="off"), tiny_clip())


def test_wrong_batch_size_is_rejected():
    engine = engine_for(config(LOCAL, 5), tiny_clip())
    with pytest.raises(ValueError, match="per-rank batch of 10"):
        engine.step(*batch(8))


def _bn_stats(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers() if n.rsplit(".", 1)[-1].startswith(
        ("running_", "num_batches"))}


def test_batchnorm_tower_grad_cache_equals_per_micro_batch_reference():
    """A BatchNorm tower (timm ResNet): gradients equal the full-graph reference over the same
    micro-batches, and the running statistics are updated once per micro-batch (the replay),
    not twice (cache pass + replay)."""
    model = tiny_clip(timm=True, dropout=0.0).train()
    ref = copy.deepcopy(model)
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    images, tokens = batch(LOCAL)
    before = _bn_stats(model)
    _, ref_grads = reference_grads(ref, images, tokens, 2)
    engine_for(config(LOCAL, 2, grad_cache="on"), model).step(images, tokens)
    assert_grads_close(grads_of(model), ref_grads)
    got, want = _bn_stats(model), _bn_stats(ref)
    assert any(not torch.equal(before[n], want[n]) for n in want), "the reference must update BN stats"
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-6, msg=lambda m: f"{name}: {m}")


class _Dropping:
    """A normalizer that, like the device JPEG decoder, reports samples it could not decode."""

    reads_host = True

    def __init__(self, drop: set, micro: int):
        from engine_testutils import normalize

        self.norm, self.drop, self.micro, self.calls = normalize, drop, micro, 0
        self.last_dropped = None

    def __call__(self, images):
        k = self.calls % (LOCAL // self.micro)  # micro-batch index within the pass
        self.calls += 1
        mask = torch.tensor([k * self.micro + i in self.drop for i in range(images.shape[0])])
        self.last_dropped = mask if mask.any() else None
        return self.norm(images)


@pytest.mark.parametrize("micro", [5, LOCAL])
def test_samples_the_decoder_dropped_are_left_out_of_the_loss(micro):
    """The step equals a full-batch step on the kept samples alone (no dropout: the dropped
    rows' forwards change nothing but get no gradient)."""
    model = tiny_clip(dropout=0.0, patch_dropout=0.0).train()
    ref = copy.deepcopy(model)
    images, tokens = batch(LOCAL)
    keep = [i for i in range(LOCAL) if i not in (3, 7)]
    ref_loss, ref_grads = reference_grads(ref, images[keep], tokens[keep], len(keep))
    mode = "on" if micro < LOCAL else "off"
    engine = engine_for(config(LOCAL, micro, grad_cache=mode), model)
    engine.normalizer = _Dropping({3, 7}, micro)
    out = engine.step(images, tokens)
    torch.testing.assert_close(out.loss, ref_loss, atol=1e-6, rtol=1e-6)
    assert_grads_close(grads_of(model), ref_grads)


def test_the_loss_sees_its_inputs_at_one_address_step_after_step_and_gradients_stay_exact():
    """The cached embeddings reach the loss in the same buffers every step of a small batch (the
    one-GPU loss replays CUDA graphs only there), and reusing them changes no gradient: each
    step equals its full-batch reference."""
    seen = []

    def recording_loss(img, txt, *extras):
        seen.append((img.data_ptr(), txt.data_ptr()))
        return clip_loss_torch(img, txt, *extras)

    model = tiny_clip(dropout=0.0, patch_dropout=0.0).train()
    ref = copy.deepcopy(model)
    engine = engine_for(config(LOCAL, 2), model, loss_fn=recording_loss)
    for seed in (1, 2, 3):
        images, tokens = batch(LOCAL, seed=seed)
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
        _, ref_grads = reference_grads(ref, images, tokens, LOCAL)
        engine.step(images, tokens)
        assert_grads_close(grads_of(model), ref_grads)
    assert len(seen) == 3 and seen[0] == seen[1] == seen[2]


def clip_loss_torch(img, txt, *extras):
    from infclip.loss import clip_loss

    return clip_loss(img, txt, *extras, impl="torch")
