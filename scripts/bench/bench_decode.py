"""Device JPEG decoders side by side: throughput, cost to the SMs, and pixel parity.

    python scripts/bench/bench_decode.py --shards '/data/photos256/{00000..00031}.tar' \
        [--backends hardware,cuda,nvjpeg] [--micro 1024] [--image-size 224] [--threads 2 --roi 0,1]

For each backend of ``data.device_decoder`` (infclip/data/jpeg_backends.py) it times
``JpegDecoder`` (decode + bicubic resized crop) on one micro-batch of packed rows from the
shards, as the trainer calls it, then again while a bf16 matmul loop (a stand-in for the
towers) runs on the compute stream; the matmul loop's slowdown is what decoding costs the
SMs. Pixel parity: levels of the decoder's output against the CPU training transform on the
same crop boxes (max, mean, share of values more than one level off). Prints one table.
"""

from __future__ import annotations

import argparse
import io
import threading
import time

import numpy as np
import torch
from PIL import Image

from infclip.data.config import DataConfig
from infclip.data.jpeg import JpegDecoder, JpegPacker, PackedJpegs, unpack_header
from infclip.data.pipeline import build_train_data
from infclip.kernels.resize import resized_crop, resized_crop_reference


def packed_rows(spec: str, size: int, micro: int, pin: bool = True) -> PackedJpegs:
    """One loader batch of packed rows (pinned unless ``pin`` is off), as data.decode=device
    workers ship them."""
    import open_clip

    cfg = DataConfig(kind="wds", workers=4, loader_batch=micro, shuffle_buffer=0, resampled=True)
    data = build_train_data(cfg, transform=JpegPacker(size), tokenizer=open_clip.get_tokenizer("ViT-B-32"),
                            rank=0, world_size=1, seed=0, shards=spec, num_samples=10**9)
    it = data.batches()
    rows = next(it)[0]
    it.close()
    if not pin:
        return PackedJpegs(rows.index, rows.data)
    return PackedJpegs(rows.index.pin_memory(), rows.data.pin_memory())


