"""Benchmark the CLIP loss across W GPUs: our ring vs open_clip local vs inf-cl 1.2.1.

    torchrun --nproc_per_node 4 scripts/bench/bench_ring.py --sizes 65536 262144 1048576
    # CPU dry run (gloo, TorchTileOps, no inf_cl):
    torchrun --nproc_per_node 2 scripts/bench/bench_ring.py --device cpu --dtype fp32 --sizes 512 2048

Per global batch b (each rank holds b/W rows, c = 512, L2-normalized random features, the
logit scale a learnable log-parameter as in open_clip), forward + backward of:

    ring       ``clip_loss(impl="auto", group=WORLD)``: our overlapped ring (Triton tiles on GPU)
    loopback   the same ring code on one GPU with every hop a local copy (``LoopbackRing``):
               the identical per-rank work without communication, so ring / loopback is the
               cost of communication that the overlap does not hide
    local      ``clip_loss(impl="local")``: open_clip ``ClipLoss(local_loss=True,
               gather_with_grad=True)``; skipped where its (b/W, b) logits cannot fit
    inf_cl     ``0.5 * (cal_inf_loss(img, txt, s) + cal_inf_loss(txt, img, s))``, inf-cl 1.2.1
    loopback_plain  (opt in) the loopback ring with its one-pass tiles' strips in the plain
               scratch, without the spare accumulator room the ring gives them
               (``spare_room``): beside ``loopback``, what that room buys

Timing: median of ``--reps`` (``--reps-large`` from ``--large-b`` on) after ``--warmup``
untimed runs; each run is a barrier, then wall-clock around the call and a device
synchronize; the max over ranks. Memory: peak allocated during the call minus what was
allocated before it (inputs), max over ranks. The floor is 8 b^2 c / W FLOP at
``--peak-tflops`` (the H200 bf16 rate measured in shared/ANCHORS.md). Prints a markdown
table on rank 0 and writes it with the raw numbers as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
METHODS = ("ring", "loopback", "inf_cl", "local")
OPT_IN_METHODS = ("loopback_plain",)  # run only when named in --methods


@dataclass
class BenchConfig:
    sizes: list[int] = field(default_factory=lambda: [65536, 262144, 1048576])  # global batch b
    dim: int = 512  # feature dim c
    dtype: str = "bf16"
    device: str = "cuda"  # "cuda" (NCCL) or "cpu" (gloo dry run)
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    warmup: int = 1
    reps: int = 3
    reps_large: int = 1  # timed runs from large_b on (a 1M step takes seconds; device time is scarce)
    large_b: int = 524288
    infcl_max_b: int = 262144  # inf_cl takes ~62 s a step at 1M on 4 H200 (ANCHORS.md)
    local_mem_frac: float = 1.0  # skip `local` when its 4 (b/W) x b logit-sized buffers exceed this share of GPU memory
    timeout_s: int = 240  # process-group timeout: a deadlock fails the run
    # the ring backward's last tile in column chunks of at least this many texts, each sent home while the
    # next computes (infclip.loss.ring.HOME_CHUNK_MIN_ROWS); 0: the ring's default; above b/(2W): the tile whole
    home_chunk_rows: int = 0
    peak_tflops: float = 799.0  # H200 bf16 dense matmul rate (ANCHORS.md)
    out: str = "bench_ring.json"


@dataclass
class Row:
    b: int
    method: str
    ms: float | None = None  # median per-rank ms, max over ranks
    gb: float | None = None  # peak extra GB per rank, max over ranks
    loss: float | None = None  # global mean loss of the last run
    note: str = ""


def parse() -> BenchConfig:
    d = BenchConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in ("sizes", "methods"):
        p.add_argument(f"--{f}", nargs="+", default=getattr(d, f), type=int if f == "sizes" else str)
    for f in ("dim", "warmup", "reps", "reps_large", "large_b", "infcl_max_b", "timeout_s", "home_chunk_rows"):
        p.add_argument(f"--{f.replace('_', '-')}", type=int, default=getattr(d, f))
    for f in ("local_mem_frac", "peak_tflops"):
        p.add_argument(f"--{f.replace('_', '-')}", type=float, default=getattr(d, f))
    p.add_argument("--dtype", choices=sorted(DTYPES), default=d.dtype)
    p.add_argument("--device", choices=("cuda", "cpu"), default=d.device)
    p.add_argument("--out", default=d.out)
    return BenchConfig(**vars(p.parse_args()))


def init(cfg: BenchConfig) -> torch.device:
    """NCCL with a high-priority communication stream, so P2P kernels get SMs mid-tile."""
    timeout = timedelta(seconds=cfg.timeout_s)  # a hung rank aborts the run, not the lease
    if cfg.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = True
        dist.init_process_group("nccl", device_id=dev, pg_options=opts, timeout=timeout)
        return dev
    dist.init_process_group("gloo", timeout=timeout)
    return torch.device("cpu")


def features(b: int, cfg: BenchConfig, dev: torch.device):
    """This rank's (b/W, c) image/text features (leaf, requires grad) and log logit scale."""
    m = b // dist.get_world_size()
    g = torch.Generator(device=dev).manual_seed(1000 + dist.get_rank())
    img, txt = (torch.nn.functional.normalize(torch.randn(m, cfg.dim, generator=g, device=dev), dim=-1)
                for _ in range(2))
    dt = DTYPES[cfg.dtype]
    log_scale = torch.tensor(math.log(1 / 0.07), device=dev, requires_grad=True)
    return img.to(dt).requires_grad_(), txt.to(dt).requires_grad_(), log_scale


