"""Input staging for one optimizer step: which micro-batch of inputs is on the device when.

The engine asks for micro-batches in a fixed schedule (pass 1: 0..K-1, then pass 2:
0..K-1). :class:`InputStager` yields each one as a dict of device tensors.

* ``offload=False``: the whole per-rank batch is copied to the device once per step
  (one buffer of b/W rows per input); micro-batches are views into it. Device memory for
  inputs: b/W samples (M_data in the paper's notation).
* ``offload=True``: the step's inputs stay in (pinned) CPU memory. Two device buffers of
  one micro-batch each (double buffering) per input: while the engine computes on
  micro-batch i from one buffer, micro-batch i+1 is copied into the other on a side CUDA
  stream. Device memory for inputs: 2 micro-batches, independent of the global batch.
  Every micro-batch crosses PCIe twice per step (pass 1 and pass 2); a 224^2 uint8 image
  is 150 KB, so a 1M batch is 150 GB of host memory (37.6 GB per rank on 4 ranks) and
  ~300 GB of PCIe traffic per step across ranks, hidden behind the encoder compute.

Images are staged as uint8 (normalized on the device by the data pipeline's normalizer):
a float32 224^2 image would be 4x the bytes on the host and on the wire.

The inputs come as a *feed* (``infclip.train.pipeline.StepFeed`` or ``TensorFeed``): rows are
read with ``feed.rows(name, start, stop)``, which waits only for rows the loader has not
delivered yet, so the cache pass starts while the step is still being assembled. Rows are
released with ``feed.release`` after their *last* read of the step (pass 2 for inputs the
replay re-reads, pass 1 for those only the cache pass reads, e.g. a locked LiT tower's
images), with the event of that copy, so the pipeline can refill them for the next step.

Fields named in ``host_fields`` are never copied: the consumer gets the host rows themselves
(``data.decode=device``: ``torchvision.io.decode_jpeg`` reads JPEG bytes from host memory
and decodes them on the GPU). They are released after the consumer returns from their last
read, with an event on the compute stream.

On a CPU device the same code runs: buffers are allocated and filled with ``copy_``, only
the stream/event synchronization is skipped.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

import torch
from torch import Tensor

from infclip.train.pipeline import TensorFeed

Item = tuple[int, Sequence[str]]  # (micro-batch index, names of the inputs it needs)


class InputStager:
    """Stages micro-batches of host inputs into device buffers (see the module docs)."""

    def __init__(self, device: torch.device, offload: bool, host_fields: Sequence[str] = (),
                 host_reader: Any = None):
        self.device = torch.device(device)
        self.offload = offload
        self.host_fields = frozenset(host_fields)  # handed over as host rows (see module docs)
        # The consumer of the host fields (JpegDecoder): told the next item's rows ahead
        # (``prefetch(thunk)``) and when a stream ends (``cancel_prefetch()``).
        self.host_reader = host_reader if hasattr(host_reader, "prefetch") else None
        self.buffers: dict[str, list[Tensor]] = {}  # name -> device buffers (1 or 2)
        self._cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if (offload and self._cuda) else None
        self._free: dict[tuple[str, int], torch.cuda.Event] = {}  # buffer last read by compute

    def resident_rows(self) -> int:
        """Largest number of samples of any one input that the device buffers can hold."""
        return max((sum(b.shape[0] for b in bufs) for bufs in self.buffers.values()), default=0)

    def stream(self, inputs: Any, micro: int, schedule: Sequence[Item]) -> Iterator[dict[str, Tensor]]:
        """Yield ``{name: device tensor (micro, ...)}`` for each schedule item, in order.

        A yielded tensor is valid until the generator is resumed (offload) or until the
        step ends (no offload); the consumer must finish its forward/backward on it first.
        """
        if isinstance(inputs, dict):  # plain tensors: a complete step
            inputs = TensorFeed(inputs)
        self._last_use = {(k, n): i for i, (k, names) in enumerate(schedule) for n in names}
        try:
            if self.offload:
                yield from self._stream_offload(inputs, micro, schedule)
            else:
                yield from self._stream_resident(inputs, micro, schedule)
        finally:
            if self.host_reader is not None:
                self.host_reader.cancel_prefetch()

    def _prefetch_host(self, inputs, micro: int, schedule, i: int) -> None:
        """Let the host reader start on item ``i``'s host rows (in its thread)."""
        if self.host_reader is None or i >= len(schedule):
            return
        k, names = schedule[i]
        for n in names:
            if n in self.host_fields:
                # read ahead while the GPU computes: a wait here is not the GPU waiting for data
                self.host_reader.prefetch(
                    lambda n=n, k=k: self._marked(inputs.rows(n, k * micro, (k + 1) * micro, count_wait=False),
                                                  n, k, i))

    def _marked(self, rows: Tensor, name: str, k: int, i: int) -> Tensor:
        """``rows`` after telling the host reader whether read ``i`` is not their last this step
        (then it may keep what it made of them for the later read: decoded pixels)."""
        if self._last_use[(k, name)] != i and hasattr(self.host_reader, "mark_reread"):
            self.host_reader.mark_reread(rows)
        return rows

    def _host_rows(self, inputs, micro: int, i: int, k: int, names) -> dict[str, Tensor]:
        return {n: self._marked(inputs.rows(n, k * micro, (k + 1) * micro), n, k, i)
                for n in names if n in self.host_fields}

    def _release_host(self, inputs, micro: int, i: int, k: int, names) -> None:
        """After the consumer's read ``i`` of micro-batch ``k``: free host fields read for the last time."""
        done = [n for n in names if n in self.host_fields and self._last_use[(k, n)] == i]
        if not done:
            return
        event = None
        if self._cuda:  # the device work that reads them (decode_jpeg's copies) is enqueued
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        for n in done:
            inputs.release(n, (k + 1) * micro, event)

    # -- resident: the whole per-rank batch on the device -------------------------------
    def _stream_resident(self, inputs, micro, schedule):
        staged = {}
        for name in sorted({n for _, names in schedule for n in names} - self.host_fields):
            staged[name] = self._stage_whole(inputs, name)
        self._prefetch_host(inputs, micro, schedule, 0)
        for i, (k, names) in enumerate(schedule):
            batch = {n: staged[n][k * micro:(k + 1) * micro] for n in names if n in staged}
            host = self._host_rows(inputs, micro, i, k, names)
            self._prefetch_host(inputs, micro, schedule, i + 1)
            yield {**batch, **host}
            self._release_host(inputs, micro, i, k, names)

    def _stage_whole(self, inputs, name: str) -> Tensor:
        """Copy every row of ``name`` to its device buffer, piece by piece (a feed's chunks),
        then release the host rows once the copies are done."""
        first = inputs.rows(name, 0, min(inputs.piece_rows, inputs.num_rows))
        n = inputs.num_rows
        buf = self._buffer(name, 0, (n, *first.shape[1:]), first.dtype)
        for a in range(0, n, inputs.piece_rows):
            b = min(a + inputs.piece_rows, n)
            buf[a:b].copy_(inputs.rows(name, a, b), non_blocking=True)
        done = None
        if self._cuda:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
        inputs.release(name, n, done)
        return buf

    # -- offload: two micro-batch buffers per input, filled ahead on a side stream ------
    def _stream_offload(self, inputs, micro, schedule):
        self._prefetch_host(inputs, micro, schedule, 0)
        ready = self._issue(inputs, micro, schedule, 0)
        for i, (k, names) in enumerate(schedule):
            nxt = self._issue(inputs, micro, schedule, i + 1) if i + 1 < len(schedule) else None
            if ready is not None:
                torch.cuda.current_stream(self.device).wait_event(ready)
            copied = [n for n in names if n not in self.host_fields]
            host = self._host_rows(inputs, micro, i, k, names)
            self._prefetch_host(inputs, micro, schedule, i + 1)
            yield {**{n: self.buffers[n][i % 2] for n in copied}, **host}
            if self._cuda:  # the compute stream has now enqueued every use of slot i % 2
                for n in copied:
                    ev = self._free[(n, i % 2)] = torch.cuda.Event()
                    ev.record(torch.cuda.current_stream(self.device))
            self._release_host(inputs, micro, i, k, names)
            ready = nxt

    def _issue(self, inputs, micro, schedule, i) -> Optional[torch.cuda.Event]:
        """Start copying schedule item ``i`` into slot ``i % 2``; returns its ready event."""
        k, names = schedule[i]
        names = [n for n in names if n not in self.host_fields]
        slot = i % 2
        rows = (k * micro, (k + 1) * micro)
        if not self._cuda:
            for n in names:
                src = inputs.rows(n, *rows)
                self._buffer(n, slot, src.shape, src.dtype).copy_(src)
                if self._last_use[(k, n)] == i:
                    inputs.release(n, rows[1])
            return None
        srcs = {n: inputs.rows(n, *rows) for n in names}
        bufs = {n: self._buffer(n, slot, s.shape, s.dtype) for n, s in srcs.items()}  # on compute stream
        with torch.cuda.stream(self._copy_stream):
            for n, src in srcs.items():
                buf = bufs[n]
                if (n, slot) in self._free:  # never overwrite a slot the compute stream still reads
                    self._copy_stream.wait_event(self._free[(n, slot)])
                buf.copy_(src, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._copy_stream)
        for n in names:  # rows read for the last time this step: refillable once this copy is done
            if self._last_use[(k, n)] == i:
                inputs.release(n, rows[1], ready)
        return ready

    def _buffer(self, name: str, slot: int, shape, dtype) -> Tensor:
        """The device buffer ``slot`` for ``name``, (re)allocated when the shape changes."""
        bufs = self.buffers.setdefault(name, [])
        while len(bufs) <= slot:
            bufs.append(torch.empty(0, device=self.device))
        if bufs[slot].shape != shape or bufs[slot].dtype != dtype:
            if self._cuda:  # a reallocation must not race a pending read of the old buffer
                torch.cuda.current_stream(self.device).synchronize()
            bufs[slot] = torch.empty(shape, dtype=dtype, device=self.device)
            self._free.pop((name, slot), None)
        return bufs[slot]


def pin(t: Tensor) -> Tensor:
    """``t`` in page-locked host memory (needed for truly asynchronous H2D copies)."""
    if t.device.type != "cpu" or t.is_pinned() or not torch.cuda.is_available():
        return t
    return t.pin_memory()
