"""Peak GPU memory and time of ONE full optimizer step vs global batch (the paper's Table 1/2).

Each row: build the step engine (gradient cache, optional offload) for a global batch,
run one warm-up step at 2 micro-batches per rank (same micro shapes: kernels compiled and
autotuned), then time one full step = engine.step (cache pass, loss across ranks, replay)
+ AdamW step, and read ``torch.cuda.max_memory_allocated`` over it (max over ranks).
"static" is what the model, gradients-free optimizer state and nothing else hold before
the step. Inputs are synthetic uint8 images / random tokens held in host memory (pinned),
so data loading is not measured. One measured step per row (they take seconds to minutes).

    python scripts/bench/bench_memory.py --model ViT-B-16 --configs ours:off:32768,vanilla:off:32768
    torchrun --nproc_per_node 4 scripts/bench/bench_memory.py --configs ours:on:1048576

A config is LOSS:OFFLOAD:GLOBAL with LOSS in ours (tiled, impl auto: Triton on CUDA) |
vanilla (full b x b logits per rank; on several ranks the all-gather baseline) | local
(open_clip local loss: local rows x gathered columns), OFFLOAD in on|off. Rows are
appended to OUT/memory.csv as they finish; rows predicted to overrun --time-budget-s are
recorded as skipped. CPU (``--device cpu --model tiny``) runs the same code as a smoke test.

``--plot PNG CSV [CSV ...]`` runs nothing: it draws the rows of earlier runs' CSVs (several
machines, models or measurements) in one figure, a line per (model, GPUs, loss, offload,
device), e.g. the figure in docs/benchmarks.md:

    python scripts/bench/bench_memory.py --plot docs/bench_memory.png docs/bench_memory_h200.csv \
        docs/bench_memory_lit_h100.csv docs/bench_memory_lit_trainer_h200.csv
"""

from __future__ import annotations

import argparse
import csv
import functools
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from infclip.config import TrainConfig  # noqa: E402
from infclip.loss import clip_loss  # noqa: E402
from infclip.train.engine import build_engine  # noqa: E402

IMPL = {"ours": "auto", "ours_torch": "torch", "vanilla": "vanilla", "local": "local"}
FIELDS = ["model", "gpus", "global_batch", "per_rank", "micro", "loss", "offload", "status",
          "peak_gb", "static_gb", "cache_pass_gb", "loss_gb", "replay_gb", "step_s", "samples_per_s",
          "cache_pass_s", "loss_s", "replay_s", "device"]


