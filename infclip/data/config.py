"""Data configuration (owned by ``infclip.data``; composed into the trainer's config)."""

from __future__ import annotations

import re

from dataclasses import dataclass, field
from typing import Any, Optional

from infclip.data.workers import check_count


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
    # DataLoader workers per rank. "auto": sized from the cores this process may run on
    # (os.sched_getaffinity) shared by the training processes of its node (LOCAL_WORLD_SIZE):
    # all but 2 of a rank's cores when the workers decode, half when the GPU decodes, rounded
    # down to 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48 or 64 (infclip/data/workers.py); the startup
    # line says what and why. A number is used as given (0: load in the training process).
    workers: Any = "auto"
    # Streams of the global sample order (infclip/data/stream.py): each rank reads whole streams,
    # each loader worker holds a few. Fixed for the life of a run (checkpoints carry it), so a run
    # resumes on any number of ranks that divides it, with the same global batches in the same
    # steps. null: ranks x data.workers of the run's first start (2 ranks x 8 workers: 16, which
    # resumes on 1, 2, 4, 8 or 16 ranks). Set a number with many divisors (48) to keep more world
    # sizes open; epoch mode needs at least that many shards, and each stream keeps its own
    # shuffle buffer (a worker holding k streams holds k buffers).
    streams: Optional[int] = None
    shuffle_buffer: int = 1000  # sample shuffle buffer per stream (data.streams; 0 disables)
    loader_batch: int = 256  # samples per loader batch; the trainer assembles steps from these
    image_size: Optional[int] = None  # None: the model's own image size
    caption_key: str = "txt"  # sample field holding the caption
    json_caption_key: Optional[str] = None  # pick the caption from this key of {key}.json instead
    aug_scale: tuple[float, float] = (0.08, 1.0)  # RandomResizedCrop scale (the paper's)
    aug_ratio: tuple[float, float] = (0.75, 1.3333333)  # RandomResizedCrop ratio (the paper's)
    # Extra augmentations (open_clip's --aug-cfg); all off by default (CLIP's recipe is the crop
    # alone). They run in the loader workers on each sample, under the per-batch seeded RNG
    # (infclip/data/stream.py), so a resumed run and both gradient-cache passes see the same
    # pixels. The GPU JPEG path (data.decode=device) only crops: these need data.decode=cpu.
    # colour jitter strength: [] off, [s] (brightness=contrast=saturation=s), [b, c, s] or
    # [b, c, s, hue] (torchvision ColorJitter; open_clip's color_jitter, e.g. [0.4, 0.4, 0.4, 0.1])
    color_jitter: list[float] = field(default_factory=list)
    color_jitter_prob: float = 1.0  # probability a sample is jittered when color_jitter is set
    gray_scale_prob: float = 0.0  # probability a sample becomes greyscale (R=G=B; open_clip's gray_scale_prob)
    # timm's RandomErasing (open_clip's re_prob / re_count): probability a sample gets re_count
    # erased boxes filled with per-pixel N(0, 1) noise in normalized space (timm's re_mode=pixel),
    # written back as uint8 (clamped to [0, 255]) in the worker, so replays read the same pixels
    re_prob: float = 0.0
    re_count: int = 1
    # timm's create_transform pipeline (open_clip's aug_cfg use_timm: timm's RandomResizedCrop with
    # python-RNG boxes, color_jitter, random erasing; no flip) instead of open_clip's; full decode
    # (data.jpeg_draft is not used), color_jitter_prob / gray_scale_prob are not part of it
    use_timm: bool = False
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
    # "auto": 2, or 1 when a rank has fewer than 8 cores (infclip/data/workers.py).
    decode_threads: Any = "auto"
    # More nvImageCodec decoder options for the hardware / cuda decoders, space-separated
    # "[module]:option=value" entries after the backend's own (nvImageCodec's "Codec options";
    # a later entry overrides an earlier one, unknown options are ignored by the library), e.g.
    # "nvjpeg_hw_decoder:force_batch_single=0"; on the command line quote the value for Hydra:
    # "data.decoder_options='nvjpeg_hw_decoder:force_batch_single=0'". The startup line shows them.
    decoder_options: str = ""
    # decode=device: decode only each sample's crop box (nvImageCodec's region-of-interest
    # decode), not the whole stored image. Off: on the H200's engines it measured slower
    # (12.9k vs 18.0k images/s) and up to 54 levels off at region edges (docs/data.md);
    # on libjpeg-turbo it is exact. nvImageCodec decoders only; the startup line says when on.
    decode_roi: bool = False
    # GB of device memory for decoded uint8 pixels kept from the gradient cache's first pass
    # for its replay (each kept sample is decoded once per step instead of twice; 3*S*S bytes
    # each). None: 40 % of the device memory free once the model is built. 0: decode twice.
    decoded_keep_gb: Optional[float] = None
    # decode=device: fraction of the samples (chosen by a hash of each sample's key, stream
    # position and batch seed: reproducible on resume) that the loader workers decode and crop
    # themselves (the CPU path's pixels, uint8 3*S*S) while the GPU decodes the rest (DALI's
    # hw_decoder_load idea): idle workers take load off the JPEG engines. Host memory: each such
    # sample holds 3*S*S bytes (150 KB at 224) instead of its JPEG until its step's last read.
    # 0.0: every sample goes to the GPU (the default). Refused with data.decode=cpu; ignored with
    # a note when data.decode=auto picks the CPU path.
    cpu_decode_share: float = 0.0
    # decode=device: SMs kept free of the towers for the decoders' own kernels (colour
    # conversion, crop-and-resize). The JPEG engines need no SMs, but each decode call runs
    # small kernels that otherwise queue behind the towers' GEMMs, which hold every SM (the
    # engines then idle: 18k images/s alone, 4-6k beside the towers on an H200). With N > 0
    # the towers, loss and optimizer run on a CUDA green-context stream confined to the SMs
    # left when N are taken off and the rest is rounded down to the driver's partition granule
    # (H100/H200: 8; N = 4 gives the towers 128 of 132). The decoders may use every SM.
    # Needs NVIDIA's cuda-bindings (pip install 'infclip[hwdecode]') and a driver with
    # green-context streams (CUDA 12.5+); else the startup line says why and the towers keep
    # every SM. 0: off (measured on an H200: the towers lost 10 % on 128 of 132 SMs, training
    # 2.5-4 %, more than the decoders gained; docs/data.md).
    decode_reserved_sms: int = 0
    # decode=device with a locked image tower (LiT: the replay decodes nothing): when the
    # decode-ahead of the next step's images starts. "replay": after the loss, as for trained
    # image towers (whose replay reads this step's kept pixels; they always start there).
    # "first_pass": as soon as the step pipeline has begun filling the next step, queued
    # behind this step's own decode-ahead, so the JPEG engines go straight on from this
    # step's last images to the next step's. Measured equal (LiT 65,536 at 512 px, H200, one
    # call: 4,903 vs 4,907 samples/s): the end-of-pass idle it fills (0.76-1.55 s in traced
    # steps) reappears at the LiT ring's end in the replay, and the step is no shorter
    # (commit fe7eba6; docs/benchmarks.md, "LiT"). With it, the next step's decoding counts in this
    # step's decode_busy_first_pct.
    decode_ahead_from: str = "replay"
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