def cpu_reference(rows: torch.Tensor, size: int, n: int) -> torch.Tensor:
    """The CPU path's uint8 pixels of the first ``n`` rows under the packed crop boxes."""
    from torchvision.transforms.functional import InterpolationMode, resized_crop

    head = unpack_header(rows).tolist()
    payloads = rows.payloads()
    refs = []
    for k in range(n):
        data = payloads[k].tobytes()
        img = Image.open(io.BytesIO(data)).convert("RGB")
        top, left, h, w = head[k][1:5]
        out = resized_crop(img, top, left, h, w, [size, size], InterpolationMode.BICUBIC)
        refs.append(torch.from_numpy(np.array(out)).permute(2, 0, 1))
    return torch.stack(refs).float()


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` (synchronized)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def matmul_load(seconds: float, stream=None) -> float:
    """TFLOP/s of back-to-back 8192^3 bf16 matmuls for ``seconds`` on ``stream`` (the towers'
    stand-in; None: the current stream, every SM; a green-context stream: its SMs only)."""
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(4):
                a @ a
            torch.cuda.current_stream().synchronize()  # this stream only: a device-wide sync would wait for the decoder
            n += 4
        return 2 * 8192**3 * n / (time.perf_counter() - t0) / 1e12


def overlap(dec: JpegDecoder, rows: torch.Tensor, seconds: float, stream=None) -> tuple[float, float]:
    """(matmul TFLOP/s while the decoder runs in a thread, decoder images/s meanwhile)."""
    stop, count = threading.Event(), [0, 0.0]

    def loop():
        t0 = time.perf_counter()
        while not stop.is_set():
            dec._decode_on_stream(lambda: rows)
            count[0] += rows.shape[0]
        torch.cuda.synchronize()
        count[1] = time.perf_counter() - t0

    th = threading.Thread(target=loop)
    th.start()
    tflops = matmul_load(seconds, stream)
    stop.set()
    th.join()
    return tflops, count[0] / count[1]


def host_phases(dec: JpegDecoder, rows: PackedJpegs, repeats: int) -> str:
    """Host seconds per micro-batch of each phase of a decode (median; thread CPU time in
    brackets: what holds the GIL unless the library releases it)."""
    from infclip.data.jpeg_backends import _nvimgcodec

    nv = _nvimgcodec()
    phases: dict[str, list] = {}

    def tick(name, fn):
        t0, c0 = time.perf_counter(), time.thread_time()
        r = fn()
        phases.setdefault(name, []).append((time.perf_counter() - t0, time.thread_time() - c0))
        return r

    for _ in range(repeats):
        datas = tick("payloads", rows.payloads)
        if nv is not None and dec.backend.name == "hardware":
            tick("CodeStream x n", lambda: [nv.CodeStream(d) for d in datas])
        images = tick("backend.decode", lambda: dec.backend.decode(datas, dec._stream))
        with torch.cuda.stream(dec._stream):
            tick("resize launch", lambda: resized_crop(images, rows.index[:, 1:5], dec.size))
            tick("reference resize of 256", lambda: resized_crop_reference(
                [torch.as_tensor(im) for im in images[:256]], rows.index[:256, 1:5], dec.size))
        tick("stream sync", dec._stream.synchronize)
    cells = []
    for name, v in phases.items():
        wall = sorted(x[0] for x in v)[len(v) // 2] * 1e3
        cpu = sorted(x[1] for x in v)[len(v) // 2] * 1e3
        cells.append(f"{name} {wall:.1f} ms [{cpu:.1f}]")
    return ", ".join(cells)


def gil_share(dec: JpegDecoder, rows: PackedJpegs, seconds: float = 1.5) -> float:
    """Pure-Python loop iterations/s of the main thread while the decoder decodes in a thread,
    against the same loop alone: 1.0 when decoding holds the GIL never, ~0.5 when it holds it
    as much as it can (what a training thread sharing the process would get)."""
    def spin(stop):
        n, t0 = 0, time.perf_counter()
        while not stop():
            n += 1
        return n / (time.perf_counter() - t0)

    t_end = time.perf_counter() + seconds
    alone = spin(lambda: time.perf_counter() > t_end)
    done = threading.Event()
    th = threading.Thread(target=lambda: [dec._decode_on_stream(lambda: rows) for _ in range(1000) if not done.is_set()])
    th.start()
    t_end = time.perf_counter() + seconds
    beside = spin(lambda: time.perf_counter() > t_end)
    done.set()
    th.join()
    return beside / alone


def bench_one(a, rows: PackedJpegs, ref: torch.Tensor, alone: float, name: str, threads: int,
              roi: bool = False, part=None) -> str:
    """One table row: decoder ``name`` with ``threads`` decoder instances (``roi``: only each
    crop box decoded, ``data.decode_roi``); the matmuls on ``part``'s stream (towers' SMs)."""
    tag = "all" if part is None or part.stream is None else str(part.tower_sms)
    try:
        dec = JpegDecoder(a.image_size, device="cuda", backend=name, decode_threads=threads, roi=roi)
    except RuntimeError as e:
        return f"| {name} | {tag} | unavailable: {e} | | | | |"
    if roi and not dec.roi:
        return f"| {name} ROI | {tag} | the {dec.backend.name} decoder decodes whole images only | | | | |"
    out = dec(rows)  # warm-up (handles, kernels)
    levels = ((out[:a.parity_n] - dec.normalizer.shift) / dec.normalizer.scale).round().cpu()
    d = (levels - ref).abs()
    rate = a.micro / timed(lambda: dec(rows), a.repeats)
    datas = rows.payloads()
    regions = [h[1:5] for h in unpack_header(rows).tolist()] if dec.roi else None
    engine_only = a.micro / timed(lambda: dec.backend.decode(datas, dec._stream, regions), a.repeats)
    print(f"  host phases per micro-batch ({name}, {threads}): {host_phases(dec, rows, a.repeats)}", flush=True)
    share = gil_share(dec, rows)
    tflops, beside = overlap(dec, rows, a.overlap_s, None if part is None else part.stream)
    return (f"| {dec.backend.name} x{threads}{' ROI' if dec.roi else ''} | {tag} | {rate:,.0f} ({engine_only:,.0f}) | {beside:,.0f} | {tflops:.0f} ({alone:.0f}) "
            f"| {share:.2f} | {d.max():.0f} / {d.mean():.3f}, {100 * (d > 1).float().mean():.2f} % |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", required=True, help="brace spec of JPEG shards (img2dataset layout)")
    p.add_argument("--backends", default="hardware,cuda,nvjpeg")
    p.add_argument("--micro", type=int, default=1024)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--overlap-s", type=float, default=4.0)
    p.add_argument("--parity-n", type=int, default=128)
    p.add_argument("--threads", default="1,2", help="data.decode_threads values (nvImageCodec backends)")
    p.add_argument("--roi", default="0", help="data.decode_roi values to run: 0, 1 or 0,1 (nvImageCodec backends)")
    p.add_argument("--reserve-sms", default="0", help="SMs kept free of the matmuls (data.decode_reserved_sms): "
                   "0 (matmuls on every SM) and/or counts, e.g. 0,4,12")
    a = p.parse_args()
    rows = packed_rows(a.shards, a.image_size, a.micro)
    head = unpack_header(rows)
    kib = head[:, 0].float().mean().item() / 1024
    print(f"{a.micro} rows, mean JPEG {kib:.1f} KiB, mean stored size "
          f"{head[:, 6].float().mean():.0f}x{head[:, 5].float().mean():.0f}", flush=True)
    ref = cpu_reference(rows, a.image_size, a.parity_n)
    from infclip.train.sm_partition import tower_stream

    table = ["| decoder x decoder instances | matmul SMs | images/s alone (decode only, no resize) | images/s beside matmuls "
             "| matmul TFLOP/s beside (alone) | Python thread's rate beside the decoder | parity vs CPU: max / mean levels, > 1 level |",
             "|---|---|---|---|---|---|---|"]
    for reserve in [int(r) for r in a.reserve_sms.split(",")]:
        part = tower_stream("cuda", reserve)
        print(f"reserve {reserve}: {part.describe()}", flush=True)
        alone = matmul_load(a.overlap_s, part.stream)
        print(f"matmul alone: {alone:.0f} TFLOP/s", flush=True)
        for name in a.backends.split(","):
            nv = name in ("hardware", "cuda")
            for threads in [int(t) for t in a.threads.split(",")] if nv else [1]:
                for roi in [bool(int(r)) for r in a.roi.split(",")] if nv else [False]:
                    row = bench_one(a, rows, ref, alone, name, threads, roi, part)
                    table.append(row)
                    print(row, flush=True)
    print("\n".join(table))


if __name__ == "__main__":
    main()
