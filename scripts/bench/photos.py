"""Benchmark shards from real photographs, in the img2dataset layout.

Generated shapes compress to a few KB and decode in microseconds; they say nothing about the
cost of decoding LAION. This module derives many distinct JPEGs from a handful of real
photographs: a random crop (area, aspect ratio, position), a horizontal flip, a colour change
(brightness, contrast, saturation, warm/cool tint), a resize so that the *shorter* side is
``side`` pixels (img2dataset's ``keep_ratio`` mode) and a baseline JPEG at a random quality
in ``[quality_min, quality_max]``. Captions name the photo and the transform ("a photo of a
tabby cat, flipped, warm tones").

Sources:

* the sample photographs bundled in the scikit-image and scikit-learn wheels (nothing is
  downloaded; both packages are imported only when asked for);
* any folder of ``.jpg``/``.jpeg``/``.png`` files (:func:`folder_photos`), with optional
  descriptions in a ``captions.json`` beside them. :func:`export_photos` writes the bundled
  photos into such a folder, so a machine with only numpy/PIL writes the same shards.

Invariants: sample ``i`` is a pure function of (seed, i, the ordered photo list, side,
quality range); shard ``k`` holds samples ``[k * shard_size, (k + 1) * shard_size)``, so the
bytes of every shard are independent of the number of worker processes. Photos are ordered
by name from every source, so an exported folder reproduces the bundled shards byte for byte.
"""

from __future__ import annotations

import io
import json
import math
import os
import random
import tarfile
import time
from dataclasses import dataclass, field
from multiprocessing import Pool
from typing import Any, Optional, Sequence

from PIL import Image, ImageStat

from infclip.data.writer import SHARD_DIGITS, ShardWriter, write_sizes

PHOTO_EXTS = (".jpg", ".jpeg", ".png")
CAPTIONS_FILE = "captions.json"  # {photo name: description} beside exported photos
STATS_FILE = "photo_stats.json"
LAION_KB_AT_256 = (20, 60)  # typical LAION JPEG size at a 256-px shorter side (kB)
MAX_UPSCALE = 2.0  # a crop is grown until the resize enlarges it at most this much

# skimage.data loaders (all bundled in the wheel) -> description. Grey photos are stored as RGB.
SKIMAGE_PHOTOS: dict[str, str] = {
    "astronaut": "an astronaut in a spacesuit in front of a flag",
    "brick": "a brick wall, black and white",
    "camera": "a man with a camera on a tripod, black and white",
    "chelsea": "a tabby cat",
    "coffee": "a cup of coffee on a saucer",
    "coins": "old coins, black and white",
    "grass": "grass, black and white",
    "gravel": "gravel, black and white",
    "hubble_deep_field": "galaxies in deep space",
    "immunohistochemistry": "a microscope image of stained tissue",
    "moon": "the surface of the moon, black and white",
    "motorcycle_left": "a motorcycle in a workshop",
    "motorcycle_right": "a motorcycle in a workshop",
    "page": "a scanned page of printed text",
    "retina": "the back of a human eye",
    "rocket": "a rocket on the launch pad",
}
SKLEARN_PHOTOS: dict[str, str] = {
    "china": "a chinese temple among trees",
    "flower": "a close-up of a flower",
}
BUNDLES = ("skimage", "sklearn")
TEMPLATES = ("a photo of {d}", "{d}", "an image of {d}", "a picture of {d}")


@dataclass
class Photo:
    """One source photograph (RGB) and the description its captions start from."""

    name: str
    description: str
    image: Image.Image


# -- sources ----------------------------------------------------------------------------------


def _skimage_arrays() -> dict[str, Any]:
    from skimage import data  # lazy: only for the bundled photos

    left, right, _ = data.stereo_motorcycle()
    arrays = {"motorcycle_left": left, "motorcycle_right": right}
    for name in SKIMAGE_PHOTOS:
        if name not in arrays:
            arrays[name] = getattr(data, name)()
    return arrays


def _sklearn_arrays() -> dict[str, Any]:
    from sklearn.datasets import load_sample_images  # lazy: only for the bundled photos

    bunch = load_sample_images()
    names = [os.path.splitext(os.path.basename(f))[0] for f in bunch.filenames]
    return dict(zip(names, bunch.images))