_DECODER_OPTION = re.compile(r"^[\w-]*:\w+=\S+$")  # nvImageCodec's "[module]:option=value"


def _check_decoder_options(cfg: DataConfig) -> None:
    """data.decoder_options: space-separated ``[module]:option=value`` entries (nvImageCodec
    silently skips any other token), and only where an nvImageCodec GPU decoder may run."""
    opts = cfg.decoder_options
    if not isinstance(opts, str):
        raise ValueError(f"data.decoder_options must be a string of nvImageCodec options, got {opts!r}")
    bad = [t for t in opts.split() if not _DECODER_OPTION.match(t)]
    if bad:
        raise ValueError(f"data.decoder_options holds {bad}, not nvImageCodec options: each entry is "
                         "[module]:option=value, e.g. nvjpeg_hw_decoder:force_batch_single=0 or :fancy_upsampling=1 "
                         "(quote the value for Hydra: \"data.decoder_options='nvjpeg_hw_decoder:force_batch_single=0'\")")
    if opts.strip() and (cfg.decode == "cpu" or cfg.device_decoder == "nvjpeg"):
        why = "data.decode=cpu" if cfg.decode == "cpu" else "data.device_decoder=nvjpeg (torchvision's decoder)"
        raise ValueError(f"data.decoder_options={opts!r} means nothing with {why}: they configure nvImageCodec's "
                         "GPU decoders; set data.decoder_options='' or data.device_decoder=auto/hardware/cuda")