def method_fn(name: str, dev: torch.device):
    """name -> fn(img, txt, log_scale) -> this rank's loss (forward only; caller backprops)."""
    from infclip.loss import _tiled_loss, clip_loss, tile_ops
    from infclip.loss.ring import LoopbackRing

    world = dist.get_world_size()
    if name == "ring":
        return lambda i, t, ls: clip_loss(i, t, ls.exp(), impl="auto", group=dist.group.WORLD)
    if name == "loopback":
        ops = tile_ops("auto", dev)
        return lambda i, t, ls: _tiled_loss(i, t, ls.exp(), ops, LoopbackRing(world))
    if name == "loopback_plain":
        plain = tile_ops("auto", dev)
        plain.takes_spare_room = False  # (this instance: the ring offers its tiles no room)
        return lambda i, t, ls: _tiled_loss(i, t, ls.exp(), plain, LoopbackRing(world))
    if name == "local":
        return lambda i, t, ls: clip_loss(i, t, ls.exp(), impl="local", group=dist.group.WORLD)
    if name == "inf_cl":
        from inf_cl import cal_inf_loss

        def infcl(i, t, ls):
            s = ls.exp()
            return 0.5 * (cal_inf_loss(i, t, scale=s) + cal_inf_loss(t, i, scale=s))

        return infcl
    if name in OBJECTIVE_METHODS:
        return objective_fn(name)
    raise ValueError(f"unknown method {name!r}; choose from {METHODS + OPT_IN_METHODS + OBJECTIVE_METHODS}")


# -- other objectives on the same ring (SigLIP, NT-Xent); opt in with --methods ... -------
# siglip_ring       ``siglip_loss(impl="auto", group=WORLD)``: texts travel, O(b/W) memory
#                   (``*_triton``: the same ring with the fused Triton tiles)
# siglip_open_clip  open_clip ``SigLipLoss(dist_impl="bidir")``: keeps every block's logits
# nt_xent_ring      ``nt_xent_loss(cat(img, txt), 0.1, group=WORLD)``: 2 b/W rows per rank
# The floor column (8 b^2 c / W) is the CLIP/SigLIP work; NT-Xent on 2 b rows does 4x that.
OBJECTIVE_METHODS = ("siglip_ring", "siglip_ring_triton", "siglip_open_clip", "nt_xent_ring", "nt_xent_ring_triton")


def objective_fn(name: str):
    """name -> fn(img, txt, log_scale) -> this rank's loss; SigLIP's bias is a fixed -10."""
    from infclip.loss import nt_xent_loss, siglip_loss

    impl = "triton" if name.endswith("_triton") else "auto"
    if name.startswith("siglip_ring"):
        return lambda i, t, ls: siglip_loss(i, t, ls.exp(), _bias(i), impl=impl, group=dist.group.WORLD)
    if name == "siglip_open_clip":
        from open_clip.loss import SigLipLoss

        oc = SigLipLoss(rank=dist.get_rank(), world_size=dist.get_world_size(), dist_impl="bidir")
        return lambda i, t, ls: oc(i, t, ls.exp().to(i.dtype), _bias(i).to(i.dtype))
    return lambda i, t, ls: nt_xent_loss(torch.cat([i, t]), 0.1, impl=impl, group=dist.group.WORLD)


