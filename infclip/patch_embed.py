"""A ViT's patch embedding as one matrix product on the GPU (``model.patch_embed_matmul``).

The patchify convolution (kernel = stride = p, no padding, e.g. open_clip's ``visual.conv1``
and timm's ``patch_embed.proj``) is a plain GEMM: each non-overlapping p x p patch of the
image, flattened in the weight's (channel, row, column) order, times the weight viewed as
(out, C*p*p). cuDNN's heuristics pick a generic implicit-GEMM kernel for it in bf16 on
Hopper (``precomputed_convolve_sgemm``, 8-9 ms per 1,024 images at 224 px, H200, about 30
TFLOP/s; its weight gradient ``wgrad_alg1_engine`` 10 ms): 0.9 s of a ViT-B/32 32k step's
7.6 s. As a GEMM it runs at matmul rate (well under a millisecond).

:func:`patchify_as_matmul` re-classes such convolutions in place (same module, same
``weight`` Parameter, same state-dict keys; checkpoints and open_clip see nothing new).
Invariant: the output equals the convolution's up to summation order (float64: 1e-12). It
takes the GEMM only on CUDA in bf16/fp16 (autocast or a low-precision input); in fp32, off
CUDA, or for an input whose sides are not multiples of p, it *is* the convolution.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def patch_matmul(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``conv2d(x, weight, bias, stride=kernel)`` as one GEMM: x (B, C, H, W) with H, W
    multiples of the kernel (p, q); weight (out, C, p, q) -> (B, out, H/p, W/q), a view of
    a (B, H/p, W/q, out) result (its two spatial dims merge without a copy)."""
    out, _, p, q = weight.shape
    b, c, h, w = x.shape
    gh, gw = h // p, w // q
    patches = x.reshape(b, c, gh, p, gw, q).permute(0, 2, 4, 1, 3, 5).reshape(b * gh * gw, c * p * q)
    y = F.linear(patches, weight.reshape(out, -1), bias)  # (B*gh*gw, out)
    return y.reshape(b, gh, gw, out).permute(0, 3, 1, 2)


def low_precision(x: Tensor) -> bool:
    """Whether the convolution of ``x`` would compute in bf16/fp16 (autocast or the dtype)."""
    return torch.is_autocast_enabled(x.device.type) or x.dtype in (torch.bfloat16, torch.float16)


class PatchMatmulConv2d(nn.Conv2d):
    """``nn.Conv2d`` with kernel = stride, padding 0: on CUDA in bf16/fp16,
    :func:`patch_matmul`; in fp32 (e.g. the eval command's default precision, whose numbers
    match open_clip's to the last digit) and off CUDA, the convolution itself."""

    def forward(self, x: Tensor) -> Tensor:  # (B, C, H, W) -> (B, out, H/p, W/q)
        p, q = self.kernel_size
        if not x.is_cuda or not low_precision(x) or x.shape[-2] % p or x.shape[-1] % q:
            return super().forward(x)
        return patch_matmul(x, self.weight, self.bias)  # under autocast F.linear casts as conv2d would


def is_patchify(m: nn.Module) -> bool:
    """A 2-D convolution that cuts an image into patches: kernel = stride > 1, no padding,
    dilation 1, one group, zeros padding mode, at most 4 input channels (RGB(A), grey). The
    1x1 convolutions of ResNets (kernel = stride = 1) are left alone."""
    return (type(m) is nn.Conv2d and m.kernel_size == m.stride and m.kernel_size != (1, 1)
            and m.in_channels <= 4 and m.padding == (0, 0) and m.dilation == (1, 1) and m.groups == 1
            and m.padding_mode == "zeros")


def patchify_as_matmul(model: nn.Module) -> list[str]:
    """Re-class every patchify convolution of ``model`` as :class:`PatchMatmulConv2d`, in
    place; returns their qualified names."""
    names = []
    for name, m in model.named_modules():
        if is_patchify(m):
            m.__class__ = PatchMatmulConv2d
            names.append(name)
    return names
