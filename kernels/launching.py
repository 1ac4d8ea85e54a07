"""Host-side launch pieces shared by the kernel families: column splits and the strip backward.

``column_splits``: the forward kernels give each program BM rows and sweep columns; when
there are few row blocks (small b) the columns are split over extra programs so the GPU
fills (partials are merged on the host: O(splits * m) fp32).

``tma_ok`` / ``tma_programs``: the persistent TMA strip kernels' launch conditions and grid
(triton's allocator set for this thread and device).

``strip_backward``: out = (s dX) @ B computed strip by strip. A kernel family's ``fill``
writes P = s * dX for R rows into a scratch of the input dtype (bounded: ``rows`` * n
elements) and returns that strip's partial scalars (ds, ...); cuBLAS then forms
out[strip] (+)= P @ B. No register accumulator over the feature dim, so the fill kernel
can use GEMM-sized tiles and the update runs at cuBLAS speed. Its ``then`` hook runs a
second product from the same scratch (the one-pass backward: ``addmm_f32_`` of P^T @
A[strip] into an fp32 accumulator of the other direction's gradient).
"""

from __future__ import annotations

import functools
import threading
from typing import Callable

import torch
import triton
from torch import Tensor


def cdiv(x: int, y: int) -> int:
    return (x + y - 1) // y


_SM_BUDGET: dict[int, int] = {}  # device index -> SMs the loss may count on (set_sm_budget)


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device the loss's persistent grids are sized for:
    all of them, or the budget :func:`set_sm_budget` gave (cached: the loss is host-bound at
    small b)."""
    total = torch.cuda.get_device_properties(device).multi_processor_count
    return min(total, _SM_BUDGET.get(_index(device), total))


def set_sm_budget(device: torch.device, sms: int) -> None:
    """Size persistent grids for ``sms`` SMs of ``device`` from now on: the loss runs on a
    stream confined to that many (a green context, ``data.decode_reserved_sms``), where a
    grid for every SM would leave a second, mostly idle wave of programs."""
    _SM_BUDGET[_index(device)] = int(sms)
    sm_count.cache_clear()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def tma_ok(*ts: Tensor) -> bool:
    """TMA descriptors need 16-bit rows of unit last stride, 16-byte aligned base and rows."""
    return all(t.element_size() == 2 and t.stride(-1) == 1 and (t.stride(0) * 2) % 16 == 0
               and t.data_ptr() % 16 == 0 for t in ts)


_ALLOCATOR_SET = threading.local()  # .device: the device this thread's triton allocator was set for


def _set_allocator(device: torch.device) -> None:
    """Device-side tensor descriptors need a global scratch from triton's allocator (set once
    per device and thread, not per launch: triton keeps the allocator in a context variable,
    which each thread starts without -- autograd runs backward in its own thread, CUDA-graph
    capture in the caller's)."""
    if getattr(_ALLOCATOR_SET, "device", None) == device:
        return
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, device=device, dtype=torch.int8))
    _ALLOCATOR_SET.device = device


def tma_programs(device: torch.device, tiles: int, per_sm: int) -> int:
    """Programs of a persistent TMA kernel over ``tiles`` tiles (``per_sm`` per SM; 3 SMs off
    CUDA, so the interpreter tests the striding), with triton's allocator set for its
    descriptors."""
    _set_allocator(device)
    sms = sm_count(device) if device.type == "cuda" else 3
    return min(tiles, sms * per_sm)


def target_programs(device: torch.device) -> int:
    """Programs that fill the GPU (4 per SM); 4 off CUDA (the interpreter)."""
    if device.type != "cuda":
        return 4
    return 4 * sm_count(device)


def column_splits(row_blocks: int, length: int, bn: int, device: torch.device) -> tuple[int, int]:
    """(splits, columns per split) for ``length`` columns over ``row_blocks`` row blocks:
    enough programs to fill the GPU, each split a multiple of ``bn`` columns."""
    splits = max(1, min(cdiv(target_programs(device), row_blocks), cdiv(length, bn)))
    per = cdiv(cdiv(length, splits), bn) * bn
    return cdiv(length, per), per


_OUT_DTYPE_OK: dict = {}  # op -> whether op(..., out_dtype=torch.float32) works here (probed once)


def f32_out_ok(op, x: Tensor, y: Tensor) -> bool:
    """Whether ``op(x, y, out_dtype=torch.float32)`` (fp32 output of 16-bit tensor-core
    products: torch.mm / torch.bmm on CUDA) is supported by this torch; x, y: a tiny probe."""
    if op not in _OUT_DTYPE_OK:
        try:
            op(x, y, out_dtype=torch.float32)
            _OUT_DTYPE_OK[op] = True
        except (TypeError, RuntimeError):
            _OUT_DTYPE_OK[op] = False
    return _OUT_DTYPE_OK[op]


def mm_f32(p: Tensor, b: Tensor) -> Tensor:
    """p @ b with an fp32 result: on CUDA 16-bit inputs run on tensor cores with fp32 output
    (``torch.mm(out_dtype=)``), elsewhere the product of the upcast operands."""
    if p.dtype == torch.float32 or not p.is_cuda:
        return torch.mm(p.float(), b.float())
    if f32_out_ok(torch.mm, p[:1], b):
        return torch.mm(p, b, out_dtype=torch.float32)
    return torch.mm(p, b).float()


