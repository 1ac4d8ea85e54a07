"""Data pipeline throughput: samples/s of decode + RandomResizedCrop + tokenize with N workers.

    python scripts/bench/bench_data.py --workers 0,1,2                 # this machine
    python scripts/bench/bench_data.py --workers 4,8,16 --images 8192  # a 16-core GPU host
    python scripts/bench/bench_data.py --workers 14 --side 128,256,512 --decode cpu,device --gpu-decode

``--decode device`` times the loader of ``data.decode=device`` (workers parse the JPEG header,
draw the crop and pack the bytes; infclip/data/jpeg.py); ``--gpu-decode`` adds the trainer-side
cost: images/s of ``JpegDecoder`` (nvJPEG decode + bicubic resized crop + normalize) on
micro-batches of ``--micro`` rows on the GPU, i.e. what each of the gradient cache's two
passes spends per image.

Writes local shards of ``--side``-px JPEGs (photo-like: smooth colour fields, a shape and grain,
~20 KB each, like img2dataset's 256-px LAION output) unless ``--root`` already holds them, then
runs the real training pipeline (infclip.data.build_train_data with open_clip's tokenizer and
the uint8 train transform at ``--image-size``) and prints a table. Resampled mode, so no epoch
boundary (worker restart) falls inside the timed window.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import time

import torch
from PIL import Image, ImageDraw

from infclip.data.config import DataConfig
from infclip.data.pipeline import build_train_data
from infclip.data.transforms import train_transform
from infclip.data.writer import ShardWriter


def photo_like(rng: random.Random, side: int) -> bytes:
    """A JPEG with smooth colour variation, an object and sensor-like grain."""
    small = Image.frombytes("RGB", (6, 6), bytes(rng.randrange(256) for _ in range(108)))
    img = small.resize((side, side), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(img)
    x, y, r = rng.uniform(0.2, 0.8) * side, rng.uniform(0.2, 0.8) * side, rng.uniform(0.1, 0.3) * side
    draw.ellipse([x - r, y - r, x + r, y + r], fill=tuple(rng.randrange(256) for _ in range(3)))
    grain = Image.effect_noise((side, side), 24).convert("RGB")
    img = Image.blend(img, grain, 0.15)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def write_bench_shards(root: str, n: int, side: int, shards: int) -> str:
    rng = random.Random(0)
    words = ["a", "photo", "of", "the", "red", "dog", "on", "beach", "city", "night", "old", "house"]
    with ShardWriter(root, max_samples=max(1, -(-n // shards))) as w:
        for i in range(n):
            caption = " ".join(rng.choice(words) for _ in range(rng.randint(5, 20)))
            w.write(f"{i:09d}", photo_like(rng, side), caption, {"width": side, "height": side})
    last = w.stats.num_shards - 1
    return os.path.join(root, f"{{00000..{last:05d}}}.tar")


def stage_costs(spec_root: str, image_size: int, tokenizer, n: int = 100) -> dict[str, float]:
    """Single-thread ms/sample of decode, augment (RRC + uint8) and tokenize."""
    import tarfile

    tar = tarfile.open(os.path.join(spec_root, "00000.tar"))
    jpgs = [tar.extractfile(m).read() for m in tar.getmembers() if m.name.endswith(".jpg")][:n]
    transform = train_transform(image_size)
    t0 = time.perf_counter()
    imgs = [Image.open(io.BytesIO(b)).convert("RGB") for b in jpgs]
    t1 = time.perf_counter()
    for img in imgs:
        transform(img)
    t2 = time.perf_counter()
    tokenizer(["a photo of the red dog on the beach at night"] * len(jpgs))
    t3 = time.perf_counter()
    k = 1000.0 / len(jpgs)
    return {"decode": (t1 - t0) * k, "augment": (t2 - t1) * k, "tokenize": (t3 - t2) * k}


def loader_transform(decode: str, image_size: int):
    if decode == "device":
        from infclip.data.jpeg import JpegPacker

        return JpegPacker(image_size)
    return train_transform(image_size)


def measure(spec: str, workers: int, batch: int, batches: int, image_size: int, tokenizer,
            decode: str = "cpu") -> float:
    cfg = DataConfig(kind="wds", workers=workers, loader_batch=batch, shuffle_buffer=1000, resampled=True)
    data = build_train_data(cfg, transform=loader_transform(decode, image_size), tokenizer=tokenizer, rank=0,
                            world_size=1, seed=0, shards=spec, num_samples=10**9)
    it = data.batches()
    for _ in range(max(2 * workers, 2)):  # start-up: fork workers, open shards, fill buffers
        next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        images, tokens = next(it)
    dt = time.perf_counter() - t0
    assert images.dtype == torch.uint8 and tokens.dtype == torch.int64
    it.close()
    return batches * batch / dt


def gpu_decode_rate(spec: str, image_size: int, micro: int, tokenizer, repeats: int = 5) -> tuple[float, float]:
    """(images/s of JpegDecoder on ``micro`` packed rows, mean packed JPEG KiB) on the GPU."""
    from infclip.data.jpeg import JpegDecoder, unpack_header

    cfg = DataConfig(kind="wds", workers=2, loader_batch=micro, shuffle_buffer=0, resampled=True)
    data = build_train_data(cfg, transform=loader_transform("device", image_size), tokenizer=tokenizer,
                            rank=0, world_size=1, seed=0, shards=spec, num_samples=10**9)
    it = data.batches()
    rows = next(it)[0]
    it.close()
    dec = JpegDecoder(image_size, device="cuda")
    dec(rows)  # warm-up (nvJPEG handles, cuBLAS)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = dec(rows)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    assert out.shape == (micro, 3, image_size, image_size) and dec.failures == 0
    kib = unpack_header(rows)[:, 0].float().mean().item() / 1024
    return micro / sorted(times)[len(times) // 2], kib


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="/tmp/infclip-bench-shards", help="shard folder (written if empty)")
    p.add_argument("--images", type=int, default=2048)
    p.add_argument("--side", default="256", help="stored JPEG side(s), comma-separated (one shard folder each)")
    p.add_argument("--decode", default="cpu", help="comma-separated: cpu (workers decode) and/or device (workers pack)")
    p.add_argument("--gpu-decode", action="store_true", help="also time JpegDecoder on the GPU")
    p.add_argument("--micro", type=int, default=1024, help="rows per JpegDecoder call (--gpu-decode)")
    p.add_argument("--image-size", type=int, default=224, help="model input side (RandomResizedCrop)")
    p.add_argument("--workers", default="0,1,2", help="comma-separated worker counts")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--batches", type=int, default=20, help="timed batches per setting")
    p.add_argument("--tokenizer", default="ViT-B-32", help="open_clip model name whose tokenizer to use")
    a = p.parse_args()
    import open_clip

    tokenizer = open_clip.get_tokenizer(a.tokenizer)
    counts = [int(w) for w in a.workers.split(",")]
    print(f"cpu cores: {os.cpu_count()}, torch threads: {torch.get_num_threads()}")
    table = ["| stored side | KiB/sample | decode | workers | batch | image size | loader samples/s |",
             "|---|---|---|---|---|---|---|"]
    gpu = ["| stored side | packed KiB | micro-batch | JpegDecoder images/s (GPU) |", "|---|---|---|---|"]
    for side in [int(x) for x in a.side.split(",")]:
        root = a.root if "," not in a.side else f"{a.root}-{side}"
        spec, kib = ensure_root(root, a.images, side, max(32, 2 * max(counts)))
        costs = stage_costs(root, a.image_size, tokenizer)
        print(f"{side}-px single-thread ms/sample: " + ", ".join(f"{k} {v:.2f}" for k, v in costs.items()))
        for decode in a.decode.split(","):
            for w in counts:
                rate = measure(spec, w, a.batch, a.batches, a.image_size, tokenizer, decode)
                table.append(f"| {side} | {kib:.1f} | {decode} | {w} | {a.batch} | {a.image_size} | {rate:,.0f} |")
                print(table[-1], flush=True)
        if a.gpu_decode:
            rate, packed = gpu_decode_rate(spec, a.image_size, a.micro, tokenizer)
            gpu.append(f"| {side} | {packed:.1f} | {a.micro} | {rate:,.0f} |")
            print(gpu[-1], flush=True)
    print("\n" + "\n".join(table))
    if a.gpu_decode:
        print("\n" + "\n".join(gpu))


def ensure_root(root: str, images: int, side: int, shards: int) -> tuple[str, float]:
    """(brace spec of the shards in ``root``, mean KiB per sample); written if absent."""
    if not os.path.exists(os.path.join(root, "sizes.json")):
        t0 = time.time()
        write_bench_shards(root, images, side, shards)
        print(f"wrote {images} {side}-px JPEGs to {root} in {time.time() - t0:.1f}s", flush=True)
    tars = [f for f in os.listdir(root) if f.endswith(".tar")]
    size = sum(os.path.getsize(os.path.join(root, f)) for f in tars)
    return os.path.join(root, f"{{00000..{len(tars) - 1:05d}}}.tar"), size / images / 1024


if __name__ == "__main__":
    main()
