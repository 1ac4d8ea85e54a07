"""Image transforms that end in uint8 tensors; normalization happens on the device.

open_clip's transforms end in ``ToTensor`` + ``Normalize`` and hand float32 CHW tensors to the
loader: 12 bytes per pixel through worker shared memory, pinned buffers and host-to-device
copies. Here the CPU side stops at ``PILToTensor`` (uint8, 3 bytes per pixel, 4x less) and
:class:`Normalizer` does ``x.float() / 255`` and the mean/std normalization on the device,
where it is a negligible elementwise op. With offload at 1M-sample steps this is the
difference between ~150 KB and ~600 KB of host memory per 224-px sample.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from open_clip.transform import AugmentationCfg, image_transform
from torchvision.transforms import Compose, Normalize, PILToTensor, RandomResizedCrop, ToTensor

from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

Transform = Callable[[object], torch.Tensor]


def _to_uint8(compose: Compose) -> Compose:
    """Replace the trailing ToTensor/Normalize of an open_clip transform by PILToTensor."""
    kept = [t for t in compose.transforms if not isinstance(t, (ToTensor, Normalize))]
    return Compose(kept + [PILToTensor()])


def train_transform(image_size: int, mean: Optional[Sequence[float]] = None,
                    std: Optional[Sequence[float]] = None,
                    aug_scale: Sequence[float] = (0.08, 1.0),
                    aug_ratio: Sequence[float] = (0.75, 1.3333333)) -> Transform:
    """open_clip's train transform (RandomResizedCrop with the paper's scale/ratio, RGB) -> uint8.

    ``mean``/``std`` are accepted for symmetry with open_clip but only used by :class:`Normalizer`.
    Returns a callable PIL.Image -> uint8 tensor (3, image_size, image_size).
    """
    aug = AugmentationCfg(scale=tuple(aug_scale))
    compose = image_transform(image_size, is_train=True, mean=mean, std=std, aug_cfg=aug)
    for t in compose.transforms:
        if isinstance(t, RandomResizedCrop):
            t.ratio = tuple(aug_ratio)  # open_clip's non-timm path leaves torchvision's default
    return _to_uint8(compose)


def val_transform(image_size: int, mean: Optional[Sequence[float]] = None,
                  std: Optional[Sequence[float]] = None, resize_mode: Optional[str] = None,
                  interpolation: Optional[str] = None) -> Transform:
    """open_clip's eval transform (resize shortest side, center crop, RGB) -> uint8 (3, S, S)."""
    compose = image_transform(image_size, is_train=False, mean=mean, std=std,
                              resize_mode=resize_mode, interpolation=interpolation)
    return _to_uint8(compose)


class Normalizer(torch.nn.Module):
    """On-device normalization of uint8 batches: (B,3,H,W) uint8 -> float (x/255 - mean)/std.

    ``dtype`` is the output dtype (float32 by default; bf16 halves activation memory of the
    stem input under autocast but keeps the op exact enough for 8-bit inputs).
    """

    def __init__(self, mean: Optional[Sequence[float]] = None, std: Optional[Sequence[float]] = None):
        super().__init__()
        mean = torch.tensor(mean or OPENAI_DATASET_MEAN, dtype=torch.float32).view(1, -1, 1, 1)
        std = torch.tensor(std or OPENAI_DATASET_STD, dtype=torch.float32).view(1, -1, 1, 1)
        # Fold /255 into the affine map: y = x * scale + shift.
        self.register_buffer("scale", 1.0 / (255.0 * std), persistent=False)
        self.register_buffer("shift", -mean / std, persistent=False)

    def forward(self, images: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if images.dtype != torch.uint8:
            raise TypeError(f"Normalizer expects uint8 images, got {images.dtype}")
        out = images.to(torch.float32) * self.scale + self.shift
        return out.to(dtype)

