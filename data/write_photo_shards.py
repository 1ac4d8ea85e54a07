"""Write benchmark shards (img2dataset layout) derived from real photographs.

    # the photos bundled in scikit-image + scikit-learn
    python data/write_photo_shards.py --out /data/photos256 --num-samples 300000 --side 256 --workers 16
    # a machine without them: export the photos once, copy the folder, generate there
    python data/write_photo_shards.py --export-photos /tmp/photo_src
    python data/write_photo_shards.py --photos /tmp/photo_src --out /data/photos512 --side 512 ...

Each sample is a random crop / flip / colour change of one photo, resized so its shorter side
is --side, saved as a baseline JPEG at a quality drawn from [--quality-min, --quality-max];
deterministic for --seed (the shards do not depend on --workers). Writes NNNNN.tar,
NNNNN_stats.json, sizes.json and photo_stats.json (mean kB per image, decode rate). The writer
is scripts/bench/photos.py; this is its command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from infclip.data.writer import ShardStats

# The writer itself sits beside the benchmarks that read its shards (scripts/bench/photos.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))
from photos import (BUNDLES, PhotoShardOptions, decode_rate, export_photos, load_photos,  # noqa: E402
                    shard_jpegs, summary, write_photo_shards, write_stats)

DECODE_SAMPLE = 300  # images of the output timed for the decode rate


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="output folder for the shards")
    p.add_argument("--photos", default=None, help="folder of .jpg/.png source photos (default: bundled)")
    p.add_argument("--bundles", default=",".join(BUNDLES), help="bundled sources: skimage,sklearn")
    p.add_argument("--export-photos", default=None, help="save the source photos as PNG here")
    p.add_argument("--num-samples", type=int, default=10_000)
    p.add_argument("--shard-size", type=int, default=10_000, help="samples per shard")
    p.add_argument("--side", type=int, default=256, help="stored shorter side in pixels")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1, help="processes, each writing whole shards")
    p.add_argument("--quality-min", type=int, default=85)
    p.add_argument("--quality-max", type=int, default=95)
    a = p.parse_args(argv)
    if not a.out and not a.export_photos:
        p.error("give --out (write shards) and/or --export-photos (save the source photos)")
    photos = load_photos(a.photos, [b for b in a.bundles.split(",") if b])
    if a.export_photos:
        paths = export_photos(photos, a.export_photos)
        print(f"exported {len(paths)} photos to {a.export_photos}")
    if not a.out:
        return
    opts = PhotoShardOptions(out_dir=a.out, num_samples=a.num_samples, shard_size=a.shard_size,
                             side=a.side, seed=a.seed, workers=a.workers,
                             quality_min=a.quality_min, quality_max=a.quality_max)
    report = write_photo_shards(photos, opts)
    stats = write_stats(opts, report, photos, decode_rate(shard_jpegs(a.out, DECODE_SAMPLE)))
    print(summary(stats))
    print(f"shards          : {ShardStats(report.sizes).brace_spec(a.out)}")


if __name__ == "__main__":
    main()
