"""The step pipeline: each step's per-rank batch is assembled from the loader while the GPU
works, so the step never starts by waiting for a whole step of data.

A background *filler* thread pulls loader batches (``TrainData.batches()``) and copies them
into pinned host memory, one :class:`StepFeed` per step. The trainer takes the next feed as
soon as its filling has *started*, and the engine reads rows as they arrive
(:meth:`StepFeed.rows` blocks only on rows not yet filled).

Host memory is a *pool of chunks* per input field (``chunk_rows`` rows each, a multiple of
the micro-batch and of the loader batch, so a micro-batch never straddles two chunks). The
engine releases a chunk after its *last* read in the step (its copy to the device done): a
field the replay re-reads (images and tokens of trained towers) after pass 2, a field only
the cache pass reads (a locked LiT tower's images) after pass 1. The filler refills freed
chunks at once, so the loader keeps working through the replay of step t for step t+1 even
when the pool holds little more than one step:

* ``prefetch_steps = p`` (a float): the pool of a re-read field holds ``(1 + p)`` steps of
  rows; ``p = 0`` still overlaps the loader with the replay (chunks free as the replay
  passes them); ``p >= 1`` also fills ahead through the cache pass;
* a read-once field (``streamed``) gets a pool of ``ring_rows`` rows, independent of the batch.

Host bytes per sample (uint8 images of H×W, int64 tokens of length L):
``(1 + p) * (3·H·W + 8·L)``; packed JPEGs (``data.decode=device``) hold the file's bytes
instead of 3·H·W, or 3·H·W for the share ``data.cpu_decode_share`` the workers decode; with streamed images ``(1 + p) * 8·L`` plus ``ring_rows * 3·H·W``
in all.

Resume: a feed carries the data position *after its last loader batch*
(``TrainData.state_dict()`` taken by the filler between two loader batches); the trainer
checkpoints the position of the last step it trained on, never that of a prefetched one.

Stalls: with a :class:`StallWatch`, the consumer checks about once a second while
it waits for rows how long the filler has been waiting for its current loader batch: past
``warn_s`` one warning names the loader worker and the shard it reads, past ``abort_s``
:class:`LoaderStalled` is raised; a stop signal while waiting raises :class:`StoppedWaiting`
(single rank: the trainer abandons the step, see ``infclip.train.loop``).

Threading: only the filler touches the loader generator (a generator cannot be closed from
another thread while it runs); :meth:`StepPipeline.close` asks the filler to stop, then
kills loader workers that outlive their loader (``stop_workers``), which also unblocks a
filler waiting on a busy worker.
"""

from __future__ import annotations

import math
import os
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


class LoaderStalled(RuntimeError):
    """No loader batch arrived for ``StallWatch.abort_s`` seconds; the message names the worker."""


class LoaderDied(RuntimeError):
    """The connection to a loader worker broke mid-batch (the worker was killed); worded as
    torch's own error for a dead worker ("DataLoader worker ...")."""


class RowsReleased(RuntimeError):
    """Rows asked for after the step's last read of them released their chunk."""


class StoppedWaiting(RuntimeError):
    """A stop signal arrived while the step waited for data (the step is abandoned)."""


@dataclass
class StallWatch:
    """What the consumer does while it waits for the loader (see module docs)."""

    warn_s: float  # seconds without a loader batch before one warning (0: never)
    abort_s: float  # ... before LoaderStalled (0: never)
    describe: Callable[[], str]  # the worker the loader waits on and what it reads
    warn: Callable[[str], None] = print
    stop_requested: Optional[Callable[[], bool]] = None  # True: raise StoppedWaiting (None: never)


