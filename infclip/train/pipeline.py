"""The step pipeline: each step's per-rank batch is assembled from the loader while the GPU
works, so the step never starts by waiting for a whole step of data.

A background *filler* thread pulls loader batches (``TrainData.batches()``) and copies them
into host buffers, one :class:`StepFeed` per step. The trainer takes the next feed with
:meth:`StepPipeline.next` as soon as its filling has *started*, and the engine reads rows as
they arrive (:meth:`StepFeed.rows` blocks only on rows not yet filled), so:

* ``prefetch_steps = k >= 1``: while step t runs, up to k later steps are filled (host
  memory: 1 + k step buffers). The GPU waits only when the loader is slower than the GPU.
* ``prefetch_steps = 0``: one step buffer; step t+1 is filled while its own cache pass runs
  (the cache pass consumes micro-batches as the loader delivers them), nothing ahead.

Inputs the engine reads only once per step (the images of a locked LiT image tower: pass 2
re-runs only the text tower) can be *streamed*: they pass through a ring of ``ring_rows``
rows that the engine frees micro-batch by micro-batch, and the step never holds them whole.

Host bytes per sample (uint8 images of H×W, int64 tokens of length L):
``(1 + prefetch_steps) * (3·H·W + 8·L)``, or for a streamed image field
``(1 + prefetch_steps) * 8·L`` plus ``(1 + prefetch_steps) * ring_rows * 3·H·W`` in all.

Resume: a feed carries the data position *after its last loader batch*
(``TrainData.state_dict()`` taken by the filler between two loader batches); the trainer
checkpoints the position of the last step it trained on, never that of a prefetched one.

Threading: only the filler touches the loader generator (a generator cannot be closed from
another thread while it runs); :meth:`StepPipeline.close` asks the filler to stop, then
kills loader workers that outlive their loader (``stop_workers``), which also unblocks a
filler waiting on a busy worker.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor

from infclip.data.pipeline import stop_workers

FIELDS = ("images", "tokens")  # loader batch = (images uint8 (B,3,H,W), tokens int64 (B,L))


class PipelineStopped(RuntimeError):
    """The pipeline was closed while a step still waited for its rows."""


@dataclass(frozen=True)
class PipelineSettings:
    """What the pipeline assembles (derived once from the config by the trainer)."""

    local: int  # rows per step on this rank (global batch / world size)
    pin: bool  # page-locked host buffers (CUDA with offload: asynchronous H2D copies)
    prefetch_steps: int = 1  # whole steps filled ahead of the one training (0: none)
    streamed: tuple[str, ...] = ()  # fields read once per step (see module docs)
    ring_rows: int = 0  # rows of a streamed field's ring (multiple of the micro-batch; <= local)
    threaded: bool = True  # False: fill in the caller's thread on next() (no overlap at all)


class StepFeed:
    """One step's per-rank inputs, filled in loader order by the filler thread.

    Invariants: rows ``[0, filled)`` of every field are valid (streamed fields: those not
    yet released); ``data_state`` is set before the last row is published.
    """

    def __init__(self, settings: PipelineSettings, index: int):
        self.s, self.index = settings, index
        self.buffers: dict[str, Tensor] = {}
        self._cond = threading.Condition()
        self._events: list[tuple[int, Any]] = []  # streamed: (rows released up to, copy-done event)
        self.free_event: Any = None  # CUDA event: the device has finished reading this feed
        self.reset(step=-1)

    def reset(self, step: int) -> None:
        self.step, self.filled, self.released = step, 0, 0
        self.data_state: Optional[dict] = None
        self.error: Optional[BaseException] = None
        self.wait_s = 0.0  # time the consumer blocked on rows not yet filled
        self.fill_s = 0.0  # time the filler spent pulling loader batches and copying them
        self._events.clear()

    # -- consumer side (the engine) -----------------------------------------------------
    def rows(self, name: str, start: int, stop: int) -> Tensor:
        """Host rows ``[start, stop)`` of field ``name``, waiting until they are filled."""
        self._wait_filled(stop)
        buf = self.buffers[name]
        if name in self.s.streamed:
            if start < self.released:
                raise RuntimeError(f"{name} rows {start}:{stop} were already released (streamed field)")
            lo = start % self.s.ring_rows
            if lo + (stop - start) > self.s.ring_rows:
                raise RuntimeError(f"{name} rows {start}:{stop} wrap the ring of {self.s.ring_rows} rows")
            return buf[lo:lo + (stop - start)]
        return buf[start:stop]

    def release(self, name: str, stop: int, event: Any = None) -> None:
        """Rows before ``stop`` of a streamed field may be overwritten once ``event`` (a CUDA
        event recorded after their copy to the device, or None) has completed."""
        if name not in self.s.streamed:
            return
        with self._cond:
            self._events.append((stop, event))
            self.released = max(self.released, stop)
            self._cond.notify_all()

    def full(self, name: str) -> Tensor:
        """The whole step of a kept field (waits for every row)."""
        return self.rows(name, 0, self.s.local)

    def wait_complete(self) -> None:
        """Wait until every row arrived (then ``data_state`` is set)."""
        self._wait_filled(self.s.local)

    def streams(self, name: str) -> bool:
        return name in self.s.streamed

    def _wait_filled(self, stop: int) -> None:
        if self.filled >= stop:  # a racy read is fine: filled only grows within a step
            return
        t0 = time.perf_counter()
        with self._cond:
            while self.filled < stop and self.error is None:
                self._cond.wait(timeout=1.0)
        self.wait_s += time.perf_counter() - t0
        if self.filled < stop:
            raise self.error if not isinstance(self.error, PipelineStopped) else PipelineStopped(
                "the step pipeline was closed before the step's data arrived")

    # -- filler side ------------------------------------------------------------------
    def put(self, images: Tensor, tokens: Tensor, last_state: Callable[[], dict], stopping) -> None:
        """Copy one loader batch in at row ``filled``; publish it (and, for the step's last
        batch, the data position ``last_state()``) to the consumer."""
        k, at = images.shape[0], self.filled
        if not self.buffers:
            self._allocate(images, tokens)
        for name, src in zip(FIELDS, (images, tokens)):
            if name in self.s.streamed:
                self._wait_ring_space(at + k, stopping)
                lo = at % self.s.ring_rows
                self.buffers[name][lo:lo + k].copy_(src)
            else:
                self.buffers[name][at:at + k].copy_(src)
        if at + k >= self.s.local:
            self.data_state = last_state()
        with self._cond:
            self.filled = at + k
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self.error = error
            self._cond.notify_all()

    def _wait_ring_space(self, stop: int, stopping) -> None:
        """Block until rows ``[stop - ring_rows, ...)`` are released and their copies done."""
        need = stop - self.s.ring_rows
        with self._cond:
            while self.released < need:
                if stopping():
                    raise PipelineStopped("closing")
                self._cond.wait(timeout=0.5)
            done = [ev for upto, ev in self._events if upto <= max(need, 0)]
            self._events[:] = [(u, ev) for u, ev in self._events if u > max(need, 0)]
        for ev in done:
            if ev is not None:
                ev.synchronize()

    def _allocate(self, images: Tensor, tokens: Tensor) -> None:
        for name, t in zip(FIELDS, (images, tokens)):
            rows = self.s.ring_rows if name in self.s.streamed else self.s.local
            self.buffers[name] = torch.empty((rows, *t.shape[1:]), dtype=t.dtype, pin_memory=self.s.pin)

    def host_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


class TensorFeed:
    """A complete step given as tensors (tests, benchmarks, SimCLR views): the same
    interface as :class:`StepFeed`, nothing to wait for, nothing streamed."""

    def __init__(self, tensors: dict[str, Tensor]):
        self.buffers = dict(tensors)
        self.wait_s = 0.0

    def rows(self, name: str, start: int, stop: int) -> Tensor:
        return self.buffers[name][start:stop]

    def release(self, name: str, stop: int, event: Any = None) -> None:
        pass

    def full(self, name: str) -> Tensor:
        return self.buffers[name]

    def wait_complete(self) -> None:
        pass

    def streams(self, name: str) -> bool:
        return False


class StepPipeline:
    """Feeds for consecutive steps, filled ahead by a background thread (see module docs).

    ``batches``: the loader generator (``TrainData.batches()``), consumed only by the filler;
    ``data_state``: returns the loader position (``TrainData.state_dict``), called by the
    filler between two loader batches.
    """

    def __init__(self, batches: Iterator, data_state: Callable[[], dict], settings: PipelineSettings):
        self.batches, self.data_state, self.s = batches, data_state, settings
        _check(settings)
        n_feeds = 1 + max(settings.prefetch_steps, 0)
        self._free: queue.Queue = queue.Queue()
        for i in range(n_feeds):
            self._free.put(StepFeed(settings, i))
        self._ready: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._next_step = 0
        self._loader_rows, self._loader_s = 0, 0.0  # for the loader's own delivery rate
        self._pending: Optional[StepFeed] = None  # unthreaded mode: filled on next()
        self._thread: Optional[threading.Thread] = None
        if settings.threaded:
            self._thread = threading.Thread(target=self._fill_forever, name="infclip-step-pipeline", daemon=True)
            self._thread.start()

    # -- consumer ----------------------------------------------------------------------
    def next(self) -> StepFeed:
        """The next step's feed (its rows may still be arriving); ``wait_s`` starts with the
        time spent waiting here for the filler to begin it."""
        t0 = time.perf_counter()
        if self._thread is None:
            feed = self._free.get_nowait() if self._pending is None else self._pending
            self._fill(feed)
        else:
            while True:
                try:
                    feed = self._ready.get(timeout=1.0)
                    break
                except queue.Empty:
                    if not self._thread.is_alive():
                        raise PipelineStopped("the step pipeline's filler thread is not running")
        if isinstance(feed, BaseException):
            raise feed
        feed.wait_s += time.perf_counter() - t0
        return feed

    def release(self, feed: StepFeed, device: Optional[torch.device] = None) -> None:
        """The step is done with ``feed``: its buffers may be refilled once the device has
        finished reading them. An event recorded on the current stream (which waited for
        every host-to-device copy of the step) orders that; the filler waits on it."""
        feed.free_event = None
        if device is not None and device.type == "cuda":
            feed.free_event = torch.cuda.Event()
            feed.free_event.record(torch.cuda.current_stream(device))
        if self._thread is None:
            self._pending = feed
        else:
            self._free.put(feed)

    def loader_rate(self) -> float:
        """Samples per second the loader delivered while the filler was pulling (not waiting
        for a free buffer): the loader's own speed, whatever the GPU does."""
        return self._loader_rows / self._loader_s if self._loader_s > 0 else math.nan

    def close(self) -> None:
        """Stop the filler, close the loader generator, kill loader workers that outlive it."""
        self._stop.set()
        self._free.put(None)  # wakes a filler waiting for a free buffer
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        elif hasattr(self.batches, "close"):
            self.batches.close()
        killed = stop_workers()
        if killed:
            print(f"stopped {killed} loader worker(s) that did not exit with their loader", flush=True)
        if self._thread is not None:
            self._thread.join(timeout=10.0)

    # -- filler ------------------------------------------------------------------------
    def _fill_forever(self) -> None:
        try:
            while not self._stop.is_set():
                feed = self._free.get()
                if feed is None or self._stop.is_set():
                    return
                self._ready.put(feed)
                self._fill(feed)
        except PipelineStopped:
            return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            self._ready.put(e)
        finally:
            close = getattr(self.batches, "close", None)
            if close is not None:
                try:
                    close()  # shuts the loader's workers down (TrainData.batches' finally)
                except Exception as e:  # noqa: BLE001 - closing must not mask the real error
                    print(f"step pipeline: closing the loader: {e}", flush=True)

    def _fill(self, feed: StepFeed) -> None:
        if feed.free_event is not None:  # the device may still read the previous step's rows
            feed.free_event.synchronize()
        feed.reset(self._next_step)
        self._next_step += 1
        try:
            while feed.filled < self.s.local:
                t0 = time.perf_counter()
                images, tokens = next(self.batches)
                t1 = time.perf_counter()
                _check_batch(images, tokens, feed.filled, self.s.local)
                feed.put(images, tokens, self.data_state, self._stop.is_set)
                self._loader_s += t1 - t0 + _copy_seconds(feed, t1)
                self._loader_rows += images.shape[0]
                feed.fill_s += time.perf_counter() - t0
        except BaseException as e:
            feed.fail(e)
            raise