def _bias(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(-10.0, device=x.device)


def skip_reason(name: str, b: int, cfg: BenchConfig, dev: torch.device) -> str:
    world = dist.get_world_size()
    if name == "inf_cl" and (dev.type != "cuda" or b > cfg.infcl_max_b):
        return "not run (needs CUDA)" if dev.type != "cuda" else f"not run (b > {cfg.infcl_max_b})"
    if name in ("local", "siglip_open_clip") and dev.type == "cuda":
        need = 4 * (b // world) * b * torch.finfo(DTYPES[cfg.dtype]).bits // 8
        have = torch.cuda.get_device_properties(dev).total_memory
        if need > cfg.local_mem_frac * have:
            return f"OOM: its logits alone need {need / 1e9:.0f} GB"
    return ""


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def run_once(fn, img, txt, ls, dev) -> tuple[float, float, float]:
    """(ms, peak extra GB, loss) of one forward + backward on this rank."""
    for x in (img, txt, ls):
        x.grad = None
    sync(dev)
    dist.barrier()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    t0 = time.perf_counter()
    loss = fn(img, txt, ls)
    loss.backward()
    sync(dev)
    ms = 1e3 * (time.perf_counter() - t0)
    gb = (torch.cuda.max_memory_allocated(dev) - base) / 1e9 if dev.type == "cuda" else float("nan")
    return ms, gb, float(loss.detach())


def measure(name: str, b: int, cfg: BenchConfig, dev: torch.device) -> Row:
    note = skip_reason(name, b, cfg, dev)
    if note:
        return Row(b, name, note=note)
    img, txt, ls = features(b, cfg, dev)
    fn = method_fn(name, dev)
    try:
        for _ in range(cfg.warmup):
            run_once(fn, img, txt, ls, dev)
        reps = cfg.reps_large if b >= cfg.large_b else cfg.reps
        runs = [run_once(fn, img, txt, ls, dev) for _ in range(reps)]
    except torch.OutOfMemoryError:  # symmetric across ranks: every rank holds the same shapes
        del img, txt, ls, fn
        torch.cuda.empty_cache()
        dist.barrier()
        return Row(b, name, note="OOM")
    ms = statistics.median(r[0] for r in runs)
    stats = torch.tensor([ms, max(r[1] for r in runs)], dtype=torch.float64, device=dev)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    loss = torch.tensor(runs[-1][2], dtype=torch.float64, device=dev)
    dist.all_reduce(loss)
    del img, txt, ls, fn
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return Row(b, name, float(stats[0]), float(stats[1]), float(loss) / dist.get_world_size())


VERIFY_ROWS = 3000  # rows a rank in the fp32 check


def verify_chunk_rows(m: int = VERIFY_ROWS) -> list:
    """The ``HOME_CHUNK_MIN_ROWS`` values :func:`verify` runs the ring with at m rows a rank: the
    configured one, and m // 8 where the configured one keeps the last tile whole ([None]: a
    ring without chunks)."""
    from infclip.loss import ring

    configured = getattr(ring, "HOME_CHUNK_MIN_ROWS", None)
    return [configured] + ([m // 8] if configured is not None and len(ring.home_cuts(m)) <= 2 else [])


def verify(cfg: BenchConfig, dev: torch.device, m: int = VERIFY_ROWS) -> dict[str, float]:
    """fp32 check before timing: ring vs local (full-matrix) loss and gradients, the largest
    relative error over ranks. The ring runs as configured and, where that keeps the last tile
    whole at m rows a rank, once more with it in chunks (``HOME_CHUNK_MIN_ROWS`` = m // 8 for
    the check: m/2, m/4, m/8, m/8), so the chunked home hop is checked on this transport too."""
    from infclip.loss import clip_loss, ring

    g = torch.Generator(device=dev).manual_seed(7 + dist.get_rank())
    feats = [torch.nn.functional.normalize(torch.randn(m, cfg.dim, generator=g, device=dev), dim=-1)
             for _ in range(2)]

    def run(impl: str) -> tuple:
        i, t = (f.clone().requires_grad_() for f in feats)
        ls = torch.tensor(math.log(1 / 0.07), device=dev, requires_grad=True)
        loss = clip_loss(i, t, ls.exp(), impl=impl, group=dist.group.WORLD)
        loss.backward()
        dist.all_reduce(ls.grad)  # DDP's average times W
        return loss.detach(), i.grad, t.grad, ls.grad

    ref = run("local")
    configured = getattr(ring, "HOME_CHUNK_MIN_ROWS", None)  # None: a ring without chunks
    settings = verify_chunk_rows(m)
    errs = torch.zeros(4, dtype=torch.float64, device=dev)
    try:
        for rows in settings:
            if rows is not None:
                ring.HOME_CHUNK_MIN_ROWS = rows
            got = run("auto")
            errs = torch.maximum(errs, torch.tensor([float((a - b).abs().max() / b.abs().max())
                                                     for a, b in zip(got, ref)], dtype=torch.float64, device=dev))
    finally:
        if configured is not None:
            ring.HOME_CHUNK_MIN_ROWS = configured
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    return dict(zip(("loss", "dimg", "dtxt", "dscale"), errs.tolist()))


def table(rows: list[Row], cfg: BenchConfig) -> str:
    world = dist.get_world_size()
    head = (f"| b | floor ms | {' | '.join(cfg.methods)} | ring / loopback | ring TFLOP/s |\n"
            f"|---|---|{'---|' * len(cfg.methods)}---|---|")
    lines = [head]
    for b in cfg.sizes:
        by = {r.method: r for r in rows if r.b == b}
        floor = 8 * b * b * cfg.dim / world / (cfg.peak_tflops * 1e12) * 1e3
        cells = [f"{by[m].ms:.1f} ms / {by[m].gb:.2f} GB" if by[m].ms is not None else by[m].note
                 for m in cfg.methods]
        ring, loop = by.get("ring"), by.get("loopback")
        ratio = f"{ring.ms / loop.ms:.3f}" if ring and loop and ring.ms and loop.ms else "-"
        tflops = f"{floor / ring.ms * cfg.peak_tflops:.0f}" if ring and ring.ms else "-"
        lines.append(f"| {b:,} | {floor:.1f} | {' | '.join(cells)} | {ratio} | {tflops} |")
    return "\n".join(lines)


def plot(rows: list[Row], cfg: BenchConfig, path: str, title: str) -> None:
    """Per-rank ms and peak GB against b, log-log, with the floor; needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    world = dist.get_world_size()
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    for name in cfg.methods:
        pts = [(r.b, r.ms, r.gb) for r in rows if r.method == name and r.ms is not None]
        if pts:
            ax_t.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
            mem = [p for p in pts if math.isfinite(p[2]) and p[2] > 0]  # no GB on CPU
            if mem:
                ax_m.plot([p[0] for p in mem], [p[2] for p in mem], "o-", label=name)
    floor = [8 * b * b * cfg.dim / world / (cfg.peak_tflops * 1e12) * 1e3 for b in cfg.sizes]
    ax_t.plot(cfg.sizes, floor, "k--", label="floor 8b²c/W")
    for ax, label in ((ax_t, "ms per rank (fwd + bwd)"), (ax_m, "peak extra GB per rank")):
        ax.set(xscale="log", yscale="log" if ax.has_data() else "linear", xlabel="global batch b", ylabel=label)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    cfg = parse()
    from infclip.loss import ring

    if cfg.home_chunk_rows:
        ring.HOME_CHUNK_MIN_ROWS = cfg.home_chunk_rows
    dev = init(cfg)
    check = verify(cfg, dev)
    if dist.get_rank() == 0:
        print(json.dumps({"verify_fp32_ring_vs_local_rel_err": check}), flush=True)
    bad = [b for b in cfg.sizes if b % dist.get_world_size()]
    if bad:
        raise ValueError(f"global batches {bad} are not divisible by the world size {dist.get_world_size()}")
    rows = []
    for name in cfg.methods:  # method-major: the memory-hungry baselines can go last
        for b in cfg.sizes:
            rows.append(measure(name, b, cfg, dev))
            if dist.get_rank() == 0:
                print(json.dumps(asdict(rows[-1])), flush=True)
    if dist.get_rank() == 0:
        env = {"world": dist.get_world_size(), "torch": torch.__version__,
               "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
               "home_chunk_min_rows": getattr(ring, "HOME_CHUNK_MIN_ROWS", None),  # None: a ring without chunks
               "verify_home_chunk_min_rows": verify_chunk_rows()}  # the fp32 check's settings
        text = table(rows, cfg)
        print(f"\n{env}\n{text}", flush=True)
        with open(cfg.out, "w") as f:
            json.dump({"config": asdict(cfg), "env": env, "verify": check, "rows": [asdict(r) for r in rows],
                       "table": text}, f, indent=1)
        try:
            plot(rows, cfg, cfg.out.removesuffix(".json") + ".png", f"{env['world']} x {env['device']}")
        except Exception as e:  # noqa: BLE001 -- the table and JSON are already written
            print(f"no plot: {e!r}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