@dataclass(frozen=True)
class PipelineSettings:
    """What the pipeline assembles (derived once from the config by the trainer)."""

    local: int  # rows per step on this rank (global batch / world size)
    pin: bool  # page-locked host buffers (CUDA with offload: asynchronous H2D copies)
    prefetch_steps: float = 1.0  # pool of a re-read field: (1 + p) steps of rows
    streamed: tuple[str, ...] = ()  # fields read once per step (see module docs)
    ring_rows: int = 0  # pool rows of a streamed field (>= 2 chunks, <= local)
    threaded: bool = True  # False: fill in the caller's thread on next() (no overlap at all)
    chunk_rows: int = 0  # rows per chunk (0: the whole step); divides local
    budget_bytes: int = 0  # cap on all pools together (0: none); never below one step (+ the streamed pools)

    @property
    def chunk(self) -> int:
        return self.chunk_rows or self.local

    def pool_chunks(self, name: str) -> int:
        rows = self.ring_rows if name in self.streamed else math.ceil((1 + self.prefetch_steps) * self.local)
        return max(-(-rows // self.chunk), 2 if name in self.streamed else -(-self.local // self.chunk))


class _Pool:
    """``n`` chunks of ``rows`` rows of one field, allocated on the first loader batch."""

    def __init__(self, n: int, rows: int, pin: bool):
        self.n, self.rows, self.pin = n, rows, pin
        self.buf: Optional[Tensor] = None
        self.free: list[tuple[int, Any]] = [(i, None) for i in range(n)]  # (chunk, event before reuse)

    @staticmethod
    def row_bytes(like: Tensor) -> int:
        return like[0].numel() * like.element_size()

    def allocate(self, like: Tensor) -> None:
        if self.buf is None:
            self.buf = torch.empty((self.n, self.rows, *like.shape[1:]), dtype=like.dtype, pin_memory=self.pin)

    def write(self, chunk: int, lo: int, src: Tensor) -> None:
        self.buf[chunk][lo:lo + src.shape[0]].copy_(src)

    def read(self, chunk: int, lo: int, k: int) -> Tensor:
        return self.buf[chunk][lo:lo + k]

    def nbytes(self) -> int:
        return 0 if self.buf is None else self.buf.numel() * self.buf.element_size()


class _PackedPool(_Pool):
    """A pool of packed JPEGs (``data.decode=device``): per chunk an index (rows, 9) and a byte
    arena sized from the first loader batch (``SLACK`` x its mean bytes per sample per row), so
    host memory follows the files' own sizes. A batch that does not fit grows its chunk's arena
    (a new pinned buffer; rows handed out before keep the old one alive)."""

    SLACK = 1.15

    def __init__(self, n: int, rows: int, pin: bool):
        super().__init__(n, rows, pin)
        self.arenas: list[Tensor] = []
        self.used: list[int] = []
        self.grown = 0  # arena reallocations (a batch of larger files than the first)

    @classmethod
    def row_bytes(cls, like: Any) -> int:
        return math.ceil(cls.SLACK * like.nbytes() / max(len(like), 1))

    def allocate(self, like: Any) -> None:
        if self.buf is None:
            from infclip.data.jpeg import INDEX

            self.buf = torch.empty((self.n, self.rows, INDEX), dtype=torch.int64, pin_memory=self.pin)
            size = self.rows * math.ceil(self.SLACK * int(like.index[:, 0].sum()) / max(len(like), 1))
            self.arenas = [torch.empty(size, dtype=torch.uint8, pin_memory=self.pin) for _ in range(self.n)]
            self.used = [0] * self.n

    def write(self, chunk: int, lo: int, src: Any) -> None:
        if lo == 0:
            self.used[chunk] = 0  # a chunk is filled from its first row on: its old bytes are free
        at, n = self.used[chunk], src.data.numel()
        lengths, offsets = src.index[:, 0], src.index[:, -1]
        end = at + n
        if end > self.arenas[chunk].numel():
            grown = torch.empty(max(end, int(1.25 * self.arenas[chunk].numel())), dtype=torch.uint8, pin_memory=self.pin)
            grown[:at].copy_(self.arenas[chunk][:at])
            self.arenas[chunk] = grown
            self.grown += 1
        arena = self.arenas[chunk]
        if bool((offsets[1:] == offsets[:-1] + lengths[:-1]).all()) and int(offsets[0]) == 0:
            arena[at:end].copy_(src.data)  # a collated batch: contiguous in order
        else:  # a slice of a larger buffer: gather each file
            end = at
            for length, offset in zip(lengths.tolist(), offsets.tolist()):
                arena[end:end + length].copy_(src.data[offset:offset + length])
                end += length
        index = self.buf[chunk][lo:lo + len(src)]
        index.copy_(src.index)
        index[:, -1] = at + torch.cumsum(lengths, 0) - lengths
        self.used[chunk] = end

    def read(self, chunk: int, lo: int, k: int) -> Any:
        from infclip.data.jpeg import PackedJpegs

        return PackedJpegs(self.buf[chunk][lo:lo + k], self.arenas[chunk])

    def nbytes(self) -> int:
        return 0 if self.buf is None else self.buf.numel() * 8 + sum(a.numel() for a in self.arenas)


class StepFeed:
    """One step's per-rank inputs, filled in loader order by the filler thread.

    Invariants: rows ``[0, filled)`` of every field are valid, except those released;
    ``data_state`` is set before the last row is published; a micro-batch (or loader batch)
    never straddles two chunks.
    """

    def __init__(self, pipe: "StepPipeline", step: int):
        self.pipe, self.s, self.step = pipe, pipe.s, step
        self._cond = pipe._cond
        self.chunks: dict[str, list[int]] = {n: [] for n in FIELDS}
        self.released: dict[str, int] = {n: 0 for n in FIELDS}  # rows released (a prefix)
        self.filled = 0
        self.data_state: Optional[dict] = None
        self.error: Optional[BaseException] = None
        self.wait_s = 0.0  # time the consumer blocked on rows not yet filled

    # -- consumer side (the engine) -----------------------------------------------------
    def rows(self, name: str, start: int, stop: int, count_wait: bool = True) -> Tensor:
        """Host rows ``[start, stop)`` of field ``name``, waiting until they are filled.
        ``count_wait=False``: a helper thread reading ahead (its wait is not the GPU's)."""
        self._wait_filled(stop, count_wait)
        c = self.s.chunk
        j, lo = divmod(start, c)
        if (stop - 1) // c != j:
            raise RuntimeError(f"{name} rows {start}:{stop} straddle two chunks of {c} rows")
        if start < self.released[name]:
            raise RowsReleased(f"{name} rows {start}:{stop} were already released (their last read is done)")
        got = self.pipe.pools[name].read(self.chunks[name][j], lo, stop - start)
        if hasattr(got, "tag"):  # packed JPEGs: the decoder keys what it keeps by step and rows
            got.tag = (self.step, name, start, stop)
        return got

    @property
    def piece_rows(self) -> int:
        """Rows that :meth:`rows` returns in one piece (a chunk)."""
        return self.s.chunk

    @property
    def num_rows(self) -> int:
        return self.s.local

    def release(self, name: str, stop: int, event: Any = None) -> None:
        """The step has read rows before ``stop`` of ``name`` for the last time; their chunks
        may be refilled once ``event`` (a CUDA event after their copy, or None) completed."""
        c = self.s.chunk
        with self._cond:
            first = self.released[name] // c  # chunks before this one were already freed
            last = min(stop, self.s.local) // c  # chunk j is done once rows up to (j + 1) c are
            pool = self.pipe.pools[name]
            for j in range(first, min(last, len(self.chunks[name]))):
                pool.free.append((self.chunks[name][j], event))
            self.released[name] = max(self.released[name], min(stop, self.s.local))
            self._cond.notify_all()

    def release_all(self, event: Any = None) -> None:
        for name in FIELDS:
            self.release(name, self.s.local, event)

    def full(self, name: str) -> Tensor:
        """The whole step of ``name`` (a copy when it spans several chunks)."""
        c = self.s.chunk
        parts = [self.rows(name, a, min(a + c, self.s.local)) for a in range(0, self.s.local, c)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def wait_complete(self) -> None:
        """Wait until every row arrived (then ``data_state`` is set)."""
        self._wait_filled(self.s.local)

    def streams(self, name: str) -> bool:
        return name in self.s.streamed

    def _wait_filled(self, stop: int, count_wait: bool = True) -> None:
        if self.filled >= stop:  # a racy read is fine: filled only grows
            return
        t0 = time.perf_counter()
        with self._cond:
            while self.filled < stop and self.error is None:
                self._cond.wait(timeout=1.0)
                if count_wait and self.filled < stop:  # the trainer's own wait (not a read-ahead thread)
                    self.pipe.check_waiting()
        if count_wait:
            self.wait_s += time.perf_counter() - t0
        if self.filled < stop:
            if isinstance(self.error, PipelineStopped):
                raise PipelineStopped("the step pipeline was closed before the step's data arrived")
            raise self.error

    # -- filler side ------------------------------------------------------------------
    def put(self, images: Tensor, tokens: Tensor, last_state: Callable[[], dict]) -> None:
        """Copy one loader batch in at row ``filled``; publish it (and, for the step's last
        batch, the data position ``last_state()``) to the consumer."""
        k, at = images.shape[0], self.filled
        j, lo = divmod(at, self.s.chunk)
        self.pipe._allocate(images, tokens)
        for name, src in zip(FIELDS, (images, tokens)):
            self.pipe.pools[name].write(self.chunks[name][j], lo, src)
        if at + k >= self.s.local:
            self.data_state = last_state()
        with self._cond:
            self.filled = at + k
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self.error = error
            self._cond.notify_all()


class TensorFeed:
    """A complete step given as tensors (tests, benchmarks, SimCLR views): the same
    interface as :class:`StepFeed`, nothing to wait for, nothing to release."""

    def __init__(self, tensors: dict[str, Tensor]):
        self.buffers = dict(tensors)
        self.wait_s = 0.0
        self.num_rows = self.piece_rows = max(t.shape[0] for t in self.buffers.values())

    def rows(self, name: str, start: int, stop: int, count_wait: bool = True) -> Tensor:
        return self.buffers[name][start:stop]

    def release(self, name: str, stop: int, event: Any = None) -> None:
        pass

    def full(self, name: str) -> Tensor:
        return self.buffers[name]

    def wait_complete(self) -> None:
        pass


class StepPipeline:
    """Feeds for consecutive steps, filled ahead by a background thread (see module docs).

    ``batches``: the loader generator (``TrainData.batches()``), consumed only by the filler;
    ``data_state``: returns the loader position (``TrainData.state_dict``), called by the
    filler between two loader batches.
    """

    def __init__(self, batches: Iterator, data_state: Callable[[], dict], settings: PipelineSettings,
                 watch: Optional[StallWatch] = None):
        self.batches, self.data_state, self.s, self.watch = batches, data_state, settings, watch
        self._pulling_since: Optional[float] = None  # monotonic start of the filler's current next(batches)
        self._warned_for: Optional[float] = None  # the pull already warned about
        _check(settings)
        self._cond = threading.Condition()
        self.pools = {n: _Pool(settings.pool_chunks(n), settings.chunk, settings.pin) for n in FIELDS}
        self._ready: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._next_step = 0
        self._loader_rows, self._loader_s = 0, 0.0  # for the loader's own delivery rate
        self._last_rate, self._first_batch = math.nan, True
        # data.cpu_decode_share: samples the workers delivered decoded (pixels), in the same window
        self._loader_cpu_rows, self._last_cpu_rate, self.cpu_decoded = 0, math.nan, 0
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
            feed = self._new_feed()
            self._fill(feed)
        else:
            while True:
                try:
                    feed = self._ready.get(timeout=1.0)
                    break
                except queue.Empty:
                    if not self._thread.is_alive():
                        raise PipelineStopped("the step pipeline's filler thread is not running")
                    self.check_waiting()
        if isinstance(feed, BaseException):
            raise feed
        feed.wait_s += time.perf_counter() - t0
        return feed

    def peek(self) -> Optional[StepFeed]:
        """The feed the filler is filling for the next step (rows may still be arriving), or
        None when there is none yet (or no filler thread). Nothing is consumed."""
        with self._ready.mutex:
            nxt = self._ready.queue[0] if self._ready.queue else None
        return nxt if isinstance(nxt, StepFeed) else None

    def release(self, feed: StepFeed, device: Optional[torch.device] = None) -> None:
        """The step is done with ``feed``: chunks the engine did not release yet are freed
        once the device has read them (an event on the current stream, which waited for
        every host-to-device copy of the step; the filler waits on it)."""
        event = None
        if device is not None and device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        feed.release_all(event)

    def check_waiting(self) -> None:
        """Called by the consumer while it waits: a stop signal raises StoppedWaiting; a loader
        batch pending for ``watch.warn_s`` is warned about once, for ``watch.abort_s`` raises
        LoaderStalled (see module docs)."""
        w = self.watch
        if w is None:
            return
        if w.stop_requested is not None and w.stop_requested():
            raise StoppedWaiting("a stop signal arrived while the step waited for data")
        since = self._pulling_since
        stalled = time.monotonic() - since if since is not None else 0.0
        if w.abort_s and stalled >= w.abort_s:
            raise LoaderStalled(f"the data loader delivered nothing for {stalled:.0f} s (data.stall_abort_s="
                                f"{w.abort_s:g}): it waits on {w.describe()}")
        if w.warn_s and stalled >= w.warn_s and self._warned_for != since:
            self._warned_for = since
            w.warn(f"warning: the data loader has delivered nothing for {stalled:.0f} s (data.stall_warn_s="
                   f"{w.warn_s:g}): it waits on {w.describe()}; a stalled file system or pipe: command? "
                   + (f"training stops with a checkpoint after data.stall_abort_s={w.abort_s:g} s" if w.abort_s
                      else "data.stall_abort_s=0: waiting for ever"))

    def loader_rate(self) -> float:
        """Samples per second the loader delivered while the filler was pulling (not waiting
        for free host memory): the loader's own speed, whatever the GPU does. Over the window
        since the previous call, without the run's first loader batch (whose wait is the
        workers' start-up: counted in, it made the rate under-read for many steps)."""
        with self._cond:
            rows, secs, cpu = self._loader_rows, self._loader_s, self._loader_cpu_rows
            self._loader_rows, self._loader_s, self._loader_cpu_rows = 0, 0.0, 0
        if secs > 0:
            self._last_rate, self._last_cpu_rate = rows / secs, cpu / secs
        return self._last_rate

    def cpu_decoded_rate(self) -> float:
        """Of :meth:`loader_rate`'s samples/s (same window, call it after), those the workers
        delivered decoded (data.cpu_decode_share with data.decode=device; 0 otherwise)."""
        return self._last_cpu_rate

    def image_bytes_per_sample(self) -> float:
        """Host bytes the images pool holds per sample slot (packed JPEGs: ~ the files' size;
        with data.cpu_decode_share f, ~ (1 - f) x the files' size + f x 3·S·S of pixels)."""
        pool = self.pools["images"]
        return pool.nbytes() / max(pool.n * pool.rows, 1)

    def host_bytes(self) -> int:
        return sum(p.nbytes() for p in self.pools.values())

    def close(self) -> None:
        """Stop the filler, close the loader generator, kill loader workers that outlive it."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()  # wakes a filler waiting for a free chunk
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
    def _new_feed(self) -> StepFeed:
        feed = StepFeed(self, self._next_step)
        self._next_step += 1
        return feed

    def _allocate(self, images: Tensor, tokens: Tensor) -> None:
        """Allocate the pools on the first loader batch (row sizes known), shrinking the
        prefetch part of the re-read fields' pools to ``budget_bytes`` if needed."""
        if self.pools["images"].buf is not None:
            return
        if not isinstance(images, Tensor) and not isinstance(self.pools["images"], _PackedPool):
            self.pools["images"] = self._packed(self.pools["images"])
        row = {n: self.pools[n].row_bytes(t) for n, t in zip(FIELDS, (images, tokens))}
        c, s = self.s.chunk, self.s
        if s.budget_bytes:
            fixed = sum(self.pools[n].n * c * row[n] for n in s.streamed)
            growable = [n for n in FIELDS if n not in s.streamed]
            per_chunk = sum(c * row[n] for n in growable)
            step_chunks = -(-s.local // c)
            fit = max((s.budget_bytes - fixed) // max(per_chunk, 1), step_chunks)
            if fit * per_chunk + fixed > s.budget_bytes:  # one step's rows must fit: the cap is raised
                print(f"step pipeline: memory.host_buffer_gb={s.budget_bytes / 2**30:.3g} is below one step's "
                      f"host buffers; using {(fit * per_chunk + fixed) / 2**30:.3g} GB (one step, no prefetch)",
                      flush=True)
            for n in growable:
                pool = self.pools[n]
                if fit < pool.n:
                    print(f"step pipeline: host buffers capped at {s.budget_bytes / 2**30:.1f} GB "
                          f"(memory.host_buffer_gb): {n} pool {pool.n} -> {fit} chunks of {c} rows "
                          f"(prefetch {fit * c / s.local - 1:.2f} steps instead of {s.prefetch_steps})", flush=True)
                    with self._cond:
                        pool.n = fit
                        pool.free = [(i, e) for i, e in pool.free if i < fit]
        for n, t in zip(FIELDS, (images, tokens)):
            self.pools[n].allocate(t)

    def _packed(self, pool: _Pool) -> _PackedPool:
        """The images pool as byte arenas: the loader ships packed JPEGs (data.decode=device)."""
        with self._cond:
            packed = _PackedPool(pool.n, pool.rows, pool.pin)
            packed.free = pool.free
        return packed

    def _acquire(self, name: str) -> int:
        """A free chunk of ``name``'s pool (blocks until the consumer releases one)."""
        pool = self.pools[name]
        with self._cond:
            while not pool.free:
                if self._stop.is_set():
                    raise PipelineStopped("closing")
                if self._thread is None:
                    raise RuntimeError(f"the {name} pool ({pool.n} chunks) is too small for one step "
                                       "without the pipeline thread")
                self._cond.wait(timeout=0.5)
            chunk, event = pool.free.pop(0)
        if event is not None:
            event.synchronize()  # the device has finished copying the chunk's previous rows
        return chunk

    def _fill_forever(self) -> None:
        try:
            while not self._stop.is_set():
                feed = self._new_feed()
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
        try:
            while feed.filled < self.s.local:
                if self._stop.is_set():
                    raise PipelineStopped("closing")
                if feed.filled % self.s.chunk == 0:  # room first: never hold a batch it cannot store
                    for name in FIELDS:
                        feed.chunks[name].append(self._acquire(name))
                t0 = time.perf_counter()
                self._pulling_since = time.monotonic()
                try:
                    images, tokens = next(self.batches)
                except (ConnectionError, EOFError) as e:  # receiving a batch from a worker that died
                    raise LoaderDied(f"DataLoader worker connection lost ({type(e).__name__}: {e})") from e
                self._pulling_since = None
                t1 = time.perf_counter()
                _check_batch(images, tokens, feed.filled, self.s)
                feed.put(images, tokens, self.data_state)
                mask = getattr(images, "pixel_mask", None)  # packed JPEGs: rows the workers decoded
                cpu = int(mask().sum()) if mask is not None else 0
                with self._cond:
                    self.cpu_decoded += cpu
                    if self._first_batch:  # the workers' start-up, not their rate
                        self._first_batch = False
                    else:
                        self._loader_s += t1 - t0
                        self._loader_rows += images.shape[0]
                        self._loader_cpu_rows += cpu
        except BaseException as e:
            feed.fail(e)
            raise


def _check(s: PipelineSettings) -> None:
    if s.local <= 0:
        raise ValueError(f"the per-rank step batch must be positive, got {s.local}")
    if s.prefetch_steps < 0:
        raise ValueError(f"memory.prefetch_steps must be >= 0, got {s.prefetch_steps}")
    if s.local % s.chunk:
        raise ValueError(f"chunk_rows={s.chunk} must divide the per-rank step batch {s.local}")
    if s.streamed and not 0 < s.ring_rows <= s.local:
        raise ValueError(f"a streamed field needs 0 < ring_rows <= {s.local}, got {s.ring_rows}")
    if not s.threaded and any(s.pool_chunks(n) * s.chunk < s.local for n in FIELDS):
        raise ValueError("a pool smaller than one step needs the pipeline thread")


def _check_batch(images: Tensor, tokens: Tensor, filled: int, s: PipelineSettings) -> None:
    k = images.shape[0]
    if tokens.shape[0] != k:
        raise ValueError(f"loader batch has {k} images but {tokens.shape[0]} token rows")
    if filled + k > s.local or filled // s.chunk != (filled + k - 1) // s.chunk:
        raise ValueError(
            f"loader batches of {k} do not divide the per-rank step batch {s.local} (chunks of {s.chunk}); "
            "set data.loader_batch to a divisor of batch.global_size / world_size and of batch.micro_size")


def ring_rows(local: int, micro: int, loader_batch: int, want_rows: int) -> int:
    """Rows of a streamed pool: a multiple of lcm(micro, loader_batch) (so every micro-batch
    and every loader batch is contiguous in it), at least two micro-batches' worth (the
    stager copies micro-batch k+1 while k is read), at most ``local``; ``want_rows``
    (memory.stream_rows) sets the size in between."""
    unit = math.lcm(micro, loader_batch)
    rows = max(2 * unit, -(-want_rows // unit) * unit)
    return min(rows, local)


def build_step_pipeline(cfg: Any, data: Any, engine: Any, device: torch.device, world_size: int,
                        watch: Optional[StallWatch] = None) -> StepPipeline:
    """The pipeline for a run: ``cfg`` a TrainConfig, ``data`` its TrainData, ``engine`` its
    StepEngine (which says which inputs only the cache pass reads); ``watch``: what to do
    about a stalled loader (threaded pipelines only: without the thread the trainer itself
    waits inside the loader)."""
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
    # chunks of lcm(micro, loader batch) rows (both divide the step, so it does too): freed
    # by the engine micro-batch by micro-batch; one chunk per step without the thread
    chunk = math.lcm(engine.s.micro, data.spec.loader_batch) if threaded else 0
    settings = PipelineSettings(
        local=local, pin=bool(mem.offload and device.type == "cuda"), prefetch_steps=mem.prefetch_steps,
        streamed=streamed, ring_rows=rows, threaded=threaded, chunk_rows=chunk,
        budget_bytes=host_budget_bytes(mem.host_buffer_gb),
    )
    return StepPipeline(data.batches(), data.state_dict, settings, watch if threaded else None)


def host_budget_bytes(host_buffer_gb: Optional[float]) -> int:
    """Bytes the pipeline may pin on this rank: ``memory.host_buffer_gb``, or by default half
    the host's available memory shared by the ranks on the host (pinned pages cannot be
    swapped; the loader workers and the page cache need the rest)."""
    if host_buffer_gb is not None:
        return int(host_buffer_gb * 2**30)
    try:
        with open("/proc/meminfo") as f:
            avail_kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return 0
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return avail_kb * 1024 // 2 // max(ranks_here, 1)


def duplicate_warning(global_size: int, epoch_samples: int, world_size: int, loader_batch: int,
                      resampled: bool) -> Optional[str]:
    """A warning when one step's batch must (or is likely to) hold the same sample twice:
    in a contrastive batch a duplicate is a false negative. None when there is no such risk;
    a line starting "note: " for the bounded epoch-boundary case (logged as it is).

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
    if per_step and epoch_batches % per_step:  # a small, bounded effect: a note, not a warning
        tail = epoch_batches % per_step
        most = min(tail, per_step - tail) * world_size * loader_batch
        return (f"note: an epoch ({epoch_batches} loader batches per rank) is not a whole number of steps "
                f"({per_step} loader batches each), so one step in every {epoch_batches / per_step:.1f} takes "
                f"samples from two epochs and may hold up to {most} of its {global_size} samples twice (false "
                f"negatives in the loss). Nothing is wrong; to avoid it make batch.global_size divide the epoch "
                f"or set data.num_samples to a multiple of {global_size}")
    return None
