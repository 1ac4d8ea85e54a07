"""Image transforms that end in uint8 tensors; normalization happens on the device.

open_clip's transforms end in ``ToTensor`` + ``Normalize`` and hand float32 CHW tensors to the
loader: 12 bytes per pixel through worker shared memory, pinned buffers and host-to-device
copies. Here the CPU side stops at ``PILToTensor`` (uint8, 3 bytes per pixel, 4x less) and
:class:`Normalizer` does ``x.float() / 255`` and the mean/std normalization on the device,
where it is a negligible elementwise op. With offload at 1M-sample steps this is the
difference between ~150 KB and ~600 KB of host memory per 224-px sample.
"""

from __future__ import annotations

import io
from typing import Callable, Optional, Sequence, Union

import torch
from open_clip.transform import AugmentationCfg, image_transform
from open_clip.transform import color_jitter as oc_color_jitter
from open_clip.transform import gray_scale as oc_gray_scale
from timm.data.random_erasing import RandomErasing
from PIL import Image
from torchvision.transforms import Compose, InterpolationMode, Normalize, PILToTensor, RandomResizedCrop, ToTensor
from torchvision.transforms import functional as F

from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

Transform = Callable[[object], torch.Tensor]


def _to_uint8(compose: Compose) -> Compose:
    """Replace the trailing ToTensor/Normalize of an open_clip transform by PILToTensor."""
    kept = [t for t in compose.transforms if not isinstance(t, (ToTensor, Normalize))]
    return Compose(kept + [PILToTensor()])


def train_transform(image_size: int, mean: Optional[Sequence[float]] = None,
                    std: Optional[Sequence[float]] = None,
                    aug_scale: Sequence[float] = (0.08, 1.0),
                    aug_ratio: Sequence[float] = (0.75, 1.3333333), draft: bool = True, *,
                    color_jitter: Sequence[float] = (), color_jitter_prob: float = 1.0,
                    gray_scale_prob: float = 0.0, re_prob: float = 0.0, re_count: int = 1,
                    use_timm: bool = False, interpolation: Optional[str] = None) -> Transform:
    """open_clip's train transform (RandomResizedCrop with the paper's scale/ratio, RGB) -> uint8.

    ``mean``/``std`` feed :class:`Normalizer` and random erasing's noise (drawn in normalized
    space). ``draft=True``: a :class:`DraftRandomResizedCrop` (same crops, same RNG use; decodes
    JPEGs at 1/2, 1/4 or 1/8 scale when the crop allows it; takes the encoded bytes). ``draft=False``:
    open_clip's Compose, a callable PIL.Image -> uint8 tensor (3, image_size, image_size).

    The rest are open_clip's AugmentationCfg (``data.color_jitter`` ... in infclip/data/config.py):
    colour jitter and greyscale (open_clip's ``color_jitter`` / ``gray_scale``, applied to the
    uint8 crop), then random erasing (:class:`UInt8RandomErasing`). ``use_timm``: open_clip's
    timm pipeline (``image_transform`` with ``use_timm``), ending in uint8 likewise; ``draft`` is
    not used. All draw from torch's and Python's RNGs, which the loader seeds per batch.
    """
    jitter = _jitter(color_jitter)
    if use_timm:
        return _timm_transform(image_size, mean, std, aug_scale, aug_ratio, jitter, re_prob, re_count, interpolation)
    if draft:
        crop: Transform = DraftRandomResizedCrop(image_size, aug_scale, aug_ratio)
    else:
        compose = image_transform(image_size, is_train=True, mean=mean, std=std, aug_cfg=AugmentationCfg(
            scale=tuple(aug_scale)))
        for t in compose.transforms:
            if isinstance(t, RandomResizedCrop):
                t.ratio = tuple(aug_ratio)  # open_clip's non-timm path leaves torchvision's default
        crop = _to_uint8(compose)
    extras: list[Transform] = []
    if jitter and color_jitter_prob > 0:
        extras.append(oc_color_jitter(*jitter, p=color_jitter_prob))
    if gray_scale_prob > 0:
        extras.append(oc_gray_scale(gray_scale_prob))
    if re_prob > 0:
        extras.append(UInt8RandomErasing(RandomErasing(re_prob, mode="pixel", max_count=re_count, device="cpu"),
                                         mean, std))
    return Augmented(crop, extras) if extras else crop


def _jitter(values: Sequence[float]) -> tuple[float, ...]:
    """data.color_jitter as (brightness, contrast, saturation, hue); () when off (timm's reading
    of one value s: (s, s, s); of three: hue 0)."""
    values = tuple(float(v) for v in values)
    if not any(values):
        return ()
    if len(values) == 1:
        values = values * 3
    return values + (0.0,) * (4 - len(values))


