"""Which output format lets the GPU's JPEG engines run without per-image SM kernels?

    python scripts/probe_decode_formats.py --shards '/tmp/photos256/{00000..00031}.tar' \\
        [--formats rgb,rgb_nofancy,yuv] [--micro 1024] [--overlap-s 3] [--trace] [--options OPTS]

A profiled LiT step showed nvJPEG launching one ``ycbcr_to_format_kernel_roi`` per image
(colour conversion and chroma upsampling to interleaved RGB, 3.2 us each, 65,536 per step)
on its internal streams; each waits for SM slots behind the towers' GEMMs, which stretches
every decode call 3-4x. nvImageCodec maps ``SampleFormat.P_YUV`` + ``ColorSpec.SYCC`` to
``NVJPEG_OUTPUT_YUV`` (planes as stored: Y at full size, Cb/Cr at their subsampled size, row
pitch W), which needs no conversion; whether nvJPEG's hardware path then launches no kernel
is what this measures. Formats (one nvImageCodec decoder each, ``--backend`` engines):

* ``rgb``: the trainer's format (sRGB, interleaved RGB, fancy upsampling; the trainer also sets
  ``--options nvjpeg_hw_decoder:force_batch_single=1``, nvImageCodec's per-image pipeline);
* ``rgb_nofancy``: the same without fancy upsampling (``:fancy_upsampling=0``);
* ``yuv``: planar YCbCr, nothing converted.

Per format, one table row: images the decoder refused (None), images/s alone, images/s
while bf16 8192^3 matmuls run on another stream (and their TFLOP/s beside the decoder), and,
from ``torch.profiler`` over one decode call, GPU kernels per image, the streams they ran on
and the most frequent kernel. ``--backend cpu`` runs the same table on the host's
libjpeg-turbo (no GPU columns; it refuses ``yuv`` for 4:2:0 images).

``--trace``: after the table, one decode call per format under ``torch.profiler`` while the
matmuls run in another thread: the device operations per image by kind (kernels, copies by
direction, memsets: a device-to-device copy or a memset may run on the SMs and wait behind the
GEMMs as a kernel does) and the CUDA runtime/driver calls, longest total first (a call that
waits for the device, such as ``cudaFree`` or a synchronisation, shows as a long total). On
the H200 the profiler gave every such call the same thread, so the same list follows for the
matmul load alone over as long a time (its launches and its stream synchronisation every four
matmuls): what the decode call adds is the difference.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

FORMATS = ("rgb", "rgb_nofancy", "yuv")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", required=True, help="brace spec of JPEG shards (img2dataset layout)")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--backend", default="hardware", choices=("hardware", "cuda", "cpu"))
    p.add_argument("--micro", type=int, default=1024, help="images per decode call")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--overlap-s", type=float, default=3.0)
    p.add_argument("--options", default="", help="more nvImageCodec decoder options for every format "
                   "(e.g. nvjpeg_hw_decoder:force_legacy_batch=1; data.decoder_options)")
    p.add_argument("--trace", action="store_true", help="device operations and CUDA API calls of one call beside matmuls")
    a = p.parse_args(argv)
    a.formats = a.formats.split(",")
    bad = [f for f in a.formats if f not in FORMATS]
    if bad:
        p.error(f"unknown format(s) {bad}; choose from {', '.join(FORMATS)}")
    if a.trace and a.backend == "cpu":
        p.error("--trace profiles GPU decoding beside matmuls: use it with --backend hardware or cuda")
    if a.backend != "cpu" and not torch.cuda.is_available():
        p.error(f"--backend {a.backend} needs a CUDA device; use --backend cpu here")
    return a


def make_decoder(nv, fmt: str, backend: str, options: str = ""):
    """(nvImageCodec decoder, decode params) for one of FORMATS, ``options`` added to its options."""
    kind = {"hardware": nv.BackendKind.HW_GPU_ONLY, "cuda": nv.BackendKind.GPU_ONLY, "cpu": nv.BackendKind.CPU_ONLY}
    dev = nv.NVIMGCODEC_DEVICE_CPU_ONLY if backend == "cpu" else torch.cuda.current_device()
    fancy = 0 if fmt == "rgb_nofancy" else 1
    dec = nv.Decoder(device_id=dev, backends=[nv.Backend(kind[backend])], options=f":fancy_upsampling={fancy} {options}".strip())
    if fmt == "yuv":
        params = nv.DecodeParams(color_spec=nv.ColorSpec.SYCC, sample_format=nv.SampleFormat.P_YUV,
                                 apply_exif_orientation=False)
    else:
        params = nv.DecodeParams(color_spec=nv.ColorSpec.SRGB, sample_format=nv.SampleFormat.I_RGB,
                                 apply_exif_orientation=False)
    return dec, params


def decode_fn(nv, dec, params, payloads: list, stream):
    """A closure decoding every payload once (waits for the result); returns refused count."""
    def run() -> int:
        streams = [nv.CodeStream(p) for p in payloads]
        if stream is None:
            out = dec.decode(streams, params=params)
        else:
            out = dec.decode(streams, params=params, cuda_stream=stream.cuda_stream)
            stream.synchronize()
        return sum(o is None for o in out)
    return run


def rate(run, n: int, repeats: int) -> float:
    """Images/s: median over ``repeats`` calls of ``run`` (``n`` images each)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return n / sorted(times)[len(times) // 2]


def beside_matmuls(run, n: int, seconds: float) -> tuple[float, float]:
    """(decoder images/s, matmul TFLOP/s) with both running for ``seconds``."""
    from bench_decode import matmul_load

    stop, done = threading.Event(), [0, 0.0]

    def loop():
        t0 = time.perf_counter()
        while not stop.is_set():
            run()
            done[0] += n
        done[1] = time.perf_counter() - t0

    th = threading.Thread(target=loop)
    th.start()
    tflops = matmul_load(seconds, torch.cuda.Stream())
    stop.set()
    th.join()
    return done[0] / done[1], tflops


def kernels(run, n: int) -> tuple[float, int, str]:
    """(GPU kernels per image, streams they ran on, most frequent kernel) of one call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    names = Counter(e.name for e in events if not e.name.startswith("Memcpy") and not e.name.startswith("Memset"))
    streams = {e.device_resource_id for e in events} - {None}  # a CUDA event's stream
    top = names.most_common(1)[0][0][:60] if names else "—"
    return sum(names.values()) / n, len(streams), top


def op_kind(name: str) -> str:
    """The kind of a device operation from its profiler name: ``kernel``, ``memset`` or
    ``copy <direction>`` (e.g. ``copy DtoD``; ``Memcpy HtoD (Pinned -> Device)`` -> ``copy HtoD``)."""
    if name.startswith("Memset"):
        return "memset"
    if name.startswith("Memcpy"):
        parts = name.split()
        return "copy " + (parts[1] if len(parts) > 1 else "?")
    return "kernel"


def api_totals(api_calls: list, top: int = 10) -> list[str]:
    """Lines of the CUDA runtime/driver calls ``api_calls`` ((name, microseconds) each), grouped
    by name, longest total first, ``top`` of them."""
    totals: dict = {}
    for name, us in api_calls:
        c = totals.setdefault(name, [0, 0.0])
        c[0] += 1
        c[1] += us
    return [f"    {name} x{count}, {us / 1e3:.1f} ms"
            for name, (count, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]]


def trace_summary(device_ops: list, api_calls: list, n: int, control_calls: list) -> list[str]:
    """Lines describing one profiled decode call of ``n`` images beside the matmul load:
    ``device_ops``, the names of the GPU operations of the decode call (the caller takes the
    matmul load's off, as counted alone over as long a time); ``api_calls`` / ``control_calls``: (name, microseconds) of the
    CUDA calls made meanwhile by every thread / by the matmul load alone over as long a time."""
    kinds = Counter(op_kind(o) for o in device_ops)
    return (["  device operations per image: " + (", ".join(f"{k} {v / n:.2f}" for k, v in sorted(kinds.items())) or "none"),
             "  CUDA calls meanwhile (every thread):"] + api_totals(api_calls)
            + ["  CUDA calls of the matmul load alone, as long:"] + api_totals(control_calls, top=4))


def _profiled(fn, seconds: float = 0.0) -> tuple[float, list, list]:
    """(wall seconds, device operation names, (name, us) CUDA calls) of ``fn()`` (then idling
    until ``seconds`` have passed) under ``torch.profiler``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        time.sleep(max(0.0, seconds - (time.perf_counter() - t0)))
        wall = time.perf_counter() - t0
    events = prof.events()
    device = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    api = [(e.name, e.cpu_time_total) for e in events
           if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cu")]
    return wall, device, api


def traced_beside_matmuls(run, n: int) -> list[str]:
    """``trace_summary`` of one ``run`` while bf16 matmuls run in another thread, and of the
    matmuls alone for as long."""
    from bench_decode import matmul_load

    stop, side = threading.Event(), torch.cuda.Stream()

    def load():
        while not stop.is_set():
            matmul_load(0.2, side)

    def with_load(fn, seconds: float = 0.0):
        stop.clear()
        th = threading.Thread(target=load)
        th.start()
        time.sleep(0.5)
        try:
            return _profiled(fn, seconds)
        finally:
            stop.set()
            th.join()

    wall, device, api = with_load(run)
    _, control_device, control = with_load(lambda: None, wall)
    # the decode call's own operations: those of the matmul load over as long a time taken off
    device = list((Counter(device) - Counter(control_device)).elements())
    return [f"  one call beside matmuls: {wall * 1e3:.1f} ms ({n / wall:,.0f} images/s)"] + \
        trace_summary(device, api, n, control)


def main(argv=None) -> None:
    from bench_decode import packed_rows
    from infclip.data.jpeg_backends import _nvimgcodec

    a = parse_args(argv)
    nv = _nvimgcodec()
    if nv is None:
        raise SystemExit("nvImageCodec is not installed: pip install -e '.[hwdecode]'")
    gpu = a.backend != "cpu"
    payloads = [p.tobytes() for p in packed_rows(a.shards, 224, a.micro, pin=gpu).payloads()]
    n = len(payloads)
    print(f"{n} JPEGs per call, mean {sum(map(len, payloads)) / n / 1024:.1f} KiB; backend {a.backend}"
          + (f"; options {a.options!r}" if a.options else ""), flush=True)
    rows = ["| format | refused | images/s alone | images/s beside matmuls | matmul TFLOP/s beside (alone) "
            "| kernels per image | streams | most frequent kernel |", "|---|---|---|---|---|---|---|---|"]
    alone_tflops = None
    for fmt in a.formats:
        dec, params = make_decoder(nv, fmt, a.backend, a.options)
        run = decode_fn(nv, dec, params, payloads, torch.cuda.Stream() if gpu else None)
        refused = run()  # warm-up (allocations, engine start)
        cells = [fmt, str(refused), f"{rate(run, n, a.repeats):,.0f}" if refused < n else "— (all refused)"]
        if gpu and refused < n:
            if alone_tflops is None:
                from bench_decode import matmul_load
                alone_tflops = matmul_load(a.overlap_s, torch.cuda.Stream())
            ips, tflops = beside_matmuls(run, n, a.overlap_s)
            per, streams, top = kernels(run, n)
            cells += [f"{ips:,.0f}", f"{tflops:.0f} ({alone_tflops:.0f})", f"{per:.2f}", str(streams), top]
        else:
            cells += ["—", "—", "—", "—", "—"]
        rows.append("| " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
        if a.trace and gpu and refused < n:
            print(f"{fmt}:\n" + "\n".join(traced_beside_matmuls(run, n)), flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
