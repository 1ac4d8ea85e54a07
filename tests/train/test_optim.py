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