@dataclass
class Ctx:
    args: argparse.Namespace
    device: torch.device
    rank: int
    world: int
    group: object


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="ViT-B-16", help="open_clip model name, or 'tiny' (CPU smoke test)")
    p.add_argument("--configs", default="ours:off:32768,vanilla:off:32768,ours:on:32768")
    p.add_argument("--micro", type=int, default=256, help="per-rank micro-batch")
    p.add_argument("--amp", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--cache-dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--lock-image", action="store_true", help="LiT: image tower locked (cached once)")
    p.add_argument("--grad-checkpointing", action="store_true")
    p.add_argument("--device", default="auto")
    p.add_argument("--time-budget-s", type=float, default=1e9, help="skip rows predicted to overrun")
    p.add_argument("--out", default=os.environ.get("OUT", ".bench"), help="folder for memory.csv/.md")
    p.add_argument("--check", action="store_true", help="first: tiny model, offload on vs off, same grads?")
    p.add_argument("--plot", nargs="+", metavar=("PNG", "CSV"), help="only draw PNG from these CSVs")
    return p.parse_args(argv)


def setup(args) -> Ctx:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available() and args.device != "cpu"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    group = None
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
        group = dist.group.WORLD
    return Ctx(args, device, rank, world, group)


def build_model(ctx: Ctx):
    import open_clip

    torch.manual_seed(0)
    if ctx.args.model == "tiny":
        vision = dict(image_size=32, patch_size=8, width=64, layers=2, head_width=32)
        text = dict(context_length=16, vocab_size=1000, width=64, heads=2, layers=2)
        model, size, ctx_len, vocab = open_clip.CLIP(32, vision, text), 32, 16, 1000
    else:
        model = open_clip.create_model(ctx.args.model, pretrained=None)
        size, ctx_len, vocab = model.visual.image_size[0], model.context_length, model.vocab_size
    if ctx.args.grad_checkpointing:
        model.set_grad_checkpointing(True)
    return model.to(ctx.device), size, ctx_len, vocab


def host_batch(n: int, size: int, ctx_len: int, vocab: int, pinned: bool, block: int):
    """Synthetic uint8 images / int64 tokens in host memory: a random block tiled n/block times."""
    pinned = pinned and torch.cuda.is_available()
    images = torch.empty((n, 3, size, size), dtype=torch.uint8, pin_memory=pinned)
    tile = torch.randint(0, 256, (min(block, n), 3, size, size), dtype=torch.uint8)
    for s in range(0, n, tile.shape[0]):
        images[s:s + tile.shape[0]] = tile[: n - s]
    tokens = torch.randint(1, vocab, (n, ctx_len), dtype=torch.int64)
    tokens[:, -1] = vocab - 1  # an EOT token (argmax pooling)
    return images, tokens.pin_memory() if pinned else tokens


def make_cfg(ctx: Ctx, global_size: int, offload: bool) -> TrainConfig:
    cfg = TrainConfig()
    cfg.batch.global_size, cfg.batch.micro_size = global_size, ctx.args.micro
    cfg.memory.grad_cache, cfg.memory.offload = "on", offload
    cfg.memory.cache_dtype, cfg.precision.amp = ctx.args.cache_dtype, ctx.args.amp
    cfg.model.lock_image = ctx.args.lock_image
    return cfg


class Bench:
    def __init__(self, ctx: Ctx):
        from infclip.data.transforms import Normalizer
        from infclip.train.lit import apply_locks

        self.ctx = ctx
        self.model, self.size, self.ctx_len, self.vocab = build_model(ctx)
        apply_locks(self.model, make_cfg(ctx, ctx.world * ctx.args.micro, False).model)
        self.net = self.model
        if ctx.world > 1:
            ids = [ctx.device.index] if ctx.device.type == "cuda" else None
            self.net = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=ids, broadcast_buffers=False)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=1e-5, fused=ctx.device.type == "cuda")
        self.normalizer = Normalizer().to(ctx.device)
        self.scaler = torch.amp.GradScaler(ctx.device.type) if ctx.args.amp == "fp16" else None
        self.warm: set = set()

    def engine(self, loss: str, global_size: int, offload: bool):
        fn = functools.partial(clip_loss, impl=IMPL[loss], group=self.ctx.group)
        return build_engine(make_cfg(self.ctx, global_size, offload), self.net, device=self.ctx.device,
                            normalizer=self.normalizer, loss_fn=fn, scaler=self.scaler,
                            group=self.ctx.group, world_size=self.ctx.world)

    def one_step(self, engine, images, tokens):
        out = engine.step(images, tokens)
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return out

    def row(self, loss: str, offload: bool, global_size: int) -> dict:
        ctx, micro = self.ctx, self.ctx.args.micro
        local = global_size // ctx.world
        if (loss, offload) not in self.warm:  # compile/autotune at the same micro shapes
            self.one_step(self.engine(loss, 2 * micro * ctx.world, offload),
                          *host_batch(2 * micro, self.size, self.ctx_len, self.vocab, offload, micro))
            self.warm.add((loss, offload))
        images, tokens = host_batch(local, self.size, self.ctx_len, self.vocab, offload, micro)
        engine = self.engine(loss, global_size, offload)
        engine.measure_memory = True  # peak per phase: cache pass, loss, replay
        _sync(ctx)
        static = _mem(ctx)
        t0 = time.perf_counter()
        out = self.one_step(engine, images, tokens)
        _sync(ctx)
        step = _max(ctx, time.perf_counter() - t0)
        phases = {f"{k}_gb": _max(ctx, float(v)) / 1e9 for k, v in engine.last_phase_peaks.items()}
        peak = max([_peak_gb(ctx), *phases.values()])  # the engine resets the peak per phase
        return {"status": "ok", "peak_gb": peak, "static_gb": _max(ctx, static) / 1e9, **phases,
                "step_s": step, "samples_per_s": global_size / step,
                **{f"{k}_s": _max(ctx, v) for k, v in out.timings.items()}}