def _timm_transform(image_size, mean, std, scale, ratio, jitter, re_prob, re_count, interpolation) -> Transform:
    """open_clip's ``use_timm`` pipeline with ToTensor/Normalize replaced by PILToTensor and
    timm's RandomErasing (which works on normalized floats) by :class:`UInt8RandomErasing`."""
    aug = AugmentationCfg(scale=tuple(scale), ratio=tuple(ratio), color_jitter=jitter or None,
                          re_prob=re_prob or None, re_count=re_count if re_prob else None, use_timm=True)
    compose = image_transform(image_size, is_train=True, mean=mean, std=std, interpolation=interpolation,
                              aug_cfg=aug)
    kept = [t for t in compose.transforms if not isinstance(t, (ToTensor, Normalize, RandomErasing))]
    erase = [UInt8RandomErasing(t, mean, std) for t in compose.transforms if isinstance(t, RandomErasing)]
    return Compose(kept + [PILToTensor()] + erase)


class Augmented:
    """A crop (PIL image or encoded bytes -> uint8 (3, S, S)) followed by uint8 tensor ops."""

    def __init__(self, crop: Transform, extras: Sequence[Transform]):
        self.crop, self.extras = crop, list(extras)
        self.decodes_bytes = getattr(crop, "decodes_bytes", False)  # the loader passes what the crop takes

    def __call__(self, image: object) -> torch.Tensor:
        out = self.crop(image)
        for t in self.extras:
            out = t(out)
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.crop!r}, {self.extras!r})"


class UInt8RandomErasing:
    """timm's RandomErasing on a uint8 image, in the loader worker.

    timm erases after Normalize (box pixels ~ N(0, 1) per pixel in normalized space, re_mode
    'pixel'). Here the boxes and noise come from the same timm object and the same RNG draws
    (Python's ``random`` for the boxes, torch's for the noise), drawn on a NaN canvas; the drawn
    values are mapped back to pixels, ``(z * std + mean) * 255``, rounded and clamped to [0, 255].
    Pixels outside the boxes are untouched, so the step's uint8 batch stays what both
    gradient-cache passes and a resumed run read.
    """

    def __init__(self, erase: RandomErasing, mean: Optional[Sequence[float]] = None,
                 std: Optional[Sequence[float]] = None):
        self.erase = erase
        self.mean = torch.tensor(mean or OPENAI_DATASET_MEAN, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std or OPENAI_DATASET_STD, dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        canvas = torch.full(img.shape, float("nan"), dtype=torch.float32)
        self.erase(canvas)
        boxes = ~canvas.isnan()
        if not boxes.any():
            return img
        pixels = ((canvas * self.std + self.mean) * 255.0).round().clamp(0, 255).to(torch.uint8)
        return torch.where(boxes, pixels, img)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.erase!r})"


class ImageDecodeError(Exception):
    """The encoded image could not be decoded (corrupt, truncated, unknown format)."""


def draft_factor(crop_w: float, crop_h: float, size: int) -> int:
    """The largest JPEG DCT reduction r in {8, 4, 2, 1} with crop_w / r >= size and
    crop_h / r >= size: the reduced decode still has at least ``size`` pixels across the crop
    in both directions, so the resize that follows only shrinks (never enlarges)."""
    for r in (8, 4, 2):
        if crop_w / r >= size and crop_h / r >= size:
            return r
    return 1


