"""When the step engine hands the next step's images to a decoding normalizer's decode-ahead
(``data.decode_ahead_from``): after the loss by default and whenever the replay re-reads the
images (a trained image tower); during the first pass under a locked image tower, once the
step's own images were handed over the step before; retried at each micro-batch while the
pipeline has no next feed; never early after a hand-off that queued nothing."""

from __future__ import annotations

import functools

import torch
from engine_testutils import batch, config, normalize, tiny_clip
from torch import nn

from infclip.loss import clip_loss
from infclip.train.engine import build_engine
from infclip.train.lit import apply_locks
from infclip.train.pipeline import TensorFeed

LOCAL, MICRO = 8, 2
K = LOCAL // MICRO


class _Decoding(nn.Module):
    """A normalizer that reads host rows and has a decode-ahead: it records, per hand-off, how
    many micro-batches of images the step had read by then (K: after the first pass)."""

    reads_host = True

    def __init__(self, queues: bool = True):
        super().__init__()
        self.reads, self.handoffs, self.queues = 0, [], queues

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        self.reads += 1
        return normalize(rows)

    def decode_ahead(self, fetchers) -> bool:
        assert len(fetchers) == K
        self.handoffs.append(self.reads)
        return self.queues


def _engine(lock_image: bool, early: bool, queues: bool = True, feeds=None):
    """An engine on a tiny CLIP with the recording normalizer; ``feeds``: what successive
    ``next_feed()`` calls return (a feed for every call when None)."""
    model = tiny_clip(dropout=0.0, patch_dropout=0.0)
    cfg = config(LOCAL, MICRO, lock_image=lock_image)
    cfg.data.decode_ahead_from = "first_pass" if early else "replay"
    apply_locks(model, cfg.model)
    dec = _Decoding(queues)
    engine = build_engine(cfg, model, device=torch.device("cpu"), normalizer=dec,
                          loss_fn=functools.partial(clip_loss, impl="torch"))
    nxt = _feed(99)
    answers = iter(feeds) if feeds is not None else None
    engine.next_feed = (lambda: nxt) if answers is None else (lambda: next(answers))
    return engine, dec, nxt


def _feed(seed: int) -> TensorFeed:
    images, tokens = batch(LOCAL, seed=seed)
    return TensorFeed({"images": images, "tokens": tokens})


def _steps(engine, dec: _Decoding, n: int) -> list[list[int]]:
    """The hand-offs of each of ``n`` steps (micro-batches read at each)."""
    out = []
    for step in range(n):
        dec.reads, dec.handoffs = 0, []
        engine.step_feed(_feed(step))
        out.append(dec.handoffs)
    return out


def test_a_locked_image_tower_hands_the_next_step_over_before_its_first_micro_batch_from_step_two():
    engine, dec, _ = _engine(lock_image=True, early=True)
    assert _steps(engine, dec, 3) == [[K], [0], [0]]  # step 1 after its first pass; then at once


def test_the_default_and_a_trained_image_tower_hand_over_after_the_loss():
    for lock_image, early in ((True, False), (False, True), (False, False)):
        engine, dec, _ = _engine(lock_image=lock_image, early=early)
        assert _steps(engine, dec, 3) == [[K]] * 3, (lock_image, early)


def test_no_next_feed_yet_is_asked_again_at_each_micro_batch_then_after_the_loss():
    nxt = _feed(99)
    # step 1: after its loss; step 2: None at micro-batches 0 and 1, the feed at 2;
    # step 3: None through its first pass, the feed after its loss; step 4: at once again
    answers = [nxt, None, None, nxt] + [None] * K + [nxt, nxt]
    engine, dec, _ = _engine(lock_image=True, early=True, feeds=answers)
    assert _steps(engine, dec, 4) == [[K], [2], [K], [0]]


def test_a_hand_off_that_queued_nothing_is_not_followed_by_an_early_one():
    engine, dec, _ = _engine(lock_image=True, early=True, queues=False)  # e.g. no keep budget
    assert _steps(engine, dec, 3) == [[K]] * 3