def product_into(out: Tensor, p: Tensor, b: Tensor, accumulate: bool) -> None:
    """out (+)= p @ b, with one rounding to out's dtype. Accumulating a 16-bit product into a
    contiguous fp32 ``out`` (the ring's fp32 dI sum) goes through ``addmm_f32_``: in place,
    no fp32 (rows, c) temporary on CUDA."""
    if accumulate and out.dtype == torch.float32 and p.dtype != out.dtype and out.is_contiguous():
        addmm_f32_(out, p, b)
        return
    if out.dtype == p.dtype and out.is_contiguous():
        if accumulate:
            out.addmm_(p, b)
        else:
            torch.mm(p, b, out=out)
        return
    prod = mm_f32(p, b) if out.dtype != p.dtype else torch.mm(p, b)
    out.add_(prod) if accumulate else out.copy_(prod)


ADDMM_CHUNK_BYTES = 16 << 20  # fp32 temporary of ``addmm_f32_``'s fallback (no fp32-output GEMM)


def addmm_f32_(acc: Tensor, p: Tensor, b: Tensor) -> None:
    """acc += p @ b, acc fp32 (or fp64 with fp64 operands): the one-pass backward's
    accumulator product. On CUDA, 16-bit operands go through one cuBLAS call that reads and
    writes acc in fp32 (``torch.addmm(out_dtype=torch.float32)``: 16-bit tensor-core
    inputs, fp32 accumulate and C); elsewhere (or on a torch without it) the fp32 product
    is formed in row chunks of at most ADDMM_CHUNK_BYTES and added."""
    if p.dtype == acc.dtype:
        acc.addmm_(p, b)
        return
    if addmm_f32_in_place(p, b):
        torch.addmm(acc, p, b, out_dtype=torch.float32, out=acc)
        return
    step = max(1, ADDMM_CHUNK_BYTES // (4 * max(1, b.shape[1])))
    for lo in range(0, p.shape[0], step):
        acc[lo:lo + step].add_(mm_f32(p[lo:lo + step], b))


def addmm_f32_in_place(p: Tensor, b: Tensor) -> bool:
    """Whether ``addmm_f32_`` of 16-bit p, b sums into its fp32 accumulator with no temporary
    here (CUDA and a torch whose addmm writes an fp32 C in place); else its chunked fallback."""
    return p.is_cuda and f32_out_ok(_addmm_f32_probe, p[:1, :1], b[:1, :1])


def _addmm_f32_probe(x: Tensor, y: Tensor, out_dtype) -> Tensor:
    """``f32_out_ok``'s probe of ``addmm_f32_``: torch.addmm writing an fp32 C in place."""
    acc = torch.ones(x.shape[0], y.shape[1], device=x.device, dtype=out_dtype)
    torch.addmm(acc, x, y, out_dtype=out_dtype, out=acc)
    if not torch.allclose(acc, 1 + torch.mm(x.float(), y.float())):  # (aliasing C and out must work)
        raise RuntimeError("torch.addmm(out=C) with an fp32 C does not accumulate")
    return acc


def fp32_accumulator(out: Tensor, accumulate: bool) -> Tensor:
    """The fp32 buffer a one-pass backward sums ``out``'s gradient in over the strips: ``out``
    itself when it is contiguous fp32 (zeroed first unless ``accumulate``), else fresh zeros
    of its shape, rounded into ``out`` once by ``finish_accumulator``."""
    if out.dtype == torch.float32 and out.is_contiguous():
        return out if accumulate else out.zero_()
    return torch.zeros(out.shape, device=out.device, dtype=torch.float32)


def finish_accumulator(out: Tensor, acc: Tensor, accumulate: bool) -> None:
    """out (+)= acc, once, when ``acc`` is not ``out`` itself (see ``fp32_accumulator``)."""
    if acc is not out:
        out.add_(acc) if accumulate else out.copy_(acc)


def strip_backward(a: Tensor, b: Tensor, out: Tensor | None, rows: int, accumulate: bool,
                   fill: Callable[[int, int, Tensor], Tensor | None], alloc=torch.empty,
                   fixup: Callable[[int, int, Tensor], None] | None = None,
                   then: Callable[[int, int, Tensor], None] | None = None) -> Tensor | None:
    """out (+)= (s dX) @ b over the rows of ``a``, ``rows`` at a time; returns the sum over
    strips of what ``fill`` returned (None if it returns None: it keeps its partials itself).

    fill(r0, r, scratch) writes P = s * dX[r0:r0 + r] into scratch[:r] (input dtype) and
    returns that strip's partials (a tensor of a fixed shape) or None. fixup(r0, r, prod), if
    given, adds to the strip's fp32 product (r, c) before its one rounding to out's dtype
    (then the product goes through an fp32 (rows, c) temporary). then(r0, r, scratch), if
    given, runs once the strip's product is done and before the next fill: the one-pass
    backward's second product, P^T @ a[strip], from the same scratch. ``out`` None: no first
    product (and no fixup) at all, only the fills and ``then`` (a one-pass backward whose rows'
    gradient is not wanted)."""
    m, n = a.shape[0], b.shape[0]
    rows = max(1, min(rows, m))
    scratch = alloc(rows, n, device=a.device, dtype=a.dtype)
    parts = []
    for r0 in range(0, m, rows):
        r = min(rows, m - r0)
        parts.append(fill(r0, r, scratch))
        if out is not None and fixup is None:
            product_into(out[r0:r0 + r], scratch[:r], b, accumulate)
        elif out is not None:
            prod = mm_f32(scratch[:r], b)
            fixup(r0, r, prod)
            out[r0:r0 + r].add_(prod) if accumulate else out[r0:r0 + r].copy_(prod)
        if then is not None:
            then(r0, r, scratch)
    parts = [p for p in parts if p is not None]
    return torch.stack(parts).sum(0) if parts else None
