"""Benchmark of the CLIP loss on one GPU: time, extra memory and effective TFLOP/s vs batch.

Measures, in one run: vanilla (bf16, fp32), open_clip local, the published ``inf-cl==1.2.1``
and ``memeff==0.3.1`` packages (an anchor not installed is reported as such, not run), and
ours (Triton bf16; the PyTorch tiled path at small b), for every
(feature dim c, batch b). Forward + backward of the symmetric loss with a learnable logit
scale (scale = logit_scale.exp(), logit_scale = ln(1/0.07)), L2-normalized random features,
except memeff, which learns no scale (its temperature is fixed at 0.07, no d scale is formed;
its rows say so),
median of ``--reps`` timed runs after one warm-up (the warm-up also compiles and tunes).
Extra memory = torch.cuda.max_memory_allocated() during one step minus what the inputs
held (so it includes the feature gradients), as in ../shared/ANCHORS.md.

Useful work is counted as 8 b^2 c FLOPs (forward 2, backward 6); "% peak" divides the
effective rate by this GPU's dense bf16 matmul rate, measured here on 8192^3 products.

    python scripts/bench/bench_loss.py --out bench_out        # CSV + PNG in bench_out/

Duplicate-aware negatives (``clip_loss(..., group_ids=, duplicates=)``):
``--duplicates`` times duplicates off / mask / positive (Triton bf16, forward + backward) at
``--dup-batches`` x ``--dup-dims`` with ``--dup-frac`` of the samples duplicating another
sample's group (~1 % duplicate pairs), and prints a table with the overhead over off
(the bar: <= 5 %); ``--dry-run`` runs the same table on the CPU (PyTorch tiles, tiny shapes).

``--breakdown`` adds forward alone, backward alone and the group ids' preparation
(``duplicates.sort_groups`` for mask, ``duplicates.prepare`` for positive), so the run shows
where any overhead is; ``--dup-backward`` picks the Triton backward (default: ``AUTO_BACKWARD`` of ``kernels/clip/ops.py``).

    python scripts/bench/bench_loss.py --duplicates --out bench_out   # b 32k, 64k; c 512, 1024
    python scripts/bench/bench_loss.py --duplicates --breakdown --dup-backward onepass --out bench_out
    python scripts/bench/bench_loss.py --duplicates --dry-run --dup-batches 48 --dup-dims 16
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass

import torch

# H200 anchors, c = 512 (../shared/ANCHORS.md): b -> ms.
ANCHOR_VANILLA_BF16_MS = {8192: 2.1, 16384: 6.6, 32768: 26.9, 65536: 112.0, 131072: 465.0}
ANCHOR_INFCL_MS = {8192: 15.8, 16384: 60.0, 32768: 235.0, 65536: 948.0, 131072: 3826.0, 262144: 15320.0}

# impl -> (input dtype, largest b tried, c values); None = every c.
IMPLS = {
    "vanilla_bf16": (torch.bfloat16, 131072, None),
    "vanilla_fp32": (torch.float32, 65536, None),
    "local_bf16": (torch.bfloat16, 65536, (512,)),
    "inf_cl": (torch.bfloat16, 131072, None),
    "memeff": (torch.bfloat16, 262144, None),  # fixed temperature: learns no scale
    "triton_bf16": (torch.bfloat16, 1 << 20, None),
    "triton_fixup_bf16": (torch.bfloat16, 1 << 20, None),  # strip path with strip_positives="fixup"
    # LiT: image features of a locked tower need no gradient (opt in with --impls; their % of
    # peak counts 6 b^2 c, the least work without the b x b matrix: forward 2, recomputed
    # logits 2, d text 2; no anchor ratios: the anchors want both gradients)
    "triton_lit_bf16": (torch.bfloat16, 1 << 20, None),
    "vanilla_lit_bf16": (torch.bfloat16, 131072, None),
    "triton_fp32_tf32": (torch.float32, 65536, (512,)),
    "torch_bf16": (torch.bfloat16, 16384, (512,)),
}
# Other objectives, opt in with --impls: SigLIP (ours vs open_clip's SigLipLoss,
# bias -10) and NT-Xent on b rows (cat of the first b/2 image and text rows, T = 0.1; ours vs
# the naive full matrix). Both do the same 8 b^2 c useful FLOPs as the CLIP loss.
OBJECTIVE_IMPLS = {
    "siglip_open_clip_bf16": (torch.bfloat16, 65536, (512,)),
    "siglip_torch_bf16": (torch.bfloat16, 65536, (512,)),
    "nt_xent_vanilla_fp32": (torch.float32, 32768, (512,)),
    "nt_xent_vanilla_bf16": (torch.bfloat16, 65536, (512,)),
    "nt_xent_torch_fp32": (torch.float32, 65536, (512,)),
    "siglip_triton_bf16": (torch.bfloat16, 262144, (512,)),
    "nt_xent_triton_bf16": (torch.bfloat16, 262144, (512,)),
}
IMPLS.update(OBJECTIVE_IMPLS)
# the published anchors: impl -> (module, what installs it)
ANCHOR_PACKAGES = {"inf_cl": ("inf_cl", "inf-cl==1.2.1"), "memeff": ("memeff", "memeff==0.3.1")}
FIXED_SCALE_IMPLS = ("memeff",)  # learn no scale: their step forms no d scale


@dataclass
class Row:
    impl: str
    c: int
    b: int
    status: str
    ms: float = float("nan")
    extra_gb: float = float("nan")
    tflops: float = float("nan")
    pct_peak: float = float("nan")
    x_vs_vanilla_anchor: float = float("nan")
    x_vs_infcl_anchor: float = float("nan")
    loss: float = float("nan")


def matmul_peak_tflops(n: int = 8192, reps: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    ms = time_ms(lambda: a @ b, reps)
    return 2 * n**3 / ms / 1e9


def time_ms(fn, reps: int) -> float:
    """Median of ``reps`` timed calls after one warm-up (:func:`times_ms`)."""
    return statistics.median(times_ms(fn, reps))


def times_ms(fn, reps: int) -> list[float]:
    """ms of each of ``reps`` timed calls after one warm-up (CUDA events; wall clock off CUDA,
    for dry runs of the scripts)."""
    fn()
    cuda = torch.cuda.is_available()
    times = []
    for _ in range(reps):
        if not cuda:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
            continue
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def _init_single_rank_group() -> None:
    """inf_cl all-reduces the scale gradient unconditionally: it needs a (1-rank) group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        dist.init_process_group("nccl", rank=0, world_size=1)


