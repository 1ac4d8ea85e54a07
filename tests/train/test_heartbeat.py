"""A long step's heartbeat (``logging.heartbeat_s``): when its line is due, what it says, the
engine's micro-batch callback it reads, and the trainer printing it while a step runs long."""

from __future__ import annotations

import copy

import pytest

from infclip.train.heartbeat import StepHeartbeat, clock_text
from engine_testutils import batch, config, engine_for, grads_of, tiny_clip


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_nothing_is_said_for_a_step_shorter_than_the_interval_then_one_line_per_interval():
    clock = Clock()
    hb = StepHeartbeat(60, say=print, clock=clock)
    assert hb.beat() is None  # no step running
    hb.begin(4, 10)
    clock.t += 59.9
    assert hb.beat() is None
    clock.t += 0.2
    assert hb.beat() == "step 4/10 running 1m00s: waiting for its first micro-batch"
    assert hb.beat() is None  # said once for this interval
    clock.t += 30
    assert hb.beat() is None
    hb.end()
    clock.t += 600
    assert hb.beat() is None  # the step ended: silent again


def test_the_line_names_the_phase_and_the_time_left_at_the_rate_so_far():
    clock = Clock()
    hb = StepHeartbeat(60, say=print, clock=clock)
    hb.begin(1, 3)
    hb.micro("cache pass", 1024, 4096)  # a quarter of the cache pass in 60 s: 240 s for it ...
    clock.t += 60
    # ... and 3 x 240 s for the replay (the prior: both towers trained): 960 s in all, 900 s left
    assert hb.beat() == "step 1/3 running 1m00s: cache pass 1,024 of 4,096 micro-batches; about 15m00s left"
    clock.t += 180
    hb.micro("cache pass", 4096, 4096)  # the cache pass ends at 240 s
    clock.t += 300
    hb.micro("replay", 2048, 4096)  # half the replay in 300 s: its own rate, 300 s left
    assert hb.beat() == "step 1/3 running 9m00s: replay 2,048 of 4,096 micro-batches; about 5m00s left"


def test_the_replay_s_rate_leaves_out_the_loss_and_its_first_micro_batch():
    clock = Clock()
    hb = StepHeartbeat(60, say=print, clock=clock)
    hb.begin(1, 1)
    clock.t += 100
    hb.micro("cache pass", 2048, 2048)  # the cache pass ends at 100 s: 1/20.48 s a micro-batch
    clock.t += 12 + 40  # the loss (12 s), then the first replayed micro-batch compiles (40 s)
    hb.micro("replay", 1, 2048)
    # one replayed micro-batch: the prior (3 cache-pass micro-batches each) stands in for the rate
    assert hb.beat() == "step 1/1 running 2m32s: replay 1 of 2,048 micro-batches; about 4m59s left"
    clock.t += 60
    hb.micro("replay", 601, 2048)  # 0.1 s a micro-batch since the first: 144.7 s left (not 112 s / 601 each)
    assert hb.beat() == "step 1/1 running 3m32s: replay 601 of 2,048 micro-batches; about 2m24s left"


def test_between_the_passes_the_line_names_the_loss_and_how_long_since_the_cache_pass():
    clock = Clock()
    hb = StepHeartbeat(60, say=print, clock=clock)
    hb.begin(1, 1)
    clock.t += 201
    hb.micro("cache pass", 1024, 1024)  # the cache pass ends at 201 s
    clock.t += 39  # the loss (on several ranks: also the wait for the slowest rank's cache pass)
    # the replay predicted at the prior weight: 3 x 201 s
    assert hb.beat() == ("step 1/1 running 4m00s: loss, 39s since the cache pass's 1,024 micro-batches; "
                         "then the replay, about 10m03s")
    hb.micro("replay", 1, 1024)
    clock.t += 60
    assert hb.beat().startswith("step 1/1 running 5m00s: replay 1 of 1,024 micro-batches")
    lit = StepHeartbeat(60, say=print, clock=clock, replay_weight=None)  # no weight yet: no prediction
    lit.begin(1, 1)
    lit.micro("cache pass", 8, 8)
    clock.t += 61
    assert lit.beat() == "step 1/1 running 1m01s: loss, 1m01s since the cache pass's 8 micro-batches"


def test_a_finished_step_measures_the_replay_for_the_next_step_s_cache_pass():
    clock = Clock()
    hb = StepHeartbeat(60, say=print, clock=clock)
    hb.begin(1, 3)
    clock.t += 100
    hb.micro("cache pass", 10, 10)  # 10 s a cache-pass micro-batch
    clock.t += 50
    hb.micro("replay", 10, 10)  # 5 s a replayed one: weight 0.5, not the prior 3
    hb.end()
    hb.begin(2, 3)
    clock.t += 50
    hb.micro("cache pass", 5, 10)
    clock.t += 10  # 12 s a micro-batch so far: 5 x 12 s of cache pass and 0.5 x 10 x 12 s of replay left
    assert hb.beat() == "step 2/3 running 1m00s: cache pass 5 of 10 micro-batches; about 2m00s left"


