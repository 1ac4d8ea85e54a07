"""Data configuration (owned by ``infclip.data``; composed into the trainer's config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class SourceConfig:
    """One shard source; several are mixed by ``weight``."""

    shards: str = ""  # brace-expanded spec, e.g. /data/laion/{00000..41407}.tar or pipe:aws s3 cp ... -
    weight: float = 1.0  # relative sampling weight when several sources are mixed
    num_samples: Optional[int] = None  # None: count from *_stats.json or sizes.json


@dataclass
class DataConfig:
    """Training data: webdataset shards in the img2dataset layout ({key}.jpg/.txt/.json)."""

    kind: str = "synthetic"  # "synthetic" (generated on first use) or "wds" (shards below)
    shards: str = ""  # shortcut for a single source; ignored when `sources` is non-empty
    sources: list[SourceConfig] = field(default_factory=list)
    num_samples: Optional[int] = None  # samples per epoch; None: count from stats/sizes files
    resampled: bool = False  # True: shards drawn with replacement (per rank/worker/epoch seeds)
    workers: int = 2  # DataLoader workers per rank
    shuffle_buffer: int = 1000  # sample shuffle buffer per worker (0 disables)
    loader_batch: int = 256  # samples per loader batch; the trainer assembles steps from these
    image_size: Optional[int] = None  # None: the model's own image size
    caption_key: str = "txt"  # sample field holding the caption
    json_caption_key: Optional[str] = None  # pick the caption from this key of {key}.json instead
    aug_scale: tuple[float, float] = (0.08, 1.0)  # RandomResizedCrop scale (the paper's)
    aug_ratio: tuple[float, float] = (0.75, 1.3333333)  # RandomResizedCrop ratio (the paper's)
    # Where training images are decoded (infclip/data/jpeg.py):
    #   "auto" (default): "device" when the GPU has hardware JPEG engines that nvImageCodec can
    #       drive (pip install 'infclip[hwdecode]'), else "cpu"; the startup line says which.
    #   "cpu": loader workers decode, crop, resize; 3*S*S bytes per sample in host memory.
    #   "device": workers parse only the JPEG header and draw the crop; the trainer decodes on
    #       the GPU (data.device_decoder) and resizes there. Host memory per sample: the JPEG's
    #       own size + 72 bytes (packed; files over jpeg_max_bytes are re-encoded smaller).
    decode: str = "auto"
    # The GPU decoder of decode=device: "auto" (fastest that works: hardware, cuda, nvjpeg),
    # "hardware" (NVJPG engines via nvImageCodec: no SM time), "cuda" (nvImageCodec on the SMs),
    # "nvjpeg" (torchvision's nvJPEG on the SMs).
    device_decoder: str = "auto"
    # nvImageCodec decoder instances (own CUDA stream and host thread each) that decode parts
    # of a micro-batch at once: beside the towers a single decode chain waits on the busy SMs
    # between its stages (docs/data.md, "Decoding on the GPU").
    decode_threads: int = 2
    # GB of device memory for decoded uint8 pixels kept from the gradient cache's first pass
    # for its replay (each kept sample is decoded once per step instead of twice; 3*S*S bytes
    # each). None: 40 % of the device memory free once the model is built. 0: decode twice.
    decoded_keep_gb: Optional[float] = None
    # decode=device: files above this many bytes are re-encoded smaller by the worker (a guard
    # against huge files); the host keeps every other file at its own size (packed).
    jpeg_max_bytes: int = 1 << 20
    # CPU decode: a JPEG decodes at 1/2-1/8 scale (PIL draft mode, DCT-domain) when its random
    # crop is >= 2x the output side; the same crops, pixels within 1-2 levels of a full decode
    # (measured: ~1.1x loader rate at 512 px, none at <= 256 px with 224 crops). false: full decode.
    jpeg_draft: bool = True
    # Synthetic captioned-shapes dataset (kind=synthetic): generated deterministically into
    # `synthetic_root` (default: ~/.cache/infclip/synthetic-<params>) on first use.
    synthetic_root: Optional[str] = None
    synthetic_train: int = 8192  # training samples
    synthetic_eval: int = 512  # held-out eval images
    synthetic_image_size: int = 64  # generated image side in pixels
    synthetic_seed: int = 0
    # A loader that delivers nothing for this long (a frozen worker: NFS stall, hung pipe:
    # command) is named in a warning (worker, shard) and, after stall_abort_s, training stops
    # with a checkpoint of the last completed step. Seconds; 0 turns either off.
    stall_warn_s: float = 120.0
    stall_abort_s: float = 1800.0


def check_data_config(cfg: DataConfig) -> None:
    """Reject impossible data settings before any work; messages name the key and the fix.

    (Structured configs built by Hydra never run ``__post_init__``, so the trainer's
    ``validate`` calls this.)
    """
    if cfg.decode not in ("auto", "cpu", "device"):
        raise ValueError(f"data.decode must be 'auto', 'cpu' or 'device', got {cfg.decode!r}")
    if cfg.device_decoder not in ("auto", "hardware", "cuda", "nvjpeg"):
        raise ValueError(f"data.device_decoder must be auto, hardware, cuda or nvjpeg, got {cfg.device_decoder!r}")
    if cfg.decode_threads < 1:
        raise ValueError(f"data.decode_threads must be >= 1 (decoder instances), got {cfg.decode_threads}")
    if cfg.decoded_keep_gb is not None and cfg.decoded_keep_gb < 0:
        raise ValueError(f"data.decoded_keep_gb must be >= 0 (0: decode in both passes) or null (auto), "
                         f"got {cfg.decoded_keep_gb}")
    if cfg.jpeg_max_bytes < 1024:
        raise ValueError(f"data.jpeg_max_bytes must be >= 1024 (bytes per packed JPEG), got {cfg.jpeg_max_bytes}")
    if cfg.loader_batch <= 0:
        raise ValueError(f"data.loader_batch must be > 0, got {cfg.loader_batch}")
    if cfg.workers < 0 or cfg.shuffle_buffer < 0:
        raise ValueError("data.workers and data.shuffle_buffer must be >= 0 (0: in-process / no shuffle)")
    if cfg.num_samples is not None and cfg.num_samples <= 0:
        raise ValueError(f"data.num_samples must be > 0 or null (count from sizes.json), got {cfg.num_samples}")
    lo, hi = cfg.aug_scale
    if not 0 < lo <= hi <= 1:
        raise ValueError(f"data.aug_scale must satisfy 0 < low <= high <= 1, got {list(cfg.aug_scale)}")
    lo, hi = cfg.aug_ratio
    if not 0 < lo <= hi:
        raise ValueError(f"data.aug_ratio must satisfy 0 < low <= high, got {list(cfg.aug_ratio)}")
    for i, s in enumerate(cfg.sources):
        if not s.shards or s.weight <= 0:
            raise ValueError(f"data.sources[{i}] needs a shard spec and weight > 0 (got {s.shards!r}, {s.weight})")
    if cfg.synthetic_train <= 0 or cfg.synthetic_eval <= 0 or cfg.synthetic_image_size < 16:
        raise ValueError("data.synthetic_train/synthetic_eval must be > 0 and data.synthetic_image_size >= 16")
    if not (cfg.stall_warn_s >= 0 and cfg.stall_abort_s >= 0):  # also rejects NaN
        raise ValueError(f"data.stall_warn_s and data.stall_abort_s must be >= 0 seconds (0: off), got "
                         f"{cfg.stall_warn_s} and {cfg.stall_abort_s}")
    if 0 < cfg.stall_abort_s <= cfg.stall_warn_s:
        raise ValueError(f"data.stall_abort_s={cfg.stall_abort_s:g} must be larger than data.stall_warn_s="
                         f"{cfg.stall_warn_s:g} (warn first, then stop), or 0 (never stop)")
