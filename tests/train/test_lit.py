"""LiT: locked towers stay bit-identical, never reach the optimizer, and their trunk runs once."""

from __future__ import annotations

import copy

import open_clip
import pytest
import torch
from engine_testutils import (
    CTX, IMG, VOCAB, assert_grads_close, batch, config, engine_for, grads_of, reference_grads, tiny_clip,
)
from torch import nn

from infclip.config import OptimConfig
from infclip.train.lit import apply_locks
from infclip.train.optim import build_optimizer

LOCAL, MICRO = 8, 2
K = LOCAL // MICRO


def _counter(module: nn.Module) -> list:
    calls: list = []
    module.register_forward_hook(lambda *_: calls.append(1))
    return calls


def _check_equivalence(model: nn.Module, cfg) -> None:
    """Engine (K micro-batches, locked trunk cached) == full-batch step with the same draws."""
    ref = copy.deepcopy(model)
    images, tokens = batch(LOCAL)
    torch.manual_seed(11)
    _, ref_grads = reference_grads(ref, images, tokens, MICRO)
    torch.manual_seed(11)
    engine_for(cfg, model).step(images, tokens)
    assert_grads_close(grads_of(model), ref_grads)


def _train_steps(model: nn.Module, cfg, steps: int = 3) -> None:
    opt = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1))
    engine = engine_for(cfg, model)
    for s in range(steps):
        model.train()
        engine.step(*batch(LOCAL, seed=s))
        opt.step()
        opt.zero_grad(set_to_none=True)
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in in_opt) == p.requires_grad, name
        assert p.requires_grad or not opt.state.get(p), f"{name}: locked parameter has optimizer state"


# groups with 2 ViT blocks: 0 = all locked, 1 = proj, 2 = + last block & ln_post, 3 = + first block
@pytest.mark.parametrize("groups,mode", [(0, "frozen"), (1, "split"), (2, "split"), (3, "split")])
def test_vit_lit_matches_reference(groups, mode):
    model = tiny_clip()
    cfg = config(LOCAL, MICRO, lock_image=True, lock_image_unlocked_groups=groups)
    plan = apply_locks(model, cfg.model)
    assert plan.image.mode == mode and plan.text.mode == "train"
    _check_equivalence(model.train(), cfg)


@pytest.mark.parametrize("groups", [0, 2])
def test_vit_lit_locked_params_unchanged_and_trunk_runs_once(groups):
    model = tiny_clip()
    cfg = config(LOCAL, MICRO, lock_image=True, lock_image_unlocked_groups=groups)
    apply_locks(model, cfg.model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trunk_calls = _counter(model.visual.conv1)
    head_calls = _counter(model.visual.transformer.resblocks[-1])
    _train_steps(model, cfg, steps=3)
    assert len(trunk_calls) == 3 * K, "the locked trunk must run once per micro-batch per step"
    assert len(head_calls) == 3 * K * (2 if groups else 1)  # trainable head: cache pass + replay
    for name, p in model.named_parameters():
        same = torch.equal(p, before[name])
        assert same != p.requires_grad, f"{name}: locked={not p.requires_grad}, unchanged={same}"
    model.train()
    assert not model.visual.conv1.training and not model.visual.patch_dropout.training
    assert model.visual.transformer.resblocks[-1].training == bool(groups)
    assert model.transformer.training  # the text tower trains


def test_timm_trunk_locked_head_trains():
    model = tiny_clip(timm=True)
    cfg = config(LOCAL, MICRO, lock_image=True)
    plan = apply_locks(model, cfg.model)
    assert plan.image.mode == "split"
    assert all(not p.requires_grad for p in model.visual.trunk.parameters())
    assert model.visual.head.proj.weight.requires_grad
    _check_equivalence(model.train(), cfg)
    model.zero_grad()
    before = {n: b.clone() for n, b in model.visual.trunk.state_dict().items()}
    calls = _counter(model.visual.trunk)
    _train_steps(model, cfg, steps=2)
    assert len(calls) == 2 * K
    after = model.visual.trunk.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before), "BN statistics or weights moved"


# text groups with 2 blocks: 1 = projection, 2 = + last block & ln_final, 3 = + first block
@pytest.mark.parametrize("layers", [1, 2, 3])
def test_clip_text_tower_split_matches_reference_and_trunk_runs_once(layers):
    model = tiny_clip()
    cfg = config(LOCAL, MICRO, lock_text=True, lock_text_unlocked_layers=layers)
    plan = apply_locks(model, cfg.model)
    assert plan.text.mode == "split" and plan.text.attr == "encode_text"
    _check_equivalence(model.train(), cfg)
    model.zero_grad()
    trunk_calls = _counter(model.token_embedding)
    last_block = _counter(model.transformer.resblocks[-1])
    _train_steps(model, cfg, steps=1)
    assert len(trunk_calls) == K
    assert len(last_block) == K * (2 if layers >= 2 else 1)
    assert "encode_text" not in vars(model), "head_only must restore the model's own method"


def test_text_tower_locked_runs_once():
    model = tiny_clip()
    cfg = config(LOCAL, MICRO, lock_text=True)
    plan = apply_locks(model, cfg.model)
    assert plan.text.mode == "frozen" and plan.image.mode == "train"
    _check_equivalence(model.train(), cfg)
    calls = _counter(model.transformer)
    _train_steps(model, cfg, steps=2)
    assert len(calls) == 2 * K


def _hf_clip() -> nn.Module:
    from open_clip.hf_model import HFTextEncoder
    from transformers import BertConfig

    torch.manual_seed(0)
    vision = dict(image_size=IMG, patch_size=8, width=64, layers=1, head_width=32)
    text = dict(context_length=CTX, vocab_size=VOCAB, width=32, heads=2, layers=1)
    model = open_clip.CustomTextCLIP(embed_dim=32, vision_cfg=vision, text_cfg=text)
    bert = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=CTX)
    model.text = HFTextEncoder("bert", output_dim=32, config=bert, pooler_type="mean_pooler",
                               proj_type="mlp", pretrained=False)
    return model


def test_hf_text_tower_split_trunk_runs_once():
    model = _hf_clip()
    cfg = config(LOCAL, MICRO, lock_text=True)
    plan = apply_locks(model, cfg.model)
    assert plan.text.mode == "split"
    assert all(not p.requires_grad for p in model.text.transformer.parameters())
    _check_equivalence(model.train(), cfg)
    calls = _counter(model.text.transformer)
    _train_steps(model, cfg, steps=2)
    assert len(calls) == 2 * K
