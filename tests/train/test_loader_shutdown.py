"""A loader worker that ignores SIGTERM (as the training loader's do, for preemption) and is
busy when training ends must not keep the trainer from exiting: torch's shutdown only joins
briefly and sends SIGTERM, and Python's exit then joins every child forever."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from infclip.data.pipeline import ignore_stop_signals
from infclip.train.pipeline import PipelineSettings, StepPipeline


class _SlowAfterFirst(IterableDataset):
    """Yields one batch, then is busy (sleeping) far longer than the test allows."""

    def __iter__(self):
        yield torch.zeros(2, 3, 4, 4, dtype=torch.uint8), torch.zeros(2, 5, dtype=torch.long)
        time.sleep(600)


_LEAKED = []  # an outside reference to the loader iterator (as a traceback can hold one)


def _batches(loader, leak: bool):
    it = iter(loader)
    if leak:
        _LEAKED.append(it)
    yield from it


@pytest.mark.parametrize("leak", [False, True], ids=["collected", "referenced"])
def test_close_stops_a_busy_worker_that_ignores_sigterm(leak):
    """referenced: the iterator is not collected when the generator closes, so torch never
    shuts its workers down and its SIGCHLD handler still watches them when they are killed."""
    loader = DataLoader(_SlowAfterFirst(), batch_size=None, num_workers=2, worker_init_fn=ignore_stop_signals)
    batcher = StepPipeline(_batches(loader, leak), dict, PipelineSettings(local=2, pin=False, prefetch_steps=1))
    images = batcher.next().full("images")
    assert images.shape == (2, 3, 4, 4)
    workers = [p for p in multiprocessing.active_children() if p.daemon]
    assert workers, "the loader should have started a worker"
    try:
        t0 = time.monotonic()
        batcher.close()
        assert time.monotonic() - t0 < 60
        assert not any(p.is_alive() for p in workers), "a worker survived close(): Python's exit would hang on it"
    finally:  # never leave the test session itself hanging at exit
        for p in workers:
            if p.is_alive():
                p.kill()
        _LEAKED.clear()
