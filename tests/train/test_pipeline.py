"""The step pipeline: steps assembled ahead by a thread give exactly the rows, in exactly the
order, of the synchronous path; the resume position travels with each step; chunks released
by the consumer are refilled for the next step at once (the loader works through the replay
even when the pool holds one step); streamed (read-once) inputs never occupy more than their
pool; LiT with streamed images computes the same gradients as with the images held whole;
errors and shutdown reach the trainer."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from engine_testutils import assert_grads_close, batch, config, engine_for, grads_of, tiny_clip

from infclip.train.lit import apply_locks
from infclip.train.pipeline import PipelineSettings, RowsReleased, StepPipeline, ring_rows

LOADER, LOCAL = 4, 12  # loader batches of 4 rows, steps of 12 rows (3 loader batches)


class _Loader:
    """A loader generator over numbered rows whose position is a plain counter."""

    def __init__(self, n_batches: int = 1000, delay: float = 0.0, fail_at: int = -1):
        self.pos, self.delay, self.fail_at, self.n = 0, delay, fail_at, n_batches
        self.closed = threading.Event()

    def batches(self):
        try:
            while self.pos < self.n:
                if self.pos == self.fail_at:
                    raise ValueError("shard 00007.tar is corrupt")
                time.sleep(self.delay)
                rows = torch.arange(self.pos * LOADER, (self.pos + 1) * LOADER)
                self.pos += 1  # the position moves before the yield, as TrainData's does
                yield rows.view(-1, 1, 1, 1).expand(-1, 3, 2, 2).to(torch.uint8), rows.view(-1, 1).repeat(1, 5)
        finally:
            self.closed.set()

    def state(self) -> dict:
        return {"batch": self.pos}


def _pipeline(loader: _Loader, **kw) -> StepPipeline:
    return StepPipeline(loader.batches(), loader.state, PipelineSettings(local=LOCAL, pin=False, **kw))


def _take(pipe: StepPipeline, steps: int) -> tuple[list, list]:
    rows, states = [], []
    for _ in range(steps):
        feed = pipe.next()
        rows.append(feed.full("tokens")[:, 0].clone())
        states.append(feed.data_state)
        pipe.release(feed)
    return rows, states


@pytest.mark.parametrize("kw", [dict(prefetch_steps=0), dict(prefetch_steps=1), dict(prefetch_steps=3),
                                dict(prefetch_steps=0.5, chunk_rows=4), dict(prefetch_steps=0, chunk_rows=4),
                                dict(prefetch_steps=1, threaded=False)],
                         ids=["p0", "p1", "p3", "p0.5-chunks", "p0-chunks", "unthreaded"])
def test_rows_and_resume_position_per_step(kw):
    pipe = _pipeline(_Loader(), **kw)
    try:
        rows, states = _take(pipe, 5)
    finally:
        pipe.close()
    for t in range(5):
        assert torch.equal(rows[t], torch.arange(t * LOCAL, (t + 1) * LOCAL)), f"step {t} rows"
        # the position after the step's own last loader batch, not after a prefetched one
        assert states[t] == {"batch": (t + 1) * LOCAL // LOADER}, f"step {t} resume position"


def test_prefetch_fills_the_next_step_while_one_trains():
    loader = _Loader()
    pipe = _pipeline(loader, prefetch_steps=1)
    try:
        feed = pipe.next()
        feed.full("tokens")
        deadline = time.monotonic() + 10
        while loader.pos < 2 * LOCAL // LOADER and time.monotonic() < deadline:
            time.sleep(0.01)
        # step 0 is still held (not released), yet step 1 has been read from the loader
        assert loader.pos == 2 * LOCAL // LOADER
        time.sleep(0.2)
        assert loader.pos == 2 * LOCAL // LOADER, "the filler must not run further ahead than prefetch_steps"
    finally:
        pipe.close()


def test_released_chunks_are_refilled_for_the_next_step_during_the_replay():
    """Pool of exactly one step in chunks of one loader batch: as the consumer releases the
    step's chunks (its replay passing them), the filler starts the next step at once."""
    loader = _Loader()
    pipe = _pipeline(loader, prefetch_steps=0, chunk_rows=LOADER)
    try:
        feed = pipe.next()
        feed.wait_complete()
        assert loader.pos == LOCAL // LOADER  # the pool is full: nothing of step 1 yet
        feed.release("images", LOADER)
        feed.release("tokens", LOADER)  # the first chunk's last read is done
        deadline = time.monotonic() + 10
        while loader.pos < LOCAL // LOADER + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert loader.pos == LOCAL // LOADER + 1, "exactly one freed chunk, exactly one loader batch refilled"
        assert torch.equal(feed.rows("tokens", LOADER, 2 * LOADER)[:, 0], torch.arange(LOADER, 2 * LOADER))
        pipe.release(feed)
        nxt = pipe.next()
        assert torch.equal(nxt.full("tokens")[:, 0], torch.arange(LOCAL, 2 * LOCAL))
    finally:
        pipe.close()


