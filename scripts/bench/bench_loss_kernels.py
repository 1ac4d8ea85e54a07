"""Per-kernel timings of the Triton CLIP loss and its kernel variants, one GPU run.

For each (c, b) of ``--shapes`` (bf16, L2-normalized random features, scale 1/0.07):

1. ``step``: forward + backward of the whole loss (``clip_loss_triton``) with the strip
   path's positives applied as an fp32 fixup (default) and folded into the scratch
   (``strip_positives="fold"``), and vanilla bf16 beside them; median of ``--reps``.
2. ``breakdown``: one step of each under ``torch.profiler``: GPU time per kernel, grouped
   (forward LSE kernel, strip fill kernel, cuBLAS GEMMs, the rest) and the launch count.
3. ``variants``: the forward kernel alone (``lse_forward``) and one backward direction
   alone (``grad_rows_strips``) for each config of the sweep (tile shapes, stages, warps,
   ``ws`` = warp-specialized loops, ``tma`` = persistent TMA strip kernel), each checked
   against the default config's output; strip heights R for the strip path.
4. ``sass``: for every compiled variant, registers, spills, wgmma in the PTX and HGMMA in
   the SASS (cuobjdump through triton's ``asm['sass']``).
5. ``onepass`` (opt in): the backward alone (``loss_backward`` on the
   forward's outputs) and the whole step (``clip_loss_triton``), with
   ``TritonTileOps(backward="twopass")`` and ``backward="onepass"``, ms and % of peak
   (8 b^2 c FLOPs for the step, 6 b^2 c for the backward), the one-pass gradients checked
   against the two-pass ones; a table at the end. ``--onepass-shapes`` (default c in
   {512, 768, 1024} x b in {16k, 32k, 64k, 128k}):

    python3 -u scripts/bench/bench_loss_kernels.py --parts onepass --reps 3 --out $OUT

    python3 -u scripts/bench/bench_loss_kernels.py --shapes 512x65536,1024x16384 --out $OUT

Every number is measured in the run (median of ``--reps`` CUDA-event timings after a
warm-up); a variant that does not compile or disagrees with the default is reported as such.
On a machine without CUDA it runs the same logic on tiny shapes under TRITON_INTERPRET
(wall-clock timings, no profiler/SASS): a dry run of the script, not a benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from infclip.kernels.clip import TritonTileOps, clip_loss_triton, launch  # noqa: E402
from infclip.kernels.clip import kernels as K  # noqa: E402
from infclip.kernels.clip.launch import FwdConfig, StripConfig  # noqa: E402
from infclip.kernels.clip.function import loss_backward, loss_forward  # noqa: E402
from infclip.kernels.clip.reference import row_dot  # noqa: E402
from infclip.loss.reference import vanilla_loss  # noqa: E402

from bench_loss import time_ms  # noqa: E402  (this folder is on sys.path when run as a script)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
LOG: list[dict] = []


def emit(kind: str, **row) -> None:
    LOG.append({"kind": kind, **row})
    print(f"{kind:10s} " + "  ".join(f"{k}={_short(v)}" for k, v in row.items()), flush=True)


def _short(v):
    return f"{v:.4g}" if isinstance(v, float) else v


def inputs(b: int, c: int):
    gen = torch.Generator(device=DEV).manual_seed(b + c)
    img = torch.nn.functional.normalize(torch.randn(b, c, device=DEV, generator=gen), dim=-1)
    txt = torch.nn.functional.normalize(torch.randn(b, c, device=DEV, generator=gen), dim=-1)
    return img.bfloat16(), txt.bfloat16(), torch.tensor(1 / 0.07, device=DEV)


def step_fn(kind: str, img, txt, scale, ops=None):
    """fwd + bwd of one loss implementation on fresh leaves (grads dropped each call);
    ``ops``: the Triton tiles to use (else built for ``kind``)."""
    i, t = img.clone().requires_grad_(), txt.clone().requires_grad_()
    s = scale.clone().requires_grad_()
    if kind == "vanilla":
        fn = vanilla_loss
    else:
        ops = ops or TritonTileOps(strip_positives=kind, strips="auto" if CUDA else "always")
        fn = lambda a, b, sc: clip_loss_triton(a, b, sc, ops=ops)  # noqa: E731

    def run():
        i.grad = t.grad = s.grad = None
        fn(i, t, s).backward()
    return run


def bench_steps(c: int, b: int, reps: int, flops: float, peak: float) -> None:
    img, txt, scale = inputs(b, c)
    for kind in ("vanilla", "fixup", "fold"):
        try:
            ms = time_ms(step_fn(kind, img, txt, scale), reps)
            emit("step", c=c, b=b, impl=kind, ms=ms, pct_peak=100 * flops / ms / 1e9 / peak)
        except torch.cuda.OutOfMemoryError:
            emit("step", c=c, b=b, impl=kind, status="out of memory")
        torch.cuda.empty_cache() if CUDA else None


def _group(name: str) -> str:
    if "_lse_fwd" in name:
        return "forward LSE kernel"
    if "_dx_strip" in name:
        return "strip fill kernel"
    if "_grad_kernel" in name:
        return "fused backward kernel"
    low = name.lower()
    if any(x in low for x in ("gemm", "nvjet", "xmma", "cutlass", "sm90", "cublas")):
        return "cuBLAS GEMM"
    return "other (elementwise, reductions, copies)"


def breakdown(c: int, b: int) -> None:
    """GPU time per kernel of one step (profiler), grouped, and the number of launches."""
    if not CUDA:
        emit("breakdown", c=c, b=b, status="skipped (no CUDA)")
        return
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    img, txt, scale = inputs(b, c)
    for kind in ("fixup", "fold", "vanilla"):
        run = step_fn(kind, img, txt, scale)
        run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        per_name: dict[str, list] = {}
        for e in prof.events():
            if e.device_type != DeviceType.CUDA:
                continue
            us = getattr(e, "device_time_total", None)
            us = e.cuda_time_total if us is None else us
            acc = per_name.setdefault(e.name, [0, 0.0])
            acc[0] += 1
            acc[1] += us / 1e3
        groups: dict[str, list] = {}
        for name, (n, ms) in per_name.items():
            g = groups.setdefault(_group(name), [0, 0.0])
            g[0] += n
            g[1] += ms
        total = sum(ms for _, ms in per_name.values())
        emit("breakdown", c=c, b=b, impl=kind, gpu_ms=total, launches=sum(n for n, _ in per_name.values()))
        for g, (n, ms) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
            emit("  group", c=c, b=b, impl=kind, group=g, launches=n, ms=ms)
        for name, (n, ms) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[:8]:
            emit("  kernel", c=c, b=b, impl=kind, name=name[:90], launches=n, ms=ms)
        del run
        torch.cuda.empty_cache()


def fwd_variants(k: int) -> list[FwdConfig]:
    if not CUDA:
        return [FwdConfig(32, 32, 32), FwdConfig(32, 32, 16, ws=True)]
    base = launch.fwd_candidates(k, 2)
    return base + [FwdConfig(256, 128, 64, 8, 4), FwdConfig(128, 256, 64, 8, 3), FwdConfig(128, 128, 64, 4, 4),
                   FwdConfig(256, 128, 64, 8, 3, ws=True), FwdConfig(128, 128, 64, 8, 3, ws=True),
                   # the exact (subtract-first) offsets of fp32 on 16-bit inputs: what the FMA shift saves
                   FwdConfig(256, 128, 32, 8, 4, fast_off=False), FwdConfig(128, 128, 64, 8, 3, fast_off=False),
                   # 64-row tiles, 4 warps: several programs per SM, one's epilogue beside another's MMAs
                   FwdConfig(64, 128, 64, 4, 3), FwdConfig(64, 256, 64, 4, 3), FwdConfig(64, 128, 64, 4, 4)]


def strip_variants(k: int) -> list[StripConfig]:
    if not CUDA:
        return [StripConfig(32, 32, 32, 2), StripConfig(32, 32, 16, 2, tma=True),
                StripConfig(32, 32, 16, 2, tma=True, ws=True)]
    base = launch.strip_candidates(k, 2)
    return base + [StripConfig(128, 256, 64, 8, 8, 4), StripConfig(128, 128, 64, 8, 4, 4),
                   StripConfig(128, 256, 64, 8, 8, 3, tma=True),
                   StripConfig(128, 256, 64, 8, 8, 3, tma=True, ws=True),
                   StripConfig(128, 128, 64, 8, 4, 3, tma=True, ws=True),
                   StripConfig(128, 128, 64, 8, 8, 4, tma=True, fast_off=False),
                   # 64-row tiles, 4 warps: several programs per SM (persistent: per_sm of them)
                   StripConfig(64, 128, 64, 8, 4, 3), StripConfig(64, 256, 64, 8, 4, 3),
                   StripConfig(64, 128, 64, 8, 4, 3, tma=True, per_sm=2),
                   StripConfig(64, 256, 64, 8, 4, 3, tma=True, per_sm=2),
                   StripConfig(64, 128, 64, 8, 4, 4, tma=True, per_sm=3)]


def _err(e: Exception) -> str:
    lines = [x for x in str(e).strip().splitlines() if x.strip()]
    return f"{type(e).__name__}: {lines[-1][:160] if lines else ''}"


def variants(c: int, b: int, reps: int, peak: float, strip_rows: list[int]) -> None:
    """Forward alone and one backward direction alone, for every config of the sweep."""
    img, txt, scale = inputs(b, c)
    pos = row_dot(img, txt)
    ref = None
    for cfg in fwd_variants(c):
        try:
            fn = lambda: launch.lse_forward(img, txt, scale, cfg, "tf32", off_a=pos, off_b=pos, diag=True)  # noqa
            out = fn()
            ms = time_ms(fn, reps)
            ref = out if ref is None else ref
            diff = max((x - y).abs().max().item() for x, y in zip(out, ref))
            emit("fwd", c=c, b=b, cfg=_cfg(cfg), ms=ms, tflops=2 * b * b * c / ms / 1e9,
                 pct_peak=100 * 2 * b * b * c / ms / 1e9 / peak, max_diff_vs_first=diff)
        except Exception as e:  # noqa: BLE001 -- a variant that does not compile is a result
            emit("fwd", c=c, b=b, cfg=_cfg(cfg), status=_err(e))
    row, col = ref
    g = torch.full((b,), 0.5 / b, device=DEV)
    default_rows = launch.strip_rows(b, 2, k=c)
    out_ref = None
    for cfg in strip_variants(c):
        for fold in (False, True):
            if fold and cfg != strip_variants(c)[0]:
                continue  # fold vs fixup: compared on the default config only
            out = torch.empty_like(img)

            def fn(cfg=cfg, out=out, fold=fold):
                return launch.grad_rows_strips(img, txt, scale, row, col, g, g, out, default_rows, cfg, "tf32",
                                               g_d=2 * g, off_a=pos, off_b=pos, fold=fold)
            try:
                fn()
                ms = time_ms(fn, reps)
                out_ref = out.float() if out_ref is None else out_ref
                rel = ((out.float() - out_ref).norm() / out_ref.norm()).item()
                emit("strip", c=c, b=b, cfg=_cfg(cfg), fold=fold, rows=default_rows, ms=ms,
                     raw_tflops=4 * b * b * c / ms / 1e9, rel_diff_vs_first=rel)
            except Exception as e:  # noqa: BLE001
                emit("strip", c=c, b=b, cfg=_cfg(cfg), fold=fold, status=_err(e))
    cfg0 = strip_variants(c)[0]
    n_strips = -(-b // default_rows)
    balanced = -(-(-(-b // n_strips)) // 128) * 128  # same strip count, even heights (no short last strip)
    default_rows = min(default_rows, b)
    for rows in sorted({min(r, b) for r in set(strip_rows) | {default_rows, balanced}}):
        out = torch.empty_like(img)
        scratch_mb = 2 * rows * b / 2**20
        fn = lambda: launch.grad_rows_strips(img, txt, scale, row, col, g, g, out, rows, cfg0, "tf32",  # noqa
                                             g_d=2 * g, off_a=pos, off_b=pos, fold=True)
        try:
            ms = time_ms(fn, reps)
            emit("rows", c=c, b=b, rows=rows, strips=-(-b // rows), scratch_mb=scratch_mb, default=rows == default_rows,
                 fits_rule=scratch_mb * 2**20 + 64 * b <= 1024 * b + (64 << 20), ms=ms)
        except Exception as e:  # noqa: BLE001
            emit("rows", c=c, b=b, rows=rows, status=_err(e))


ONEPASS_SHAPES = ",".join(f"{c}x{b}" for c in (512, 768, 1024) for b in (16384, 32768, 65536, 131072))


def onepass(c: int, b: int, reps: int, peak: float) -> dict:
    """Backward alone and fwd + bwd, two-pass vs one-pass (bf16; graphs as by default)."""
    img, txt, scale = inputs(b, c)
    row = {"c": c, "b": b}
    grads = {}
    for path in ("twopass", "onepass"):
        ops = TritonTileOps(backward=path, strips="auto" if CUDA else "always")
        try:
            with torch.no_grad():
                _, r, cl, pos = loss_forward(ops, img, txt, scale)
            g = torch.ones((), device=DEV)
            bwd = lambda: loss_backward(ops, img, txt, scale, r, cl, pos, g)  # noqa: E731
            grads[path] = bwd()
            bwd_ms = time_ms(bwd, reps)
            step_ms = time_ms(step_fn("fold", img, txt, scale, ops), reps)
        except torch.cuda.OutOfMemoryError:
            emit("onepass", c=c, b=b, path=path, status="out of memory")
            continue
        row[f"{path}_bwd_ms"], row[f"{path}_step_ms"] = bwd_ms, step_ms
        row[f"{path}_step_pct"] = 100 * 8 * b * b * c / step_ms / 1e9 / peak
        emit("onepass", c=c, b=b, path=path, bwd_ms=bwd_ms, bwd_pct_peak=100 * 6 * b * b * c / bwd_ms / 1e9 / peak,
             step_ms=step_ms, step_pct_peak=row[f"{path}_step_pct"])
        del ops
        torch.cuda.empty_cache() if CUDA else None
    if len(grads) == 2:
        row["rel_diff"] = max(((x.float() - y.float()).norm() / y.float().norm()).item()
                              for x, y in zip(grads["onepass"], grads["twopass"]))
        row["bwd_speedup"] = row["twopass_bwd_ms"] / row["onepass_bwd_ms"]
        row["step_speedup"] = row["twopass_step_ms"] / row["onepass_step_ms"]
        emit("onepass", **row)
    return row


def onepass_table(rows: list[dict]) -> None:
    """The one-pass rows as a markdown table (the last lines of the run)."""
    cols = ["c", "b", "twopass_bwd_ms", "onepass_bwd_ms", "bwd_speedup", "twopass_step_ms", "onepass_step_ms",
            "twopass_step_pct", "onepass_step_pct", "step_speedup", "rel_diff"]
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(_short(r.get(k, "-"))) for k in cols) + " |")


def _cfg(cfg) -> str:
    d = {k: v for k, v in vars(cfg).items() if v not in (False,)}
    return ",".join(f"{k}={v}" if not isinstance(v, bool) else k for k, v in d.items())


def sass_report() -> None:
    """Registers, spills, wgmma (PTX) and HGMMA (SASS) of every compiled kernel variant."""
    for fn in (K._lse_fwd_kernel, K._dx_strip_kernel, K._dx_strip_tma_kernel, K._grad_kernel):
        for kern in _compiled(fn):
            md = kern.metadata
            row = dict(kernel=fn.__name__, warps=getattr(md, "num_warps", "?"), stages=getattr(md, "num_stages", "?"),
                       regs=getattr(kern, "n_regs", "?"), spills=getattr(kern, "n_spills", "?"),
                       shared_kb=round(getattr(md, "shared", 0) / 1024, 1))
            try:
                ptx = kern.asm["ptx"]
                row["ptx_wgmma"] = ptx.count("wgmma.mma_async")
                row["ptx_mma_sync"] = ptx.count("mma.sync")
                row["ptx_tma"] = ptx.count("cp.async.bulk.tensor")
                row["ptx_setmaxnreg"] = ptx.count("setmaxnreg")
            except Exception as e:  # noqa: BLE001
                row["ptx"] = _err(e)
            try:
                sass = kern.asm["sass"]
                row["sass_HGMMA"] = sass.count("HGMMA")
                row["sass_HMMA"] = sass.count("HMMA")
            except Exception as e:  # noqa: BLE001
                row["sass"] = _err(e)
            emit("sass", **row)


def _compiled(fn) -> list:
    """The CompiledKernels in a JITFunction's caches (layout differs across triton versions)."""
    found = {}
    for entry in getattr(fn, "device_caches", {}).values():
        caches = entry if isinstance(entry, tuple) else (entry,)
        for cache in caches:
            if isinstance(cache, dict):
                found.update((id(k), k) for k in cache.values() if hasattr(k, "asm"))
    return list(found.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="512x65536,1024x16384", help="c x b pairs")
    p.add_argument("--parts", default="step,breakdown,variants,sass")
    p.add_argument("--rows", default="384,1024,2048,3072", help="strip heights R to time (the default R as well)")
    p.add_argument("--onepass-shapes", default=ONEPASS_SHAPES, help="c x b pairs of the onepass part")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    parts = set(args.parts.split(","))
    peak = 1.0
    if CUDA:
        a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
        peak = 2 * 8192**3 / time_ms(lambda: a @ a, 10) / 1e9
        del a
        emit("device", name=torch.cuda.get_device_name(), torch=torch.__version__,
             triton=__import__("triton").__version__, peak_tflops=peak)
    for shape in args.shapes.split(","):
        c, b = (int(x) for x in shape.split("x"))
        t0 = time.time()
        for part, fn in (("step", lambda: bench_steps(c, b, args.reps, 8 * b * b * c, peak)),
                         ("breakdown", lambda: breakdown(c, b)),
                         ("variants", lambda: variants(c, b, args.reps, peak, [int(r) for r in args.rows.split(",")]))):
            if part in parts:
                try:
                    fn()
                except Exception:  # noqa: BLE001 -- keep the other parts' results
                    emit(part, c=c, b=b, status="failed: " + traceback.format_exc(limit=3).replace("\n", " | "))
        emit("elapsed", c=c, b=b, s=time.time() - t0)
    if "onepass" in parts:
        t0 = time.time()
        rows = []
        for shape in args.onepass_shapes.split(","):
            c, b = (int(x) for x in shape.split("x"))
            try:
                rows.append(onepass(c, b, args.reps, peak))
            except Exception:  # noqa: BLE001 -- keep the other shapes' results
                emit("onepass", c=c, b=b, status="failed: " + traceback.format_exc(limit=3).replace("\n", " | "))
        emit("elapsed", part="onepass", s=time.time() - t0)
        onepass_table(rows)
    if "sass" in parts and CUDA:
        sass_report()
    with open(os.path.join(args.out, "bench_loss_kernels.json"), "w") as f:
        json.dump(LOG, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