def check_data_config(cfg: DataConfig) -> None:
    """Reject impossible data settings before any work; messages name the key and the fix.

    (Structured configs built by Hydra never run ``__post_init__``, so the trainer's
    ``validate`` calls this.)
    """
    if cfg.decode not in ("auto", "cpu", "device"):
        raise ValueError(f"data.decode must be 'auto', 'cpu' or 'device', got {cfg.decode!r}")
    if cfg.device_decoder not in ("auto", "hardware", "cuda", "nvjpeg"):
        raise ValueError(f"data.device_decoder must be auto, hardware, cuda or nvjpeg, got {cfg.device_decoder!r}")
    check_count("data.decode_threads", cfg.decode_threads, 1)
    if cfg.decoded_keep_gb is not None and cfg.decoded_keep_gb < 0:
        raise ValueError(f"data.decoded_keep_gb must be >= 0 (0: decode in both passes) or null (auto), "
                         f"got {cfg.decoded_keep_gb}")
    share = cfg.cpu_decode_share
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share < 1.0:
        raise ValueError(f"data.cpu_decode_share must be a number in [0, 1) (the fraction of samples the loader "
                         f"workers decode beside the GPU; 0: none), got {share!r}")
    if share > 0 and cfg.decode == "cpu":
        raise ValueError(f"data.cpu_decode_share={share} means nothing with data.decode=cpu (the loader workers "
                         "decode every sample already): set data.cpu_decode_share=0, or data.decode=device "
                         "(or auto) to split decoding between the GPU and the workers")
    _check_decoder_options(cfg)
    if cfg.decode_ahead_from not in ("first_pass", "replay"):
        raise ValueError(f"data.decode_ahead_from must be 'first_pass' or 'replay' (when the next step's "
                         f"images start decoding under a locked image tower), got {cfg.decode_ahead_from!r}")
    reserved = cfg.decode_reserved_sms
    if isinstance(reserved, bool) or not isinstance(reserved, int) or reserved < 0:
        raise ValueError(f"data.decode_reserved_sms must be a whole number >= 0 (SMs kept free of the towers for "
                         f"the GPU decoders' kernels; 0: off), got {reserved!r}")
    if reserved > 0 and cfg.decode == "cpu":
        raise ValueError(f"data.decode_reserved_sms={reserved} means nothing with data.decode=cpu (no decoding "
                         "runs on the GPU): set data.decode_reserved_sms=0, or data.decode=device (or auto)")
    if cfg.jpeg_max_bytes < 1024:
        raise ValueError(f"data.jpeg_max_bytes must be >= 1024 (bytes per packed JPEG), got {cfg.jpeg_max_bytes}")
    if cfg.loader_batch <= 0:
        raise ValueError(f"data.loader_batch must be > 0, got {cfg.loader_batch}")
    if cfg.streams is not None and (isinstance(cfg.streams, bool) or cfg.streams < 1):
        raise ValueError(f"data.streams must be a whole number >= 1 (streams of the global sample order) or null "
                         f"(ranks x data.workers at the run's first start), got {cfg.streams!r}")
    check_count("data.workers", cfg.workers, 0)
    if cfg.shuffle_buffer < 0:
        raise ValueError("data.shuffle_buffer must be >= 0 (0: no shuffle)")
    if cfg.num_samples is not None and cfg.num_samples <= 0:
        raise ValueError(f"data.num_samples must be > 0 or null (count from sizes.json), got {cfg.num_samples}")
    lo, hi = cfg.aug_scale
    if not 0 < lo <= hi <= 1:
        raise ValueError(f"data.aug_scale must satisfy 0 < low <= high <= 1, got {list(cfg.aug_scale)}")
    lo, hi = cfg.aug_ratio
    if not 0 < lo <= hi:
        raise ValueError(f"data.aug_ratio must satisfy 0 < low <= high, got {list(cfg.aug_ratio)}")
    _check_augmentation(cfg)
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


def augmentation_keys(cfg: DataConfig) -> list[str]:
    """The data.* augmentation keys set beyond the random resized crop (empty: crop only)."""
    keys = []
    if list(cfg.color_jitter) and any(v != 0 for v in cfg.color_jitter) and cfg.color_jitter_prob > 0:
        keys.append("data.color_jitter")
    if cfg.gray_scale_prob > 0:
        keys.append("data.gray_scale_prob")
    if cfg.re_prob > 0:
        keys.append("data.re_prob")
    if cfg.use_timm:
        keys.append("data.use_timm")
    return keys


def _check_augmentation(cfg: DataConfig) -> None:
    jitter = list(cfg.color_jitter)
    if len(jitter) not in (0, 1, 3, 4) or any(not v >= 0 for v in jitter):
        raise ValueError(f"data.color_jitter must be [], [strength], [brightness, contrast, saturation] or "
                         f"[brightness, contrast, saturation, hue] with values >= 0, got {jitter}")
    if len(jitter) == 4 and jitter[3] > 0.5:
        raise ValueError(f"data.color_jitter's hue (4th value) must be in [0, 0.5], got {jitter[3]}")
    for key in ("color_jitter_prob", "gray_scale_prob", "re_prob"):
        value = getattr(cfg, key)
        if not 0 <= value <= 1:  # also rejects NaN
            raise ValueError(f"data.{key} is a probability and must be in [0, 1], got {value}")
    if cfg.re_count < 1:
        raise ValueError(f"data.re_count must be >= 1 (boxes erased per erased sample), got {cfg.re_count}")
    if cfg.use_timm and (cfg.color_jitter_prob != 1 or cfg.gray_scale_prob > 0):
        raise ValueError("data.use_timm=true builds timm's pipeline, which has no data.color_jitter_prob or "
                         "data.gray_scale_prob (timm jitters every sample when data.color_jitter is set): "
                         "leave them at 1.0 and 0.0, or set data.use_timm=false")
    keys = augmentation_keys(cfg)
    if keys and cfg.decode == "device":
        raise ValueError(
            f"{', '.join(keys)} asks for augmentations the GPU JPEG path cannot do: with data.decode=device "
            "the loader workers only parse each JPEG's header and draw its random resized crop, and the "
            "trainer decodes and resizes on the GPU, so no colour jitter, greyscale, random erasing or timm "
            "pipeline would ever touch the pixels. Set data.decode=cpu (the workers decode and augment; "
            "data.decode=auto picks it by itself for these keys), or drop " + " and ".join(keys) + ".")
