"""loss.duplicates in the trainer: the step hashes the captions into group ids, the loss gets
them, and the step's duplicate_pairs is logged (engine, then the real train.py)."""

from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path

import pytest
import torch
from engine_testutils import assert_grads_close, batch, config, engine_for, grads_of, reference_grads, tiny_clip

from infclip.data.dedup import group_ids
from infclip.loss import clip_loss

LOCAL = 12


@pytest.mark.parametrize("mode", ["mask", "positive"])
@pytest.mark.parametrize("micro", [LOCAL, 4])
def test_engine_passes_group_ids_and_counts_duplicate_pairs(mode, micro):
    """Captions deliberately duplicated across micro-batches (groups of 3, 2 and 2): the step's
    gradients are those of the duplicate-aware loss on the whole batch, duplicate_pairs = 3 + 1 + 1."""
    images, tokens = batch(LOCAL)
    tokens[[5, 9]] = tokens[0].clone()
    tokens[11] = tokens[2].clone()
    tokens[7] = tokens[3].clone()
    model = tiny_clip(dropout=0.0, patch_dropout=0.0).train()
    ref = copy.deepcopy(model)
    ids = group_ids(tokens)
    ref_fn = functools.partial(clip_loss, impl="torch", group_ids=ids, duplicates=mode)
    ref_loss, ref_grads = reference_grads(ref, images, tokens, micro, loss_fn=ref_fn)
    off_loss, _ = reference_grads(copy.deepcopy(model), images, tokens, micro)
    cfg = config(LOCAL, micro)
    cfg.loss.duplicates = mode
    loss_fn = functools.partial(clip_loss, impl="torch", duplicates=mode)
    out = engine_for(cfg, model, loss_fn=loss_fn).step(images, tokens)
    assert {k: int(v) for k, v in out.metrics.items()} == {"duplicate_pairs": 5}  # a 0-d device count
    torch.testing.assert_close(out.loss, ref_loss, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(out.loss, off_loss)  # the duplicates changed the loss
    assert_grads_close(grads_of(model), ref_grads)


def test_engine_off_hashes_nothing_and_logs_nothing():
    images, tokens = batch(LOCAL)
    out = engine_for(config(LOCAL, LOCAL), tiny_clip(dropout=0.0, patch_dropout=0.0)).step(images, tokens)
    assert out.metrics == {}


def test_train_py_logs_duplicate_pairs(tmp_path):
    """The real train.py, 16 synthetic samples per epoch and 32 per step: every step holds each
    sample (its caption) twice, so at least 16 duplicate pairs are logged every step."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_train_cli import metrics, run_train

    run_dir = tmp_path / "run"
    run_train(tmp_path, f"run_dir={run_dir}", "steps=2", "eval.tasks=[]", "data.synthetic_train=16",
              "loss.duplicates=positive")
    logged = [m for m in metrics(run_dir) if "loss" in m]
    assert [m["step"] for m in logged] == [1, 2]
    assert all(m["duplicate_pairs"] >= 16 for m in logged), logged
