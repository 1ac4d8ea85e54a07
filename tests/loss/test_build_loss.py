"""``build_loss`` gives the engine's callable for every loss.kind; the presets compose."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from infclip.config import ConfigError, LossConfig, TrainConfig, validate
from infclip.loss import build_loss, clip_loss, nt_xent_loss, siglip_loss
from infclip.loss.filtering import filtered_clip_loss

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def embeddings(b=12, c=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    img = F.normalize(torch.randn(b, c, generator=g), dim=-1)
    txt = F.normalize(img + 0.5 * torch.randn(b, c, generator=g), dim=-1)
    return img, txt, torch.tensor(10.0, requires_grad=True), torch.tensor(-10.0, requires_grad=True)


def test_each_kind_calls_its_loss():
    img, txt, s, t = embeddings()
    assert torch.equal(build_loss(LossConfig(kind="clip"))(img, txt, s), clip_loss(img, txt, s))
    assert torch.equal(build_loss(LossConfig(kind="siglip"))(img, txt, s, t), siglip_loss(img, txt, s, t))
    nt = build_loss(LossConfig(kind="nt_xent", temperature=0.2))(img, txt, s)
    assert torch.allclose(nt, nt_xent_loss(torch.cat([img, txt]), 0.2))
    (g,) = torch.autograd.grad(nt, s)  # fixed temperature: the engine's scale leaf gets zero
    assert float(g) == 0.0
    filt = build_loss(LossConfig(kind="clip", grad_filter=2**-7))(img, txt, s)
    assert torch.equal(filt, filtered_clip_loss(img, txt, s, eps=2**-7))


def test_clear_errors():
    img, txt, s, t = embeddings()
    with pytest.raises(ValueError, match="needs the model's logit bias"):
        build_loss(LossConfig(kind="siglip"))(img, txt, s)
    with pytest.raises(ValueError, match="got a logit_bias"):
        build_loss(LossConfig(kind="clip"))(img, txt, s, t)
    with pytest.raises(ValueError, match="not available for loss.kind=siglip"):
        build_loss(LossConfig(kind="siglip", impl="local"))
    with pytest.raises(ValueError, match="unknown loss.kind"):
        build_loss(LossConfig(kind="triplet"))


def test_validate_rejects_bad_combinations():
    for kw in ({"kind": "siglip", "grad_filter": 0.01}, {"kind": "clip", "impl": "vanilla", "grad_filter": 0.01},
               {"kind": "clip", "grad_filter": -1.0}, {"kind": "nt_xent", "impl": "local"}):
        cfg = TrainConfig()
        for k, v in kw.items():
            setattr(cfg.loss, k, v)
        with pytest.raises(ConfigError, match="loss"):
            validate(cfg, 1)


@pytest.mark.parametrize("preset,kind", [("siglip", "siglip"), ("nt_xent", "nt_xent"), ("clip", "clip")])
def test_presets_compose(preset, kind):
    from hydra import compose, initialize_config_dir

    from infclip.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"loss={preset}"])
    assert cfg.loss.kind == kind
    validate(cfg, 1)
    if kind == "siglip":  # SigLIP's initialization: s = 10, bias -10
        assert abs(cfg.model.init_logit_scale - torch.log(torch.tensor(10.0)).item()) < 1e-6
        assert cfg.model.init_logit_bias == -10.0