def test_a_locked_tower_s_first_cache_pass_gives_no_time_left_until_a_step_measured_the_replay():
    clock = Clock()
    hb = StepHeartbeat(60, say=print, clock=clock, replay_weight=None)  # LiT: the image tower runs once
    hb.begin(1, 2)
    clock.t += 60
    hb.micro("cache pass", 465, 1024)
    assert hb.beat() == "step 1/2 running 1m00s: cache pass 465 of 1,024 micro-batches"
    clock.t += 72
    hb.micro("cache pass", 1024, 1024)
    clock.t += 40
    hb.micro("replay", 512, 1024)
    clock.t += 8
    assert hb.beat() == "step 1/2 running 3m00s: replay 512 of 1,024 micro-batches; about 48s left"
    hb.micro("replay", 1024, 1024)
    hb.end()
    hb.begin(2, 2)
    clock.t += 60
    hb.micro("cache pass", 512, 1024)
    # step 1: 132 s of cache pass, 48 s of replay (weight 48 / 132); now 60 s of cache pass left
    # and (48 / 132) x 120 s of replay
    assert hb.beat().endswith("cache pass 512 of 1,024 micro-batches; about 1m43s left")


def test_clock_text():
    assert [clock_text(s) for s in (0, 42.9, 60, 125, 3599, 3600, 3780)] == [
        "0s", "42s", "1m00s", "2m05s", "59m59s", "1h00m", "1h03m"]


def test_a_heartbeat_needs_a_positive_interval():
    with pytest.raises(ValueError, match="heartbeat_s"):
        StepHeartbeat(0, say=print)


def test_the_engine_reports_each_micro_batch_of_both_passes_and_computes_the_same_gradients():
    model = tiny_clip(dropout=0.0, patch_dropout=0.0).train()
    ref = copy.deepcopy(model)
    images, tokens = batch(8)
    seen = []
    engine = engine_for(config(8, 2), model)
    engine.on_micro = lambda phase, done, total: seen.append((phase, done, total))
    engine.step(images, tokens)
    assert seen == [("cache pass", k, 4) for k in (1, 2, 3, 4)] + [("replay", k, 4) for k in (1, 2, 3, 4)]
    engine_for(config(8, 2), ref).step(images, tokens)
    for name, g in grads_of(ref).items():
        assert (grads_of(model)[name] == g).all(), name


def test_the_thread_says_the_due_line_while_a_step_runs_and_stops_on_close():
    import threading

    said, got = [], threading.Event()
    hb = StepHeartbeat(0.05, say=lambda line: (said.append(line), got.set()))
    hb.start()
    try:
        hb.begin(2, 5)
        hb.micro("replay", 1, 8)
        assert got.wait(timeout=30), "no heartbeat line while the step ran"
    finally:
        hb.end()
        hb.close()
    assert said[0].startswith("step 2/5 running 0s: replay 1 of 8 micro-batches; about ")
    assert not hb._thread.is_alive()


def test_the_trainer_wires_the_heartbeat_on_the_main_rank_only_and_off_at_zero():
    from types import SimpleNamespace

    from infclip.config import TrainConfig
    from infclip.train.loop import _heartbeat

    cfg = TrainConfig()
    assert cfg.logging.heartbeat_s == 60.0  # on by default
    engine = SimpleNamespace(on_micro=None)
    parts = SimpleNamespace(engine=engine)
    assert _heartbeat(cfg, SimpleNamespace(is_main=False), parts) is None and engine.on_micro is None
    cfg.logging.heartbeat_s = 0
    assert _heartbeat(cfg, SimpleNamespace(is_main=True), parts) is None and engine.on_micro is None
    cfg.logging.heartbeat_s = 30
    hb = _heartbeat(cfg, SimpleNamespace(is_main=True), parts)
    try:
        assert engine.on_micro == hb.micro and hb.every_s == 30
    finally:
        hb.close()


def test_a_negative_heartbeat_is_refused_before_anything_runs():
    from infclip.config import ConfigError, TrainConfig, _validate_numbers

    cfg = TrainConfig()
    cfg.logging.heartbeat_s = -5
    with pytest.raises(ConfigError, match=r"logging.heartbeat_s must be >= 0, got -5"):
        _validate_numbers(cfg)