def bundled_photos(bundles: Sequence[str] = BUNDLES) -> list[Photo]:
    """The photos bundled in scikit-image and/or scikit-learn, RGB, sorted by name.

    Raises ImportError naming the fixes when a requested package is not installed."""
    unknown = set(bundles) - set(BUNDLES)
    if unknown or not bundles:
        raise ValueError(f"bundles must be a non-empty subset of {BUNDLES}, got {list(bundles)}")
    loaders = {"skimage": (_skimage_arrays, SKIMAGE_PHOTOS, "scikit-image"),
               "sklearn": (_sklearn_arrays, SKLEARN_PHOTOS, "scikit-learn")}
    photos = []
    for bundle in bundles:
        load, descriptions, package = loaders[bundle]
        try:
            arrays = load()
        except ImportError as e:
            raise ImportError(f"{package} is not installed ({e}); pip install {package}, use only "
                              f"the other bundle, or pass a folder of photos") from e
        photos += [Photo(n, descriptions[n], Image.fromarray(arrays[n]).convert("RGB"))
                   for n in descriptions]
    return sorted(photos, key=lambda p: p.name)


def folder_photos(folder: str) -> list[Photo]:
    """Every .jpg/.jpeg/.png in ``folder`` (not recursive), RGB, sorted by name (file stem).

    Descriptions come from ``captions.json`` ({stem: text}) when present, else the stem with
    ``_``/``-`` as spaces."""
    files = sorted(f for f in os.listdir(folder) if f.lower().endswith(PHOTO_EXTS))
    if not files:
        raise FileNotFoundError(f"no {'/'.join(PHOTO_EXTS)} files in {folder}")
    captions_path = os.path.join(folder, CAPTIONS_FILE)
    captions = json.load(open(captions_path)) if os.path.exists(captions_path) else {}
    photos = []
    for f in files:
        stem = os.path.splitext(f)[0]
        with Image.open(os.path.join(folder, f)) as img:
            rgb = img.convert("RGB")
        photos.append(Photo(stem, captions.get(stem, stem.replace("_", " ").replace("-", " ")), rgb))
    names = [p.name for p in photos]
    if len(set(names)) != len(names):
        raise ValueError(f"{folder}: two photos share a name (same stem, other extension)")
    return sorted(photos, key=lambda p: p.name)


def export_photos(photos: Sequence[Photo], folder: str) -> list[str]:
    """Save photos as lossless ``{name}.png`` plus ``captions.json``; returns the PNG paths.
    ``folder_photos(folder)`` then returns the same photos (pixels, names, descriptions)."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for p in photos:
        path = os.path.join(folder, f"{p.name}.png")
        p.image.save(path, format="PNG")
        paths.append(path)
    with open(os.path.join(folder, CAPTIONS_FILE), "w") as f:
        json.dump({p.name: p.description for p in photos}, f, indent=1, sort_keys=True)
    return paths


# -- one sample -------------------------------------------------------------------------------


@dataclass
class Look:
    """The random transform of one sample (crop box in source pixels, colour factors)."""

    box: tuple[float, float, float, float]  # left, top, right, bottom
    flip: bool
    brightness: float
    contrast: float
    saturation: float
    tint: float  # > 0 warm (more red, less blue), < 0 cool
    quality: int
    area: float  # crop area / photo area (after growing a crop too small to upscale)


def draw_look(rng: random.Random, width: int, height: int, side: int, quality: tuple[int, int]) -> Look:
    """Crop: area fraction U(0.25, 1), aspect (w/h) log-uniform in [3/5, 16/9], grown until
    the resize to ``side`` upscales it at most MAX_UPSCALE, then clipped to the photo."""
    area = rng.uniform(0.25, 1.0) * width * height
    aspect = math.exp(rng.uniform(math.log(3 / 5), math.log(16 / 9)))
    cw, ch = math.sqrt(area * aspect), math.sqrt(area / aspect)
    grow = max(1.0, side / MAX_UPSCALE / min(cw, ch))
    cw, ch = cw * grow, ch * grow
    shrink = min(1.0, width / cw, height / ch)  # keeps the aspect ratio
    cw, ch = min(cw * shrink, width), min(ch * shrink, height)  # min: float rounding
    x0, y0 = rng.uniform(0, width - cw), rng.uniform(0, height - ch)
    return Look(box=(x0, y0, x0 + cw, y0 + ch), flip=rng.random() < 0.5,
                brightness=rng.uniform(0.75, 1.25), contrast=rng.uniform(0.75, 1.3),
                saturation=rng.uniform(0.6, 1.4), tint=rng.uniform(-0.08, 0.08),
                quality=rng.randint(*quality), area=cw * ch / (width * height))


def output_size(box: Sequence[float], side: int) -> tuple[int, int]:
    """(width, height) with the shorter side == ``side`` and the box's aspect ratio."""
    w, h = box[2] - box[0], box[3] - box[1]
    if w >= h:
        return max(side, round(side * w / h)), side
    return side, max(side, round(side * h / w))


