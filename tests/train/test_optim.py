"""Optimizer groups and the learning-rate schedule."""

import math

import pytest
import torch

from infclip.config import OptimConfig, ScheduleConfig
from infclip.train.optim import build_optimizer, build_scheduler, lr_factor, param_groups


class Tower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.ln = torch.nn.LayerNorm(4)
        self.frozen = torch.nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.0))


def test_no_decay_on_gains_biases_scale_and_frozen_excluded():
    m = Tower()
    decay, no_decay = param_groups(m, 1e-4)
    assert decay["params"] == [m.proj.weight] and decay["weight_decay"] == 1e-4
    ids = {id(p) for p in no_decay["params"]}
    assert ids == {id(m.proj.bias), id(m.ln.weight), id(m.ln.bias), id(m.logit_scale)}
    assert no_decay["weight_decay"] == 0.0


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_optimizers_step_and_hold_no_state_for_frozen(name):
    m = Tower()
    opt = build_optimizer(m, OptimConfig(name=name, lr=1e-2))
    before = m.frozen.weight.clone()
    loss = m.proj(torch.randn(3, 4)).pow(2).sum() + m.ln(torch.randn(3, 4)).sum() + m.logit_scale
    loss.backward()
    opt.step()
    assert torch.equal(m.frozen.weight, before)
    assert all(id(p) != id(m.frozen.weight) for g in opt.param_groups for p in g["params"])
    assert len(opt.state) > 0


def test_warmup_then_cosine_to_floor():
    total, warm = 100, 10
    f = [lr_factor(s, total, warm, "cosine", 0.1) for s in range(total + 1)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(f[:10], f[1:10]))  # monotone warm-up
    assert f[10] == pytest.approx(1.0) and f[total] == pytest.approx(0.1)
    assert f[55] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_scheduler_uses_warmup_fraction():
    m = Tower()
    opt = build_optimizer(m, OptimConfig(lr=1.0))
    sched = build_scheduler(opt, ScheduleConfig(warmup_fraction=0.5), total_steps=10)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])


def test_const_cooldown_holds_then_decays_to_the_end_lr():
    """open_clip's const-cooldown: constant after warm-up, then (1 - progress) ** power to the end lr."""
    total, warm, cool = 100, 10, 20
    f = [lr_factor(s, total, warm, "const-cooldown", 0.1, cool, 2.0) for s in range(total)]
    assert f[9] == pytest.approx(1.0) and f[79] == pytest.approx(1.0)
    assert all(x == pytest.approx(1.0) for x in f[10:80])
    assert f[99] == pytest.approx(0.1)  # the last step is at the end lr
    assert f[89] == pytest.approx(0.1 + 0.9 * (1 - 10 / 20) ** 2)
    assert all(a > b for a, b in zip(f[80:99], f[81:100]))  # strictly decaying


@pytest.mark.parametrize("name", ["timm/lamb", "timm/lion"])
def test_timm_optimizers_by_name_keep_our_weight_decay_groups(name):
    m = Tower()
    opt = build_optimizer(m, OptimConfig(name=name, lr=1e-2, weight_decay=0.1))
    decays = sorted(g["weight_decay"] for g in opt.param_groups)
    assert decays == [0.0, 0.1]  # gains/biases/logit scale undecayed, as with adamw
    no_decay = next(g for g in opt.param_groups if g["weight_decay"] == 0.0)
    assert {id(p) for p in no_decay["params"]} == {id(m.proj.bias), id(m.ln.weight), id(m.ln.bias), id(m.logit_scale)}
    before = m.proj.weight.clone()
    (m.proj(torch.randn(3, 4)).pow(2).sum() + m.logit_scale).backward()
    opt.step()
    assert not torch.equal(m.proj.weight, before)
    assert type(opt).__name__.lower().startswith(name[5:])


@pytest.mark.parametrize("overrides, match", [
    (["optim.name=timm/lamd"], "did you mean timm/lamb"),
    (["optim.name=sgd"], "choose adamw, adafactor or timm/"),
    (["schedule.kind=const-cooldown"], "needs schedule.cooldown_steps"),
    (["schedule.cooldown_steps=5"], "apply to schedule.kind=const-cooldown"),
    (["schedule.kind=const-cooldown", "schedule.cooldown_steps=90", "schedule.warmup_steps=20", "steps=100"],
     "exceed steps=100"),
])
def test_bad_optimizer_and_schedule_values_are_refused_before_any_model(overrides, match):
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    from infclip.config import ConfigError, register_configs, validate

    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[2] / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    with pytest.raises(ConfigError, match=match):
        validate(cfg, world_size=1)
