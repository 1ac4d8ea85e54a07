"""Keep a few SMs free of the towers, for the JPEG decoders' small kernels (CUDA green contexts).

On H100/H200 the JPEG engines (NVJPG) decode without SMs, but every decode call still runs
small CUDA kernels (nvImageCodec's colour conversion, our crop-and-resize): beside the towers,
whose GEMMs hold every SM, each of them queues until a tower kernel ends, and the decode chain
fell from ~18k images/s alone to 4-6k (docs/benchmarks.md). A *green context* confines the
kernels of a stream to a subset of the SMs. :func:`tower_stream` returns such a stream with
all SMs but (at least) ``reserve`` of them; the trainer runs the towers, the loss and the
optimizer on it, while the decoders stay on ordinary streams, which may use every SM, the
reserved ones included, so their kernels start at once.

Measured on an H200 (commit e819e19, with a probe since deleted): the same kernels in the same order
on one stream; the loss at b = 8,192 bit-identical, at 32,768 equal up to summation order (its
persistent grids are sized for the partition's SMs, :func:`infclip.kernels.launching.set_sm_budget`;
cuBLAS and Inductor size theirs for the whole device); the towers 10 % slower on 128 of 132
SMs, which is why ``data.decode_reserved_sms`` stays 0 by default.

The stream is made with the CUDA driver's green-context calls through NVIDIA's
``cuda-bindings`` package (``cuGreenCtxStreamCreate``; torch's own ``GreenContext`` needs that
package too on torch 2.14 and has no stream before 2.12) and wrapped as a
``torch.cuda.ExternalStream``. Partitions live until the process ends: a context destroyed
while the caching allocator still holds blocks recorded on its stream would be used after
its end.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

_ALIVE: dict[tuple[int, int], "Partition"] = {}  # (device, tower SMs) -> partition, never freed


@dataclass
class Partition:
    """The compute stream of the towers. ``stream`` None: not partitioned (``reason`` says why)."""

    stream: Optional[torch.cuda.Stream]
    tower_sms: int
    total_sms: int
    reason: str = ""
    handles: Any = None  # the driver's green context and stream (kept, never destroyed)

    def describe(self) -> str:
        if self.stream is None:
            return f"towers on all SMs ({self.reason})" if self.reason else "towers on all SMs"
        return (f"towers confined to {self.tower_sms} of {self.total_sms} SMs (CUDA green context), "
                f"{self.total_sms - self.tower_sms} kept free for the decoders' kernels")


def tower_sm_count(total: int, reserve: int, granule: int) -> int:
    """SMs left to the towers: ``total - reserve`` rounded *down* to a multiple of the
    partition ``granule`` (so at least ``reserve`` stay free); 0 when nothing is left."""
    return max(0, (total - reserve) // granule * granule)


def tower_stream(device: torch.device | str, reserve: int) -> Partition:
    """A stream whose kernels run on all but (at least) ``reserve`` SMs of ``device``, the
    same object for the same request. Where green contexts cannot be made (CPU, no
    ``cuda-bindings``, an old driver) it returns an unpartitioned :class:`Partition` whose
    reason says why; it raises only what CUDA itself raises for ``device``."""
    device = torch.device(device)
    if device.type != "cuda" or reserve <= 0:
        return Partition(None, 0, 0, "" if reserve <= 0 else "not a CUDA device")
    idx = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(idx).multi_processor_count
    try:
        driver, dev, sms = _driver_sm_resource(idx)
    except ImportError:
        return Partition(None, 0, total, "no green context: NVIDIA's cuda.bindings is not installed; "
                                         "pip install -e \".[hwdecode]\" adds it")
    except Exception as e:  # a driver without green contexts
        return Partition(None, 0, total, f"no green context: {_first_line(e)}")
    n = tower_sm_count(total, reserve, _granule(sms))
    if n <= 0:
        return Partition(None, 0, total, f"{reserve} reserved SMs leave none of {total} for the towers")
    if (idx, n) not in _ALIVE:
        try:
            stream, handles, got = _driver_green_stream(driver, dev, sms, idx, n)
        except Exception as e:  # a refused split or context
            return Partition(None, 0, total, f"no green context: {_first_line(e)}")
        _ALIVE[(idx, n)] = Partition(stream, got, total, handles=handles)
        from infclip.kernels.launching import set_sm_budget

        set_sm_budget(torch.device("cuda", idx), got)  # persistent loss grids fill the partition
    return _ALIVE[(idx, n)]


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0][:160] if str(e) else type(e).__name__


def _check(result):
    """cuda-bindings return ``(CUresult, *values)``: the values (one, or a list), or raise
    naming the error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err!r}")
    return values[0] if len(values) == 1 else values


