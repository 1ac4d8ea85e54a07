"""Build img2dataset-layout webdataset shards from local images.

    # a table of image paths + captions (.csv, .tsv or .parquet)
    python data/build_shards.py captions.csv --out /data/mine --image-col filepath --caption-col caption
    # a folder of images with sidecar captions (a/001.jpg + a/001.txt)
    python data/build_shards.py /data/images --out /data/mine --resize 256 --workers 8

    # hold out 500 pairs as a retrieval eval set (OUT/holdout: images/ + test.json)
    python data/build_shards.py /data/images --out /data/mine --holdout 500
    # a labelled table with a split column: val rows held out, also as a zero-shot set by label
    python data/build_shards.py labels.csv --out /data/mine --split-col split --label-col label

Output: 00000.tar ... ({key}.jpg/.txt/.json), {shard}_stats.json, sizes.json, build_stats.json;
train on it with  train.py data.kind=wds "data.shards='/data/mine/{00000..000NN}.tar'" name=mine (the
script prints the command, with the held-out set as the run's eval task when there is one; for a
held-out set, --use eval or a name such as val.csv, it prints an eval-task snippet instead).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys

from infclip.data.build import (BuildOptions, build_shards, held_indices, rows_from, summarize, table_columns,
                                write_class_folders, write_holdout)


def _spec(out: str, shards: int) -> str:
    out = out.rstrip("/") or "/"
    return f"{out}/{{00000..{shards - 1:05d}}}.tar" if shards > 1 else f"{out}/00000.tar"


def run_name(out: str) -> str:
    """The run's name: the output folder's own name (``/data/mine/`` -> ``mine``)."""
    return os.path.basename(os.path.normpath(out)) or "mine"


def train_hint(out: str, shards: int, holdout: str | None = None, classes: str | None = None) -> str:
    """The command that trains on the shards, safe to paste into a shell: double quotes for
    the shell (which would expand the braces), single quotes for Hydra (which rejects them bare).
    The run is named after the output folder (``name=``), so it never resumes another run's
    folder (the quick start's ``runs/quickstart``). With a held-out folder, it is the run's eval
    task (retrieval, flat layout)."""
    hint = f"python train.py data.kind=wds \"data.shards='{_spec(out, shards)}'\" {shlex.quote('name=' + run_name(out))}"
    tasks = [f"{{name: holdout, kind: retrieval, format: flat, root: '{holdout}'}}"] if holdout else []
    if classes:
        tasks.append(f"{{name: holdout_classes, kind: zeroshot, format: imagefolder, root: '{classes}'}}")
    if tasks:
        hint += f" \"eval.tasks=[{', '.join(tasks)}]\""
    return hint


def eval_hint(out: str, shards: int, samples: int) -> str:
    """A held-out set in the training format as an eval task (open_clip's --val-data: the
    contrastive loss over batches of ``batch`` samples and retrieval recall over all of them),
    for a training command or ``python -m infclip.eval``."""
    batch = min(256, samples)
    return (f"\"eval.tasks=[{{name: {run_name(out)}, kind: contrastive, root: '{_spec(out, shards)}', "
            f"batch: {batch}}}]\"")


_HELD_OUT = re.compile(r"(^|[^a-z])(val|valid|validation|test|holdout|heldout|held_out|eval)([^a-z]|$)")


def held_out_name(*paths: str) -> str | None:
    """The word in an input or output name that marks a held-out split (``val.csv``,
    ``/data/mine_test``), or None."""
    for path in paths:
        m = _HELD_OUT.search(os.path.basename(os.path.normpath(path)).lower())
        if m:
            return m.group(2)
    return None


def next_steps(a: argparse.Namespace, shards: int, samples: int, holdout: str | None,
               classes: str | None = None) -> list[str]:
    """What to do with the shards: the training command, or for a held-out set (``--use eval``,
    or ``--use auto`` and a name such as val.csv) the eval-task snippet first."""
    use = a.use
    word = held_out_name(a.input, a.out) if use == "auto" else None
    if use == "eval" or word:
        why = f" (its name says {word!r}; --use train prints the training command)" if word else ""
        return [f"a held-out set{why}: evaluate on it by adding this eval task to a training command or to "
                f"python -m infclip.eval checkpoint=<run>:",
                f"  {eval_hint(a.out, shards, samples)}",
                f"(to train on it instead: {train_hint(a.out, shards, holdout, classes)})"]
    steps = [f"train with: {train_hint(a.out, shards, holdout, classes)}"]
    if classes:
        steps.append(f"for clip_benchmark: python -m infclip.eval.wds_export {classes} --out {classes}_wds")
    return steps


def fail(message: str) -> None:
    """One paragraph on stderr and exit status 2: the problem and its fix, no traceback."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


# (option, its value must be, the test) for the numeric options
_LIMITS = (("--shard-size", "a whole number > 0", lambda a: a.shard_size > 0),
           ("--max-shard-mb", "> 0 (or left out)", lambda a: a.max_shard_mb is None or a.max_shard_mb > 0),
           ("--resize", "> 0 pixels (or left out)", lambda a: a.resize is None or a.resize > 0),
           ("--quality", "in 1..100", lambda a: 1 <= a.quality <= 100),
           ("--workers", ">= 1", lambda a: a.workers >= 1),
           ("--max-image-mb", "> 0", lambda a: a.max_image_mb > 0),
           ("--holdout", ">= 0", lambda a: a.holdout >= 0))


def bad_arguments(a: argparse.Namespace) -> str | None:
    """The first impossible option value, named with what it must be; None when all fit."""
    for option, want, ok in _LIMITS:
        if not ok(a):
            return f"{option} {getattr(a, option[2:].replace('-', '_'))} is not valid: it must be {want}"
    if not os.path.exists(a.input):
        return (f"input {a.input!r} does not exist: give a .csv/.tsv/.parquet table of image paths and captions, "
                "or a folder of images with sidecar .txt captions")
    if (a.split_col or a.label_col) and os.path.isdir(a.input):
        return "--split-col and --label-col read columns of a table: give a .csv/.tsv/.parquet input"
    if a.split_col and a.holdout:
        return "--split-col and --holdout both choose the held-out rows: give one of them"
    if a.label_col and not (a.split_col or a.holdout):
        return ("--label-col labels the held-out rows as a zero-shot set: choose them with --split-col COL "
                "or --holdout N")
    if os.path.isfile(a.out):
        return f"--out {a.out!r} is a file: give a folder for the shards (created if missing)"
    return None


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
    p.add_argument("--split-col", default=None,
                   help="table column naming each row's split: rows whose split is one of --eval-splits are held "
                        "out (instead of --holdout's random draw), the others become the shards")
    p.add_argument("--eval-splits", default="val,valid,validation,test,holdout",
                   help="--split-col values that are held out (comma-separated, case-insensitive)")
    p.add_argument("--label-col", default=None,
                   help="table column with each image's class label: the held-out rows also become a zero-shot "
                        "eval set, OUT/holdout_classes/<label>/ (an image folder; wds_export makes clip_benchmark's "
                        "layout of it)")
    p.add_argument("--use", choices=("auto", "train", "eval"), default="auto",
                   help="what the shards are for, which sets the command printed at the end: train (the training "
                        "command), eval (an eval-task snippet for a held-out set), auto (eval when the input or "
                        "output name says val/test/holdout, else train)")
    p.add_argument("--follow-links", action="store_true",
                   help="pack the targets of symbolic links that point outside the input folder (default: skip them)")
    a = p.parse_args(argv)
    problem = bad_arguments(a)
    if problem:
        fail(problem)
    opts = BuildOptions(out_dir=a.out, shard_size=a.shard_size,
                        max_shard_bytes=int(a.max_shard_mb * 2**20) if a.max_shard_mb else None,
                        resize=a.resize, quality=a.quality, verify=not a.no_verify, workers=a.workers,
                        max_image_bytes=int(a.max_image_mb * 2**20))
    try:
        rows = rows_from(a.input, a.image_col, a.caption_col, a.image_root, a.follow_links)
    except (OSError, KeyError, ImportError, ValueError, UnicodeDecodeError) as e:  # the input itself
        fail(e.args[0] if isinstance(e, KeyError) else str(e).strip("'\""))
    rows, held, labels = split_rows(a, rows)
    holdout = classes = None
    if held:
        holdout = os.path.join(a.out, "holdout")
        os.makedirs(a.out, exist_ok=True)
        print(summarize(write_holdout(held, opts, holdout), holdout).replace(" in 0 shards", "").replace(
            "wrote", "held out"))
    if held and labels:
        classes = os.path.join(a.out, "holdout_classes")
        per_class = write_class_folders(holdout, labels, classes)
        print(f"held out {sum(per_class.values())} labelled images of {len(per_class)} classes as a zero-shot set "
              f"in {classes} (class folders)")
    report = build_shards(rows, opts)
    print(summarize(report, a.out))
    if report.shards:
        print("\n".join(next_steps(a, report.shards, report.written, holdout, classes)))


def split_rows(a: argparse.Namespace, rows: list) -> tuple[list, list, dict[str, str]]:
    """(training rows, held-out rows, held-out image path -> class label): held out by
    --split-col (the rows whose split is one of --eval-splits) or --holdout N (a seeded
    draw); labels from --label-col for the held-out rows (empty without it)."""
    cols = [c for c in (a.split_col, a.label_col) if c]
    if not cols and not a.holdout:
        return rows, [], {}
    try:
        values = table_columns(a.input, cols) if cols else None
        splits = [v[a.split_col] for v in values] if a.split_col else None
        held = held_indices(len(rows), a.holdout, a.seed, splits, tuple(a.eval_splits.split(",")))
    except (KeyError, ValueError, ImportError) as e:
        fail(str(e).strip("'\"") + (". Pass --split-col/--label-col" if isinstance(e, KeyError) else ""))
    if not held or len(held) == len(rows):
        fail(f"--split-col {a.split_col}: {len(held)} of {len(rows)} rows have a split in --eval-splits "
             f"{a.eval_splits}; the shards and the held-out set both need rows (values seen: "
             f"{sorted(set(splits))[:10]})")
    labels = {rows[i][0]: values[i][a.label_col] for i in held} if a.label_col else {}
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held], labels


if __name__ == "__main__":
    main()
