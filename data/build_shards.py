"""Build img2dataset-layout webdataset shards from local images.

    # a table of image paths + captions (.csv, .tsv or .parquet)
    python data/build_shards.py captions.csv --out /data/mine --image-col filepath --caption-col caption
    # a folder of images with sidecar captions (a/001.jpg + a/001.txt)
    python data/build_shards.py /data/images --out /data/mine --resize 256 --workers 8

    # hold out 500 pairs as a retrieval eval set (OUT/holdout: images/ + test.json)
    python data/build_shards.py /data/images --out /data/mine --holdout 500

Output: 00000.tar ... ({key}.jpg/.txt/.json), {shard}_stats.json, sizes.json, build_stats.json;
train on it with  train.py data.kind=wds "data.shards='/data/mine/{00000..000NN}.tar'" (the
script prints the command, with the held-out set as the run's eval task when there is one).
"""

from __future__ import annotations

import argparse
import os
import sys

from infclip.data.build import BuildOptions, build_shards, rows_from, split_holdout, summarize, write_holdout


def train_hint(out: str, shards: int, holdout: str | None = None) -> str:
    """The command that trains on the shards, safe to paste into a shell: double quotes for
    the shell (which would expand the braces), single quotes for Hydra (which rejects them bare).
    With a held-out folder, it is the run's eval task (retrieval, flat layout)."""
    spec = f"{out}/{{00000..{shards - 1:05d}}}.tar" if shards > 1 else f"{out}/00000.tar"
    hint = f"python train.py data.kind=wds \"data.shards='{spec}'\""
    if holdout:
        hint += f" \"eval.tasks=[{{name: holdout, kind: retrieval, format: flat, root: '{holdout}'}}]\""
    return hint


def check_args(a: argparse.Namespace) -> str | None:
    """What is wrong with the numeric arguments, or None."""
    for name, lo in (("shard_size", 1), ("workers", 1), ("max_image_mb", 1e-9), ("holdout", 0)):
        if getattr(a, name) < lo:
            return f"--{name.replace('_', '-')} {getattr(a, name)}: must be {'> 0' if lo else '>= 0'}"
    for name in ("max_shard_mb", "resize"):
        if getattr(a, name) is not None and getattr(a, name) <= 0:
            return f"--{name.replace('_', '-')} {getattr(a, name)}: must be > 0 (or left out)"
    if not 1 <= a.quality <= 100:
        return f"--quality {a.quality}: must be in 1..100"
    return None


def fail(message: str) -> None:
    """One paragraph on stderr, exit status 2 (bad input: no traceback)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="a .csv/.tsv/.parquet table or an image folder with sidecar .txt captions")
    p.add_argument("--out", required=True, help="output folder for the shards")
    p.add_argument("--image-col", default="filepath", help="table column with image paths")
    p.add_argument("--caption-col", default="caption", help="table column with captions")
    p.add_argument("--image-root", default=None, help="resolve relative image paths here (default: table's folder)")
    p.add_argument("--shard-size", type=int, default=10_000, help="samples per shard")
    p.add_argument("--max-shard-mb", type=float, default=None, help="also cut shards at this size")
    p.add_argument("--resize", type=int, default=None, help="re-encode as JPEG, shorter side to this many px")
    p.add_argument("--quality", type=int, default=95, help="JPEG quality when re-encoding")
    p.add_argument("--no-verify", action="store_true", help="do not decode images (faster, trusts the input)")
    p.add_argument("--workers", type=int, default=1, help="processes reading / re-encoding images")
    p.add_argument("--max-image-mb", type=float, default=64,
                   help="skip (and count) image files larger than this; bounds each worker's memory")
    p.add_argument("--holdout", type=int, default=0,
                   help="image-caption pairs kept out of the shards and written to OUT/holdout as a retrieval eval set")
    p.add_argument("--seed", type=int, default=0, help="which rows --holdout takes")
    p.add_argument("--follow-links", action="store_true",
                   help="pack the targets of symbolic links that point outside the input folder (default: skip them)")
    a = p.parse_args(argv)
    problem = check_args(a)
    if problem:
        fail(problem)
    opts = BuildOptions(out_dir=a.out, shard_size=a.shard_size,
                        max_shard_bytes=int(a.max_shard_mb * 2**20) if a.max_shard_mb else None,
                        resize=a.resize, quality=a.quality, verify=not a.no_verify, workers=a.workers,
                        max_image_bytes=int(a.max_image_mb * 2**20))
    try:
        rows = rows_from(a.input, a.image_col, a.caption_col, a.image_root, a.follow_links)
    except (OSError, KeyError, ImportError, ValueError, UnicodeDecodeError) as e:
        fail(e.args[0] if isinstance(e, KeyError) else str(e))
    holdout = None
    if a.holdout:
        try:
            rows, held = split_holdout(rows, a.holdout, a.seed)
        except ValueError as e:
            fail(str(e))
        holdout = os.path.join(a.out, "holdout")
        os.makedirs(a.out, exist_ok=True)
        print(summarize(write_holdout(held, opts, holdout), holdout).replace(" in 0 shards", "").replace(
            "wrote", "held out"))
    report = build_shards(rows, opts)
    print(summarize(report, a.out))
    n = report.shards
    if n:
        print(f"train with: {train_hint(a.out, n, holdout)}")


if __name__ == "__main__":
    main()
