"""Typed training configuration, registered in Hydra's ConfigStore.

Every component has one dataclass; YAML files in ``configs/`` are presets over these
schemas and the command line overrides any field. Unknown keys are rejected by
OmegaConf's struct mode, and keys added with ``+key=value`` (which struct mode lets in) by
:func:`check_known_keys`, naming the nearest valid key; impossible values and combinations
(non-finite numbers, lr <= 0, betas outside [0, 1), ...) by :func:`validate`, before any model
or GPU work, with a message naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

from infclip.data.config import DataConfig, SourceConfig, check_data_config
from infclip.eval.config import EvalConfig, EvalTaskConfig, validate_eval


@dataclass
class ModelConfig:
    name: str = "infclip-tiny"  # any open_clip model name (or one of infclip/model_configs/*.json)
    config_file: Optional[str] = None  # custom open_clip JSON model config; registered under its stem
    pretrained: Optional[str] = None  # open_clip pretrained tag or a local checkpoint file
    image_pretrained: Optional[str] = None  # LiT: a local checkpoint file with weights for the image tower only
    lock_image: bool = False  # LiT: freeze the image tower (eval mode, no optimizer state)
    lock_image_unlocked_groups: int = 0  # LiT: last N layer groups of the image tower stay trainable
    lock_text: bool = False  # freeze the text tower
    lock_text_unlocked_layers: int = 0  # last N text layers stay trainable
    grad_checkpointing: bool = False  # activation checkpointing inside the towers
    # a ViT's patchify convolution as one GEMM on the GPU in bf16/fp16 (cuDNN's bf16 kernel for it runs at
    # ~30 TFLOP/s on Hopper; infclip/patch_embed.py). Same weights and state-dict keys.
    patch_embed_matmul: bool = True
    # the towers' self-attention in training through F.scaled_dot_product_attention on (N, H, L, d), the text
    # tower's causal mask as is_causal=True (no mask tensor: flash / cuDNN attention eligible; infclip/attention.py).
    # Same weights and state-dict keys; outputs equal nn.MultiheadAttention's up to summation order.
    # Eager on an H100: +24 % (ViT-B/32), +25 % (ViT-B/16) over nn.MultiheadAttention; compiled ViT-B/16 on an
    # H200: +7.8 % (scripts/bench/bench_towers.py --compile). false: open_clip's own nn.MultiheadAttention path
    sdpa_attention: bool = True
    compile: bool = False  # torch.compile the towers in place (state-dict keys unchanged), as open_clip's --torchcompile
    # under DDP, let dynamo split each compiled tower at DDP's gradient buckets (torch's optimize_ddp), so that
    # buckets all-reduce while the backward runs. Under the gradient cache only the last micro-batch's backward
    # all-reduces, and the split (21 graphs for ViT-B/32 instead of 2) cuts fusion in every replay micro-batch;
    # false: each tower compiles whole, as on one GPU, and its gradients all-reduce after that backward.
    compile_ddp_split: bool = False
    # torch.compile's mode for the towers: "default" (inductor's fusion), "max-autotune-no-cudagraphs" (also
    # benchmarks GEMM / Triton configs while compiling: ViT-B/32 takes over 9 minutes, and cuBLAS stays
    # the fastest for most of its GEMMs). "max-autotune" and "reduce-overhead" capture CUDA graphs
    # (cudagraph trees), which fail in training (validation refuses them: _validate_model).
    # Only with model.compile=true.
    compile_mode: str = "default"
    init_logit_scale: Optional[float] = None  # None: the model's default (ln(1/0.07))
    init_logit_bias: Optional[float] = None  # SigLIP bias init (e.g. -10)
    max_logit_scale: float = 4.605170185988092  # clamp: ln 100, as in CLIP
    # FLIP patch dropout (open_clip's PatchDropout, ViT image towers): fraction in [0, 1) of the
    # image patches dropped per sample in training, never in eval. 0: off (overrides any value in
    # the model's JSON config). The gradient cache replays each micro-batch under its cache-pass
    # RNG state, so both passes keep the same patches.
    patch_dropout: float = 0.0
    # input side in pixels (open_clip's force_image_size); None: the model config's own. Pretrained
    # ViT position embeddings are interpolated to it; transforms and checkpoints follow it.
    image_size: Optional[int] = None
    # Inference/normalization preprocessing overrides (open_clip's --image-mean, --image-std,
    # --image-interpolation, --image-resize-mode; create_model_and_transforms' image_* arguments).
    # None: the model config's own (OpenAI's mean/std, bicubic, shortest side). They set the
    # training normalization and the eval transforms, and are written to the checkpoints'
    # open_clip_config.json preprocess_cfg, so open_clip / clip_benchmark preprocess the same way.
    image_mean: Optional[list[float]] = None  # per-channel RGB mean in [0, 1], e.g. [0.5, 0.5, 0.5]
    image_std: Optional[list[float]] = None  # per-channel RGB std (> 0)
    image_interpolation: Optional[str] = None  # eval resize: "bicubic" | "bilinear" (timm train pipeline too)
    image_resize_mode: Optional[str] = None  # eval resize: "shortest" | "longest" | "squash"


@dataclass
class LossConfig:
    kind: str = "clip"  # "clip" | "siglip" | "nt_xent"
    impl: str = "auto"  # "auto" | "vanilla" | "local" | "torch" | "triton"
    fp32_precision: str = "ieee"  # fp32 dot precision inside the tiled loss: "ieee" | "tf32"
    temperature: float = 0.1  # nt_xent only
    grad_filter: float = 0.0  # clip only: skip backward blocks with softmax < eps/b (0 = off; infclip/loss/filtering.py)
    # clip only: pairs i != j of one duplicate group (same caption) are "off" negatives as usual,
    # "mask": neither negatives nor positives, "positive": extra positives (multi-positive
    # InfoNCE). Exact definitions: infclip/loss/duplicates.py. Off by default: no cost at all.
    duplicates: str = "off"
    # what makes a duplicate group: "caption" (a 62-bit hash of the token ids) or "caption+image"
    # (and of the image tensor's bytes as the trainer receives it; see infclip/data/dedup.py)
    duplicate_key: str = "caption"


@dataclass
class OptimConfig:
    # "adamw" | "adafactor" (timm's big_vision-style AdafactorBigVision) | "timm/<name>": any of
    # timm.optim.list_optimizers() (lamb, lion, adan, ...), as open_clip's --opt timm/<name>
    name: str = "adamw"
    lr: float = 1e-3  # peak learning rate (the paper's)
    weight_decay: float = 1e-4  # the paper's; gains, biases and logit scale get none
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables


@dataclass
class ScheduleConfig:
    kind: str = "cosine"  # "cosine" | "constant" | "const-cooldown" (open_clip's: constant, then a cooldown)
    warmup_steps: int = 0  # linear warm-up from 0 to lr
    warmup_fraction: float = 0.0  # alternative to warmup_steps, as a fraction of train.steps
    min_lr_ratio: float = 0.0  # cosine floor / cooldown end lr, as a fraction of lr
    cooldown_steps: int = 0  # const-cooldown: the last steps decay from lr to min_lr_ratio * lr
    cooldown_fraction: float = 0.0  # alternative to cooldown_steps, as a fraction of train.steps
    cooldown_power: float = 1.0  # const-cooldown: decay (1 - progress) ** power (1: linear, open_clip's default)


@dataclass
class PrecisionConfig:
    # "fp32" | "bf16" | "fp16" (autocast; fp16 uses a GradScaler) | "pure_bf16" (open_clip's: the
    # weights themselves are bf16, no autocast, the optimizer steps bf16 parameters; the loss is
    # still computed in fp32 from the bf16 embeddings)
    amp: str = "fp32"
    tf32: bool = False  # allow TF32 matmuls in the towers (CUDA)
    # "off" | "tensorwise" | "rowwise": the trained linear layers of the towers' transformer blocks (MLP, attention
    # in/out projections) run torchao's float8 training with that scaling recipe (CUDA, compute capability >= 8.9,
    # precision.amp=bf16 or pure_bf16);
    # embeddings, norms, final projections, logit scale and loss stay bf16/fp32 (infclip/fp8.py). Off: no change
    fp8: str = "off"
    # with fp8 on, which of those layers: "all", or "large": only those whose GEMM is large enough for FP8 to pay
    # in torchao's measurements (tensorwise: out_features > 1024 or in_features > 4096; rowwise: out > 2048,
    # in > 1024 and not both out <= 4096 and in <= 2048); the startup line names them (infclip/fp8.py)
    fp8_layers: str = "all"


@dataclass
class BatchConfig:
    global_size: int = 256  # samples per optimizer step across all ranks
    micro_size: Optional[int] = None  # samples per encoder pass per rank; None: global_size / world


@dataclass
class MemoryConfig:
    grad_cache: str = "auto"  # "auto" (on when micro < per-rank batch) | "on" | "off"
    cache_dtype: str = "fp32"  # cached embeddings: "fp32" | "bf16"
    offload: bool = False  # keep the step's inputs in pinned CPU memory, stream micro-batches
    # Step pipeline (infclip/train/pipeline.py): a background thread assembles the next
    # step while the GPU trains; the cache pass reads micro-batches as they arrive, and host
    # chunks freed by the replay are refilled for the next step at once. Pinned host memory
    # per rank: (1 + prefetch_steps) x per-rank batch x (3*H*W + 8*L) bytes (uint8 images,
    # int64 tokens): 0 still overlaps the loader with the replay; 1 also fills a whole step
    # ahead through the cache pass. Fractions work (0.25 at 256k x 224 px = 49 GB, not 79).
    prefetch_steps: float = 1.0
    # cap on those pinned buffers per rank (GB); None: half the host's available memory
    # shared by the ranks on the host. The pool never goes below one step.
    host_buffer_gb: Optional[float] = None
    stream_once_inputs: bool = True
    stream_rows: int = 32768  # ring size in samples (rounded up to whole micro/loader batches)
    # false: fill each step in the trainer's thread (no overlap; debugging). data.workers=0
    # always fills in the trainer's thread (in-process decoding shares torch's global RNG).
    pipeline_thread: bool = True


@dataclass
class CheckpointConfig:
    every_n_steps: int = 0  # 0: only at the end
    keep_last: int = 3  # keep-last-k pruning (never removes the checkpoint resumed from)
    # also write open_clip's format (open_clip_config.json + open_clip_model.safetensors) into each
    # checkpoint folder, so open_clip / clip_benchmark load it as local-dir:<folder>; doubles weight bytes
    open_clip_export: bool = True
    # fsspec URL (s3://bucket/run, gs://..., file:///path, memory://run) each published checkpoint is
    # mirrored to, as <remote>/checkpoints/step_XXXXXXXX/ (manifest last); None: local only. Rank 0
    # uploads after the local publish; a failed upload warns and training goes on (local is the truth)
    remote: Optional[str] = None


@dataclass
class LoggingConfig:
    every_n_steps: int = 10  # progress line / metrics-file cadence
    progress: bool = True  # live progress bar on the terminal
    wandb_mode: str = "offline"  # "online" | "offline" | "disabled" (never prompts)
    wandb_project: str = "infclip"
    wandb_entity: Optional[str] = None
    # rank 0 also writes the logged scalars (the numbers of metrics.jsonl) as TensorBoard event
    # files into <run_dir>/tensorboard/ (needs `pip install tensorboard`)
    tensorboard: bool = False
    # profile this step (1-based; 0: none) under the PyTorch profiler: every kernel and copy of
    # the process, the decoders' included; trace and GPU-time summary in <run_dir>/profile/
    profile_step: int = 0
    # record the device JPEG decoder's timeline in this step (1-based; 0: none; data.decode
    # device or auto on the GPU): when it worked and idled per phase, printed to the log and
    # written to <run_dir>/decode_trace/ (cheap: the step runs at full speed)
    decode_trace_step: int = 0
    # a step running longer than this prints, every this many seconds, a line with its phase,
    # micro-batches done and the time left at its rate so far (main rank; 0: never)
    heartbeat_s: float = 60.0


@dataclass
class DistConfig:
    # seconds a rank waits at the start for the others to join (torchrun / by hand: the
    # rendezvous and the first collective, which compares the ranks' configurations); a rank
    # that waits says so after at most 30 s. A node that never joins ends the job then, exit 2
    join_timeout_s: float = 300.0
    # seconds any later collective may wait (torch's process-group timeout; its default)
    timeout_s: float = 1800.0
    # seconds a step may still take after a stop signal (SIGTERM, SIGINT, SIGHUP, SIGUSR1) before
    # the process exits without a checkpoint: a rank stuck in a collective whose peers are gone
    # is stopped by the signal, not by the collective timeout; 0: wait for the step however long
    stop_grace_s: float = 120.0


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    steps: int = 100  # optimizer steps to train
    # alternative to steps: steps = ceil(epochs * samples per epoch / batch.global_size), from the
    # dataset's size (data.synthetic_train; data.num_samples or the shards' counts for wds)
    epochs: Optional[int] = None
    seed: int = 0
    name: str = "run"  # run name; the run directory is <runs_root>/<name>
    runs_root: str = "runs"
    run_dir: Optional[str] = None  # explicit run directory (overrides runs_root/name)
    resume: str = "auto"  # "auto" (latest valid checkpoint in run_dir) | "none" | a checkpoint path
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    max_nonfinite: int = 5  # consecutive non-finite steps before aborting
    experiment: Optional[str] = None  # name of the preset this run came from (informational)
    task: str = "clip"  # "clip" | "simclr" (image-only, two views, NT-Xent; infclip/train/simclr.py)


def register_configs() -> None:
    """Register the schemas so YAML presets and overrides are type-checked."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(group="model", name="schema", node=ModelConfig)
    cs.store(group="data", name="schema", node=DataConfig)
    cs.store(group="loss", name="schema", node=LossConfig)
    cs.store(group="optim", name="schema", node=OptimConfig)
    cs.store(group="eval", name="schema", node=EvalConfig)


