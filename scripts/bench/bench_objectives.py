"""SigLIP / NT-Xent / gradient filtering on one process (CPU or one GPU): time, memory, error.

    python scripts/bench/bench_objectives.py losses --device cpu --sizes 1024 4096 8192
    python scripts/bench/bench_objectives.py filter --device cpu --b 4096

``losses``: forward + backward of SigLIP (ours tiled vs open_clip ``SigLipLoss``, bias -10,
s = 10) and NT-Xent (ours tiled on b rows vs the naive (b, b) matrix, T = 0.1), c = 512,
fp32, L2-normalized random features; min over ``--reps`` after a warm-up. Each point runs
in a fresh process so that its peak memory is its own: CUDA max_memory_allocated, or on CPU
the growth of the process's peak RSS during the step (both minus the inputs).

``filter``: backward of the CLIP loss with gradient filtering (``FilteredTileOps``) vs the
same tiles unfiltered, on features with a peaked softmax (late training, s = 100): "pairs"
(each text a small perturbation of its image), "clusters" (64 concepts, negatives within a
concept ~e^-30 below the positive) and "hard" (tight concepts: in-concept negatives compete
with the positive, scattered over every block), and "pairs_s20" (pairs at s = 20: a
moderately peaked softmax, where filtering starts to cost accuracy); kept blocks, speed-up and the gradient error relative to the gradient's norm.
Denormals are flushed (peaked softmaxes underflow; x86 handles denormals ~100x slower).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

METHODS = ("siglip_open_clip", "siglip_ours", "nt_xent_naive", "nt_xent_ours")


def loss_fn(method: str):
    from infclip.loss import nt_xent_loss, siglip_loss

    if method == "siglip_open_clip":
        from open_clip.loss import SigLipLoss

        return lambda i, t, s, b: SigLipLoss()(i, t, s, b)
    if method == "siglip_ours":
        return lambda i, t, s, b: siglip_loss(i, t, s, b)
    impl = "vanilla" if method == "nt_xent_naive" else "auto"
    return lambda i, t, s, b: nt_xent_loss(torch.cat([i[: len(i) // 2], t[: len(t) // 2]]), 0.1, impl=impl)


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def point(method: str, b: int, c: int, reps: int, device: str) -> dict:
    """One (method, b) point in this process: ms (min), extra MB, loss."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(b)
    img, txt = (F.normalize(torch.randn(b, c, generator=g, device=dev), dim=-1).requires_grad_() for _ in range(2))
    s = torch.tensor(10.0, device=dev, requires_grad=True)
    bias = torch.tensor(-10.0, device=dev, requires_grad=True)
    fn = loss_fn(method)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times, loss = [], None
    for _ in range(reps + 1):
        for x in (img, txt, s, bias):
            x.grad = None
        _sync(dev)
        t0 = time.perf_counter()
        loss = fn(img, txt, s, bias)
        loss.backward()
        _sync(dev)
        times.append(1e3 * (time.perf_counter() - t0))
    if dev.type == "cuda":
        mb = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    return {"method": method, "b": b, "ms": min(times[1:]), "extra_mb": mb, "loss": float(loss)}


def losses(args) -> None:
    rows = []
    for b in args.sizes:
        for method in args.methods:
            cmd = [sys.executable, __file__, "point", method, str(b), str(args.c), str(args.reps), args.device]
            out = subprocess.run(cmd, capture_output=True, text=True)
            row = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else \
                {"method": method, "b": b, "error": out.stderr.strip().splitlines()[-1:]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| b | " + " | ".join(args.methods) + " |\n|---|" + "---|" * len(args.methods))
    for b in args.sizes:
        cells = [next((f"{r['ms']:.0f} ms / {r['extra_mb']:.0f} MB" if "ms" in r else "error")
                      for r in rows if r["b"] == b and r["method"] == m) for m in args.methods]
        print(f"| {b:,} | " + " | ".join(cells) + " |")


def peaked(kind: str, b: int, c: int):
    g = torch.Generator().manual_seed(0)
    if kind in ("pairs", "pairs_s20"):
        img = F.normalize(torch.randn(b, c, generator=g), dim=-1)
    else:  # 64 concepts; samples scattered over the batch in random order
        spread = 0.8 if kind == "clusters" else 0.25
        centres = F.normalize(torch.randn(64, c, generator=g), dim=-1)
        noise = spread * torch.randn(b, c, generator=g) / c**0.5
        img = F.normalize(centres[torch.randint(0, 64, (b,), generator=g)] + noise, dim=-1)
    txt = F.normalize(img + 0.5 * torch.randn(b, c, generator=g) / c**0.5, dim=-1)
    return img, txt, torch.tensor(20.0 if kind == "pairs_s20" else 100.0)


def _timed(fn, reps, dev):
    """Best of ``reps`` wall times in ms (after one untimed warm-up on a GPU), and the output."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    if dev.type == "cuda":
        fn()
    best, out = float("inf"), None
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best, out


def filtering(args) -> None:
    from infclip.loss.filtering import FilteredTileOps
    from infclip.loss.tiled import TorchTileOps

    torch.set_flush_denormal(True)
    dev = torch.device(args.device)
    print(f"device: {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}, b = {args.b}, "
          f"c = {args.c}, fp32, tile {args.tile}, block {args.block}")
    print("| features | eps | kept blocks | backward ms (unfiltered -> filtered) | speed-up | "
          "max rel. err dI | rel. err ds |\n|---|---|---|---|---|---|---|")
    for kind in ("pairs", "clusters", "hard", "pairs_s20"):
        img, txt, s = (x.to(dev) for x in peaked(kind, args.b, args.c))
        row, col = TorchTileOps().forward(img, txt, s)
        g = torch.full((args.b,), 0.5 / args.b, device=dev)
        plain = TorchTileOps(tile=args.tile)
        ms0, exact = _timed(lambda: plain.backward(img, txt, s, row, col, g, g), args.reps, dev)
        for eps in (2**-10, 2**-7, 2**-4):
            ops = FilteredTileOps(eps, args.b, tile=args.tile, block=args.block)
            ops.kept = ops.total = 0  # count the timed runs only
            ms1, got = _timed(lambda: ops.backward(img, txt, s, row, col, g, g), args.reps, dev)
            err_i = float((got[0] - exact[0]).norm(dim=-1).max() / exact[0].norm(dim=-1).max())
            err_s = float((got[2] - exact[2]).abs() / exact[2].abs())
            kept = f"{ops.kept // args.reps}/{ops.total // args.reps}"
            print(f"| {kind} | 2^{int(torch.log2(torch.tensor(eps)))} | {kept} | {ms0:.0f} -> {ms1:.0f} | "
                  f"{ms0 / ms1:.2f}x | {err_i:.1e} | {err_s:.1e} |", flush=True)


def main() -> None:
    if sys.argv[1:2] == ["point"]:
        method, b, c, reps, device = sys.argv[2:7]
        print(json.dumps(point(method, int(b), int(c), int(reps), device)))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    lo = sub.add_parser("losses")
    lo.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 8192])
    lo.add_argument("--methods", nargs="+", default=list(METHODS))
    fi = sub.add_parser("filter")
    fi.add_argument("--b", type=int, default=4096)
    fi.add_argument("--tile", type=int, default=256)
    fi.add_argument("--block", type=int, default=256)
    for q in (lo, fi):
        q.add_argument("--c", type=int, default=512)
        q.add_argument("--reps", type=int, default=2)
        q.add_argument("--device", default="cpu")
    args = p.parse_args()
    losses(args) if args.cmd == "losses" else filtering(args)


if __name__ == "__main__":
    main()