def _copy_seconds(feed: StepFeed, t1: float) -> float:
    """Copy time counted in the loader's rate; ring waits (the GPU being behind) are not."""
    return 0.0 if feed.s.streamed else time.perf_counter() - t1


def _check(s: PipelineSettings) -> None:
    if s.local <= 0:
        raise ValueError(f"the per-rank step batch must be positive, got {s.local}")
    if s.prefetch_steps < 0:
        raise ValueError(f"memory.prefetch_steps must be >= 0, got {s.prefetch_steps}")
    if s.streamed and not 0 < s.ring_rows <= s.local:
        raise ValueError(f"a streamed field needs 0 < ring_rows <= {s.local}, got {s.ring_rows}")
    if s.streamed and not s.threaded and s.ring_rows < s.local:
        raise ValueError("a streamed ring smaller than the step needs the threaded pipeline")


def _check_batch(images: Tensor, tokens: Tensor, filled: int, local: int) -> None:
    k = images.shape[0]
    if tokens.shape[0] != k:
        raise ValueError(f"loader batch has {k} images but {tokens.shape[0]} token rows")
    if filled + k > local:
        raise ValueError(
            f"loader batches of {k} do not divide the per-rank step batch {local}; set data.loader_batch "
            "to a divisor of batch.global_size / world_size")