def _sync(ctx: Ctx) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
    if ctx.world > 1:
        dist.barrier()


def _mem(ctx: Ctx) -> float:
    return float(torch.cuda.memory_allocated(ctx.device)) if ctx.device.type == "cuda" else 0.0


def _peak_gb(ctx: Ctx) -> float:
    peak = torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else 0
    return _max(ctx, float(peak)) / 1e9


def _max(ctx: Ctx, x: float) -> float:
    if ctx.world == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def parse_configs(text: str) -> list[tuple[str, bool, int]]:
    out = []
    for item in text.split(","):
        loss, off, g = item.split(":")
        if loss not in IMPL or off not in ("on", "off"):
            raise SystemExit(f"bad config {item!r}: want LOSS:OFFLOAD:GLOBAL, LOSS in {list(IMPL)}, on|off")
        out.append((loss, off == "on", int(g)))
    return out


def run(ctx: Ctx) -> list[dict]:
    bench, rows, rate = Bench(ctx), [], None
    t_start = time.perf_counter()
    for loss, offload, g in parse_configs(ctx.args.configs):
        base = {"model": ctx.args.model + ("-LiT" if ctx.args.lock_image else ""), "gpus": ctx.world,
                "global_batch": g, "per_rank": g // ctx.world, "micro": ctx.args.micro, "loss": loss,
                "offload": "on" if offload else "off", "device": _device_name(ctx)}
        predicted = g / rate if rate else 0.0
        if time.perf_counter() - t_start + 1.2 * predicted > ctx.args.time_budget_s:
            rows.append({**base, "status": f"skipped (time budget; predicted {predicted:.0f} s)"})
        else:
            res = _guarded(bench, loss, offload, g)
            if res["status"].startswith("error") and loss == "ours":  # e.g. no Triton: PyTorch tiles
                print(f"ours (Triton) failed: {res['status']}; retrying with impl=torch", flush=True)
                base["loss"] = "ours_torch"
                res = _guarded(bench, "ours_torch", offload, g)
            rate = res.get("samples_per_s", rate)
            rows.append({**base, **res})
        if ctx.rank == 0:
            print(_fmt(rows[-1]), flush=True)
            write_csv(rows, Path(ctx.args.out))
    return rows


def _guarded(bench: Bench, loss: str, offload: bool, g: int) -> dict:
    """One row; out-of-memory and other failures become the row's status, the sweep goes on."""
    try:
        return bench.row(loss, offload, g)
    except torch.cuda.OutOfMemoryError:
        return {"status": "out of memory"}
    except Exception as e:  # noqa: BLE001 -- a benchmark row must not end the sweep
        return {"status": f"error: {type(e).__name__}: {str(e)[:200]}"}
    finally:
        bench.opt.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _device_name(ctx: Ctx) -> str:
    return torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"


def _fmt(r: dict) -> str:
    return " ".join(f"{k}={r[k]:.3f}" if isinstance(r.get(k), float) else f"{k}={r.get(k)}" for k in FIELDS if k in r)


