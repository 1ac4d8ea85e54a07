"""Crop-and-resize of a batch of decoded images in one launch (the GPU JPEG path's resize).

Math (PIL's antialiased bicubic resampling, as torchvision's ``resized_crop`` on a PIL image):
image n is cropped to the box ``(top, left, h, w)`` and resized to ``S x S``. Along an axis
with crop start ``s``, crop length ``L`` and image size ``N``, output pixel ``i`` reads input
pixels ``j`` in ``[s, s + L)`` (and ``< N``) with weights

    scale = L / S,  support = max(scale, 1),  center_i = s + (i + 0.5) * scale
    w_ij = cubic(|j + 0.5 - center_i| / support) / sum_j(...)      (cubic: a = -0.5, 0 past 2)

The horizontal pass runs first and is rounded to 8-bit levels, as PIL's two-pass resampler
does; the vertical pass is rounded (half up) and clamped to ``0..255``.

Inputs: a list of ``(H_n, W_n, 3)`` uint8 images (any strides: interleaved RGB as nvImageCodec
returns it, with or without row padding, or planar views as nvJPEG's) on one device, each of
its own size, and
``boxes`` int64 ``(n, 4)``. Output: uint8 ``(n, 3, S, S)``.

:func:`resized_crop_reference` is the plain PyTorch statement of the math (two batched matmuls
over a zero-padded canvas, float32). :func:`resized_crop` is the Triton kernel: it reads each
image through its own device pointer, so there is no canvas, no per-image copy and no
per-image launch on the host -- the host work per micro-batch is one small index array. A
program computes ``BY`` output rows x all ``S`` columns x 3 channels of one image: for each
input row the block needs, it forms that row's horizontal pass (only the filter's taps, not
the whole row as the matmul does) and adds it into the ``BY`` output rows with their vertical
weights. No autograd: the images are data, not parameters.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

META = 10  # per-image int64 index: [pointer, top, left, h, w, H, W, row, pixel and channel strides]
BY = 16  # output rows per program: 16 x 256 columns x 3 channels of fp32 accumulators


# ------------------------------------------------------------------ reference (PyTorch)
def bicubic_weights(start: Tensor, length: Tensor, out: int, size: int) -> Tensor:
    """Resampling matrices (B, out, size) float32 on ``start``'s device: row i of image n holds
    the weights of input pixels ``[start_n, start_n + length_n)`` for output pixel i (module
    docstring). Columns outside the crop, and at or past ``size``, are 0; rows sum to 1."""
    start, length = start.float(), length.float()
    dev = start.device
    scale = (length / out)[:, None, None]  # input pixels per output pixel
    support = scale.clamp(min=1.0)
    center = start[:, None, None] + (torch.arange(out, dtype=torch.float32, device=dev)[None, :, None] + 0.5) * scale
    j = torch.arange(size, dtype=torch.float32, device=dev)[None, None, :]
    x = ((j + 0.5 - center) / support).abs()
    a = -0.5
    w = torch.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                    torch.where(x < 2, (((x - 5) * x + 8) * x - 4) * a, torch.zeros_like(x)))
    inside = (j >= start[:, None, None]) & (j < (start + length)[:, None, None])
    w = w * inside
    return w / w.sum(-1, keepdim=True).clamp(min=1e-12)


def _round_level(x: Tensor) -> Tensor:
    """Round half up and clamp to 8-bit levels (PIL's clip8), keeping the dtype."""
    return (x + 0.5).floor_().clamp_(0, 255)


def resized_crop_reference(images: Sequence[Tensor], boxes: Tensor, size: int) -> Tensor:
    """(n, 3, size, size) uint8: each (H, W, 3) uint8 image cropped to its box (top, left, h, w)
    and resized (module docstring), as two float32 batched matmuls over a padded canvas."""
    dev = images[0].device if len(images) else boxes.device
    if not len(images):
        return torch.empty((0, 3, size, size), dtype=torch.uint8, device=dev)
    hmax, wmax = max(im.shape[0] for im in images), max(im.shape[1] for im in images)
    canvas = torch.zeros((len(images), 3, hmax, wmax), dtype=torch.float32, device=dev)
    for c, im in zip(canvas, images):  # padding columns get zero weight
        c[:, :im.shape[0], :im.shape[1]] = im.permute(2, 0, 1)
    top, left, h, w = boxes.to(dev).unbind(1)
    ry = bicubic_weights(top, h, size, hmax)  # (n, S, H)
    rx = bicubic_weights(left, w, size, wmax)  # (n, S, W)
    tmp = _round_level(torch.matmul(canvas, rx.transpose(1, 2)[:, None]))  # horizontal: (n, 3, H, S)
    return _round_level(torch.matmul(ry[:, None], tmp)).to(torch.uint8)  # vertical: (n, 3, S, S)


# ------------------------------------------------------------------ kernel
@triton.jit
def _cubic(x):
    """PIL's bicubic kernel (a = -0.5) at |offset| ``x``; 0 from 2 on."""
    a: tl.constexpr = -0.5
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    far = (((x - 5.0) * x + 8.0) * x - 4.0) * a
    return tl.where(x < 1.0, near, tl.where(x < 2.0, far, 0.0))


@triton.jit
def _resized_crop_kernel(meta, out, S, BY: tl.constexpr, BX: tl.constexpr):
    n = tl.program_id(0)
    yb = tl.program_id(1)
    m = meta + n * 10
    base = tl.load(m).to(tl.pointer_type(tl.uint8))
    top = tl.load(m + 1)
    left = tl.load(m + 2)
    h = tl.load(m + 3)
    w = tl.load(m + 4)
    H = tl.load(m + 5)
    W = tl.load(m + 6)
    pitch = tl.load(m + 7)
    px_stride = tl.load(m + 8)
    ch_stride = tl.load(m + 9)
    sy = h.to(tl.float32) / S
    sx = w.to(tl.float32) / S
    supy = tl.maximum(sy, 1.0)
    supx = tl.maximum(sx, 1.0)
    # -- columns: each output column's first tap and the taps' count (same for all rows) --
    xs = tl.arange(0, BX)
    xok = xs < S
    cx = left.to(tl.float32) + (xs.to(tl.float32) + 0.5) * sx
    x0 = tl.maximum(tl.floor(cx - 2.0 * supx - 0.5).to(tl.int64), left)
    xend = tl.minimum(left + w, W)
    ntx = tl.ceil(4.0 * supx).to(tl.int32) + 2
    wxsum = tl.zeros((BX,), tl.float32)
    for k in range(0, ntx):
        j = x0 + k
        wxsum += tl.where(xok & (j < xend), _cubic(tl.abs(j.to(tl.float32) + 0.5 - cx) / supx), 0.0)
    wxsum = tl.maximum(wxsum, 1e-12)
    # -- rows: this block's output rows and the input rows they read --
    ys = yb * BY + tl.arange(0, BY)
    yok = ys < S
    cy = top.to(tl.float32) + (ys.to(tl.float32) + 0.5) * sy
    y_first = yb * BY
    y_last = tl.minimum(y_first + BY - 1, S - 1)
    cy0 = top.to(tl.float32) + (y_first.to(tl.float32) + 0.5) * sy
    cy1 = top.to(tl.float32) + (y_last.to(tl.float32) + 0.5) * sy
    r0 = tl.maximum(tl.floor(cy0 - 2.0 * supy - 0.5).to(tl.int64), top)
    r1 = tl.minimum(tl.minimum(tl.floor(cy1 + 2.0 * supy + 0.5).to(tl.int64) + 1, top + h), H)
    acc_r = tl.zeros((BY, BX), tl.float32)
    acc_g = tl.zeros((BY, BX), tl.float32)
    acc_b = tl.zeros((BY, BX), tl.float32)
    wysum = tl.zeros((BY,), tl.float32)
    for r in range(r0, r1):
        # -- compute tile: input row r's horizontal pass, rounded to 8-bit levels (PIL) --
        row = base + r * pitch
        hr = tl.zeros((BX,), tl.float32)
        hg = tl.zeros((BX,), tl.float32)
        hb = tl.zeros((BX,), tl.float32)
        for k in range(0, ntx):
            j = x0 + k
            ok = xok & (j < xend)
            wx = tl.where(ok, _cubic(tl.abs(j.to(tl.float32) + 0.5 - cx) / supx), 0.0)
            px = row + j * px_stride
            hr += wx * tl.load(px, mask=ok, other=0).to(tl.float32)
            hg += wx * tl.load(px + ch_stride, mask=ok, other=0).to(tl.float32)
            hb += wx * tl.load(px + 2 * ch_stride, mask=ok, other=0).to(tl.float32)
        hr = tl.minimum(tl.maximum(tl.floor(hr / wxsum + 0.5), 0.0), 255.0)
        hg = tl.minimum(tl.maximum(tl.floor(hg / wxsum + 0.5), 0.0), 255.0)
        hb = tl.minimum(tl.maximum(tl.floor(hb / wxsum + 0.5), 0.0), 255.0)
        # -- into the block's output rows with their vertical weights --
        wy = _cubic(tl.abs((r + 0.5) - cy) / supy)  # (r: an int in the interpreter)
        wysum += wy
        acc_r += wy[:, None] * hr[None, :]
        acc_g += wy[:, None] * hg[None, :]
        acc_b += wy[:, None] * hb[None, :]
    wysum = tl.maximum(wysum, 1e-12)
    plane = S * S
    o = out + n * 3 * plane + ys[:, None] * S + xs[None, :]
    ok2 = yok[:, None] & xok[None, :]
    tl.store(o, tl.minimum(tl.maximum(tl.floor(acc_r / wysum[:, None] + 0.5), 0.0), 255.0).to(tl.uint8), mask=ok2)
    tl.store(o + plane, tl.minimum(tl.maximum(tl.floor(acc_g / wysum[:, None] + 0.5), 0.0), 255.0).to(tl.uint8),
             mask=ok2)
    tl.store(o + 2 * plane, tl.minimum(tl.maximum(tl.floor(acc_b / wysum[:, None] + 0.5), 0.0), 255.0).to(tl.uint8),
             mask=ok2)


def crop_index(images: Sequence[Tensor], boxes: Tensor) -> Tensor:
    """int64 (n, 10) host index ``[pointer, top, left, h, w, H, W, row stride, pixel stride,
    channel stride]`` of ``images`` (each (H, W, 3) uint8, any strides), checked."""
    for im in images:
        if im.dtype != torch.uint8 or im.dim() != 3 or im.shape[2] != 3:
            raise ValueError(f"resized_crop takes (H, W, 3) uint8 images, got {im.dtype} {tuple(im.shape)}")
    geo = torch.tensor([(im.data_ptr(), im.shape[0], im.shape[1], *im.stride()) for im in images],
                       dtype=torch.int64).reshape(-1, 6)
    boxes = boxes.to(torch.int64).cpu()
    top, left, h, w = boxes.unbind(1)
    if ((top < 0) | (left < 0) | (h < 1) | (w < 1) | (top + h > geo[:, 1]) | (left + w > geo[:, 2])).any():
        raise ValueError("resized_crop: a crop box lies outside its image")
    return torch.cat([geo[:, :1], boxes, geo[:, 1:]], 1)


def resized_crop(images: Sequence[Tensor], boxes: Tensor, size: int, out: Tensor | None = None) -> Tensor:
    """The Triton kernel's (n, 3, size, size) uint8 (module docstring), in the current stream.

    The images must stay alive until the kernel has run (the caller's stream order)."""
    dev = images[0].device if len(images) else boxes.device
    if out is None:
        out = torch.empty((len(images), 3, size, size), dtype=torch.uint8, device=dev)
    if not len(images):
        return out
    if size > 1024:
        raise ValueError(f"resized_crop: output side {size} > 1024 (one program spans a whole row)")
    meta = crop_index(images, boxes)
    if dev.type == "cuda":
        meta = meta.pin_memory().to(dev, non_blocking=True)  # the copy is stream-ordered
    grid = (len(images), triton.cdiv(size, BY))
    _resized_crop_kernel[grid](meta, out, size, BY=BY, BX=triton.next_power_of_2(size), num_warps=4)
    return out
