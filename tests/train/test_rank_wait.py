"""2 gloo ranks: a timed step's ``rank_wait`` lap holds the wait for the slowest rank's cache
pass, so the ``loss`` lap holds the loss alone; untimed steps make no extra collective."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from engine_testutils import config, engine_for, normalize, spawn_ranks, tiny_clip

WORLD, LOCAL, MICRO = 2, 4, 2
SLEEP_S = 0.75  # rank 1 sleeps this long in each cache-pass micro-batch (2 of them)


def _worker(images, tokens) -> dict:
    rank = dist.get_rank()
    calls = {"n": 0}

    def slow_on_rank_1(x):
        calls["n"] += 1
        if rank == 1 and calls["n"] <= LOCAL // MICRO:  # the cache pass of the first step only
            time.sleep(SLEEP_S)
        return normalize(x)

    model = tiny_clip(dropout=0.0, patch_dropout=0.0)
    engine = engine_for(config(LOCAL, MICRO, world=WORLD), model, group=dist.group.WORLD, world=WORLD)
    engine.normalizer = slow_on_rank_1
    reduces, real = [], dist.all_reduce

    def counted(*args, **kwargs):
        reduces.append(1)
        return real(*args, **kwargs)

    dist.all_reduce = counted  # the engine looks it up on the module at each call
    try:
        dist.barrier()  # both ranks start the timed step together: only the sleep sets them apart
        timed = engine.step(images, tokens).timings
        n_timed = len(reduces)
        engine.measure_timings = False
        untimed = engine.step(images, tokens).timings
    finally:
        dist.all_reduce = real
    return {"timed": timed, "untimed": untimed, "reduces": (n_timed, len(reduces) - n_timed)}


def test_rank_wait_lap_takes_the_wait_for_the_slow_rank_out_of_the_loss(tmp_path):
    res = spawn_ranks(_worker, tmp_path, WORLD, LOCAL)
    timed = res["timed"]
    assert list(timed) == ["cache_pass", "rank_wait", "loss", "replay"]
    # rank 0 waited there for rank 1's slept cache pass (2 x SLEEP_S after a common barrier);
    # half of it leaves room for rank 0's own cache pass being slower on a loaded machine
    assert timed["rank_wait"] >= SLEEP_S
    assert timed["loss"] < SLEEP_S
    assert "rank_wait" not in res["untimed"]
    timed_reduces, untimed_reduces = res["reduces"]
    assert timed_reduces == untimed_reduces + 1  # the one extra collective, on timed steps only


def test_one_rank_has_no_rank_wait_lap():
    from engine_testutils import batch

    model = tiny_clip(dropout=0.0, patch_dropout=0.0)
    engine = engine_for(config(LOCAL, MICRO), model)
    images, tokens = batch(LOCAL)
    assert list(engine.step(images, tokens).timings) == ["cache_pass", "loss", "replay"]
