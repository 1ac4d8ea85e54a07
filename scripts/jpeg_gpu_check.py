"""data.decode=device on a GPU: nvJPEG + resize against the CPU decoder and the CPU transform.

    python scripts/jpeg_gpu_check.py [--n 256]

Packs ``--n`` photo-like JPEGs of mixed sizes (colour and greyscale, 96-640 px) as a loader
worker would, decodes them with ``JpegDecoder`` on the GPU twice (the gradient cache's two
passes must see the same pixels) and on the CPU, and compares both with the CPU training
transform's output under the same crop. Prints max/mean differences in 8-bit levels.
"""

from __future__ import annotations

import argparse
import io
import random
import sys
from pathlib import Path

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_data import photo_like  # noqa: E402

from infclip.data.jpeg import JpegDecoder, JpegPacker, PackedJpegs  # noqa: E402
from infclip.data.transforms import train_transform  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--size", type=int, default=224)
    a = p.parse_args()
    rng = random.Random(0)
    packer, transform = JpegPacker(a.size), train_transform(a.size)
    rows, refs = [], []
    for i in range(a.n):
        data = photo_like(rng, rng.choice([96, 256, 333, 512, 640]))
        if i % 7 == 0:  # greyscale JPEGs: nvJPEG must expand them to RGB
            buf = io.BytesIO()
            Image.open(io.BytesIO(data)).convert("L").save(buf, format="JPEG", quality=90)
            data = buf.getvalue()
        torch.manual_seed(i)
        rows.append(packer(data))
        torch.manual_seed(i)
        refs.append(transform(Image.open(io.BytesIO(data)).convert("RGB")))
    rows, refs = PackedJpegs.collate(rows), torch.stack(refs).float()
    gpu, cpu = JpegDecoder(a.size, device="cuda"), JpegDecoder(a.size, device="cpu")

    def levels(dec, out):
        return ((out - dec.normalizer.shift) / dec.normalizer.scale).round().cpu()

    first = gpu(rows)
    with torch.autocast("cuda", dtype=torch.bfloat16):  # pass 1 runs under autocast, pass 2 not
        second = gpu(rows)
    # Allocator hazard check: decode while the compute stream has queued work on memory that
    # is freed and re-allocated meanwhile; the queued results must stay right.
    w = torch.randn(8192, 8192, device="cuda")
    ref = (w @ w).sum().item()
    bad = 0
    for _ in range(5):
        acc = []
        for _ in range(16):
            x = w @ w  # queued; freed below while kernels may still run
            acc.append(x.sum())
            del x
        gpu(rows)
        bad += sum(abs(v.item() - ref) > 1e-3 * abs(ref) for v in acc)
    print(f"compute results corrupted while decoding: {bad} of 80")
    g, c = levels(gpu, first), levels(cpu, cpu(rows))
    print(f"GPU decode twice (plain, under bf16 autocast) identical: {torch.equal(first, second)}; "
          f"failures: {gpu.failures}")
    for name, x, y in (("GPU vs CPU decoder", g, c), ("GPU vs CPU transform", g, refs),
                       ("CPU decoder vs CPU transform", c, refs)):
        d = (x - y).abs()
        print(f"{name}: max {d.max().item():.0f} levels, mean {d.mean().item():.3f}, "
              f"> 2 levels {100 * (d > 2).float().mean().item():.3f} % of values")


if __name__ == "__main__":
    main()