def loss_fn(impl: str):
    """(img, txt, scale) -> scalar loss for ``impl``."""
    from infclip.loss import clip_loss

    if impl in OBJECTIVE_IMPLS:
        return objective_loss_fn(impl)
    if impl.startswith("vanilla"):
        return lambda i, t, s: clip_loss(i, t, s, impl="vanilla")
    if impl.startswith("local"):
        return lambda i, t, s: clip_loss(i, t, s, impl="local")
    if impl.startswith("torch"):
        return lambda i, t, s: clip_loss(i, t, s, impl="torch")
    if impl == "triton_fp32_tf32":
        return lambda i, t, s: clip_loss(i, t, s, impl="triton", fp32_precision="tf32")
    if impl == "triton_fixup_bf16":
        from infclip.kernels.clip import TritonTileOps, clip_loss_triton

        ops = TritonTileOps(strip_positives="fixup")
        return lambda i, t, s: clip_loss_triton(i, t, s, ops=ops)
    if impl.startswith("triton"):
        return lambda i, t, s: clip_loss(i, t, s, impl="triton")
    if impl == "inf_cl":
        from inf_cl import cal_inf_loss

        _init_single_rank_group()
        return lambda i, t, s: 0.5 * (cal_inf_loss(i, t, scale=s) + cal_inf_loss(t, i, scale=s))
    if impl == "memeff":
        from memeff import MemoryEfficientCLIPLoss

        # its temperature is a float fixed at construction: 0.07, the scale every impl starts
        # from here; inputs are unit rows already; stable=False: the usual 1 / T gradient scale
        fixed = MemoryEfficientCLIPLoss(temperature=0.07, normalized_inputs=True, stable=False)
        return lambda i, t, s: fixed(i, t)
    raise ValueError(impl)


def missing_anchor(impl: str) -> str | None:
    """The pip requirement of an anchor package that is not installed, else None."""
    import importlib.util

    module, requirement = ANCHOR_PACKAGES.get(impl, (None, None))
    if module is None or importlib.util.find_spec(module) is not None:
        return None
    return requirement


