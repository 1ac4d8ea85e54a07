"""Offload: same gradients as resident inputs; device buffers hold at most 2 micro-batches."""

from __future__ import annotations

import functools

import pytest
import torch
from engine_testutils import assert_grads_close, batch, config, engine_for, grads_of, normalize, tiny_clip

from infclip.loss import clip_loss
from infclip.train.engine import build_engine
from infclip.train.offload import InputStager

LOCAL, MICRO = 12, 3


def _step(offload: bool):
    model = tiny_clip().train()
    engine = engine_for(config(LOCAL, MICRO, offload=offload), model)
    torch.manual_seed(5)
    out = engine.step(*batch(LOCAL))
    return engine, out, grads_of(model)


def test_offload_on_off_identical_gradients():
    _, out_off, g_off = _step(False)
    _, out_on, g_on = _step(True)
    assert torch.equal(out_on.loss, out_off.loss)
    assert_grads_close(g_on, g_off, atol=0, rtol=0)


def test_offload_device_buffers_hold_two_micro_batches():
    engine, _, _ = _step(True)
    bufs = engine.stager.buffers
    assert set(bufs) == {"images", "tokens"}
    for name, slots in bufs.items():
        assert len(slots) == 2, name  # double buffering
        assert all(b.shape[0] == MICRO for b in slots), name
    assert engine.stager.resident_rows() == 2 * MICRO < LOCAL


def test_resident_inputs_hold_the_local_batch_once():
    engine, _, _ = _step(False)
    assert {n: [b.shape[0] for b in s] for n, s in engine.stager.buffers.items()} == {
        "images": [LOCAL], "tokens": [LOCAL]
    }


@pytest.mark.parametrize("offload", [False, True])
def test_stager_yields_the_scheduled_slices(offload):
    x = torch.arange(24).view(12, 2)
    y = -torch.arange(12)
    schedule = [(0, ("x", "y")), (3, ("x",)), (1, ("y",)), (2, ("x", "y"))]
    stager = InputStager(torch.device("cpu"), offload)
    seen = [{k: v.clone() for k, v in item.items()} for item in stager.stream({"x": x, "y": y}, 3, schedule)]
    for (k, names), got in zip(schedule, seen):
        assert set(got) == set(names)
        for n in names:
            src = {"x": x, "y": y}[n]
            assert torch.equal(got[n], src[3 * k:3 * k + 3])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CPU counterpart above)")
def test_cuda_offload_matches_resident():
    results = []
    for offload in (False, True):
        model = tiny_clip().train().cuda()
        engine = build_engine(config(LOCAL, MICRO, offload=offload), model, device=torch.device("cuda"),
                              normalizer=normalize, loss_fn=functools.partial(clip_loss, impl="torch"),
                              scaler=None, group=None, world_size=1)
        images, tokens = batch(LOCAL)
        torch.manual_seed(5)
        engine.step(images.pin_memory(), tokens.pin_memory())
        results.append(grads_of(model))
    assert_grads_close(*results, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("offload", [False, True])
def test_no_normalized_images_survive_their_micro_batch(offload):
    """The leak a 1M batch cannot afford: at the loss (between the passes) no
    float image batch from the cache pass may still be alive."""
    import weakref

    alive_at_loss = []
    refs: list = []

    def tracking_normalize(x):
        out = normalize(x)
        refs.append(weakref.ref(out))
        return out

    def tracking_loss(img, txt, scale):
        alive_at_loss.append(sum(r() is not None for r in refs))
        return clip_loss(img, txt, scale, impl="torch")

    model = tiny_clip().train()
    engine = build_engine(config(LOCAL, MICRO, offload=offload), model, device=torch.device("cpu"),
                          normalizer=tracking_normalize, loss_fn=tracking_loss)
    engine.step(*batch(LOCAL))
    assert len(refs) == 2 * (LOCAL // MICRO)  # normalized once per pass per micro-batch
    assert alive_at_loss == [0]
