"""``task=simclr``: self-supervised image-only training with the NT-Xent loss.

The step engine is built for two towers (image, text slots). SimCLR reuses it unchanged:

* ``SimCLRModel`` wraps an open_clip image tower with a projection head (Linear, GELU,
  Linear; no BatchNorm, so the gradient-cache replay recomputes exactly the same
  activations). Its image slot takes view 1 (normalized by the engine), its text slot takes
  view 2 as uint8 (normalized here); both go through the same tower and head. Its
  ``logit_scale`` is a frozen ln(1 / temperature) so the logging and clamping code that reads
  it keeps working; the loss uses ``loss.temperature``.
* ``two_views`` makes the two augmented views of every image of the step's batch on the
  step's device: independent random resized crops (scale [0.2, 1]) and horizontal flips
  through one batched ``grid_sample``, then brightness / contrast / saturation jitter and
  random grayscale (p = 0.2), as SimCLR's recipe. Its RNG is seeded by (seed, step, rank),
  so a resumed run sees the same views.
* ``build_loss`` for ``loss.kind=nt_xent`` concatenates the two slots: [views 1; views 2].
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

HEAD_HIDDEN_MULT = 2  # projection head: d -> 2d -> d (SimCLR uses an MLP of width ~ the features)


class SimCLRModel(nn.Module):
    """Image tower + projection head; forward(image=view 1, text=view 2 uint8) -> CLIP-style dict."""

    def __init__(self, visual: nn.Module, dim: int, temperature: float, mean, std):
        super().__init__()
        from infclip.data.transforms import Normalizer

        self.visual = visual
        self.head = nn.Sequential(nn.Linear(dim, HEAD_HIDDEN_MULT * dim), nn.GELU(),
                                  nn.Linear(HEAD_HIDDEN_MULT * dim, dim))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / temperature)), requires_grad=False)
        self.normalizer = Normalizer(mean, std)

    def encode_image(self, images: Tensor, normalize: bool = False) -> Tensor:
        z = self.head(self.visual(images))
        return F.normalize(z, dim=-1) if normalize else z

    def forward(self, image: Optional[Tensor] = None, text: Optional[Tensor] = None) -> dict:
        out = {"image_features": None, "text_features": None, "logit_scale": self.logit_scale.exp()}
        if image is not None:
            out["image_features"] = self.encode_image(image, normalize=True)
        if text is not None:  # view 2, uint8 (the engine only normalizes the image slot)
            out["text_features"] = self.encode_image(self.normalizer(text), normalize=True)
        return out


def wrap_model(built: Any, temperature: float) -> Any:
    """``BuiltModel`` whose model is the SimCLR image tower + head (the text tower is dropped)."""
    visual = built.model.visual
    model = SimCLRModel(visual, _feature_dim(visual, built.image_size), temperature, built.mean, built.std)
    model.to(next(visual.parameters()).device)
    return dataclasses.replace(built, model=model)


def _feature_dim(visual: nn.Module, image_size: int) -> int:
    """The tower's output width (ViT: ``output_dim``; any tower: one probe forward in eval mode)."""
    dim = getattr(visual, "output_dim", None)
    if isinstance(dim, int):
        return dim
    was_training = visual.training
    visual.eval()
    with torch.no_grad():
        probe = torch.zeros(1, 3, image_size, image_size, device=next(visual.parameters()).device)
        dim = visual(probe).shape[-1]
    visual.train(was_training)
    return dim


def two_views(images: Tensor, seed: int) -> tuple[Tensor, Tensor]:
    """(view 1, view 2) uint8 (B, 3, H, W): independent SimCLR augmentations of ``images``."""
    g = torch.Generator(device=images.device).manual_seed(seed)
    return _augment(images, g), _augment(images, g)


def _augment(images: Tensor, g: torch.Generator) -> Tensor:
    b, dev = images.shape[0], images.device
    x = images.float() / 255.0
    x = F.grid_sample(x, _crop_grids(b, images.shape[-2:], g, dev), mode="bilinear", align_corners=False)
    x = _color_jitter(x, g)
    return (x.clamp(0, 1) * 255.0).round().to(torch.uint8)


def _rand(b: int, g: torch.Generator, dev, lo: float = 0.0, hi: float = 1.0) -> Tensor:
    return lo + (hi - lo) * torch.rand(b, generator=g, device=dev)


def _crop_grids(b: int, size, g: torch.Generator, dev) -> Tensor:
    """Sampling grids of random resized crops (area [0.2, 1], ratio [3/4, 4/3]) + flips."""
    area = _rand(b, g, dev, 0.2, 1.0)
    ratio = torch.exp(_rand(b, g, dev, math.log(3 / 4), math.log(4 / 3)))
    w = torch.sqrt(area * ratio).clamp(max=1.0)
    h = torch.sqrt(area / ratio).clamp(max=1.0)
    cx = (_rand(b, g, dev) * 2 - 1) * (1 - w)
    cy = (_rand(b, g, dev) * 2 - 1) * (1 - h)
    flip = torch.where(_rand(b, g, dev) < 0.5, -1.0, 1.0)
    theta = torch.zeros(b, 2, 3, device=dev)
    theta[:, 0, 0], theta[:, 0, 2] = w * flip, cx
    theta[:, 1, 1], theta[:, 1, 2] = h, cy
    return F.affine_grid(theta, (b, 3, *size), align_corners=False)


def _color_jitter(x: Tensor, g: torch.Generator) -> Tensor:
    """Brightness, contrast, saturation in [0.6, 1.4] (p = 0.8), grayscale (p = 0.2)."""
    b, dev = x.shape[0], x.device
    on = (_rand(b, g, dev) < 0.8).float().view(b, 1, 1, 1)
    bright, contrast, sat = (_rand(b, g, dev, 0.6, 1.4).view(b, 1, 1, 1) for _ in range(3))
    gray = (x * torch.tensor([0.299, 0.587, 0.114], device=dev).view(1, 3, 1, 1)).sum(1, keepdim=True)
    y = x * bright
    y = (y - y.mean((1, 2, 3), keepdim=True)) * contrast + y.mean((1, 2, 3), keepdim=True)
    y = gray * bright + (y - gray * bright) * sat
    x = on * y + (1 - on) * x
    to_gray = (_rand(b, g, dev) < 0.2).float().view(b, 1, 1, 1)
    gray = (x * torch.tensor([0.299, 0.587, 0.114], device=dev).view(1, 3, 1, 1)).sum(1, keepdim=True)
    return to_gray * gray.expand_as(x) + (1 - to_gray) * x


def step_seed(seed: int, step: int, rank: int) -> int:
    """Deterministic per (run seed, step, rank): resumed runs make the same views."""
    return (seed * 1_000_003 + step * 10_007 + rank) % (2**63 - 1)