def ring_rows(local: int, micro: int, loader_batch: int, want_rows: int) -> int:
    """Rows of a streamed ring: a multiple of lcm(micro, loader_batch) (so every micro-batch
    and every loader batch is contiguous in it), at least two micro-batches' worth (the
    stager copies micro-batch k+1 while k is read), at most ``local``; ``want_rows``
    (memory.stream_rows) sets the size in between."""
    unit = math.lcm(micro, loader_batch)
    rows = max(2 * unit, -(-want_rows // unit) * unit)
    return min(rows, local)


def build_step_pipeline(cfg: Any, data: Any, engine: Any, device: torch.device, world_size: int) -> StepPipeline:
    """The pipeline for a run: ``cfg`` a TrainConfig, ``data`` its TrainData, ``engine`` its
    StepEngine (which says which inputs only the cache pass reads)."""
    local = cfg.batch.global_size // world_size
    mem = cfg.memory
    # data.workers=0 decodes and augments in the filler itself, seeding torch's *global* RNG
    # per batch (fork_rng), which the trainer's thread shares (dropout, patch dropout): only
    # loader worker processes keep that RNG untouched, so only they get the thread.
    threaded = mem.pipeline_thread and data.workers > 0
    streamed: tuple[str, ...] = ()
    rows = 0
    if mem.stream_once_inputs and threaded and cfg.task != "simclr":
        streamed = engine.streamable_inputs()
        rows = ring_rows(local, engine.s.micro, data.spec.loader_batch, mem.stream_rows) if streamed else 0
        if rows >= local:  # the ring would hold the whole step anyway
            streamed, rows = (), 0
    settings = PipelineSettings(
        local=local, pin=bool(mem.offload and device.type == "cuda"), prefetch_steps=mem.prefetch_steps,
        streamed=streamed, ring_rows=rows, threaded=threaded,
    )
    return StepPipeline(data.batches(), data.state_dict, settings)


def duplicate_warning(global_size: int, epoch_samples: int, world_size: int, loader_batch: int,
                      resampled: bool) -> Optional[str]:
    """A warning when one step's batch must (or is likely to) hold the same sample twice:
    in a contrastive batch a duplicate is a false negative. None when there is no such risk.

    * the global batch exceeds the dataset: every step repeats samples;
    * epoch mode, a step straddles an epoch boundary (the epoch is not a whole number of
      steps): the step's tail of epoch e and head of epoch e+1 can share samples;
    * resampled mode: b draws with replacement from N give about b²/(2N) duplicates.
    """
    fix = ("use a smaller batch.global_size, more data, or data.num_samples matching the data; "
           "duplicates in a contrastive batch are false negatives")
    if global_size > epoch_samples:
        return (f"batch.global_size={global_size} is larger than the dataset ({epoch_samples} samples per "
                f"epoch): every step holds repeated samples; {fix}")
    if resampled:
        expected = global_size * global_size / (2.0 * epoch_samples)
        if expected >= max(1.0, 0.01 * global_size):
            return (f"data.resampled=true draws with replacement: a step of {global_size} from {epoch_samples} "
                    f"samples holds about {expected:.0f} duplicate pairs; {fix}")
        return None
    per_step = global_size // (world_size * loader_batch)
    epoch_batches = epoch_samples // (world_size * loader_batch)
    if per_step and epoch_batches % per_step:
        return (f"an epoch ({epoch_batches} loader batches per rank) is not a whole number of steps "
                f"({per_step} loader batches each): the step that crosses an epoch boundary can hold samples "
                f"of both epochs twice; make batch.global_size divide the epoch or set data.num_samples "
                f"to a multiple of {global_size}")
    return None