def colour_matrix(look: Look, mean: float) -> tuple[float, ...]:
    """PIL's 12-tuple RGB->RGB affine map: brightness * tint * (contrast around ``mean``
    luminance of saturation-adjusted pixels); what ImageEnhance's chain does, in one pass."""
    lum = (0.299, 0.587, 0.114)
    s, c, b = look.saturation, look.contrast, look.brightness
    gains = (1 + look.tint, 1.0, 1 - look.tint)
    out = []
    for i in range(3):
        row = [b * gains[i] * c * (s * (i == j) + (1 - s) * lum[j]) for j in range(3)]
        out += row + [b * gains[i] * (1 - c) * mean]
    return tuple(out)


def render(photo: Photo, look: Look, side: int) -> bytes:
    """The sample's baseline JPEG: crop + resize (bicubic) + flip + colour, at ``look.quality``."""
    img = photo.image.resize(output_size(look.box, side), Image.BICUBIC, box=look.box)
    if look.flip:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    mean = ImageStat.Stat(img.convert("L").reduce(4)).mean[0]
    img = img.convert("RGB", colour_matrix(look, mean))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=look.quality, progressive=False, optimize=False)
    return buf.getvalue()


def caption(photo: Photo, look: Look, rng: random.Random) -> str:
    """A template naming the photo, plus words for the notable parts of the transform."""
    words = [w for w, on in (
        ("close-up", look.area < 0.4), ("flipped", look.flip),
        ("bright", look.brightness > 1.15), ("dark", look.brightness < 0.85),
        ("high contrast", look.contrast > 1.2), ("low contrast", look.contrast < 0.85),
        ("vivid colours", look.saturation > 1.25), ("muted colours", look.saturation < 0.75),
        ("warm tones", look.tint > 0.04), ("cool tones", look.tint < -0.04)) if on]
    return ", ".join([rng.choice(TEMPLATES).format(d=photo.description)] + words)


def make_sample(photos: Sequence[Photo], seed: int, index: int, side: int,
                quality: tuple[int, int]) -> tuple[bytes, str, dict[str, Any]]:
    """(jpeg, caption, json meta) of sample ``index``: a pure function of the arguments."""
    rng = random.Random(f"infclip-photos-{seed}-{index}")  # str seeds hash stably
    photo = photos[rng.randrange(len(photos))]
    look = draw_look(rng, photo.image.width, photo.image.height, side, quality)
    jpeg = render(photo, look, side)
    width, height = output_size(look.box, side)
    meta = {"width": width, "height": height, "original_width": photo.image.width,
            "original_height": photo.image.height, "photo": photo.name, "quality": look.quality,
            "crop": [round(v, 2) for v in look.box], "flip": look.flip}
    return jpeg, caption(photo, look, rng), meta


# -- shards -----------------------------------------------------------------------------------


