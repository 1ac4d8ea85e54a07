"""task=simclr: two-view augmentation, the image-only model, the gradient-cached step, a run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine_testutils import batch, config, engine_for, grads_of, normalize, tiny_clip
from infclip.config import ConfigError, LossConfig, TrainConfig, validate
from infclip.loss import build_loss
from infclip.train.simclr import SimCLRModel, step_seed, two_views

ROOT = Path(__file__).resolve().parents[2]


def simclr_model(seed: int = 0) -> SimCLRModel:
    visual = tiny_clip(seed, dropout=0.2, patch_dropout=0.25).visual  # dropout: the replay must match
    return SimCLRModel(visual, visual.output_dim, 0.2, (0.5,) * 3, (0.25,) * 3)


def test_two_views_deterministic_distinct_uint8():
    images, _ = batch(6)
    v1, v2 = two_views(images, seed=3)
    w1, w2 = two_views(images, seed=3)
    assert v1.dtype == torch.uint8 and v1.shape == images.shape
    assert torch.equal(v1, w1) and torch.equal(v2, w2)  # same seed: the same views (resume)
    assert not torch.equal(v1, v2)  # independent augmentations
    assert not torch.equal(two_views(images, seed=4)[0], v1)
    assert step_seed(0, 5, 1) != step_seed(0, 5, 0) != step_seed(0, 6, 0)


def test_model_embeds_both_slots_with_one_tower():
    model = simclr_model().eval()
    images, _ = batch(4)
    out = model(image=normalize(images), text=images)  # text slot: view 2 as uint8
    assert torch.allclose(out["image_features"], out["text_features"], atol=1e-6)
    assert torch.allclose(out["image_features"].norm(dim=-1), torch.ones(4))
    assert not model.logit_scale.requires_grad


def test_gradient_cache_equals_full_batch_step():
    """Two micro-batches with the cache == one forward/backward of the whole batch."""
    images, _ = batch(16, seed=2)
    v1, v2 = two_views(images, seed=7)
    loss_fn = build_loss(LossConfig(kind="nt_xent", temperature=0.2))
    ref = simclr_model().train()
    torch.manual_seed(11)
    imgs, txts = [], []
    for k in (0, 8):
        out = ref(image=normalize(v1[k:k + 8]), text=v2[k:k + 8])
        imgs.append(out["image_features"])
        txts.append(out["text_features"])
    ref_loss = loss_fn(torch.cat(imgs), torch.cat(txts), out["logit_scale"])
    ref_loss.backward()
    model = simclr_model().train()
    engine = engine_for(config(16, 8), model, loss_fn=loss_fn)
    torch.manual_seed(11)
    step = engine.step(v1, v2)
    assert engine.s.grad_cache and abs(step.loss.item() - ref_loss.item()) < 1e-6
    got, want = grads_of(model), grads_of(ref)
    assert got.keys() == want.keys() and "head.0.weight" in got
    for name in got:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_validate_names_the_fix():
    cfg = TrainConfig()
    cfg.task = "simclr"
    with pytest.raises(ConfigError, match="task=simclr"):
        validate(cfg, 1)


def test_train_cli_simclr_runs_and_learns(tmp_path):
    args = [sys.executable, str(ROOT / "train.py"), "experiment=simclr_quickstart",
            f"data.synthetic_root={tmp_path / 'syn'}", f"run_dir={tmp_path / 'run'}", "steps=6",
            "model.name=infclip-micro", "data.synthetic_train=256", "data.synthetic_eval=32",
            "data.synthetic_image_size=32", "data.workers=0", "data.loader_batch=16",
            "batch.global_size=32", "batch.micro_size=16", "logging.every_n_steps=1", "logging.progress=false"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [float(line.split("loss=")[1].split()[0]) for line in proc.stdout.splitlines() if " loss=" in line]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert (tmp_path / "run" / "checkpoints").exists()