_CHOICES: dict[str, tuple[Any, ...]] = {
    "loss.kind": ("clip", "siglip", "nt_xent"),
    "loss.impl": ("auto", "vanilla", "local", "torch", "triton"),
    "loss.fp32_precision": ("ieee", "tf32"),
    "loss.duplicates": ("off", "mask", "positive"),
    "loss.duplicate_key": ("caption", "caption+image"),
    "schedule.kind": ("cosine", "constant", "const-cooldown"),
    "precision.amp": ("fp32", "bf16", "fp16", "pure_bf16"),
    "precision.fp8": ("off", "tensorwise", "rowwise"),
    "precision.fp8_layers": ("all", "large"),
    "model.compile_mode": ("default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead"),
    "memory.grad_cache": ("auto", "on", "off"),
    "memory.cache_dtype": ("fp32", "bf16"),
    "logging.wandb_mode": ("online", "offline", "disabled"),
    "data.kind": ("synthetic", "wds"),
    "device": ("auto", "cpu", "cuda"),
    "task": ("clip", "simclr"),
}


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key and the fix."""


def _validate_optimizer(name: str) -> None:
    """adamw, adafactor, or timm/<a name timm.optim knows> (nearest names suggested)."""
    if name in ("adamw", "adafactor"):
        return
    if not name.startswith("timm/"):
        raise ConfigError(f"optim.name={name!r} is not valid; choose adamw, adafactor or timm/<optimizer> "
                          "(e.g. timm/lamb, timm/lion; timm.optim.list_optimizers() lists them)")
    import difflib

    from timm.optim import list_optimizers

    known = list_optimizers()
    if name[5:] not in known:
        near = difflib.get_close_matches(name[5:], known, n=3)
        hint = f"did you mean {', '.join('timm/' + n for n in near)}?" if near else \
            "timm.optim.list_optimizers() lists the names"
        raise ConfigError(f"optim.name={name!r}: timm has no optimizer {name[5:]!r}; {hint}")


def _validate_schedule(cfg: Any, steps: int) -> None:
    if cfg.cooldown_steps < 0 or not 0 <= cfg.cooldown_fraction <= 1 or cfg.cooldown_power <= 0:
        raise ConfigError("schedule.cooldown_steps must be >= 0, schedule.cooldown_fraction in [0, 1] and "
                          "schedule.cooldown_power > 0")
    if cfg.kind == "const-cooldown" and not (cfg.cooldown_steps or cfg.cooldown_fraction):
        raise ConfigError("schedule.kind=const-cooldown needs schedule.cooldown_steps=N or "
                          "schedule.cooldown_fraction=F (the final steps over which the lr decays)")
    if cfg.kind != "const-cooldown" and (cfg.cooldown_steps or cfg.cooldown_fraction):
        raise ConfigError(f"schedule.cooldown_steps/cooldown_fraction apply to schedule.kind=const-cooldown, "
                          f"not {cfg.kind!r}: set schedule.kind=const-cooldown or drop them")
    warmup = cfg.warmup_steps or math.ceil(cfg.warmup_fraction * steps)
    cooldown = cfg.cooldown_steps or math.ceil(cfg.cooldown_fraction * steps)
    if cfg.kind == "const-cooldown" and warmup + cooldown > steps:  # (a warm-up alone may outlast a short run)
        raise ConfigError(f"the warm-up ({warmup} steps) and the cooldown ({cooldown}) exceed steps={steps}: "
                          "shorten schedule.warmup_* / schedule.cooldown_* or train longer")


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def validate(cfg: Any, world_size: int) -> None:
    """Reject unknown keys and impossible settings before any model or GPU work."""
    check_known_keys(cfg)
    _check_finite(cfg)
    for key, choices in _CHOICES.items():
        if _get(cfg, key) not in choices:
            raise ConfigError(f"{key}={_get(cfg, key)!r} is not valid; choose one of {list(choices)}")
    _validate_optimizer(cfg.optim.name)
    _validate_batch(cfg.batch, world_size)
    _validate_numbers(cfg)
    _validate_epochs(cfg)
    _validate_schedule(cfg.schedule, cfg.steps)
    _validate_loss(cfg)
    _validate_model(cfg)
    _validate_fp8(cfg)
    _validate_logging_backends(cfg.logging)
    streams = cfg.data.streams
    if isinstance(streams, int) and streams >= 1 and streams % world_size:
        raise ConfigError(f"data.streams={streams} is not a multiple of the world size {world_size}: each rank reads "
                          f"whole streams of the global sample order. Run on a number of ranks that divides "
                          f"{streams}, or set data.streams to a multiple of {world_size} (or null) for a new run")
    if "/" in cfg.name or "\\" in cfg.name or cfg.name in ("", ".", ".."):  # the run folder stays in runs_root
        raise ConfigError(f"name={cfg.name!r} must be a plain folder name (no '/', not '.' or '..'); "
                          "use run_dir=<path> for a run folder elsewhere")
    if cfg.data.kind == "wds" and not (cfg.data.shards or cfg.data.sources):
        raise ConfigError("data.kind=wds needs data.shards=/path/{00000..00099}.tar (or data.sources)")
    if cfg.task == "simclr" and (cfg.loss.kind != "nt_xent" or cfg.model.lock_image or cfg.model.lock_text
                                 or len(cfg.eval.tasks)):
        raise ConfigError("task=simclr trains an image tower alone: it needs loss=nt_xent, no model.lock_* "
                          "and eval.tasks=[] (see configs/experiment/simclr_quickstart.yaml)")
    if cfg.task == "simclr" and cfg.data.decode == "device":
        raise ConfigError("task=simclr augments decoded images on the device itself; use data.decode=cpu")
    try:
        check_data_config(cfg.data)
        validate_eval(cfg.eval)
    except ValueError as e:
        raise ConfigError(str(e)) from None


_POSITIVE = ("steps", "optim.lr", "optim.eps", "checkpoint.keep_last", "max_nonfinite", "memory.stream_rows",
             "dist.join_timeout_s", "dist.timeout_s")
_NON_NEGATIVE = ("optim.weight_decay", "optim.grad_clip", "schedule.warmup_steps", "memory.prefetch_steps",
                 "logging.every_n_steps", "checkpoint.every_n_steps", "logging.profile_step",
                 "logging.decode_trace_step", "logging.heartbeat_s", "dist.stop_grace_s")


def _validate_numbers(cfg: Any) -> None:
    for key in _POSITIVE:
        if _get(cfg, key) <= 0:
            raise ConfigError(f"{key} must be > 0, got {_get(cfg, key)}")
    for key in _NON_NEGATIVE:
        if _get(cfg, key) < 0:
            raise ConfigError(f"{key} must be >= 0, got {_get(cfg, key)}")
    if cfg.memory.host_buffer_gb is not None and not cfg.memory.host_buffer_gb > 0:
        raise ConfigError(f"memory.host_buffer_gb must be > 0 (or null for the default), got {cfg.memory.host_buffer_gb}")
    for key, lo, hi in (("schedule.warmup_fraction", 0, 0.999999), ("schedule.min_lr_ratio", 0, 1)):
        if not lo <= _get(cfg, key) <= hi:
            raise ConfigError(f"{key} must be in [{lo}, {round(hi)}], got {_get(cfg, key)}")
    for key in ("optim.beta1", "optim.beta2"):  # Adam's moment decays (AdaFactor: momentum, decay cap)
        if not 0 <= _get(cfg, key) < 1:
            raise ConfigError(f"{key} must be in [0, 1), got {_get(cfg, key)} (typical: beta1=0.9, beta2=0.95..0.999)")


def _validate_epochs(cfg: Any) -> None:
    if cfg.epochs is not None and cfg.epochs <= 0:
        raise ConfigError(f"epochs must be > 0 (or null to train for steps), got {cfg.epochs}")


def check_run_length(cfg: Any, overrides: list[str]) -> None:
    """``epochs`` replaces ``steps`` (a preset's steps included); ``steps=N`` given beside it on
    the command line is ambiguous and refused, naming both keys and the fix."""
    given = any(o.split("=", 1)[0].lstrip("+~") == "steps" for o in overrides if "=" in o)
    if cfg.epochs is not None and given:
        raise ConfigError(f"both steps={cfg.steps} and epochs={cfg.epochs} are set; the run length is one or "
                          f"the other (epochs derives steps from the dataset size): drop steps=... to train "
                          f"{cfg.epochs} epoch(s), or drop epochs=... to train {cfg.steps} steps")


def infer_data_kind(cfg: Any, overrides: list[str]) -> Optional[str]:
    """Training data is what the user named: ``data.shards`` (or ``data.sources``) with a
    preset's ``data.kind=synthetic`` becomes ``data.kind=wds`` (returns the line saying so);
    with ``data.kind=synthetic`` on the command line the contradiction is refused, naming both
    keys and the fix. None when nothing was inferred."""
    if cfg.data.kind != "synthetic" or not (cfg.data.shards or cfg.data.sources):
        return None
    given = "data.shards" if cfg.data.shards else "data.sources"
    if any(o.split("=", 1)[0].lstrip("+~") == "data.kind" for o in overrides if "=" in o):
        raise ConfigError(f"data.kind=synthetic and {given} are both given: the synthetic shapes would be trained "
                          f"on and {given} ignored. To train on your shards set data.kind=wds (or drop "
                          f"data.kind=synthetic); to train on the synthetic set drop {given}")
    cfg.data.kind = "wds"
    return (f"data: data.kind=wds inferred from {given} (the preset{' ' + cfg.experiment if cfg.experiment else ''}"
            " has data.kind=synthetic, which would ignore the shards)")


def steps_for_epochs(epochs: int, num_samples: int, global_batch: int) -> int:
    """Optimizer steps that see ``epochs`` passes over ``num_samples`` (the last one partial)."""
    return math.ceil(epochs * num_samples / global_batch)


def _leaves(node: Any, prefix: str = "") -> Any:
    """(dotted key, value) of every leaf of a config (dicts, lists, dataclasses)."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        node = {f.name: getattr(node, f.name) for f in dataclasses.fields(node)}
    items = node.items() if isinstance(node, dict) else (enumerate(node) if isinstance(node, (list, tuple)) else None)
    if items is None:
        yield prefix.rstrip("."), node
        return
    for k, v in items:
        yield from _leaves(v, f"{prefix}{k}.")


def _check_finite(cfg: Any) -> None:
    """No number in the config is NaN or infinite (``optim.lr=inf`` would train to NaN)."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else cfg
    for key, value in _leaves(plain):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value} is not a finite number; give a finite value")


def _schema_keys(schema: type, prefix: str = "") -> list[str]:
    """Every dotted key of a dataclass schema (nested dataclass fields included)."""
    keys = []
    for f in dataclasses.fields(schema):
        keys.append(prefix + f.name)
        sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(sub):
            keys += _schema_keys(type(sub), f"{prefix}{f.name}.")
    return keys


def check_overrides(args: list[str], groups: tuple[str, ...] = ()) -> None:
    """Command-line overrides checked before Hydra sees them, so that a typo gets our
    paragraph (Hydra's own error for ``key=value`` on an unknown key recommends ``+key=``,
    the wrong fix, and exits 1). ``groups``: config group names (``experiment``, ...).

    Checks plain ``key=value`` overrides only (``+``/``~``/``hydra.`` ones are Hydra's): the key
    must be a path through :class:`TrainConfig`'s fields (anything below a list or dict field
    is left to the composed config's check), and a brace-expanded value must be quoted (a value
    that is a Hydra list or dict, ``[{name: a}]``, is not a brace expansion).
    """
    for arg in args:
        if "=" not in arg or arg[0] in "-+~":
            continue
        key, value = arg.split("=", 1)
        if key.startswith("hydra.") or key.split("@")[0] in groups:
            continue
        if not _schema_path_ok(key.split("."), TrainConfig):
            raise ConfigError(_unknown_key_message(key, _parent_kind(key.split(".")), TrainConfig))
        if "{" in value and value[:1] not in ("'", '"', "[", "{"):  # lists / dicts are Hydra's own syntax
            raise ConfigError(
                f"{key}={value}: a brace-expanded spec must be quoted for Hydra, in both quotes: "
                f"\"{key}='{value}'\" (double for the shell, single for Hydra)")


def _parent_kind(parts: list[str], kind: type = None) -> type:
    """The deepest schema dataclass along ``parts`` (the one that lacks the next name)."""
    import typing

    kind = kind or TrainConfig
    sub = typing.get_type_hints(kind).get(parts[0])
    return _parent_kind(parts[1:], sub) if len(parts) > 1 and dataclasses.is_dataclass(sub) else kind


def _schema_path_ok(parts: list[str], kind: type) -> bool:
    import typing

    hints = typing.get_type_hints(kind)
    if parts[0] not in hints:
        return False
    if len(parts) == 1:
        return True
    sub = hints[parts[0]]
    args = [t for t in typing.get_args(sub) if t is not type(None)]
    if typing.get_origin(sub) is typing.Union and len(args) == 1:
        sub = args[0]  # Optional[X]
    return _schema_path_ok(parts[1:], sub) if dataclasses.is_dataclass(sub) else True


def check_known_keys(cfg: Any, schema: type = None) -> None:
    """Every key of the composed config is a field of its schema dataclass.

    OmegaConf's struct mode rejects ``key=value`` for an unknown key, but ``+key=value``
    adds it; Hydra's own error for the first even suggests the second. So walk the composed
    config: a node typed by a dataclass may hold only that dataclass's fields.
    """
    from omegaconf import DictConfig, ListConfig, OmegaConf

    schema = schema or TrainConfig

    def walk(node: Any, path: str) -> None:
        if isinstance(node, ListConfig) and not node._is_none():  # a null Optional[list] has no items
            for i, item in enumerate(node):
                walk(item, f"{path}{i}.")
        if not isinstance(node, DictConfig):
            return
        kind = OmegaConf.get_type(node)
        fields = {f.name for f in dataclasses.fields(kind)} if dataclasses.is_dataclass(kind) else None
        for key in node.keys():
            if fields is not None and key not in fields:
                raise ConfigError(_unknown_key_message(f"{path}{key}", kind, schema))
            walk(node._get_node(key), f"{path}{key}.")

    if isinstance(cfg, DictConfig):
        walk(cfg, "")


def _unknown_key_message(key: str, kind: type, schema: type) -> str:
    near = difflib.get_close_matches(key, _schema_keys(schema), n=1, cutoff=0.6)
    hint = f"did you mean {near[0]}?" if near else "see the schema (python train.py --cfg job lists every key)"
    return (f"unknown config key {key!r}: {kind.__name__} has no field {key.rsplit('.', 1)[-1]!r} "
            f"(a '+' override adds keys the schema does not know, and they would be ignored); {hint}")


GRAPHED_COMPILE_MODES = ("max-autotune", "reduce-overhead")  # torch.compile modes that capture CUDA graphs
# With torch 2.11 on an H200, towers compiled one by one (model.compile) in reduce-overhead train one
# step (the trees' warm-up), then the first recorded backward reads saved activations the trees
# have already handed to another graph: in a plain training loop and in the gradient-cache replay.

def _validate_model(cfg: Any) -> None:
    """model.patch_dropout in [0, 1) on a tower that trains; model.compile_mode only with
    model.compile and capturing no CUDA graphs; model.image_size > 0 or null; it and
    data.image_size agree when both are set (the crops must be the side the model is built at)."""
    m = cfg.model
    if not 0 <= m.patch_dropout < 1:
        raise ConfigError(f"model.patch_dropout={m.patch_dropout} must be in [0, 1) (the fraction of image patches "
                          "dropped in training; FLIP uses 0.5 or 0.75): set e.g. model.patch_dropout=0.5, "
                          "or 0 for none")
    if m.patch_dropout > 0 and m.lock_image:
        raise ConfigError(f"model.patch_dropout={m.patch_dropout} with model.lock_image=true: the locked image trunk "
                          "(patch dropout included) runs in eval mode, so no patch would be dropped; set "
                          "model.patch_dropout=0 or model.lock_image=false")
    if m.compile_mode in GRAPHED_COMPILE_MODES:
        raise ConfigError(f"model.compile_mode={m.compile_mode} captures CUDA graphs of the compiled towers "
                          "(cudagraph trees), and training with them stops at the first recorded backward "
                          "(\"accessing tensor output of CUDAGraphs that has been overwritten\": the trees reuse the "
                          "text tower's saved activations before its backward reads them); what they would save, "
                          "the launch gaps, is 4-5 % of a compiled ViT-B/32 step; set model.compile_mode=default (or "
                          "max-autotune-no-cudagraphs)")
    if m.compile_mode != "default" and not m.compile:
        raise ConfigError(f"model.compile_mode={m.compile_mode} with model.compile=false: the mode is torch.compile's "
                          "and nothing would be compiled; add model.compile=true, or drop model.compile_mode")
    if m.image_size is not None and m.image_size <= 0:
        raise ConfigError(f"model.image_size must be > 0 pixels (or null for the model's own), got {m.image_size}")
    _validate_preprocess(m)
    d = cfg.data.image_size
    if m.image_size is not None and d is not None and d != m.image_size:
        raise ConfigError(f"data.image_size={d} but model.image_size={m.image_size}: the model is built for "
                          f"{m.image_size}-px inputs and the crops must have that side; drop data.image_size "
                          f"(it follows model.image_size) or set both to the same value")


def _validate_preprocess(m: Any) -> None:
    """model.image_mean/std: 3 (or 1) numbers, std > 0; interpolation and resize mode among open_clip's."""
    for key, positive in (("image_mean", False), ("image_std", True)):
        v = getattr(m, key)
        if v is None:
            continue
        v = list(v)
        if len(v) not in (1, 3) or any(not (x > 0 if positive else 0 <= x <= 1) for x in v):
            want = "> 0" if positive else "in [0, 1] (pixels scaled to [0, 1])"
            raise ConfigError(f"model.{key} must be null or 3 per-channel RGB values (or 1 for all) {want}, got {v}; "
                              f"e.g. model.{key}=[0.5,0.5,0.5]")
    if m.image_interpolation not in (None, "bicubic", "bilinear"):
        raise ConfigError(f"model.image_interpolation={m.image_interpolation!r}: choose bicubic, bilinear or null "
                          "(the model's own)")
    if m.image_resize_mode not in (None, "shortest", "longest", "squash"):
        raise ConfigError(f"model.image_resize_mode={m.image_resize_mode!r}: choose shortest, longest, squash or "
                          "null (the model's own)")


def _validate_loss(cfg: Any) -> None:
    loss = cfg.loss
    if loss.grad_filter < 0 or (loss.grad_filter > 0 and (loss.kind, loss.impl) not in
                                (("clip", "auto"), ("clip", "torch"), ("clip", "triton"))):
        raise ConfigError("loss.grad_filter must be >= 0 and needs loss.kind=clip with loss.impl=auto, torch "
                          "or triton")
    if loss.duplicates != "off" and (loss.kind != "clip" or loss.impl not in ("auto", "torch", "triton")
                                     or loss.grad_filter > 0 or cfg.task != "clip"):
        raise ConfigError(f"loss.duplicates={loss.duplicates} needs loss.kind=clip with loss.impl=auto, torch or "
                          f"triton, loss.grad_filter=0 and task=clip (got kind={loss.kind}, impl={loss.impl}, "
                          f"grad_filter={loss.grad_filter}, task={cfg.task}); set loss.duplicates=off otherwise")
    if loss.impl == "local" and loss.kind != "clip":
        raise ConfigError(f"loss.impl=local is CLIP-only; use auto, torch or triton for loss.kind={loss.kind}")
    if loss.kind == "nt_xent" and loss.temperature <= 0:
        raise ConfigError(f"loss.temperature must be > 0 for loss.kind=nt_xent, got {loss.temperature}")
    no_cuda = cfg.device == "cpu" or (cfg.device == "auto" and not _cuda_available())
    if loss.impl == "triton" and no_cuda and not os.environ.get("TRITON_INTERPRET"):
        raise ConfigError("loss.impl=triton needs CUDA; use loss.impl=auto (Triton on CUDA, PyTorch tiles elsewhere)")


def _validate_fp8(cfg: Any) -> None:
    """precision.fp8 on: a CUDA device of compute capability >= 8.9 (this process's) and torchao's
    float8 module importable, then bf16 towers (precision.amp=bf16 or pure_bf16: the FP8 GEMMs
    write bf16, and rowwise scaling takes no other output type); checked before any model is built."""
    if cfg.precision.fp8 == "off":
        return
    import torch

    from infclip.fp8 import check_fp8

    cuda = cfg.device == "cuda" or (cfg.device == "auto" and _cuda_available())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda and _cuda_available() else \
        torch.device("cuda" if cuda else "cpu")
    problem = check_fp8(cfg.precision.fp8, device)
    if problem:
        raise ConfigError(problem)
    if cfg.precision.amp not in ("bf16", "pure_bf16"):
        raise ConfigError(f"precision.fp8={cfg.precision.fp8} with precision.amp={cfg.precision.amp}: the FP8 layers "
                          "write bf16 (rowwise scaling takes no other output type) and the rest of the towers should "
                          "match; set precision.amp=bf16 (or pure_bf16), or precision.fp8=off")


def _validate_logging_backends(log: Any) -> None:
    """The logging backends a run asks for are importable: wandb unless logging.wandb_mode=disabled,
    tensorboard with logging.tensorboard=true (otherwise the run fails at its first record, after
    the model is built and compiled)."""
    import importlib.util

    if log.wandb_mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"logging.wandb_mode={log.wandb_mode} logs the run to Weights & Biases, but this Python "
                          "has no wandb package (it is one of infclip's dependencies, so this environment was "
                          "installed without them). Install it (pip install 'wandb>=0.17'), or set "
                          "logging.wandb_mode=disabled to log to <run_dir>/metrics.jsonl and out.log only")
    if log.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("logging.tensorboard=true writes TensorBoard event files, but this Python has no tensorboard "
                          "package. Install it (pip install 'infclip[tensorboard]'), or set "
                          "logging.tensorboard=false")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _validate_batch(batch: BatchConfig, world_size: int) -> None:
    g, w = batch.global_size, world_size
    if g <= 0:
        raise ConfigError(f"batch.global_size must be > 0, got {g}")
    if g % w:
        raise ConfigError(
            f"batch.global_size={g} is not divisible by the world size {w}; "
            f"use a multiple of {w} (e.g. batch.global_size={(g // w + 1) * w})"
        )
    local = g // w
    micro = batch.micro_size
    if micro is not None and (micro <= 0 or local % micro):
        raise ConfigError(
            f"batch.micro_size={micro} must divide the per-rank batch global_size/world = {g}/{w} = "
            f"{local}; choose a divisor of {local} (or leave batch.micro_size unset for {local})"
        )


def micro_size(cfg: Any, world_size: int) -> int:
    """Samples per encoder pass per rank."""
    local = cfg.batch.global_size // world_size
    return local if cfg.batch.micro_size is None else cfg.batch.micro_size


__all__ = [
    "TrainConfig", "ModelConfig", "DataConfig", "SourceConfig", "LossConfig", "OptimConfig",
    "ScheduleConfig", "PrecisionConfig", "BatchConfig", "MemoryConfig", "CheckpointConfig",
    "LoggingConfig", "EvalConfig", "EvalTaskConfig", "ConfigError", "register_configs",
    "validate", "check_known_keys", "micro_size",
]

