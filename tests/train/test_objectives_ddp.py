"""SigLIP and NT-Xent through the gradient-cached engine on 2 gloo DDP ranks equal one process
on the global batch: the loss's scale/bias gradients (local parts) and DDP's averaging compose."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from engine_testutils import (
    assert_grads_close, batch, config, engine_for, grads_of, reference_grads, spawn_ranks, tiny_clip,
)

from infclip.config import LossConfig
from infclip.loss import build_loss

WORLD, LOCAL, MICRO = 2, 6, 3
KINDS = ("siglip", "nt_xent")


def _model(kind: str):
    kw = {"init_logit_bias": -10.0} if kind == "siglip" else {}
    return tiny_clip(dropout=0.0, patch_dropout=0.0, **kw)  # same seed: same weights on every rank


def _worker(images, tokens) -> dict:
    """One rank: its LOCAL rows through DDP + the gradient-cached engine, one step per kind."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    results = {}
    for kind in KINDS:
        model = _model(kind)
        ddp = DDP(model, broadcast_buffers=False)
        loss_fn = build_loss(LossConfig(kind=kind, impl="torch", temperature=0.2), group=dist.group.WORLD)
        engine = engine_for(config(LOCAL, MICRO, world=WORLD), ddp, group=dist.group.WORLD, world=WORLD,
                            loss_fn=loss_fn)
        out = engine.step(images, tokens)
        results[kind] = {"grads": grads_of(model), "global_loss": out.global_loss}
    return results


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    return spawn_ranks(_worker, tmp_path_factory.mktemp("ddp_objectives"), WORLD, LOCAL)


@pytest.mark.parametrize("kind", KINDS)
def test_ddp_grad_cache_equals_single_process(ddp_results, kind):
    res = ddp_results[kind]
    model = _model(kind).train()
    images, tokens = batch(LOCAL * WORLD)
    loss_fn = build_loss(LossConfig(kind=kind, impl="torch", temperature=0.2))
    # NT-Xent: per rank the rows are [img_r; txt_r], in one process [all img; all txt]: the same
    # positive pairs and, the denominator running over every other row, the same loss.
    ref_loss, ref = reference_grads(model, images, tokens, LOCAL * WORLD, loss_fn=loss_fn)
    torch.testing.assert_close(res["global_loss"], ref_loss, atol=1e-6, rtol=1e-6)
    assert_grads_close(res["grads"], ref)
    if kind == "siglip":
        assert "logit_bias" in res["grads"] and "logit_scale" in res["grads"]