def test_rows_can_be_read_before_the_step_is_complete():
    """prefetch 0: the consumer reads the first rows while later loader batches still arrive."""
    pipe = _pipeline(_Loader(delay=0.3), prefetch_steps=0)
    try:
        feed = pipe.next()
        t0 = time.monotonic()
        first = feed.rows("tokens", 0, LOADER)
        got_first = time.monotonic() - t0
        assert torch.equal(first[:, 0], torch.arange(LOADER))
        assert feed.filled < LOCAL and got_first < 0.8
        feed.full("tokens")
        assert feed.wait_s > 0.3
    finally:
        pipe.close()


def test_a_read_ahead_thread_waiting_for_rows_is_not_counted_as_data_wait():
    """data.decode=device reads the next micro-batch in a thread while the GPU computes."""
    pipe = _pipeline(_Loader(delay=0.3), prefetch_steps=0)
    try:
        feed = pipe.next()
        before, t0 = feed.wait_s, time.monotonic()
        last = feed.rows("tokens", LOCAL - LOADER, LOCAL, count_wait=False)
        assert time.monotonic() - t0 > 0.3  # it did block on the loader
        assert torch.equal(last[:, 0], torch.arange(LOCAL - LOADER, LOCAL))
        assert feed.wait_s == before
    finally:
        pipe.close()


def test_loader_error_reaches_the_trainer():
    pipe = _pipeline(_Loader(fail_at=4), prefetch_steps=1)
    try:
        feed = pipe.next()
        feed.full("tokens")
        pipe.release(feed)
        with pytest.raises(ValueError, match="00007.tar is corrupt"):
            pipe.next().full("tokens")
    finally:
        pipe.close()


def test_close_stops_the_filler_and_closes_the_loader():
    loader = _Loader()
    pipe = _pipeline(loader, prefetch_steps=2)
    pipe.next()
    pipe.close()
    assert loader.closed.wait(5), "the loader generator was not closed (its workers would outlive the run)"
    assert not pipe._thread.is_alive()


