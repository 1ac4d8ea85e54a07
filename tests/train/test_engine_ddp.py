"""2 gloo ranks: one gradient all-reduce per step; result == one process on the global batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from engine_testutils import (
    assert_grads_close, batch, config, engine_for, grads_of, reference_grads, spawn_ranks, tiny_clip,
)

from infclip.train.lit import apply_locks

WORLD, LOCAL = 2, 6
CASES = {  # name -> (micro-batch, model config overrides)
    "cache": (2, {}),
    "plain": (LOCAL, {}),
    "lit": (3, {"lock_image": True, "lock_image_unlocked_groups": 2}),
}


def _model(case: str):
    micro, model_kw = CASES[case]
    model = tiny_clip(dropout=0.0, patch_dropout=0.0)  # same seed, same weights on every rank
    cfg = config(LOCAL, micro, world=WORLD, **model_kw)
    apply_locks(model, cfg.model)
    return model, cfg


def _worker(images, tokens) -> dict:
    """One rank: its LOCAL rows through DDP + the engine, two steps per case."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    results = {}
    for name in CASES:
        model, cfg = _model(name)
        ddp = DDP(model, broadcast_buffers=False, bucket_cap_mb=100)  # one bucket: one all-reduce
        calls: list = []

        def hook(state, bucket, calls=calls):
            calls.append(1)
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(dist.group.WORLD, hook)
        engine = engine_for(cfg, ddp, group=dist.group.WORLD, world=WORLD)
        per_step = []
        for _ in range(2):
            ddp.zero_grad(set_to_none=True)
            n0 = len(calls)
            out = engine.step(images, tokens)
            per_step.append(len(calls) - n0)
        results[name] = {"calls": per_step, "grads": grads_of(model), "global_loss": out.global_loss}
    return results


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    return spawn_ranks(_worker, tmp_path_factory.mktemp("ddp"), WORLD, LOCAL)


@pytest.mark.parametrize("case", list(CASES))
def test_one_allreduce_per_step_and_single_process_equality(ddp_results, case):
    res = ddp_results[case]
    assert res["calls"] == [1, 1], "exactly one gradient all-reduce per optimizer step"
    model, _ = _model(case)
    images, tokens = batch(LOCAL * WORLD)
    ref_loss, ref = reference_grads(model.train(), images, tokens, LOCAL * WORLD)  # one literal forward
    torch.testing.assert_close(res["global_loss"], ref_loss, atol=1e-6, rtol=1e-6)
    assert_grads_close(res["grads"], ref)
