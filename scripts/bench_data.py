"""Data pipeline throughput: samples/s of decode + RandomResizedCrop + tokenize with N workers.

    python scripts/bench_data.py --workers 0,1,2                 # this machine
    python scripts/bench_data.py --workers 4,8,16 --images 8192  # a 16-core GPU host

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


def measure(spec: str, workers: int, batch: int, batches: int, image_size: int, tokenizer) -> float:
    cfg = DataConfig(kind="wds", workers=workers, loader_batch=batch, shuffle_buffer=1000, resampled=True)
    data = build_train_data(cfg, transform=train_transform(image_size), tokenizer=tokenizer, rank=0,
                            world_size=1, seed=0, shards=spec, num_samples=10**9)
    it = data.batches()
    for _ in range(max(2 * workers, 2)):  # start-up: fork workers, open shards, fill buffers
        next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        images, tokens = next(it)
    dt = time.perf_counter() - t0
    assert images.dtype == torch.uint8 and images.shape[-1] == image_size and tokens.dtype == torch.int64
    return batches * batch / dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="/tmp/infclip-bench-shards", help="shard folder (written if empty)")
    p.add_argument("--images", type=int, default=2048)
    p.add_argument("--side", type=int, default=256, help="stored JPEG side")
    p.add_argument("--image-size", type=int, default=224, help="model input side (RandomResizedCrop)")
    p.add_argument("--workers", default="0,1,2", help="comma-separated worker counts")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--batches", type=int, default=20, help="timed batches per setting")
    p.add_argument("--tokenizer", default="ViT-B-32", help="open_clip model name whose tokenizer to use")
    a = p.parse_args()
    import open_clip

    tokenizer = open_clip.get_tokenizer(a.tokenizer)
    counts = [int(w) for w in a.workers.split(",")]
    if not os.path.exists(os.path.join(a.root, "sizes.json")):
        t0 = time.time()
        write_bench_shards(a.root, a.images, a.side, max(32, 2 * max(counts)))
        print(f"wrote {a.images} {a.side}-px JPEGs to {a.root} in {time.time() - t0:.1f}s")
    nshards = len([f for f in os.listdir(a.root) if f.endswith(".tar")])
    spec = os.path.join(a.root, f"{{00000..{nshards - 1:05d}}}.tar")
    size = sum(os.path.getsize(os.path.join(a.root, f)) for f in os.listdir(a.root) if f.endswith(".tar"))
    print(f"cpu cores: {os.cpu_count()}, torch threads: {torch.get_num_threads()}, "
          f"mean shard bytes/sample: {size / a.images / 1024:.1f} KiB")
    costs = stage_costs(a.root, a.image_size, tokenizer)
    print("single-thread ms/sample: " + ", ".join(f"{k} {v:.2f}" for k, v in costs.items()))
    print(f"\n| workers | batch | image size | samples/s |\n|---|---|---|---|")
    for w in counts:
        rate = measure(spec, w, a.batch, a.batches, a.image_size, tokenizer)
        print(f"| {w} | {a.batch} | {a.image_size} | {rate:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
