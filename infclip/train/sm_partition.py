"""Keep a few SMs free of the towers, for the JPEG decoders' small kernels (CUDA green contexts).

On H100/H200 the JPEG engines (NVJPG) decode without SMs, but every decode call still runs
small CUDA kernels (nvImageCodec's colour conversion, our crop-and-resize): beside the towers,
whose GEMMs hold every SM, each of them queues until a tower kernel ends, and the decode chain
fell from ~18k images/s alone to 4-6k (docs/benchmarks.md). A *green context* confines the
kernels of a stream to a subset of the SMs. :func:`tower_stream` returns such a stream with
all SMs but ``reserve`` of them; the trainer runs the towers, the loss and the optimizer on it,
while the decoders stay on ordinary streams, which may use every SM, the reserved ones
included, so their kernels start at once.

Invariant: the partition changes where kernels run, never what they compute (same kernels,
same order on one stream): a run with and without it is bit-identical (checked on the GPU by
``scripts/check_sm_partition.py``).

Two ways to make the stream, the first that works: torch's ``GreenContext(...).Stream()``
(torch >= 2.12), else the CUDA driver's green-context calls through NVIDIA's ``cuda-bindings``
package (``cuGreenCtxStreamCreate``), wrapped as a ``torch.cuda.ExternalStream``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

# SM partitions on sm_90 come in multiples of 8 SMs (CUDA driver API, "Green Contexts").
GRANULE = {9: 8, 10: 8, 8: 2}


@dataclass
class Partition:
    """The compute stream of the towers. ``stream`` None: not partitioned (``reason`` says why)."""

    stream: Optional[torch.cuda.Stream]
    tower_sms: int
    total_sms: int
    reason: str = ""
    _keep: Any = None  # the green context (and driver handles): they must outlive the stream

    def describe(self) -> str:
        if self.stream is None:
            return f"towers on all SMs ({self.reason})" if self.reason else "towers on all SMs"
        return (f"towers confined to {self.tower_sms} of {self.total_sms} SMs (green context), "
                f"{self.total_sms - self.tower_sms} kept free for the decoders' kernels")


def tower_sm_count(total: int, reserve: int, major: int) -> int:
    """SMs left to the towers: ``total - reserve`` rounded *down* to the partition granule of
    compute capability ``major`` (so at least ``reserve`` stay free); 0 when nothing is left."""
    g = GRANULE.get(major, 8)
    return max(0, (total - reserve) // g * g)


def tower_stream(device: torch.device | str, reserve: int) -> Partition:
    """A stream whose kernels run on all but (at least) ``reserve`` SMs of ``device``.

    Never raises: where green contexts are unavailable (CPU, old driver or torch, no
    ``cuda-bindings``) it returns an unpartitioned :class:`Partition` whose reason says why."""
    device = torch.device(device)
    if device.type != "cuda" or reserve <= 0:
        return Partition(None, 0, 0, "" if reserve <= 0 else "not a CUDA device")
    idx = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(idx)
    total = props.multi_processor_count
    n = tower_sm_count(total, reserve, props.major)
    if n <= 0:
        return Partition(None, 0, total, f"{reserve} reserved SMs leave none of {total} for the towers")
    errors = []
    for label, maker in (("torch GreenContext", "_torch_green_stream"), ("cuda-bindings", "_driver_green_stream")):
        try:
            stream, keep, got = globals()[maker](idx, n)
            return Partition(stream, got, total, _keep=keep)
        except Exception as e:  # an API this torch / driver lacks, or a refused partition
            errors.append(f"{label}: {str(e).splitlines()[0][:120] if str(e) else type(e).__name__}")
    return Partition(None, 0, total, "no green context: " + "; ".join(errors))


def _torch_green_stream(idx: int, n: int):
    from torch.cuda.green_contexts import GreenContext

    if not hasattr(GreenContext, "Stream"):  # torch < 2.12: only make-current on the default stream
        raise RuntimeError("this torch's GreenContext has no Stream()")
    ctx = GreenContext.create(num_sms=n, device_id=idx)
    return ctx.Stream(), ctx, n


def _check(result):
    """cuda-bindings return (CUresult, *values): the values, or raise naming the error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err!r}")
    return values[0] if len(values) == 1 else values


def _driver_green_stream(idx: int, n: int):
    from cuda.bindings import driver as cu

    torch.cuda.init()
    _check(cu.cuInit(0))
    dev = _check(cu.cuDeviceGet(idx))
    sms = _check(cu.cuDeviceGetDevResource(dev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    groups, count, _rest = _check(cu.cuDevSmResourceSplitByCount(1, sms, 0, n))
    got = groups[0].sm.smCount if count == 1 else 0
    if got < n or got >= int(sms.sm.smCount):  # (n is a whole number of granules already)
        raise RuntimeError(f"the driver split off {count} group(s) of {got} SMs for {n}")
    desc = _check(cu.cuDevResourceGenerateDesc([groups[0]], 1))
    green = _check(cu.cuGreenCtxCreate(desc, dev, cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
    handle = _check(cu.cuGreenCtxStreamCreate(green, cu.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
    stream = torch.cuda.ExternalStream(int(handle), device=torch.device("cuda", idx))
    return stream, (green, handle), got


@contextlib.contextmanager
def running_on(part: Partition) -> Iterator[None]:
    """Run the enclosed work (this thread's CUDA work: the training steps) on ``part``'s stream;
    nothing changes when it is unpartitioned. Ordered after everything the current stream
    holds at entry (the model build, a resumed checkpoint), and the current stream waits for
    it at exit, so work after the block sees its results. Other threads keep their streams."""
    if part.stream is None:
        yield
        return
    outer = torch.cuda.current_stream(part.stream.device)
    part.stream.wait_stream(outer)
    try:
        with torch.cuda.stream(part.stream):
            yield
    finally:
        outer.wait_stream(part.stream)