def write_csv(rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "memory.csv", "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in FIELDS})
    (out / "memory.md").write_text(markdown(rows))


def markdown(rows: list[dict]) -> str:
    head = ("| model | GPUs | global batch | micro | loss | offload | peak GB/rank | static GB | "
            "peak in cache pass / loss / replay GB | step s | samples/s |\n")
    head += "|---|---|---|---|---|---|---|---|---|---|---|\n"
    for r in rows:
        if r.get("status") != "ok":
            head += (f"| {r['model']} | {r['gpus']} | {r['global_batch']:,} | {r['micro']} | {r['loss']} | "
                     f"{r['offload']} | {r['status']} | | | | |\n")
            continue
        head += (f"| {r['model']} | {r['gpus']} | {r['global_batch']:,} | {r['micro']} | {r['loss']} | "
                 f"{r['offload']} | {r['peak_gb']:.2f} | {r['static_gb']:.2f} | {_phases(r)} | {r['step_s']:.1f} | "
                 f"{r['samples_per_s']:.0f} |\n")
    return head


def _phases(r: dict) -> str:
    keys = ("cache_pass_gb", "loss_gb", "replay_gb")
    return " / ".join(f"{r[k]:.2f}" if isinstance(r.get(k), float) else "-" for k in keys)


def plot(csvs: list[Path], png: Path) -> None:
    """Peak memory vs global batch, one line per (model, GPUs, loss, offload, device) of the
    CSVs' finished rows; needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for path in csvs for r in csv.DictReader(open(path)) if r["status"] == "ok"]
    if not rows:
        raise ValueError(f"no finished row in {', '.join(map(str, csvs))}")
    key = lambda r: (r["model"], r["gpus"], r["loss"], r["offload"], r.get("device", ""))  # noqa: E731
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k in sorted({key(r) for r in rows}):
        pts = sorted((int(r["global_batch"]), float(r["peak_gb"])) for r in rows if key(r) == k)
        device = k[4].replace("NVIDIA ", "")
        ax.plot(*zip(*pts), marker="o", label=f"{k[0]} x{k[1]} {k[2]} offload={k[3]}, {device}")
    ax.set(xscale="log", xlabel="global batch", ylabel="peak GB per GPU", title="One optimizer step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def check_offload(ctx: Ctx) -> float:
    """Tiny model, 4 micro-batches: max |grad difference| between offload on and off."""
    tiny = argparse.Namespace(**{**vars(ctx.args), "model": "tiny", "micro": 4, "lock_image": False})
    tctx = Ctx(tiny, ctx.device, ctx.rank, 1, None)
    grads = []
    for offload in (False, True):
        model, size, ctx_len, vocab = build_model(tctx)
        engine = build_engine(make_cfg(tctx, 16, offload), model, device=ctx.device,
                              normalizer=lambda x: x.float() / 255.0,
                              loss_fn=functools.partial(clip_loss, impl="torch"))
        torch.manual_seed(1)
        engine.step(*host_batch(16, size, ctx_len, vocab, ctx.device.type == "cuda", 16))
        grads.append(torch.cat([p.grad.flatten().float() for p in model.parameters()]))
    return float((grads[0] - grads[1]).abs().max())


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.plot:
        if len(args.plot) < 2:
            raise SystemExit("--plot PNG CSV [CSV ...]: name the figure, then at least one CSV")
        plot([Path(c) for c in args.plot[1:]], Path(args.plot[0]))
        print(f"wrote {args.plot[0]}")
        return
    ctx = setup(args)
    if args.check and ctx.rank == 0:
        try:
            print(f"offload on vs off, tiny model: max |grad diff| = {check_offload(ctx):.3g}", flush=True)
        except Exception as e:  # noqa: BLE001 -- report and go on to the sweep
            print(f"offload check failed: {type(e).__name__}: {e}", flush=True)
    run(ctx)
    if ctx.rank == 0:
        try:
            plot([Path(args.out) / "memory.csv"], Path(args.out) / "memory.png")
        except ImportError:
            print("matplotlib missing: no memory.png (the CSV and the markdown table are written)")
    if ctx.world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