def objective_loss_fn(impl: str):
    """(img, txt, scale) -> scalar for the SigLIP / NT-Xent entries of OBJECTIVE_IMPLS."""
    from infclip.loss import nt_xent_loss, siglip_loss

    if impl.startswith("siglip"):
        if "open_clip" in impl:
            from open_clip.loss import SigLipLoss

            oc = SigLipLoss()
            return lambda i, t, s: oc(i, t, s.to(i.dtype), torch.tensor(-10.0, device=i.device, dtype=i.dtype))
        kind = "triton" if "triton" in impl else "torch"
        return lambda i, t, s: siglip_loss(i, t, s, torch.tensor(-10.0, device=i.device), impl=kind)
    kind = "vanilla" if "vanilla" in impl else "triton" if "triton" in impl else "torch"
    return lambda i, t, s: nt_xent_loss(torch.cat([i[: len(i) // 2], t[: len(t) // 2]]), 0.1, impl=kind)


def _inputs(b: int, c: int, dtype: torch.dtype, locked_image: bool = False):
    """(img, txt, logit_scale) leaves; ``locked_image``: the image features need no gradient (LiT)."""
    gen = torch.Generator(device="cuda").manual_seed(b + c)
    img = torch.nn.functional.normalize(torch.randn(b, c, device="cuda", generator=gen), dim=-1)
    txt = torch.nn.functional.normalize(torch.randn(b, c, device="cuda", generator=gen), dim=-1)
    logit_scale = torch.tensor(math.log(1 / 0.07), device="cuda", requires_grad=True)
    return img.to(dtype).requires_grad_(not locked_image), txt.to(dtype).requires_grad_(), logit_scale


def measure(impl: str, b: int, c: int, reps: int, peak: float) -> Row:
    """One (impl, b, c) point: ms (median), extra peak GB, effective TFLOP/s."""
    fn = loss_fn(impl)
    img, txt, logit_scale = _inputs(b, c, IMPLS[impl][0], locked_image="_lit" in impl)
    state = {}

    def step():
        for x in (img, txt, logit_scale):
            x.grad = None
        loss = fn(img, txt, logit_scale.exp())
        loss.backward()
        state["loss"] = loss.detach()

    step()  # warm-up: compile, tune
    for x in (img, txt, logit_scale):
        x.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - base) / 1e9
    ms = time_ms(step, reps)
    lit = "_lit" in impl
    tflops = (6 if lit else 8) * b * b * c / ms / 1e9
    row = Row(impl, c, b, "ok", ms, extra, tflops, 100 * tflops / peak, loss=float(state["loss"]))
    if c == 512 and b in ANCHOR_VANILLA_BF16_MS and not lit:
        row.x_vs_vanilla_anchor = ANCHOR_VANILLA_BF16_MS[b] / ms
    if c == 512 and b in ANCHOR_INFCL_MS and not lit:
        row.x_vs_infcl_anchor = ANCHOR_INFCL_MS[b] / ms
    return row


DUP_MODES = ("off", "mask", "positive")


def duplicate_ids(b: int, frac: float, device, seed: int = 0) -> torch.Tensor:
    """(b,) int64 group ids: round(frac * b) random samples take the id of another random
    sample, the rest are unique (about frac * b duplicate pairs)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.arange(b, dtype=torch.int64)
    k = round(frac * b)
    dst = torch.randperm(b, generator=gen)[:k]
    ids[dst] = torch.randint(0, b, (k,), generator=gen)
    return (ids * 1_000_003 + 17).to(device)


def time_split(forward, zero, reps: int) -> tuple[float, float]:
    """(forward ms, backward ms): medians over ``reps`` steps after one warm-up, each step timed
    in two parts (CUDA events before the forward, between it and its backward, after; wall
    clock off CUDA). ``zero`` clears the gradients before each step (untimed)."""
    forward().backward()
    cuda = torch.cuda.is_available()
    fwd, bwd = [], []
    for _ in range(reps):
        zero()
        if not cuda:
            t0 = time.perf_counter()
            loss = forward()
            t1 = time.perf_counter()
            loss.backward()
            fwd.append(1e3 * (t1 - t0))
            bwd.append(1e3 * (time.perf_counter() - t1))
            continue
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        ev[0].record()
        loss = forward()
        ev[1].record()
        loss.backward()
        ev[2].record()
        torch.cuda.synchronize()
        fwd.append(ev[0].elapsed_time(ev[1]))
        bwd.append(ev[1].elapsed_time(ev[2]))
    return statistics.median(fwd), statistics.median(bwd)


def measure_duplicates(b: int, c: int, frac: float, reps: int, device: str, impl: str,
                       breakdown: bool = False) -> dict:
    """ms (median of ``reps``, forward + backward) of clip_loss with duplicates off / mask /
    positive on the same inputs; off is the default call (no group ids). ``breakdown``: also
    each mode's forward and backward alone (``<mode>_fwd``, ``<mode>_bwd``) and the per-call
    preparation of the group ids alone (``<mode>_prep``, inside the forward's time too: for
    mask the sort by group, ``duplicates.sort_groups`` (Triton; the tiles: the dense ids,
    ``duplicates.prepare``); for positive ``duplicates.prepare``, the pair list and its one
    host sync)."""
    from infclip.loss import clip_loss
    from infclip.loss.duplicates import duplicate_pairs, prepare, sort_groups

    gen = torch.Generator(device=device).manual_seed(b + c)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    feats = [torch.nn.functional.normalize(torch.randn(b, c, device=device, generator=gen), dim=-1).to(dtype)
             .requires_grad_() for _ in range(2)]
    logit_scale = torch.tensor(math.log(1 / 0.07), device=device, requires_grad=True)
    ids = duplicate_ids(b, frac, device)
    out = {"b": b, "c": c, "pairs": duplicate_pairs(ids)}
    for mode in DUP_MODES:
        kw = {} if mode == "off" else {"group_ids": ids, "duplicates": mode}

        def step():
            for x in (*feats, logit_scale):
                x.grad = None
            clip_loss(*feats, logit_scale.exp(), impl=impl, **kw).backward()

        out[mode] = time_ms(step, reps)
    if breakdown:
        def zero():
            for x in (*feats, logit_scale):
                x.grad = None

        for mode in DUP_MODES:
            kw = {} if mode == "off" else {"group_ids": ids, "duplicates": mode}
            out[f"{mode}_fwd"], out[f"{mode}_bwd"] = time_split(
                lambda: clip_loss(*feats, logit_scale.exp(), impl=impl, **kw), zero, reps)
        # what "mask" runs: the sort by group on the fused Triton loss, the dense ids on the tiles
        out["mask_prep"] = time_ms(lambda: sort_groups(ids) if impl == "triton" else prepare("mask", ids), reps)
        out["positive_prep"] = time_ms(lambda: prepare("positive", ids), reps)
    return out


def duplicate_table(rows: list[dict]) -> str:
    """The --duplicates table: ms per mode and the overhead of mask / positive over off."""
    lines = [f"{'c':>5} {'b':>8} {'dup pairs':>9} {'off ms':>9} {'mask ms':>9} {'positive ms':>11} "
             f"{'mask +%':>8} {'pos +%':>8}"]
    for r in rows:
        lines.append(f"{r['c']:>5} {r['b']:>8} {r['pairs']:>9} {r['off']:>9.2f} {r['mask']:>9.2f} "
                     f"{r['positive']:>11.2f} {100 * (r['mask'] / r['off'] - 1):>8.1f} "
                     f"{100 * (r['positive'] / r['off'] - 1):>8.1f}")
    return "\n".join(lines)


def breakdown_table(rows: list[dict]) -> str:
    """The --breakdown table: per mode, forward and backward alone, the preparation of the
    group ids alone, and the forward's / backward's overhead over off's."""
    lines = [f"{'c':>5} {'b':>8} {'mode':>9} {'fwd ms':>8} {'bwd ms':>8} {'prep ms':>8} {'fwd +%':>7} {'bwd +%':>7}"]
    for r in rows:
        for mode in DUP_MODES:
            f, b = r[f"{mode}_fwd"], r[f"{mode}_bwd"]
            prep = f"{r[f'{mode}_prep']:8.3f}" if mode != "off" else f"{'':8}"
            lines.append(f"{r['c']:>5} {r['b']:>8} {mode:>9} {f:8.2f} {b:8.2f} {prep} "
                         f"{100 * (f / r['off_fwd'] - 1):7.1f} {100 * (b / r['off_bwd'] - 1):7.1f}")
    return "\n".join(lines)


def run_duplicates(args) -> list[dict]:
    """The --duplicates benchmark: every (c, b), a table printed as it fills, a CSV in --out."""
    device, impl = ("cpu", "torch") if args.dry_run else ("cuda", "triton")
    if args.dup_backward != "auto":  # the Triton ops that clip_loss builds take backward="auto"
        from infclip.kernels.clip import ops

        ops.AUTO_BACKWARD = args.dup_backward
    rows = []
    for c in [int(x) for x in args.dup_dims.split(",")]:
        for b in [int(x) for x in args.dup_batches.split(",")]:
            rows.append(measure_duplicates(b, c, args.dup_frac, args.reps, device, impl, args.breakdown))
            print(duplicate_table(rows[-1:]).splitlines()[-1], flush=True)
    print(duplicate_table(rows))
    if args.breakdown:
        print(breakdown_table(rows))
    with open(os.path.join(args.out, "bench_duplicates.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return rows


def _skip_reason(impl: str, b: int, c: int, last_ms: dict, max_s: float, reps: int) -> str | None:
    dtype, b_max, dims = IMPLS[impl]
    if dims is not None and c not in dims:
        return "not run"
    requirement = missing_anchor(impl)
    if requirement is not None:
        return f"not installed (pip install {requirement})"
    if b > b_max:
        return f"skipped (b > {b_max})"
    prev = last_ms.get((impl, c))
    if prev is not None:
        runs = 3 if b >= 262144 else 2 + reps  # warm-up + peak-memory run + timed runs
        est_s = prev[1] * (b / prev[0]) ** 2 / 1e3 * runs  # time grows as b^2
        if est_s > max_s:
            return f"skipped (too slow: ~{est_s:.0f} s)"
    if impl.startswith(("vanilla", "local")):
        need = (7.6 if dtype == torch.bfloat16 else 15.2) * b * b / 1e9  # logits + grads + softmax
        free = torch.cuda.mem_get_info()[0] / 1e9
        if need > 0.98 * free:
            return f"skipped (out of memory: ~{need:.0f} GB)"
    return None


def run_all(batches, dims, impls, reps, max_s, peak, csv_path) -> list[Row]:
    """Every (c, impl, b) point; the CSV is rewritten after each one (a cut-off run keeps its rows)."""
    rows, last_ms = [], {}
    for c in dims:
        for impl in impls:
            for b in batches:
                reason = _skip_reason(impl, b, c, last_ms, max_s, reps)
                if reason == "not run":
                    break
                if reason is None:
                    try:
                        row = measure(impl, b, c, reps if b < 262144 else 1, peak)
                        last_ms[(impl, c)] = (b, row.ms)
                    except torch.cuda.OutOfMemoryError:
                        row = Row(impl, c, b, "out of memory")
                    torch.cuda.empty_cache()
                else:
                    row = Row(impl, c, b, reason)
                rows.append(row)
                write_csv(rows, csv_path)
                print(_fmt(row), flush=True)
    return rows


def _fmt(r: Row) -> str:
    if r.status != "ok":
        return f"{r.impl:18s} c={r.c:4d} b={r.b:8d}  {r.status}"
    return (f"{r.impl:18s} c={r.c:4d} b={r.b:8d}  {r.ms:10.2f} ms  {r.extra_gb:8.3f} GB  "
            f"{r.tflops:6.0f} TFLOP/s  {r.pct_peak:5.1f}% peak  loss {r.loss:.4f}"
            + ("  (fixed scale: no d scale)" if r.impl in FIXED_SCALE_IMPLS else ""))


def write_csv(rows: list[Row], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        w.writeheader()
        for r in rows:
            w.writerow(asdict(r))


def plot(rows: list[Row], path: str, dims) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(dims), figsize=(5 * len(dims), 8), squeeze=False)
    colors = {impl: f"C{i}" for i, impl in enumerate(IMPLS)}  # same colour per impl in every panel
    for col, c in enumerate(dims):
        for impl in IMPLS:
            pts = [r for r in rows if r.impl == impl and r.c == c and r.status == "ok"]
            if not pts:
                continue
            bs = [r.b for r in pts]
            axes[0][col].plot(bs, [r.ms for r in pts], "o-", color=colors[impl], label=impl)
            axes[1][col].plot(bs, [r.extra_gb for r in pts], "o-", color=colors[impl], label=impl)
        for ax, ylabel in zip((axes[0][col], axes[1][col]), ("time fwd+bwd (ms)", "extra memory (GB)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("batch size b")
            ax.set_ylabel(ylabel)
            ax.set_title(f"c = {c}")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][col].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def read_csv(paths: list[str]) -> list[Row]:
    """Rows of earlier runs; a later file's row replaces an earlier one for the same point."""
    merged = {}
    for path in paths:
        with open(path) as f:
            for d in csv.DictReader(f):
                row = Row(d["impl"], int(d["c"]), int(d["b"]), d["status"],
                          *(float(d[k]) for k in list(asdict(Row("", 0, 0, "")))[4:]))
                merged[(row.impl, row.c, row.b)] = row
    return list(merged.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="8192,16384,32768,65536,131072,262144,1048576")
    p.add_argument("--dims", default="512,768,1024")
    p.add_argument("--impls", default=",".join(k for k in IMPLS if k not in OBJECTIVE_IMPLS and k != "triton_fixup_bf16"
                                               and "_lit" not in k))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-s", type=float, default=90.0, help="skip a point estimated to take longer")
    p.add_argument("--commit", default=None, help="commit to report (default: git rev-parse --short HEAD)")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--replot", nargs="+", metavar="CSV", help="only merge these CSVs and plot them")
    p.add_argument("--duplicates", action="store_true",
                   help="time duplicates=off|mask|positive instead (see the module docs)")
    p.add_argument("--dup-batches", default="32768,65536", help="--duplicates: batch sizes")
    p.add_argument("--dup-dims", default="512,1024", help="--duplicates: feature dims")
    p.add_argument("--dup-frac", type=float, default=0.01, help="--duplicates: fraction of duplicated samples")
    p.add_argument("--dry-run", action="store_true", help="--duplicates on the CPU (PyTorch tiles, fp32)")
    p.add_argument("--breakdown", action="store_true",
                   help="--duplicates: also forward / backward alone per mode and the group ids' preparation")
    p.add_argument("--dup-backward", default="auto", choices=("auto", "onepass", "twopass"),
                   help="--duplicates: the Triton backward (auto: kernels/clip/ops.py's AUTO_BACKWARD)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.dry_run and not args.duplicates:
        p.error("--dry-run applies to --duplicates only")
    if args.breakdown and not args.duplicates:
        p.error("--breakdown applies to --duplicates only")
    if not 0 <= args.dup_frac < 1:
        p.error(f"--dup-frac must be in [0, 1), got {args.dup_frac}")
    if args.duplicates:
        if not args.dry_run:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
            print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  commit {commit.strip() or '?'}  "
                  f"backward {args.dup_backward}", flush=True)
        run_duplicates(args)
        print_tuned()
        return
    if args.replot:
        rows = read_csv(args.replot)
        write_csv(rows, os.path.join(args.out, "bench_loss.csv"))
        plot(rows, os.path.join(args.out, "bench_loss.png"), sorted({r.c for r in rows}))
        return
    batches = [int(x) for x in args.batches.split(",")]
    dims = [int(x) for x in args.dims.split(",")]
    impls = [x for x in args.impls.split(",") if x]
    unknown = [x for x in impls if x not in IMPLS]
    if unknown or not impls:
        p.error(f"--impls: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(IMPLS)}")
    peak = matmul_peak_tflops()
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  commit {commit or '?'}")
    print(f"measured bf16 matmul (8192^3): {peak:.0f} TFLOP/s", flush=True)
    t0 = time.time()
    rows = run_all(batches, dims, impls, args.reps, args.max_s, peak, os.path.join(args.out, "bench_loss.csv"))
    plot(rows, os.path.join(args.out, "bench_loss.png"), dims)
    print_tuned()
    print(f"done in {time.time() - t0:.0f} s; wrote {args.out}/bench_loss.csv and bench_loss.png")


def print_tuned() -> None:
    """The configs the kernel tuner chose, one line per problem class (kind, c, dtype, rows and
    columns buckets): which forward and strip fill ran (Triton or Gluon) at each size."""
    from infclip.kernels.clip import launch

    for key, cfg in sorted(launch.tuned_configs().items(), key=str):
        kind, c, dtype, _, rows, cols, _ = key
        print(f"tuned {kind:18s} c={c:5d} {str(dtype):15s} rows<={rows:7d} cols<={cols:7d}  {cfg}")


if __name__ == "__main__":
    main()
