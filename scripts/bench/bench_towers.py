"""Where the towers' time goes under the gradient cache, per model and per ``precision.fp8`` recipe.

The command (one H100; the defaults stop starting variants after 170 s; eager towers)::

    python scripts/bench/bench_towers.py --out bench_towers

and the compiled towers of one model (``model.compile=true``; compiling each variant's three
graphs takes most of the time, and variants that would start after ``--budget-s`` are
skipped; eager FP8 runs torchao's casts as separate kernels, so FP8's speed is the compiled
rows')::

    python scripts/bench/bench_towers.py --compile --models ViT-L-14 --attention sdpa --out bench_towers_compile
    python scripts/bench/bench_towers.py --compile --models ViT-B-16 --fp8 off --attention sdpa \
        --compile-modes default,max-autotune-no-cudagraphs --out bench_towers_modes

For each model (ViT-B/32, ViT-B/16, ViT-L/14 by default) and each ``--fp8`` variant (off,
tensorwise, rowwise; plus fp8 off with open_clip's ``nn.MultiheadAttention``, the A/B of
``model.sdpa_attention``; the bf16 rows run first, then the FP8 recipes), on synthetic inputs
(random uint8 images, random tokens, on the GPU: no data loading, no download), the trainer's
own step engine (``infclip.train.engine``: gradient cache with ``--micro-batches`` micro-batches
of ``--micro`` samples, bf16 autocast, the trainer's loss) runs ``--warmup`` steps and then
``--steps`` timed steps. Per variant:

* seconds per step of the cache pass (no-grad forward of every micro-batch), the loss, the
  replay forward and the replay backward (the replay's forward timed by CUDA events around
  the engine's ``_encode`` calls made with grad; backward = replay - forward, which also holds
  the replay's image normalization), medians over the timed steps;
* samples/s and MFU: samples/s x FLOPs per sample / ``--peak-tflops``, a sample costing 4
  forward passes of each tower (no-grad pass, replay forward, backward = 2 forwards), forward
  FLOPs counted by ``torch.utils.flop_counter`` on the bf16 model in train mode, as
  ``scripts/bench/bench_trainer.py`` counts them (FP8 rows: the same count against the same bf16
  peak, so their MFU is the bf16-equivalent rate); ``towers MFU`` divides by the cache pass +
  replay time only (without the loss);
* one more step under the PyTorch profiler, through the trainer's ``logging.profile_step``
  code (``infclip.train.profiling``: its summary under ``--out``, the trace too with
  ``--keep-traces``), its GPU time per
  phase split into kernel classes: GEMM, attention, norm + elementwise, other, and the
  launch gaps (phase wall - GPU busy);
* the SDPA backend each tower reaches in the cache pass, replay and backward
  (``infclip.attention.sdpa_backends``; fp8=off rows), and once per model the time of each SDPA backend
  (flash, cuDNN, memory-efficient, math) on the towers' attention shapes at the micro-batch
  (bf16; the text tower causal), forward and forward + backward.

A variant that fails (out of memory, torchao missing, a compile error) prints its error in
the table and the run goes on; a variant that would start after ``--budget-s`` is skipped
and says so (``--budget-s``, 170 s by default, leaves room for the variant in flight). Prints
the markdown tables and writes ``towers.json`` and ``towers.md`` into ``--out`` after every row,
so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# default micro-batch per model: what fits one 80 GB GPU in bf16 with room for the FP8 casts
MICRO = {"ViT-B-32": 1024, "ViT-B-16": 512, "ViT-L-14": 192}
CLASSES = ("gemm", "attention", "norm_elementwise", "other")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="ViT-B-32,ViT-B-16,ViT-L-14", help="comma-separated open_clip names")
    p.add_argument("--micro", type=int, default=None,
                   help=f"samples per micro-batch (default per model: {MICRO}; others 256)")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step (gradient cache: >= 2)")
    p.add_argument("--fp8", default="off,tensorwise,rowwise",
                   help="comma-separated precision.fp8 variants; RECIPE:large converts only the layers large "
                        "enough for FP8 to pay (precision.fp8_layers=large), e.g. tensorwise:large")
    p.add_argument("--attention", default="sdpa,native",
                   help="sdpa: model.sdpa_attention=true in every --fp8 variant; native: one more fp8=off row with "
                        "open_clip's nn.MultiheadAttention (model.sdpa_attention=false), the A/B of the attention path")
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps first (default 1 eager, 2 with --compile: compiling happens here)")
    p.add_argument("--compile", action="store_true", help="model.compile=true (torch.compile of each tower)")
    p.add_argument("--compile-modes", default="default",
                   help="with --compile: comma-separated model.compile_mode values, each a bf16 SDPA row compiled "
                        "in that mode; 'default' is the baseline row, left out to time only the others (e.g. "
                        "max-autotune-no-cudagraphs); modes capturing CUDA graphs are refused (the row says why)")
    p.add_argument("--no-profile", action="store_true", help="skip the profiled step (no kernel-class split)")
    p.add_argument("--keep-traces", action="store_true", help="keep each profiled step's Chrome trace (.json.gz)")
    p.add_argument("--no-attention-kernels", action="store_true",
                   help="skip timing each SDPA backend on the towers' attention shapes")
    p.add_argument("--budget-s", type=float, default=170.0, help="no variant starts after this many seconds")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="bf16 dense peak (H100/H200 measured: 790)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--amp", default="bf16", choices=["bf16", "fp32"], help="precision.amp of the towers")
    p.add_argument("--out", default="bench_towers", help="folder for towers.json, towers.md and the traces")
    a = p.parse_args(argv)
    if a.compile_modes != "default" and not a.compile:
        p.error(f"--compile-modes {a.compile_modes} needs --compile (the modes are torch.compile's)")
    return a


# ----------------------------------------------------------------------------- one variant


def train_config(model: str, micro: int, k: int, fp8: str, compile_: bool, amp: str, device: str,
                 sdpa: bool = True, mode: str = "default") -> Any:
    """The TrainConfig of the trainer for one variant (gradient cache on, no offload)."""
    from infclip.config import TrainConfig

    cfg = TrainConfig()
    cfg.model.name, cfg.model.compile, cfg.model.sdpa_attention = model, compile_, sdpa
    cfg.model.compile_mode = mode
    cfg.batch.global_size, cfg.batch.micro_size = micro * k, micro
    cfg.memory.grad_cache, cfg.memory.offload = "on", False
    cfg.memory.cache_dtype = "bf16" if amp == "bf16" else "fp32"  # as the vit_b32_laion preset
    recipe, _, layers = fp8.partition(":")  # "tensorwise:large": precision.fp8_layers=large
    cfg.precision.amp, cfg.precision.fp8, cfg.precision.tf32 = amp, recipe, True
    cfg.precision.fp8_layers = layers or "all"
    cfg.device = device
    return cfg


def build_variant(cfg: Any, device: torch.device, count=None, probe=None) -> tuple[Any, Any, str, Any]:
    """(built model, step engine, fp8 line, ``probe(built)``) as ``infclip.train.build`` builds
    them for one rank: model, locks, FP8 conversion, compile; the trainer's normalizer and loss.
    ``count(built)`` runs on the bf16 model before the FP8 swap (FLOP count), ``probe`` on the
    eager model just before compiling (SDPA backends)."""
    from infclip.config import validate
    from infclip.data.transforms import Normalizer
    from infclip.model import build_model
    from infclip.loss import build_loss
    from infclip.train.build import allow_tf32, prepare_model
    from infclip.train.distributed import DistInfo
    from infclip.train.engine import build_engine

    validate(cfg, 1)  # precision.fp8 on a GPU below sm_89 / without torchao: its one paragraph
    allow_tf32(cfg, device)
    built = build_model(cfg.model, device=device)
    probed = []

    def before_compile() -> None:
        built.model.train()
        probed.append(probe(built) if probe is not None else None)

    # the trainer's own steps on one rank: locks, FP8 swap, compile in model.compile_mode
    line = prepare_model(cfg, DistInfo(rank=0, world_size=1, local_rank=0, device=device), built.model,
                         before_fp8=None if count is None else lambda: count(built), before_compile=before_compile)
    engine = build_engine(cfg, built.model, device=device, normalizer=Normalizer(built.mean, built.std).to(device),
                          loss_fn=build_loss(cfg.loss, group=None))
    return built, engine, line, probed[0]


class ReplayForwardTimer:
    """CUDA events around the engine's ``_encode`` calls made with grad (the replay's forwards);
    :meth:`seconds` sums them after a sync. On the CPU, wall time."""

    def __init__(self, engine: Any, device: torch.device):
        self.engine, self.cuda = engine, device.type == "cuda"
        self.pairs: list = []
        self._orig = engine._encode
        engine._encode = self._encode

    def _encode(self, net, m):
        if not torch.is_grad_enabled():
            return self._orig(net, m)
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = self._orig(net, m)
            b.record()
        else:
            a = time.perf_counter()
            out = self._orig(net, m)
            b = time.perf_counter()
        self.pairs.append((a, b))
        return out

    def seconds(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            s = sum(a.elapsed_time(b) for a, b in self.pairs) / 1e3
        else:
            s = sum(b - a for a, b in self.pairs)
        self.pairs = []
        return s


def run_step(engine: Any, built: Any, images: torch.Tensor, tokens: torch.Tensor, timer: ReplayForwardTimer) -> dict:
    """One step of the engine (gradients only: no optimizer) -> phase seconds."""
    built.model.zero_grad(set_to_none=True)
    out = engine.step(images, tokens)
    t = dict(out.timings)
    fwd = timer.seconds()
    return {"cache_pass": t["cache_pass"], "loss": t["loss"], "replay_fwd": fwd,
            "replay_bwd": t["replay"] - fwd, "step": t["cache_pass"] + t["loss"] + t["replay"],
            "loss_value": float(out.loss)}


def synthetic_inputs(built: Any, rows: int, device: torch.device, seed: int = 0) -> tuple:
    """uint8 images (rows, 3, S, S) and int64 tokens (rows, L) with an end-of-text token, on ``device``."""
    g = torch.Generator().manual_seed(seed)
    side = built.image_size
    images = torch.randint(0, 256, (rows, 3, side, side), generator=g, dtype=torch.uint8)
    length = int(getattr(built.model, "context_length", 77))
    tokens = torch.randint(1, 40000, (rows, length), generator=g)
    tokens[:, length // 2] = 49407  # open_clip's end-of-text id: argmax pooling takes it
    tokens[:, length // 2 + 1:] = 0
    return images.to(device), tokens.to(device)


def forward_gflops(model: torch.nn.Module, images: torch.Tensor, tokens: torch.Tensor) -> tuple[float, float]:
    """Forward GFLOPs per sample of (image tower, text tower), train mode with grad (counted
    before any FP8 swap, as ``bench_trainer.fwd_gflops``)."""
    from torch.utils.flop_counter import FlopCounterMode

    res = []
    for fn, x in ((model.encode_image, images), (model.encode_text, tokens)):
        with FlopCounterMode(display=False) as fc:
            fn(x)
        res.append(fc.get_total_flops() / x.shape[0] / 1e9)
    model.zero_grad(set_to_none=True)
    return res[0], res[1]


# ----------------------------------------------------------------------------- attention kernels


def attention_shapes(model: torch.nn.Module, micro: int, image_size: int) -> list[tuple[str, tuple, bool]]:
    """(tower, (N, H, L, d), causal) of each tower's self-attention at ``micro`` samples: the ViT's
    patches + class token, the text tower's context with its causal mask."""
    shapes = []
    visual = getattr(model, "visual", None)
    blocks = getattr(getattr(visual, "transformer", None), "resblocks", None)
    if blocks is not None:
        attn = blocks[0].attn
        grid = visual.grid_size if hasattr(visual, "grid_size") else (image_size // 16, image_size // 16)
        tokens = grid[0] * grid[1] + 1
        shapes.append(("image", (micro, attn.num_heads, tokens, attn.embed_dim // attn.num_heads), False))
    text = getattr(getattr(model, "transformer", None), "resblocks", None)
    if text is not None and hasattr(model, "token_embedding"):
        attn = text[0].attn
        shapes.append(("text", (micro, attn.num_heads, int(model.context_length), attn.embed_dim // attn.num_heads),
                       True))
    return shapes


def _time(fn, reps: int, cuda: bool) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls (CUDA events on the GPU)."""
    times = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def attention_kernels(shapes: list, device: torch.device, reps: int = 10) -> list[dict]:
    """Forward and forward + backward time of each SDPA backend (flash, cuDNN, memory-efficient,
    math) on each tower's attention shape, bf16, q/k/v as the towers lay them out (views of one
    packed (N, L, 3, H, d) projection); a backend that refuses the shape gets its error."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)]
    cuda, rows = device.type == "cuda", []
    dtype = torch.bfloat16 if cuda else torch.float32
    for tower, (n, h, seq, d), causal in shapes:
        packed = torch.randn(n, seq, 3, h, d, device=device, dtype=dtype, requires_grad=True)
        q, k, v = packed.permute(2, 0, 3, 1, 4).unbind(0)
        grad = torch.randn(n, h, seq, d, device=device, dtype=dtype)
        # open_clip's nn.MultiheadAttention path: the causal mask as a float (L, L) tensor
        mask = torch.full((seq, seq), float("-inf"), device=device, dtype=dtype).triu(1) if causal else None
        extra = [(f"{name}, float mask", backend, mask) for name, backend in backends[1:3]] if causal else []
        for name, backend, bias in [(n_, b_, None) for n_, b_ in backends] + extra:
            row = {"tower": tower, "shape": [n, h, seq, d], "causal": causal, "backend": name}
            try:
                with sdpa_kernel([backend]):
                    fwd = lambda: F_sdpa(q, k, v, causal, bias)  # noqa: E731
                    step = lambda: torch.autograd.backward(F_sdpa(q, k, v, causal, bias), grad)  # noqa: E731
                    fwd(), step()  # warm-up (and the backend's refusal, if any)
                    row["fwd_ms"] = 1e3 * _time(fwd, reps, cuda)
                    row["fwd_bwd_ms"] = 1e3 * _time(step, reps, cuda)
                flops = 4 * n * h * seq * seq * d * (0.5 if causal else 1.0)
                row["fwd_tflops"] = flops / (row["fwd_ms"] / 1e3) / 1e12
            except Exception as e:  # noqa: BLE001 - the backend does not take this shape / dtype / device
                row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:120] if str(e).strip() else ''}"
            packed.grad = None
            rows.append(row)
    return rows


def F_sdpa(q, k, v, causal: bool, mask=None):
    """SDPA with ``is_causal`` or (``mask`` given) the equivalent additive mask."""
    if mask is not None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


# ----------------------------------------------------------------------------- kernel classes


def kernel_class(name: str) -> str:
    """GEMM, attention, norm_elementwise or other, from a GPU kernel's name (cuBLAS / CUTLASS /
    nvjet GEMMs, FP8 scaled GEMMs; flash / cuDNN / memory-efficient attention; norms, casts,
    elementwise, reductions and inductor's fused Triton kernels)."""
    n = name.lower()
    if any(s in n for s in ("nccl", "memcpy", "memset")):
        return "other"  # communication and copies
    if any(s in n for s in ("flash", "fmha", "attention", "attn", "sdpa", "cudnn_generated_fort_native_sdpa")):
        return "attention"
    if any(s in n for s in ("gemm", "cutlass", "nvjet", "xmma", "cublas", "_mm_", "matmul", "sm90_", "sm80_", "s16816",
                            "scaled_mm", "f8f8")):
        return "gemm"
    if any(s in n for s in ("norm", "elementwise", "vectorized", "reduce", "triton_", "softmax", "gelu", "copy",
                            "cat", "fill", "amax", "abs", "clamp", "mul", "add", "cast", "unrolled", "index")):
        return "norm_elementwise"
    return "other"


def phase_classes(events: list[dict]) -> dict[str, dict[str, float]]:
    """Per phase of a profiled step (the engine's phase marks: cache_pass, loss, replay), its
    wall seconds, GPU-busy seconds (union over streams), seconds per kernel class and the
    launch gaps (wall - busy)."""
    from infclip.spans import clip, covered
    from infclip.train.profiling import GPU_CATS, PHASE_MARK

    gpu = [e for e in events if e.get("cat") in GPU_CATS and "dur" in e and "ts" in e]
    marks = sorted((float(e["ts"]), e["name"][len(PHASE_MARK):]) for e in events
                   if str(e.get("name", "")).startswith(PHASE_MARK))
    timed = [float(e["ts"]) for e in events if "ts" in e and e.get("ph") in ("X", None)]
    start = min(timed, default=0.0)
    out: dict[str, dict[str, float]] = {}
    for a, (b, label) in zip([start] + [t for t, _ in marks], marks):
        spans = clip([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu], a, b)
        row = {"wall": (b - a) / 1e6, "busy": covered(spans) / 1e6}
        row.update({c: 0.0 for c in CLASSES})
        for e in gpu:
            s, t = max(float(e["ts"]), a), min(float(e["ts"]) + float(e["dur"]), b)
            if t > s:
                row[kernel_class(str(e.get("name", "")))] += (t - s) / 1e6
        row["gaps"] = max(row["wall"] - row["busy"], 0.0)
        out[label] = row
    return out


def profile_classes(engine: Any, built: Any, images, tokens, out: Path, tag: str, keep_trace: bool = False) -> dict:
    """One step under the trainer's profiler (``infclip.train.profiling.profiled_step``); its
    summary (and with ``keep_trace`` its Chrome trace, tens of MB) stays in ``out/<tag>/profile/``;
    returns :func:`phase_classes` of it."""
    from infclip.train.profiling import profiled_step

    run_dir = out / tag
    with profiled_step(run_dir, 1, 0, True) as summary:
        built.model.zero_grad(set_to_none=True)
        engine.step(images, tokens)
    trace = Path(summary).with_suffix(".json.gz")
    with gzip.open(trace, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    if not keep_trace:
        trace.unlink()
    return phase_classes(events)


def variants(a: argparse.Namespace) -> list[tuple[str, bool, str]]:
    """(precision.fp8, model.sdpa_attention, model.compile_mode) of each row per model, in order:
    the bf16 rows first (SDPA, then nn.MultiheadAttention: the attention A/B, then SDPA in each
    other compile mode), then each FP8 recipe, so that a budget that cuts the run cuts FP8 rows
    before the bf16 baseline's A/Bs. The bf16 rows in mode default (SDPA and nn.MHA) run only
    when ``--compile-modes`` names ``default`` (it does unless given)."""
    kinds, fp8s, modes = a.attention.split(","), a.fp8.split(","), a.compile_modes.split(",")
    base = "default" in modes
    rows = [("off", True, "default")] if base and "sdpa" in kinds and "off" in fp8s else []
    rows += [("off", False, "default")] if base and "native" in kinds else []
    rows += [("off", True, m) for m in modes if m != "default"]
    return rows + ([(f, True, "default") for f in fp8s if f != "off"] if "sdpa" in kinds else [])


def label(row: dict) -> str:
    """The variant column: the fp8 recipe, the attention path where it is open_clip's own, and
    the compile mode where it is not inductor's default."""
    mode = row.get("compile_mode", "default")
    return (row["fp8"] + ("" if row.get("sdpa_attention", True) else ", nn.MHA attention")
            + ("" if mode == "default" else f", compile mode={mode}"))


def run_variant(a: argparse.Namespace, model: str, fp8: str, out: Path, flops: dict, sdpa: bool = True,
                mode: str = "default") -> dict:
    """Build, warm up, time, profile one (model, fp8, attention path, compile mode) variant; returns its row."""
    from infclip.attention import sdpa_backends

    device = torch.device(a.device)
    micro = a.micro or MICRO.get(model, 256)
    cfg = train_config(model, micro, a.micro_batches, fp8, a.compile, a.amp, a.device, sdpa, mode)
    row: dict = {"model": model, "fp8": fp8, "sdpa_attention": sdpa, "micro": micro, "global": micro * a.micro_batches,
                 "compile": a.compile, "compile_mode": mode}
    amp = torch.bfloat16 if a.amp == "bf16" else None

    def small(built: Any) -> tuple:
        images, tokens = synthetic_inputs(built, 4, device)
        return images.float() / 255, tokens

    def count(built: Any) -> None:  # on the bf16 model, once per model (the FP8 swap changes no FLOP count)
        if model not in flops:
            flops[model] = forward_gflops(built.model, *small(built))

    def probe(built: Any) -> Optional[dict]:
        if fp8 == "off" and sdpa and not a.no_attention_kernels:  # once per model: the kernels on its shapes
            row["attention_kernels"] = attention_kernels(attention_shapes(built.model, micro, built.image_size), device)
        # the FP8 swap leaves attention as it is: its backends are those of the fp8=off row
        return sdpa_backends(built.model, *small(built), amp) if fp8 == "off" else None

    built, engine, line, row["sdpa"] = build_variant(cfg, device, count, probe)
    row["fp8_layers"] = line
    images, tokens = synthetic_inputs(built, micro * a.micro_batches, device)
    timer = ReplayForwardTimer(engine, device)
    for _ in range(a.warmup):
        run_step(engine, built, images, tokens, timer)
    steps = [run_step(engine, built, images, tokens, timer) for _ in range(a.steps)]
    for key in ("cache_pass", "loss", "replay_fwd", "replay_bwd", "step"):
        row[key + "_s"] = statistics.median(s[key] for s in steps)
    row["loss_value"] = steps[-1]["loss_value"]
    row["samples_per_s"] = row["global"] / row["step_s"]
    if flops.get(model):
        gi, gt = flops[model]
        per_sample = 4 * (gi + gt) * 1e9
        row["gflops_fwd_per_sample"] = [gi, gt]
        row["mfu_pct"] = 100 * row["samples_per_s"] * per_sample / (a.peak_tflops * 1e12)
        towers_s = row["cache_pass_s"] + row["replay_fwd_s"] + row["replay_bwd_s"]
        row["towers_mfu_pct"] = 100 * row["global"] / towers_s * per_sample / (a.peak_tflops * 1e12)
    if device.type == "cuda":
        row["peak_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    if not a.no_profile:
        tag = f"{model}_fp8-{fp8.replace(':', '-')}" + ("" if sdpa else "_mha") + ("" if mode == "default" else f"_{mode}")
        row["profile"] = profile_classes(engine, built, images, tokens, out, tag, a.keep_traces)
    del engine, built, images, tokens
    return row


# ----------------------------------------------------------------------------- table


def _ms(x: Optional[float]) -> str:
    return "—" if x is None else f"{1e3 * x:.1f}"


def table(rows: list[dict]) -> str:
    """The markdown tables: times, throughput and MFU per variant; the kernel classes per phase;
    the SDPA backends."""
    lines = ["| model | variant | micro x K | cache ms | loss ms | replay fwd ms | replay bwd ms | step ms | samples/s "
             "| MFU % | towers MFU % | peak GB | note |", "|" + "---|" * 13]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {label(r)} | | | | | | | | | | | {r['error'][:160]} |")
            continue
        lines.append(
            f"| {r['model']} | {label(r)} | {r['micro']} x {r['global'] // r['micro']} | {_ms(r['cache_pass_s'])} | "
            f"{_ms(r['loss_s'])} | {_ms(r['replay_fwd_s'])} | {_ms(r['replay_bwd_s'])} | {_ms(r['step_s'])} | "
            f"{r['samples_per_s']:,.0f} | {r.get('mfu_pct', float('nan')):.1f} | "
            f"{r.get('towers_mfu_pct', float('nan')):.1f} | {r.get('peak_gb', 0):.1f} | "
            f"{'compiled' if r['compile'] else 'eager'} |")
    prof = [r for r in rows if r.get("profile")]
    if prof:
        lines += ["", "| model | variant | phase | wall ms | GEMM ms | attention ms | norm+elementwise ms | other ms "
                  "| launch gaps ms | GEMM % of wall |", "|" + "---|" * 10]
        for r in prof:
            for phase, p in r["profile"].items():
                lines.append(f"| {r['model']} | {label(r)} | {phase} | {_ms(p['wall'])} | {_ms(p['gemm'])} | "
                             f"{_ms(p['attention'])} | {_ms(p['norm_elementwise'])} | {_ms(p['other'])} | "
                             f"{_ms(p['gaps'])} | {100 * p['gemm'] / max(p['wall'], 1e-12):.0f} |")
    kern = [(r, k) for r in rows for k in r.get("attention_kernels", [])]
    if kern:
        lines += ["", "| model | tower | N, H, L, d | causal | backend | fwd ms | fwd+bwd ms | fwd TFLOP/s |",
                  "|" + "---|" * 8]
        for r, k in kern:
            shape = ", ".join(map(str, k["shape"]))
            if "error" in k:
                lines.append(f"| {r['model']} | {k['tower']} | {shape} | {k['causal']} | {k['backend']} | "
                             f"{k['error'][:80]} | | |")
            else:
                lines.append(f"| {r['model']} | {k['tower']} | {shape} | {k['causal']} | {k['backend']} | "
                             f"{k['fwd_ms']:.3f} | {k['fwd_bwd_ms']:.3f} | {k['fwd_tflops']:.0f} |")
    sdpa = [r for r in rows if r.get("sdpa")]
    if sdpa:
        lines += ["", "| model | variant | tower | cache pass | replay fwd | replay bwd |", "|" + "---|" * 6]
        for r in sdpa:
            for tower, p in r["sdpa"].items():
                lines.append(f"| {r['model']} | {label(r)} | {tower} | {p['cache']} | {p['replay']} | "
                             f"{p['backward']} |")
    return "\n".join(lines) + "\n"


def save(out: Path, a: argparse.Namespace, flops: dict, rows: list[dict]) -> str:
    """Write towers.md (the tables) and towers.json (args, FLOP counts, rows); returns the tables."""
    text = table(rows)
    (out / "towers.md").write_text(text)
    (out / "towers.json").write_text(json.dumps({"args": vars(a), "flops_gflop_fwd": flops, "rows": rows}, indent=1))
    return text


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    if a.warmup is None:
        a.warmup = 2 if a.compile else 1
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows: list[dict] = []
    flops: dict = {}
    if a.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()} (torch {torch.__version__})", flush=True)
    for model in a.models.split(","):
        for fp8, sdpa, mode in variants(a):
            head = {"model": model, "fp8": fp8, "sdpa_attention": sdpa, "compile_mode": mode}
            if time.perf_counter() - t0 > a.budget_s:
                rows.append({**head, "error": f"skipped: --budget-s {a.budget_s:g} s spent"})
                continue
            try:
                row = run_variant(a, model, fp8, out, flops, sdpa, mode)
            except Exception as e:  # noqa: BLE001 - a failing variant is a row of the table
                traceback.print_exc()
                text = str(e).strip()
                row = {**head, "error": f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"}
            row["elapsed_s"] = time.perf_counter() - t0
            rows.append(row)
            save(out, a, flops, rows)  # after every row: a run cut short keeps what it measured
            print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
            gc.collect()
            if a.device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            torch._dynamo.reset()
    text = save(out, a, flops, rows)
    print(text, flush=True)
    print(f"done in {time.perf_counter() - t0:.0f} s; {out / 'towers.json'}", flush=True)
    return rows


if __name__ == "__main__":
    main()