def _driver_sm_resource(idx: int):
    """(the cuda-bindings driver module, CUdevice, the device's whole SM resource)."""
    from cuda.bindings import driver

    torch.cuda.init()  # the primary context first: a green context retains it
    _check(driver.cuInit(0))
    dev = _check(driver.cuDeviceGet(idx))
    sms = _check(driver.cuDeviceGetDevResource(dev, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    return driver, dev, sms


def _granule(sms) -> int:
    """SM count granule of a partition, as the driver reports it (``minSmPartitionSize`` and
    ``smCoscheduledAlignment`` of the device's SM resource, newer drivers), else Hopper's 8."""
    sm = getattr(sms, "sm", None)
    sizes = [int(getattr(sm, k, 0) or 0) for k in ("minSmPartitionSize", "smCoscheduledAlignment")]
    return max(sizes + [1]) if any(sizes) else 8


def _driver_green_stream(driver, dev, sms, idx: int, n: int):
    """(ExternalStream, handles, SMs it got): a green context of ``n`` of the device's SMs and
    a non-blocking stream of it. Refuses a split that is smaller than ``n`` or leaves nothing
    free. The handles are returned to be kept: nothing here is ever destroyed."""
    groups, count, _rest = _check(driver.cuDevSmResourceSplitByCount(1, sms, 0, n))
    got = int(groups[0].sm.smCount) if count == 1 else 0
    if got < n or got >= int(sms.sm.smCount):
        raise RuntimeError(f"the driver split off {count} group(s) of {got} SMs for {n}")
    desc = _check(driver.cuDevResourceGenerateDesc([groups[0]], 1))
    green = _check(driver.cuGreenCtxCreate(desc, dev, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
    handle = _check(driver.cuGreenCtxStreamCreate(green, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
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


# Decode-bound steps: the reserve pays where the decoder's work fills the step. Measured on one
# H200 (commit 4221a99, LiT ViT-B/16 compiled, 65,536, 512-px photo shards, one call): decoder
# busy ~94 % of the step, 4,151 samples/s with no reserve, 4,613 with 4 SMs, 4,705 with 8; at
# 256 px, where the towers bound the step, 4 SMs cost 2.5-4 % (docs/benchmarks.md).
DECODE_BOUND_PCT = 90.0
SUGGESTED_RESERVE = 8


def decode_bound_hint(busy_pct: float, reserved_sms: int, step: int,
                      first_pass_pct: float = float("nan")) -> Optional[str]:
    """One paragraph for the log when the JPEG decoder worked ``busy_pct`` % of step ``step``
    or ``first_pass_pct`` % of its first pass (the gradient cache's; LiT decodes only there),
    either >= ``DECODE_BOUND_PCT`` (decoding bounds the step), and no SMs are kept for it;
    None otherwise, and for the first step (compile and warm-up distort it)."""
    shares = [p for p in (busy_pct, first_pass_pct) if p == p]  # (NaN: not measured)
    if step < 2 or reserved_sms > 0 or not shares or max(shares) < DECODE_BOUND_PCT:
        return None
    where = f"{busy_pct:.0f} % of step {step}"
    if first_pass_pct == first_pass_pct:
        where += f" ({first_pass_pct:.0f} % of its first pass)"
    return (f"note: the GPU JPEG decoder worked {where}, so decoding bounds the step. "
            f"data.decode_reserved_sms={SUGGESTED_RESERVE} keeps {SUGGESTED_RESERVE} SMs free of the towers for "
            f"its kernels (LiT ViT-B/16 on 512-px photos, one H200: +13 %); where the towers bound the step "
            f"it costs them 3-4 %.")