def draft_open(img: Image.Image, crop_w: float, crop_h: float, size: int) -> int:
    """Configure an unloaded JPEG (RGB/YCbCr or L) to decode at 1/r scale, r = draft_factor;
    returns the reduction PIL applied (1: none; other formats and modes, e.g. PNG, CMYK, and
    loaded images decode in full). The image's size becomes ceil(W / r) x ceil(H / r)."""
    r = draft_factor(crop_w, crop_h, size)
    if r == 1 or img.format not in ("JPEG", "MPO") or img.mode not in ("RGB", "L"):
        return 1  # a loaded JPEG ignores draft() (its size stays: r = 1 below)
    (w, h) = img.size
    img.draft(img.mode, (w // r, h // r))  # PIL picks the largest s in {8,4,2,1} <= min(w//(w//r), ..)
    for s in (1, 2, 4, 8):
        if img.size == (-(-w // s), -(-h // s)):
            return s
    raise AssertionError(f"unexpected draft size {img.size} for {(w, h)}")


def crop_resize(rgb: Image.Image, r: float, box: Sequence[int], size: int) -> torch.Tensor:
    """uint8 (3, size, size) of the crop ``box`` = (top, left, h, w) in full-size pixels of an
    image decoded at 1/r scale (r >= 1): bicubic with antialiasing. r = 1 is exactly torchvision's
    ``resized_crop`` (open_clip's transform); r > 1 resizes the box divided by r, sub-pixel."""
    top, left, h, w = box
    if r == 1:
        out = F.resized_crop(rgb, top, left, h, w, [size, size], InterpolationMode.BICUBIC, antialias=True)
    else:
        out = rgb.resize((size, size), Image.BICUBIC, box=(left / r, top / r, (left + w) / r, (top + h) / r))
    return F.pil_to_tensor(out)


class DraftRandomResizedCrop:
    """RandomResizedCrop -> RGB -> uint8 (3, S, S) that decodes only the pixels it keeps.

    The crop box is drawn first, by torchvision's ``RandomResizedCrop.get_params`` on the
    header's size: the same torch RNG draws and the same boxes as open_clip's train transform.
    When the box is at least twice the output in both directions, a JPEG is decoded with
    libjpeg's DCT scaling (``Image.draft``) at 1/r, r = :func:`draft_factor`, and the box is
    divided by r; the bicubic, antialiased resize then runs on the smaller image (the result
    differs from the full decode by 1-2 grey levels on average: the DCT downscale filters
    less than the bicubic one; more on fine textures such as grass). Otherwise (r = 1, non-JPEG, CMYK,
    ``draft=False``) the pixels are bit-identical to ``train_transform(..., draft=False)``.

    Input: the encoded bytes (``decodes_bytes``: the loader passes them) or a PIL image (an
    unloaded one from ``Image.open`` can still be drafted). Bytes that do not decode raise
    :class:`ImageDecodeError`; truncated JPEGs are refused (PIL's default).
    """

    decodes_bytes = True  # infclip.data.stream.decode passes the raw file

    def __init__(self, size: int, scale: Sequence[float] = (0.08, 1.0),
                 ratio: Sequence[float] = (0.75, 1.3333333), draft: bool = True):
        self.size, self.scale, self.ratio, self.draft = size, list(scale), list(ratio), draft

    def __call__(self, image: Union[bytes, Image.Image]) -> torch.Tensor:
        if isinstance(image, (bytes, bytearray, memoryview)):
            try:
                img = Image.open(io.BytesIO(image))
            except Exception as e:
                raise ImageDecodeError(str(e)) from None
            with img:
                return self._crop(img)
        return self._crop(image)

    def _crop(self, img: Image.Image) -> torch.Tensor:
        state = torch.get_rng_state()
        top, left, h, w = RandomResizedCrop.get_params(img, self.scale, self.ratio)
        try:
            rgb, r = self.decode(img, w, h)
        except ImageDecodeError:
            # A sample that does not decode must not consume random draws: the full-decode
            # path drops it before its transform runs, and the following crops must match.
            torch.set_rng_state(state)
            raise
        return crop_resize(rgb, r, (top, left, h, w), self.size)

    def decode(self, img: Image.Image, crop_w: float, crop_h: float) -> tuple[Image.Image, int]:
        """(the loaded RGB image, reduction r): drafted at 1/r when allowed, else in full."""
        try:
            r = draft_open(img, crop_w, crop_h, self.size) if self.draft else 1
            return img.convert("RGB"), r
        except Exception as e:  # OSError (truncated), SyntaxError, ValueError from decoders
            raise ImageDecodeError(str(e)) from None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(size={self.size}, scale={self.scale}, ratio={self.ratio}, "
                f"draft={self.draft})")


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


def pil_library() -> str:
    """The CPU path's image library as the startup line names it, e.g. ``Pillow 13.0.0
    (libjpeg-turbo 3.2.0)`` or ``Pillow-SIMD 12.1.1.post0 (libjpeg-turbo 2.1.5)``.

    Both decode and resize every ``data.decode=cpu`` sample, so they set its pixels and the
    loader's rate: Pillow-SIMD resizes ~1.5x faster (docs/benchmarks.md) within one level of
    Pillow, and JPEG decodes differ between libjpeg-turbo versions (docs/data.md). A later
    ``pip install`` that pulls Pillow back in replaces Pillow-SIMD silently; this line shows it."""
    from importlib import metadata

    import PIL
    from PIL import features

    try:  # (a Pillow installed over Pillow-SIMD may leave its record behind: the versions differ)
        simd = metadata.version("pillow-simd") == PIL.__version__
    except metadata.PackageNotFoundError:
        simd = False
    name = "Pillow-SIMD" if simd else "Pillow"
    try:
        jpeg = features.version("libjpeg_turbo")
        lib = f"libjpeg-turbo {jpeg}" if jpeg else f"libjpeg {features.version('jpg')}"
    except Exception:  # a build without JPEG support
        lib = "no JPEG support"
    return f"{name} {PIL.__version__} ({lib})"