def test_streamed_field_lives_in_a_ring():
    loader = _Loader()
    pipe = _pipeline(loader, prefetch_steps=1, streamed=("images",), ring_rows=8, chunk_rows=4)
    try:
        for t in range(3):
            feed = pipe.next()
            assert feed.streams("images") and not feed.streams("tokens")
            for k in range(0, LOCAL, LOADER):  # read once, in order, releasing as a stager does
                img = feed.rows("images", k, k + LOADER)
                assert torch.equal(img[:, 0, 0, 0].long(), torch.arange(t * LOCAL + k, t * LOCAL + k + LOADER))
                feed.release("images", k + LOADER)
            assert pipe.pools["images"].buf.shape[:2] == (2, 4)  # a pool of 8 rows, whatever the step
            assert pipe.pools["tokens"].buf.shape[:2] == (2 * LOCAL // 4, 4)  # (1 + prefetch) steps
            with pytest.raises(RuntimeError, match="released"):
                feed.rows("images", 0, LOADER)
            pipe.release(feed)
    finally:
        pipe.close()


def test_ring_rows_holds_whole_micro_and_loader_batches():
    assert ring_rows(local=4096, micro=512, loader_batch=256, want_rows=1000) == 1024
    assert ring_rows(local=4096, micro=384, loader_batch=256, want_rows=100) == 1536  # 2 x lcm
    assert ring_rows(local=1024, micro=512, loader_batch=256, want_rows=1 << 20) == 1024


@pytest.mark.parametrize("prefetch", [0, 1])
def test_lit_streamed_images_same_gradients_and_no_whole_step_of_images(prefetch):
    """Locked image tower, offload: images stream through a 2-micro-batch ring; the gradients
    are identical to the step given the whole batch as tensors."""
    local, micro = 8, 2
    model = tiny_clip(dropout=0.0, patch_dropout=0.0)
    cfg = config(local, micro, offload=True, lock_image=True)
    apply_locks(model, cfg.model)
    ref = copy.deepcopy(model)
    images, tokens = batch(local)

    engine_for(cfg, ref).step(images, tokens)
    engine = engine_for(cfg, model)
    assert engine.streamable_inputs() == ("images",)
    rows = iter([(images[k:k + micro], tokens[k:k + micro]) for k in range(0, local, micro)])
    settings = PipelineSettings(local=local, pin=False, prefetch_steps=prefetch, streamed=("images",),
                                ring_rows=ring_rows(local, micro, micro, 1), chunk_rows=micro)
    pipe = StepPipeline(rows, dict, settings)
    try:
        feed = pipe.next()
        engine.step_feed(feed)
        assert pipe.pools["images"].buf.shape[:2] == (2, micro)  # never a whole step of images
        assert feed.released == {"images": local, "tokens": local}  # the engine freed every chunk after its last read
    finally:
        pipe.close()
    assert_grads_close(grads_of(model), grads_of(ref), atol=0, rtol=0)


def test_host_budget_shrinks_prefetch_but_never_below_one_step(capsys):
    row = 3 * 2 * 2 + 5 * 8  # bytes of one loader row (uint8 3x2x2 image, 5 int64 tokens)
    pipe = _pipeline(_Loader(), prefetch_steps=3, chunk_rows=4, budget_bytes=row * (LOCAL + 4))
    try:
        _take(pipe, 2)
        assert pipe.pools["images"].n == pipe.pools["tokens"].n == (LOCAL + 4) // 4
    finally:
        pipe.close()
    assert "below one step" not in capsys.readouterr().out
    pipe = _pipeline(_Loader(), prefetch_steps=3, chunk_rows=4, budget_bytes=1)
    try:
        rows, _ = _take(pipe, 3)  # one step of chunks still works (the replay frees them)
        assert torch.equal(rows[2], torch.arange(2 * LOCAL, 3 * LOCAL))
        assert pipe.pools["images"].n == LOCAL // 4
    finally:
        pipe.close()
    # raised to one step, and said so (it used to be raised silently)
    assert "memory.host_buffer_gb=9.31e-10 is below one step's host buffers" in capsys.readouterr().out


@pytest.mark.parametrize("steps_of", [1, 4])
def test_lit_host_bytes_per_sample_are_the_tokens_only(steps_of):
    """Streamed images: host bytes = (1 + p) x local x 8·L for tokens + a fixed image pool;
    growing the batch 4x grows only the token part."""
    local = LOCAL * steps_of
    loader = _Loader()
    settings = PipelineSettings(local=local, pin=False, prefetch_steps=1, streamed=("images",), ring_rows=8,
                                chunk_rows=4)
    pipe = StepPipeline(loader.batches(), loader.state, settings)
    try:
        feed = pipe.next()
        for k in range(0, local, LOADER):
            feed.rows("images", k, k + LOADER)
            feed.release("images", k + LOADER)
        feed.wait_complete()
        image_bytes, token_bytes = 3 * 2 * 2, 5 * 8
        assert pipe.host_bytes() == 8 * image_bytes + 2 * local * token_bytes
    finally:
        pipe.close()


def _packed_batches(sizes: list[int]):
    """Loader batches of packed 'JPEGs' whose bytes name their sample: sample i is ``sizes[i %
    len(sizes)]`` bytes of value i % 251 (the header's crop fields carry i)."""
    from infclip.data.jpeg import HEADER_INTS, PackedJpegs

    i = 0
    while True:
        index, data = [], []
        for _ in range(LOADER):
            n = sizes[i % len(sizes)]
            offset = sum(len(d) for d in data)
            index.append([n, i, 0, 1, 1, 1, 1, 0, offset])
            data.append(torch.full((n,), i % 251, dtype=torch.uint8))
            i += 1
        assert len(index[0]) == HEADER_INTS + 1
        yield PackedJpegs(torch.tensor(index), torch.cat(data)), torch.arange(i - LOADER, i).view(-1, 1)


@pytest.mark.parametrize("threaded", [True, False])
def test_packed_jpegs_are_kept_at_their_own_size_and_read_back_exactly(threaded):
    """data.decode=device: the host keeps each file's bytes (not fixed rows); arenas grow when
    later batches hold larger files; every read returns exactly the bytes put in."""
    sizes = [100, 300, 50, 700]  # the first loader batch's mean is 287.5 bytes
    pipe = StepPipeline(_packed_batches(sizes), lambda: {}, PipelineSettings(
        local=LOCAL, pin=False, chunk_rows=LOADER, prefetch_steps=1.0, threaded=threaded))
    try:
        for step in range(3):
            feed = pipe.next()
            for a in range(0, LOCAL, LOADER):
                got = feed.rows("images", a, a + LOADER)
                for k, payload in enumerate(got.payloads()):
                    i = int(got.index[k, 1])
                    assert i == step * LOCAL + a + k
                    assert len(payload) == sizes[i % len(sizes)] and (payload == i % 251).all()
            pipe.release(feed)
        pool = pipe.pools["images"]
        per_sample = pool.nbytes() / (pool.n * pool.rows)
        assert per_sample <= 1.15 * 287.5 + 72 + 1, per_sample  # ~ the files' own size, not a fixed row
    finally:
        pipe.close()


def test_a_batch_of_larger_files_grows_its_arena_and_every_row_reads_back():
    sizes = [10] * LOADER + [5000] * LOADER  # the second batch is 500x the first's files
    pipe = StepPipeline(_packed_batches(sizes), lambda: {}, PipelineSettings(
        local=LOCAL, pin=False, chunk_rows=LOCAL, prefetch_steps=0.0, threaded=False))
    try:
        feed = pipe.next()
        first = feed.rows("images", 0, LOADER)
        whole = feed.rows("images", 0, LOCAL)
        assert pipe.pools["images"].grown >= 1
        assert [len(p) for p in first.payloads()] == [10] * LOADER and all((p == k).all() for k, p in enumerate(first.payloads()))
        assert [len(p) for p in whole.payloads()] == [10] * 4 + [5000] * 4 + [10] * 4
        pipe.release(feed)
    finally:
        pipe.close()


def test_packed_rows_carry_their_step_and_released_rows_are_refused():
    """A refilled chunk holds later rows at the same address: each read is tagged with its
    step and rows (what the device decoder keys kept pixels by), and rows read after their
    release raise RowsReleased (the decode-ahead's signal that the step read them itself)."""
    pipe = StepPipeline(_packed_batches([64]), lambda: {}, PipelineSettings(
        local=LOCAL, pin=False, chunk_rows=LOADER, prefetch_steps=0.0, threaded=False))
    try:
        feed = pipe.next()
        first = feed.rows("images", 0, LOADER)
        assert first.tag == (feed.step, "images", 0, LOADER)
        feed.release("images", LOADER)
        with pytest.raises(RowsReleased, match="already released"):
            feed.rows("images", 0, LOADER)
        pipe.release(feed)
        later = pipe.next()
        again = later.rows("images", 0, LOADER)
        assert again.tag == (later.step, "images", 0, LOADER) != first.tag
        pipe.release(later)
    finally:
        pipe.close()