@dataclass
class PhotoShardOptions:
    """What to write; the samples depend on (seed, side, quality range, photos) only."""

    out_dir: str
    num_samples: int
    shard_size: int = 10_000  # samples per shard (img2dataset's default)
    side: int = 256  # stored shorter side in pixels
    seed: int = 0
    workers: int = 1  # processes; each writes whole shards
    quality_min: int = 85
    quality_max: int = 95

    def __post_init__(self) -> None:
        if self.num_samples <= 0 or self.shard_size <= 0:
            raise ValueError("num_samples and shard_size must be > 0")
        if self.side < 16:
            raise ValueError(f"side must be >= 16 pixels, got {self.side}")
        if not 1 <= self.quality_min <= self.quality_max <= 100:
            raise ValueError(f"need 1 <= quality_min <= quality_max <= 100, got "
                             f"{self.quality_min}, {self.quality_max}")

    @property
    def num_shards(self) -> int:
        return -(-self.num_samples // self.shard_size)


@dataclass
class PhotoShardReport:
    """What was written (also saved as ``photo_stats.json``)."""

    samples: int
    shards: int
    image_bytes: int
    seconds: float
    sizes: dict[str, int] = field(default_factory=dict)

    @property
    def mean_kb(self) -> float:
        """Mean JPEG size per sample in kB (1000 bytes)."""
        return self.image_bytes / max(self.samples, 1) / 1000

    @property
    def samples_per_s(self) -> float:
        return self.samples / max(self.seconds, 1e-9)


_PHOTOS: list[Photo] = []  # the worker processes' photos (set by _init_worker)


def _init_worker(photos: list[Photo]) -> None:
    global _PHOTOS
    _PHOTOS = photos


def write_shard(opts: PhotoShardOptions, shard: int) -> tuple[str, int, int]:
    """Write shard ``shard`` (its ``_stats.json`` too; not ``sizes.json``); returns
    (tar name, samples, image bytes). Uses the photos set by ``_init_worker``."""
    first = shard * opts.shard_size
    last = min(first + opts.shard_size, opts.num_samples)
    quality, nbytes = (opts.quality_min, opts.quality_max), 0
    writer = ShardWriter(opts.out_dir, max_samples=opts.shard_size, start_shard=shard, write_sizes=False)
    with writer:
        for i in range(first, last):
            jpeg, text, meta = make_sample(_PHOTOS, opts.seed, i, opts.side, quality)
            writer.write(f"{i:09d}", jpeg, text, meta)
            nbytes += len(jpeg)
    return f"{shard:0{SHARD_DIGITS}d}.tar", last - first, nbytes


def _write_shard_star(args: tuple[PhotoShardOptions, int]) -> tuple[str, int, int]:
    return write_shard(*args)


def write_photo_shards(photos: Sequence[Photo], opts: PhotoShardOptions) -> PhotoShardReport:
    """Write all shards (``opts.workers`` processes, whole shards each), ``sizes.json`` and
    ``photo_stats.json``. The shard bytes do not depend on ``opts.workers``."""
    if not photos:
        raise ValueError("no source photos")
    os.makedirs(opts.out_dir, exist_ok=True)
    jobs = [(opts, k) for k in range(opts.num_shards)]
    start = time.perf_counter()
    if opts.workers <= 1:
        _init_worker(list(photos))
        results = [_write_shard_star(j) for j in jobs]
    else:
        with Pool(min(opts.workers, len(jobs)), _init_worker, (list(photos),)) as pool:
            results = list(pool.imap_unordered(_write_shard_star, jobs))
    seconds = time.perf_counter() - start
    sizes = {name: n for name, n, _ in results}
    write_sizes(opts.out_dir, sizes)
    return PhotoShardReport(samples=sum(sizes.values()), shards=len(sizes),
                            image_bytes=sum(b for _, _, b in results), seconds=seconds, sizes=sizes)


# -- measuring the output ---------------------------------------------------------------------


def shard_jpegs(out_dir: str, limit: int) -> list[bytes]:
    """Up to ``limit`` JPEG files from the first shard(s) of ``out_dir``, in order."""
    jpegs: list[bytes] = []
    for name in sorted(f for f in os.listdir(out_dir) if f.endswith(".tar")):
        with tarfile.open(os.path.join(out_dir, name)) as tar:
            for info in tar:
                if info.name.endswith(".jpg"):
                    jpegs.append(tar.extractfile(info).read())
                    if len(jpegs) >= limit:
                        return jpegs
    return jpegs


def decode_rate(jpegs: Sequence[bytes], repeats: int = 3) -> float:
    """Images/s of a full PIL decode to RGB on the calling core (best of ``repeats`` passes)."""
    if not jpegs:
        raise ValueError("no JPEGs to decode")
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for data in jpegs:
            with Image.open(io.BytesIO(data)) as img:
                img.convert("RGB")
        best = min(best, time.perf_counter() - start)
    return len(jpegs) / best


def write_stats(opts: PhotoShardOptions, report: PhotoShardReport, photos: Sequence[Photo],
                decode_per_s: float) -> dict[str, Any]:
    """Save ``photo_stats.json`` beside the shards and return its content."""
    stats = {"num_samples": report.samples, "num_shards": report.shards, "side": opts.side,
             "seed": opts.seed, "quality": [opts.quality_min, opts.quality_max],
             "mean_image_kb": round(report.mean_kb, 3), "image_bytes": report.image_bytes,
             "write_seconds": round(report.seconds, 3), "workers": opts.workers,
             "samples_per_s": round(report.samples_per_s, 1),
             "decode_images_per_s_single_core": round(decode_per_s, 1),
             "laion_reference_kb_at_256": list(LAION_KB_AT_256),
             "photos": [{"name": p.name, "width": p.image.width, "height": p.image.height}
                        for p in photos]}
    with open(os.path.join(opts.out_dir, STATS_FILE), "w") as f:
        json.dump(stats, f, indent=1, sort_keys=True)
    return stats


def summary(stats: dict[str, Any]) -> str:
    """The lines the CLI prints at the end."""
    lo, hi = stats["laion_reference_kb_at_256"]
    return "\n".join([
        f"samples written : {stats['num_samples']} in {stats['num_shards']} shards "
        f"({stats['write_seconds']:.1f} s, {stats['samples_per_s']:.0f} samples/s, "
        f"{stats['workers']} workers)",
        f"mean image size : {stats['mean_image_kb']:.1f} kB at shorter side {stats['side']} px "
        f"(LAION: about {lo}-{hi} kB at 256 px)",
        f"CPU decode      : {stats['decode_images_per_s_single_core']:.0f} images/s "
        "(PIL full decode to RGB, one core)",
    ])


def load_photos(folder: Optional[str], bundles: Sequence[str] = BUNDLES) -> list[Photo]:
    """Photos from ``folder`` when given, else the bundled ones (skimage/sklearn imported only then)."""
    return folder_photos(folder) if folder else bundled_photos(bundles)
