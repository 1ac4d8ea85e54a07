"""Everything one run is built from: model (locks, compile, DDP), data (CPU or device JPEG
decoding), loss, optimizer, engine, checkpointer, logger — from the config, once, in
``build``. The loop (``infclip.train.loop``) uses the :class:`Parts` and parses no config.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from omegaconf import OmegaConf

from infclip.eval import check_tasks
from infclip.export import checkpoint_writer
from infclip.model import BuiltModel, build_model, compile_towers
from infclip.train import checkpoint as ckpt
from infclip.train.distributed import DistInfo, all_ok, barrier, on_rank0
from infclip.train.guard import WeightGuard
from infclip.train.logger import MetricsLogger
from infclip.train.optim import build_optimizer, build_scheduler
from infclip.train.sm_partition import Partition, tower_stream


@dataclass
class Parts:
    """Everything built from the config for one run."""

    built: BuiltModel
    model: torch.nn.Module  # DDP-wrapped when distributed
    data: Any  # infclip.data.pipeline.TrainData
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Optional[torch.amp.GradScaler]
    engine: Any  # infclip.train.engine step engine
    checkpointer: ckpt.Checkpointer
    logger: MetricsLogger
    eval_cfg: Any  # EvalConfig with resolved dataset roots
    run_dir: Path
    guard: Optional[WeightGuard] = None  # finite-weights check after every update (built in build)
    config: dict = field(default_factory=dict)  # the resolved config, saved in train.pt (resume compares it)
    overrides: list[str] = field(default_factory=list)  # this start's command-line overrides
    # where the towers run: a green-context stream leaving SMs to the decoders
    # (data.decode_reserved_sms; infclip.train.sm_partition), or the current stream
    towers: Partition = field(default_factory=lambda: Partition(None, 0, 0))



def build_checkpointer(cfg: Any, info: DistInfo, run_dir: Path) -> ckpt.Checkpointer:
    """The run's checkpointer (with its remote mirror on rank 0), built before the model: the
    resume picks and loads its checkpoint first, so that "resumed from ..." leads the start's
    lines. ``build`` adds the open_clip export once the model exists."""
    checkpointer = ckpt.Checkpointer(run_dir, cfg.checkpoint.keep_last, info.rank, lambda: barrier(info),
                                     agree=lambda ok: all_ok(ok, info))
    if cfg.checkpoint.remote and info.is_main:  # rank 0 uploads and downloads
        from infclip.train.remote import RemoteCheckpoints

        checkpointer.remote = RemoteCheckpoints(cfg.checkpoint.remote, cfg.checkpoint.keep_last)
    return checkpointer


def build(cfg: Any, info: DistInfo, run_dir: Path, checkpointer: Optional[ckpt.Checkpointer] = None) -> Parts:
    from infclip.train.engine import build_engine

    allow_tf32(cfg, info.device)
    preflight(cfg)  # paths before the model: a wrong shard or eval root fails in seconds
    built = build_model(cfg.model, device=info.device)
    if cfg.task == "simclr":  # image tower + projection head; the two views fill both slots
        from infclip.train.simclr import wrap_model

        built = wrap_model(built, cfg.loss.temperature)
    if cfg.precision.amp == "pure_bf16":  # open_clip's pure_bf16: bf16 weights, no autocast (engine.py)
        built.model.to(torch.bfloat16)
    prepare_model(cfg, info, built.model)
    model = _wrap_ddp(built.model, info)
    data, eval_cfg, normalizer, towers = _build_data(cfg, info, built)
    check_tasks(eval_cfg)  # open every eval dataset now: a wrong path fails before training
    optimizer = build_optimizer(built.model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.schedule, cfg.steps)
    scaler = torch.amp.GradScaler(info.device.type) if cfg.precision.amp == "fp16" else None
    group = torch.distributed.group.WORLD if info.distributed else None
    loss_fn = _loss_fn(cfg, group)
    engine = build_engine(
        cfg, model, device=info.device, normalizer=normalizer, loss_fn=loss_fn,
        scaler=scaler, group=group, world_size=info.world_size,
    )
    checkpointer = checkpointer or build_checkpointer(cfg, info, run_dir)
    checkpointer.on_publish = checkpoint_writer(built, cfg.model, cfg.checkpoint.open_clip_export)  # open_clip's format
    logger = MetricsLogger(
        run_dir, cfg.logging, info.is_main, cfg.steps, OmegaConf.to_container(cfg, resolve=True)
    )
    if checkpointer.remote is not None:
        checkpointer.remote.warn = logger.write  # beside the progress bar
    guard = WeightGuard([p for g in optimizer.param_groups for p in g["params"]],
                        abort=lambda: "an optimizer update made the weights non-finite (NaN/inf)")
    return Parts(built, model, data, optimizer, scheduler, scaler, engine, checkpointer, logger, eval_cfg, run_dir,
                 guard=guard, config=OmegaConf.to_container(cfg, resolve=True), towers=towers)


def allow_tf32(cfg: Any, device: torch.device) -> None:
    """precision.tf32 on a CUDA device: fp32 matmuls and convolutions may use TF32 (process-wide)."""
    if cfg.precision.tf32 and device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def prepare_model(cfg: Any, info: DistInfo, model: torch.nn.Module,
                  before_fp8: Optional[Callable[[], None]] = None,
                  before_compile: Optional[Callable[[], None]] = None) -> str:
    """The trainer's changes to a built model, in place and in this order: the locks
    (``model.lock_*``), precision.fp8's swap of the trained block layers (after the locks: trained
    layers only), model.compile (before DDP wraps it: state-dict keys, locks and DDP see the same
    modules). ``before_fp8`` / ``before_compile`` run at those two points (a benchmark counts FLOPs
    on the bf16 model, probes the eager one). Returns the FP8 line ('' when off), printed on rank 0."""
    from infclip.train.lit import apply_locks

    apply_locks(model, cfg.model)
    if before_fp8 is not None:
        before_fp8()
    line = _fp8(cfg, info, model)
    if before_compile is not None:
        before_compile()
    if cfg.model.compile:
        _compile(cfg, info, model)
    return line


def _wrap_ddp(model: torch.nn.Module, info: DistInfo) -> torch.nn.Module:
    if not info.distributed:
        return model
    ids = [info.device.index] if info.device.type == "cuda" else None
    # No buffer sync in the forward: open_clip towers keep no buffers that must stay in sync,
    # and the gradient-cache replay runs several forwards per step. torch >= 2.14 names it
    # forward_sync_buffers (its broadcast_buffers warns once per rank); either way the
    # buffers, identical on every rank at init, agree.
    import inspect

    ddp = torch.nn.parallel.DistributedDataParallel
    key = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters \
        else "broadcast_buffers"
    return ddp(model, device_ids=ids, **{key: False})


def _loss_fn(cfg: Any, group: Any):
    """loss_fn(img, txt, logit_scale[, logit_bias]) for loss.kind (clip / siglip / nt_xent)."""
    from infclip.loss import build_loss

    return build_loss(cfg.loss, group=group)


def _build_data(cfg: Any, info: DistInfo, built: BuiltModel):
    from infclip.data.pipeline import build_train_data
    from infclip.data.transforms import Normalizer

    size = cfg.data.image_size or built.image_size
    decode, why = resolve_decode(cfg, info.device)
    sizing = size_loader_agreed(cfg, info, decode)
    share = float(cfg.data.cpu_decode_share)
    reserved, towers = int(cfg.data.decode_reserved_sms), Partition(None, 0, 0)
    if decode == "device":  # workers pack JPEG bytes + crop; the trainer decodes (data/jpeg.py)
        from infclip.data.jpeg import JpegDecoder, JpegPacker

        # data.cpu_decode_share: the workers decode that fraction themselves, with the CPU
        # path's own transform (decode=device refuses augmentations, so it is the crop only)
        transform = JpegPacker(size, cfg.data.jpeg_max_bytes, tuple(cfg.data.aug_scale), tuple(cfg.data.aug_ratio),
                               cpu_share=share, cpu_transform=_cpu_transform(cfg, size, built) if share else None)
        normalizer = JpegDecoder(size, built.mean, built.std, device=info.device, backend=cfg.data.device_decoder,
                                 keep_bytes=_keep_bytes(cfg, info.device), decode_threads=sizing.decode_threads,
                                 roi=cfg.data.decode_roi, decoder_options=cfg.data.decoder_options)
        why = f"{why}; decoder {normalizer.describe()}"
        if reserved:  # after the decoder: its probe initialised CUDA on this device
            towers = tower_stream(info.device, reserved)
            why += f"; {towers.describe()} (data.decode_reserved_sms={reserved})"
        if cfg.data.decode_ahead_from == "first_pass" and not cfg.model.lock_image:
            why += ("; data.decode_ahead_from=first_pass has no effect: the image tower trains (its replay "
                    "reads this step's decoded pixels, so the next step's images start decoding after the loss)")
        if share:
            why += (f"; loader workers decode {100 * share:g} % of the samples (data.cpu_decode_share={share:g}, "
                    f"+{3 * size * size * share / 1000:.0f} KB of host pixels per sample on average)")
    else:
        from infclip.data.transforms import pil_library

        transform = _cpu_transform(cfg, size, built)
        normalizer = Normalizer(built.mean, built.std).to(info.device)
        why += f"; loader workers decode with {pil_library()}"
        if share:
            why += f"; data.cpu_decode_share={share:g} ignored: the loader workers decode every sample"
        if reserved:
            why += f"; data.decode_reserved_sms={reserved} ignored: no decoding runs on the GPU"
        if cfg.data.decode_ahead_from != "replay":
            why += f"; data.decode_ahead_from={cfg.data.decode_ahead_from} ignored: no decoding runs on the GPU"
    if info.is_main:
        print(f"data: decode={decode} ({why})", flush=True)
        print(f"data: {sizing.workers} loader worker(s) per rank: {sizing.why}", flush=True)
    shards, num_samples, eval_cfg = None, None, _eval_config(cfg)
    if cfg.data.kind == "synthetic":
        shards, num_samples, eval_cfg = _synthetic(cfg, info)
    data_cfg = copy.deepcopy(cfg.data)
    data_cfg.loader_batch = _loader_batch(cfg, info, num_samples if shards else _wds_samples(cfg))
    data_cfg.workers, data_cfg.decode_threads = sizing.workers, sizing.decode_threads
    data = build_train_data(
        data_cfg, transform=transform, tokenizer=built.tokenizer, rank=info.rank,
        world_size=info.world_size, seed=cfg.seed, shards=shards, num_samples=num_samples,
    )
    if info.is_main:
        print(data_line(cfg, data, shards), flush=True)
    return data, eval_cfg, normalizer, towers


def _compile(cfg: Any, info: DistInfo, model: torch.nn.Module) -> None:
    """model.compile: each tower compiled in place in ``model.compile_mode`` (a startup line names
    a mode other than inductor's default), whole or split under DDP (``_compile_under_ddp``)."""
    mode = cfg.model.compile_mode
    compile_towers(model, **({} if mode == "default" else {"mode": mode}))
    if mode != "default" and info.is_main:
        print(f"model: towers compiled with torch.compile mode={mode} (model.compile_mode)", flush=True)
    _compile_under_ddp(cfg, info)


def _compile_under_ddp(cfg: Any, info: DistInfo) -> None:
    """model.compile_ddp_split: whether dynamo splits the compiled towers at DDP's buckets (its
    ``optimize_ddp``, a process-wide setting read when a graph compiles). Said in one startup line
    on more than one rank; one process has no DDP and nothing to split."""
    if not info.distributed:
        return
    split = bool(cfg.model.compile_ddp_split)
    torch._dynamo.config.optimize_ddp = split
    if info.is_main:
        how = ("split at DDP's gradient buckets (model.compile_ddp_split=true)" if split else
               "whole, as on one GPU; gradients all-reduce after the last micro-batch's backward "
               "(model.compile_ddp_split=false)")
        print(f"model: compiled towers under DDP: {how}", flush=True)


def _fp8(cfg: Any, info: DistInfo, model: torch.nn.Module) -> str:
    """precision.fp8: the towers' trained block layers to torchao's Float8Linear (infclip.fp8),
    said in one startup line (returned too); off: the model is untouched, nothing is printed, ''."""
    if cfg.precision.fp8 == "off":
        return ""
    from infclip.fp8 import convert_towers

    line = convert_towers(model, cfg.precision.fp8, cfg.precision.fp8_layers).line()
    if info.is_main:
        print(line, flush=True)
    return line


def data_line(cfg: Any, data: Any, synthetic_shards: Optional[str]) -> str:
    """The startup line saying what is trained on: the source, its shards and samples per
    epoch, and where the sample count came from."""
    if cfg.data.kind == "synthetic":
        what = f"the embedded synthetic captioned shapes (data.kind=synthetic) in {synthetic_shards}"
        origin = "the generated set's size, data.synthetic_train"
    else:
        spec = cfg.data.shards if not cfg.data.sources else f"data.sources ({len(cfg.data.sources)} sources)"
        what, origin = f"data.kind=wds {spec}", data.origin
    return (f"data: training on {what}: {len(data.spec.urls)} shard(s), {data.num_samples} samples per epoch "
            f"({origin})")


def size_loader_agreed(cfg: Any, info: DistInfo, decode: str) -> Any:
    """data.workers / data.decode_threads for this process (infclip.data.workers), the worker
    count agreed on by every rank (the smallest): the default data.streams is ranks x workers,
    and ranks on machines of other sizes must build the same global sample order."""
    from dataclasses import replace

    from infclip.data.workers import AUTO, size_loader, this_machine

    sizing = size_loader(this_machine(info.world_size), decode, cfg.data.workers, cfg.data.decode_threads)
    if cfg.data.workers != AUTO or not info.distributed:
        return sizing
    agreed = torch.tensor([sizing.workers], device=info.device)
    torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
    if int(agreed.item()) == sizing.workers:
        return sizing
    return replace(sizing, workers=int(agreed.item()),
                   why=f"{sizing.why}; {int(agreed.item())}, the fewest any rank chose (every rank reads the same streams)")


def _cpu_transform(cfg: Any, size: int, built: BuiltModel):
    """The loader workers' train transform of data.decode=cpu (also their share of a
    data.decode=device run, data.cpu_decode_share)."""
    from infclip.data.transforms import train_transform

    d = cfg.data
    return train_transform(size, built.mean, built.std, tuple(d.aug_scale), tuple(d.aug_ratio),
                           draft=d.jpeg_draft, color_jitter=tuple(d.color_jitter),
                           color_jitter_prob=d.color_jitter_prob, gray_scale_prob=d.gray_scale_prob,
                           re_prob=d.re_prob, re_count=d.re_count, use_timm=d.use_timm,
                           interpolation=cfg.model.image_interpolation)


def resolve_decode(cfg: Any, device: torch.device) -> tuple[str, str]:
    """("cpu" | "device", why) for data.decode; "auto" takes the GPU's JPEG engines when they
    work (the loader then parses headers only), else the loader workers' CPU decode."""
    want = cfg.data.decode
    if want != "auto":
        return want, f"data.decode={want}"
    if cfg.task == "simclr":
        return "cpu", "auto: task=simclr augments decoded images on the host"
    from infclip.data.config import augmentation_keys

    augs = augmentation_keys(cfg.data)
    if augs:
        return "cpu", f"auto: {', '.join(augs)} augment in the loader workers (the GPU JPEG path only crops)"
    if device.type != "cuda":
        return "cpu", "auto: CPU training device"
    if cfg.data.device_decoder not in ("auto", "hardware"):
        return "device", f"auto: data.device_decoder={cfg.data.device_decoder}"
    from infclip.data.jpeg_backends import hardware_available

    missing = hardware_available(device)
    if missing is None:
        return "device", "auto: the GPU's hardware JPEG engines work"
    return "cpu", f"auto: no hardware JPEG decoder ({missing})"


def _keep_bytes(cfg: Any, device: torch.device) -> int:
    """Device bytes for decoded pixels kept between the gradient cache's passes."""
    gb = cfg.data.decoded_keep_gb
    if gb is not None:
        return int(gb * 2**30)
    if device.type != "cuda":
        return 256 * 2**20  # CPU runs: enough for the tests' steps, bounded
    free, _ = torch.cuda.mem_get_info(device)
    return int(0.4 * free)


def _synthetic(cfg: Any, info: DistInfo):
    """Generates the embedded dataset once (rank 0 first) and points eval tasks at it."""
    from infclip.data.synthetic import ensure_synthetic

    ds = on_rank0(info, lambda: ensure_synthetic(cfg.data))
    if not info.is_main:
        ds = ensure_synthetic(cfg.data)  # already there: returns its paths
    eval_cfg = _eval_config(cfg)
    for task in eval_cfg.tasks:
        if task.root.startswith("synthetic:"):
            task.root = str(Path(ds.root) / "eval" / task.root.split(":", 1)[1])
    return ds.train_shards, ds.num_train, eval_cfg


def apply_epochs(cfg: Any, info: DistInfo) -> None:
    """With ``epochs`` set, ``cfg.steps`` becomes ceil(epochs x samples per epoch / global
    batch), said in one line by rank 0, and the schedule is checked against it; without it
    the config is untouched. Every rank derives the same number from the same counts."""
    if cfg.epochs is None:
        return
    from infclip.config import _validate_schedule, steps_for_epochs

    samples = _epoch_samples(cfg)
    cfg.steps = steps_for_epochs(cfg.epochs, samples, cfg.batch.global_size)
    _validate_schedule(cfg.schedule, cfg.steps)
    if info.is_main:
        print(f"epochs={cfg.epochs}: {samples} samples per epoch / batch.global_size={cfg.batch.global_size} "
              f"-> steps={cfg.steps}", flush=True)


def _epoch_samples(cfg: Any) -> int:
    """Samples per epoch: the synthetic set's size, or data.num_samples / the shards' counts."""
    if cfg.data.kind == "synthetic":
        return cfg.data.synthetic_train
    from infclip.config import ConfigError
    from infclip.data.pipeline import resolve_sources, total_samples
    from infclip.data.shards import DataError

    sources = resolve_sources(cfg.data)  # a missing shard is a DataError of its own
    try:
        return total_samples(cfg.data, sources, None)
    except DataError as e:
        raise ConfigError(f"epochs={cfg.epochs} needs the dataset size, which is not known: {e}. Or train "
                          f"for a number of steps instead (epochs=null steps=N)") from None


def preflight(cfg: Any) -> None:
    """Check the data sources (spec, files, sample counts) and the eval datasets that exist
    before training, without a model: what ``build`` would find wrong later, found first."""
    from infclip.data.pipeline import resolve_sources

    _check_image_size(cfg)
    _check_tensorboard(cfg)
    _check_remote(cfg)
    if cfg.data.kind == "wds":
        resolve_sources(cfg.data)
    ev = _eval_config(cfg)
    ev.tasks = [t for t in ev.tasks if not str(t.root).startswith("synthetic:")]  # generated with the data
    check_tasks(ev)


def _check_tensorboard(cfg: Any) -> None:
    """logging.tensorboard=true needs the tensorboard package (torch's SummaryWriter imports it)."""
    import importlib.util

    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        from infclip.config import ConfigError

        raise ConfigError("logging.tensorboard=true but the tensorboard package is not installed (torch's "
                          "SummaryWriter writes through it): pip install tensorboard, or set "
                          "logging.tensorboard=false (metrics.jsonl and wandb hold the same numbers)")


def _check_remote(cfg: Any) -> None:
    """checkpoint.remote must be a URL fsspec can open (its protocol's package installed)."""
    if not cfg.checkpoint.remote:
        return
    import fsspec

    from infclip.config import ConfigError

    try:
        fsspec.core.url_to_fs(cfg.checkpoint.remote)
    except Exception as e:  # ImportError (s3fs, gcsfs missing), ValueError (unknown protocol)
        raise ConfigError(f"checkpoint.remote={cfg.checkpoint.remote!r}: fsspec cannot open it ({type(e).__name__}: "
                          f"{str(e).strip()[:200]}); install the file system's package (s3fs for s3://, gcsfs "
                          "for gs://, adlfs for az://), fix the URL, or set checkpoint.remote=null") from None


def _check_image_size(cfg: Any) -> None:
    """The crops have the side the model is built at: open_clip's ViTs have a fixed grid of
    position embeddings (a 32-px input on a 48-px model failed deep in the forward), so
    data.image_size must equal the model config's side unless model.image_size rebuilds the
    model at another one (config.validate refuses the two keys disagreeing), and a ViT's
    model.image_size must be a whole number of patches."""
    import open_clip

    from infclip.config import ConfigError

    if cfg.model.config_file:
        return
    vision = (open_clip.get_model_config(cfg.model.name) or {}).get("vision_cfg", {})
    side, patch = vision.get("image_size"), vision.get("patch_size")
    side = side[0] if isinstance(side, (list, tuple)) else side
    want = cfg.model.image_size
    if want is not None and patch and want % patch:
        raise ConfigError(f"model.image_size={want} is not a multiple of model.name={cfg.model.name}'s {patch}-px "
                          f"patches; set model.image_size={want // patch * patch or patch} or "
                          f"{(want // patch + 1) * patch}")
    if want is None and cfg.data.image_size is not None and side is not None and patch \
            and cfg.data.image_size != side:
        raise ConfigError(f"data.image_size={cfg.data.image_size} but model.name={cfg.model.name} takes {side}-px "
                          f"images (a ViT's position embeddings fix its input side): drop data.image_size "
                          f"(it defaults to the model's), set data.image_size={side}, or build the model at "
                          f"that side with model.image_size={cfg.data.image_size}")


def _eval_config(cfg: Any) -> Any:
    """The eval section as a plain EvalConfig dataclass (what infclip.eval consumes). With
    data.kind=wds the embedded dataset's ``synthetic:`` tasks (the quickstart preset's) have
    nothing to evaluate: they are left out, with one line."""
    ev = OmegaConf.to_object(cfg.eval) if OmegaConf.is_config(cfg.eval) else copy.deepcopy(cfg.eval)
    if cfg.data.kind != "synthetic":
        kept = [t for t in ev.tasks if not str(t.root).startswith("synthetic:")]
        if len(kept) < len(ev.tasks) and not getattr(_eval_config, "_said", False):
            _eval_config._said = True
            print(f"eval: {len(ev.tasks) - len(kept)} task(s) of the embedded synthetic dataset skipped "
                  "(data.kind=wds); " + ("evaluating the others" if kept else
                  "no eval runs: add your own with eval.tasks (docs/eval.md), e.g. a held-out folder"),
                  flush=True)
        ev.tasks = kept
    return ev


def _wds_samples(cfg: Any) -> Optional[int]:
    """Samples per epoch of the configured shards, or None where they cannot be counted
    (building the data then says so, naming data.num_samples)."""
    from infclip.data.pipeline import resolve_sources, total_samples
    from infclip.data.shards import DataError

    try:
        return total_samples(cfg.data, resolve_sources(cfg.data), None)
    except DataError:
        return None


def _loader_batch(cfg: Any, info: DistInfo, epoch_samples: Optional[int] = None) -> int:
    """Largest loader batch <= data.loader_batch that divides the per-rank step batch and
    that an epoch of ``epoch_samples`` fills at least once on every rank (a small dataset
    gets a smaller loader batch, said in one line, instead of no batch at all)."""
    local, asked = cfg.batch.global_size // info.world_size, cfg.data.loader_batch
    fits = max(1, epoch_samples // info.world_size) if epoch_samples else asked
    size = next(d for d in range(min(asked, local, fits), 0, -1) if local % d == 0)
    if size != asked and info.is_main:
        why = (f"an epoch of {epoch_samples} samples on {info.world_size} rank(s) fills no batch of {asked}"
               if fits < min(asked, local) else f"it does not divide the per-rank batch {local}")
        print(f"note: data.loader_batch={asked} lowered to {size}: {why}", flush=True)
    return size
