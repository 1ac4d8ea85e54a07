"""Where the time of one small-batch loss step goes: host (Python, launches) vs GPU.

At b = 8k the Triton loss does ~1-1.5 ms of GPU work; whether a step costs that or more
depends on how fast the host issues it. For each (c, b) this prints, over ``--reps`` steps
(forward + backward, bf16, learnable scale):

- ``step_ms``: CUDA-event time of one step from an idle GPU (as ``bench_loss.time_ms``),
- ``host_ms``: wall time the host spends issuing one step (no sync at its end),
- ``gpu_ms``: summed CUDA kernel time of one step (``torch.profiler``) and the launch count,
- ``triton_launch_us``: host time per Triton launch (``JITFunction.run`` wrapped),
- the top host functions by own time (``cProfile``), with ``--cprofile``.

    python3 scripts/profile_loss_host.py --dims 512,1024 --batches 8192,16384 [--impls triton,vanilla]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_loss import loss_fn, time_ms  # noqa: E402


def _inputs(b: int, c: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    img = torch.nn.functional.normalize(torch.randn(b, c, device="cuda", generator=g), dim=1)
    txt = torch.nn.functional.normalize(img + torch.randn(b, c, device="cuda", generator=g), dim=1)
    img = img.bfloat16().requires_grad_()
    txt = txt.bfloat16().requires_grad_()
    log_s = torch.tensor(2.659, device="cuda", requires_grad=True)
    return img, txt, log_s


def _step(fn, img, txt, log_s):
    def run():
        img.grad = txt.grad = log_s.grad = None
        fn(img, txt, log_s.exp()).backward()
    return run


def host_ms(run, reps: int) -> float:
    """Median wall time to issue one step (the GPU drained before each)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        times.append(1e3 * (time.perf_counter() - t0))
    torch.cuda.synchronize()
    return statistics.median(times)


def gpu_ms(run, reps: int) -> tuple[float, float]:
    """(summed kernel ms per step, kernel launches per step) from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    total_us = sum(e.device_time for e in events)
    return total_us / 1e3 / reps, len(events) / reps


class LaunchTimer:
    """Wraps triton's JITFunction.run: host microseconds per launch, by kernel name."""

    def __init__(self):
        from triton.runtime.jit import JITFunction

        self.cls, self.orig, self.us = JITFunction, JITFunction.run, {}

    def __enter__(self):
        orig, us = self.orig, self.us

        def run(fn_self, *args, **kwargs):
            t0 = time.perf_counter()
            out = orig(fn_self, *args, **kwargs)
            us.setdefault(fn_self.__name__, []).append(1e6 * (time.perf_counter() - t0))
            return out

        self.cls.run = run
        return self

    def __exit__(self, *exc):
        self.cls.run = self.orig


def graphed_fn(img, txt, log_s):
    """The Triton loss captured as CUDA graphs (forward and backward) by
    ``torch.cuda.make_graphed_callables`` around the eager kernels: the bound that
    ``infclip.kernels.clip.graphs`` (used by the plain ``triton`` impl since) was built to reach."""
    from infclip.kernels.clip import TritonTileOps

    ops = TritonTileOps(cuda_graphs="never")
    graphed = torch.cuda.make_graphed_callables(lambda i, t, s: ops.fused_loss(i, t, s),
                                                (img, txt, log_s.exp().detach().requires_grad_()))
    return lambda i, t, s: graphed(i, t, s)


def profile_one(impl: str, b: int, c: int, reps: int, cprof: bool) -> None:
    tensors = _inputs(b, c)
    if impl == "triton_graphed":
        fn = graphed_fn(*tensors)
    else:
        fn = loss_fn(f"{impl}_bf16" if impl in ("triton", "vanilla") else impl)
    run = _step(fn, *tensors)
    for _ in range(3):  # compile / tune / allocator warm-up
        run()
    torch.cuda.synchronize()
    step = time_ms(run, reps)
    host = host_ms(run, reps)
    gpu, launches = gpu_ms(run, reps)
    with LaunchTimer() as lt:
        host_ms(run, reps)
    per = {k: statistics.median(v) for k, v in lt.us.items()}
    tl = ", ".join(f"{k} {v:.0f} us x{len(lt.us[k]) // reps}" for k, v in per.items())
    print(f"{impl:10s} c={c:5d} b={b:7d}  step_ms={step:7.3f}  host_ms={host:7.3f}  gpu_ms={gpu:7.3f}  "
          f"launches={launches:5.1f}  triton: {tl or '-'}", flush=True)
    if cprof:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        print("\n".join(s.getvalue().splitlines()[:45]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", default="512,1024")
    ap.add_argument("--batches", default="8192")
    ap.add_argument("--impls", default="triton,vanilla")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cprofile", action="store_true")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    for c in map(int, args.dims.split(",")):
        for b in map(int, args.batches.split(",")):
            for impl in args.impls.split(","):
                profile_one(impl, b, c, args.reps, args.cprofile and impl == "triton")


if __name__ == "__main__":
    main()
