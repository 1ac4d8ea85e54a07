"""Build img2dataset-layout shards from local images: a CSV/TSV/parquet table or a folder.

Inputs:
* a table with an image-path column and a caption column (paths relative to the table's
  folder unless ``image_root`` is given); ``.csv``, ``.tsv`` or ``.parquet``;
* a folder of images with sidecar captions (``cat/001.jpg`` + ``cat/001.txt``).

Images are copied byte for byte (jpg/png/webp), or re-encoded as JPEG with the shorter side
resized to ``resize`` pixels. Failures (missing file, undecodable image, empty caption) are
skipped and counted, never fatal; ``build_stats.json`` records them next to ``sizes.json``.

Invariant of a folder scan: every file is written, or counted under a skip reason, or is a
``.txt`` caption. Hidden names (``.DS_Store``, ``..jpg``, macOS's ``._x.jpg``) count as
``hidden_file``, other types (``.gif``, ``notes.md``) as ``unknown_extension``, a caption
that is not UTF-8 as ``caption_not_utf8``, one that cannot be read as
``caption_unreadable`` (no permission), ``caption_not_regular_file`` (a folder named
``x.txt``, a FIFO), ``caption_missing`` (a dangling link) or ``caption_too_large``.

Only regular files are read (symlinks resolved), never more than a cap: a FIFO, socket or
device (``/dev/zero`` behind a link) counts as ``not_regular_file`` without a blocking open
or an unbounded read; an image above ``max_image_bytes`` as ``image_too_large``.
"""

from __future__ import annotations

import csv
import io
import json
import os
import random
import shutil
import stat
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing import Pool
from typing import Callable, Iterator, Optional, Union

from PIL import Image

from infclip.data.shards import IMAGE_EXTS
from infclip.data.writer import ShardWriter


@dataclass
class BuildOptions:
    out_dir: str
    shard_size: int = 10_000  # samples per shard
    max_shard_bytes: Optional[int] = None  # also cut a shard at this many payload bytes
    resize: Optional[int] = None  # re-encode: shorter side to this many pixels (None: copy bytes)
    quality: int = 95  # JPEG quality when re-encoding
    verify: bool = True  # decode every image once (catches corrupt files before training does)
    workers: int = 1  # processes reading/re-encoding images
    max_image_bytes: int = 64 * 2**20  # larger image files are skipped (no photo needs more; bounds memory)


@dataclass(frozen=True)
class Skip:
    """The caption field of a row that is no sample: it is counted under ``reason``."""
    reason: str


Caption = Union[str, Skip]  # a row's caption field


MAX_CAPTION_BYTES = 2**20  # a sidecar caption above this is skipped (captions are a few hundred bytes)


class Unreadable(Exception):
    """A file that ``read_regular`` refused; ``reason`` is its skip reason."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class BuildReport:
    written: int = 0
    skipped: Counter = field(default_factory=Counter)
    shards: int = 0
    seconds: float = 0.0


# -- inputs -----------------------------------------------------------------------------------


def read_table(path: str, image_col: str, caption_col: str,
               image_root: Optional[str] = None) -> list[tuple[str, str]]:
    """(image path, caption) rows of a CSV/TSV/parquet table."""
    root = image_root or os.path.dirname(os.path.abspath(path))
    if path.endswith(".parquet"):
        rows = _parquet_rows(path, image_col, caption_col)
    else:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f, delimiter="\t" if path.endswith((".tsv", ".tab")) else ",")
            missing = {image_col, caption_col} - set(reader.fieldnames or [])
            if missing:
                raise KeyError(f"{path} has no column(s) {sorted(missing)}; columns: {reader.fieldnames}. "
                               "Pass --image-col/--caption-col")
            rows = [(r[image_col], r[caption_col]) for r in reader]
    return [(p if os.path.isabs(p) else os.path.join(root, p), c or "") for p, c in rows]


def _parquet_rows(path: str, image_col: str, caption_col: str) -> list[tuple[str, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("reading parquet needs pyarrow or pandas: pip install pyarrow") from None
        df = pd.read_parquet(path, columns=[image_col, caption_col])
        return list(zip(df[image_col].astype(str), df[caption_col].fillna("").astype(str)))
    table = pq.read_table(path, columns=[image_col, caption_col]).to_pydict()
    return list(zip(map(str, table[image_col]), (c or "" for c in table[caption_col])))


def scan_folder(folder: str, follow_links: bool = False) -> list[tuple[str, Caption]]:
    """(path, caption) for every file but ``.txt`` captions: an image's caption is its sidecar
    ``.txt`` (none: ""), a file that is no sample has a ``Skip`` (counted, never dropped). A
    symbolic link (image or caption) whose target lies outside ``folder`` is skipped and
    counted unless ``follow_links``: the shards hold only what the input folder holds."""
    root = os.path.realpath(folder)
    inside = (lambda path: True) if follow_links else (lambda path: _within(path, root))
    rows: list[tuple[str, Caption]] = []
    for parent, dirs, names in os.walk(folder):
        dirs.sort()
        for name in sorted(names):
            if not name.endswith(".txt"):
                path = os.path.join(parent, name)
                caption = _folder_caption(parent, name, inside) if inside(path) else Skip("link_outside_input")
                rows.append((path, caption))
    return rows


def _within(path: str, root: str) -> bool:
    """Whether ``path`` (links followed) lies inside the real folder ``root``."""
    real = os.path.realpath(path)
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def _folder_caption(parent: str, name: str, inside: Callable[[str], bool] = lambda path: True) -> Caption:
    """The sidecar caption of ``parent/name``, or why that file is not a sample."""
    if name.startswith("."):  # hidden: .DS_Store, ..jpg, ._x.jpg (AppleDouble, not an image)
        return Skip("hidden_file")
    stem, ext = os.path.splitext(name)
    if ext.lower().lstrip(".") not in IMAGE_EXTS:
        return Skip("unknown_extension")
    side = os.path.join(parent, stem + ".txt")
    if os.path.lexists(side) and not inside(side):
        return Skip("caption_link_outside_input")
    return read_caption(side) if os.path.lexists(side) else ""


def read_caption(path: str) -> Caption:
    """The UTF-8 text of a sidecar caption, or a ``Skip`` saying why it cannot be used."""
    try:
        data = read_regular(path, MAX_CAPTION_BYTES)
    except Unreadable as e:
        return Skip(f"caption_{e.reason}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return Skip("caption_not_utf8")


def read_regular(path: str, max_bytes: int) -> bytes:
    """The bytes of the regular file at ``path`` (links resolved); raises ``Unreadable``.

    Never blocks and never reads without bound: ``os.stat`` refuses anything but a regular
    file before it is opened (a FIFO's open would block, a device's may act); the open is
    non-blocking and re-checked with ``fstat`` (the path may be swapped in between); at most
    ``max_bytes + 1`` bytes are read (a file may grow). Reasons: ``missing``,
    ``unreadable`` (no permission, a link loop), ``not_regular_file``, ``too_large``.
    """
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise Unreadable("not_regular_file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise Unreadable("missing") from None
    except OSError:
        raise Unreadable("unreadable") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unreadable("not_regular_file")
        if st.st_size > max_bytes:
            raise Unreadable("too_large")
        try:
            data = f.read(max_bytes + 1)
        except OSError:
            raise Unreadable("unreadable") from None
    if len(data) > max_bytes:
        raise Unreadable("too_large")
    return data


# -- per image --------------------------------------------------------------------------------


def load_image(item: tuple[str, Caption, BuildOptions]) -> tuple[str, Optional[bytes], str, dict]:
    """(status, payload, ext, meta) for one (path, caption); status "ok" or a skip reason."""
    path, caption, opts = item
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    ext = "jpg" if ext == "jpeg" else ext
    if isinstance(caption, Skip):
        return caption.reason, None, ext, {}
    if not caption.strip():
        return "empty_caption", None, ext, {}
    if ext not in IMAGE_EXTS:
        return "unknown_extension", None, ext, {}
    try:
        data = read_regular(path, opts.max_image_bytes)
    except Unreadable as e:
        return f"{e.reason}_image" if e.reason in ("missing", "unreadable") else f"image_{e.reason}", None, ext, {}
    if not (opts.verify or opts.resize):
        return "ok", data, ext, {}
    try:
        with Image.open(io.BytesIO(data)) as img:
            img = img.convert("RGB")
    except Exception:
        return "corrupt_image", None, ext, {}
    meta = {"original_width": img.width, "original_height": img.height}
    if opts.resize:
        data, img = _reencode(img, opts.resize, opts.quality)
        ext = "jpg"
    meta.update(width=img.width, height=img.height)
    return "ok", data, ext, meta


def _reencode(img: Image.Image, side: int, quality: int) -> tuple[bytes, Image.Image]:
    scale = side / min(img.size)
    if scale < 1:
        img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))),
                         Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return buf.getvalue(), img


# -- driver -----------------------------------------------------------------------------------


def _loaded(rows: list[tuple[str, Caption]], opts: BuildOptions) -> Iterator[tuple[tuple[str, str], tuple]]:
    items = [(p, c, opts) for p, c in rows]
    if opts.workers <= 1:
        for row, item in zip(rows, items):
            yield row, load_image(item)
        return
    with Pool(opts.workers) as pool:  # imap keeps the input order: output is deterministic
        yield from zip(rows, pool.imap(load_image, items, chunksize=16))


def build_shards(rows: list[tuple[str, Caption]], opts: BuildOptions, progress: bool = True) -> BuildReport:
    """Write ``rows`` as shards into ``opts.out_dir``; returns what was written and skipped."""
    from tqdm import tqdm

    report, t0 = BuildReport(), time.time()
    with ShardWriter(opts.out_dir, max_samples=opts.shard_size, max_bytes=opts.max_shard_bytes) as writer:
        bar = tqdm(_loaded(rows, opts), total=len(rows), disable=not progress, unit="img", desc="shards")
        for (path, caption), (status, data, ext, meta) in bar:
            if status != "ok":
                report.skipped[status] += 1
            else:
                writer.write(f"{report.written:09d}", data, caption.strip(), {"url": path, **meta}, ext=ext)
                report.written += 1
            # the bar counts rows read; the postfix what was written and skipped (its last
            # render, when the loop ends, shows the final numbers)
            bar.set_postfix(written=report.written, skipped=sum(report.skipped.values()), refresh=False)
    report.shards, report.seconds = writer.stats.num_shards, time.time() - t0
    _write_report(opts.out_dir, report, len(rows))
    return report


def split_holdout(rows: list[tuple[str, Caption]], n: int, seed: int = 0) -> tuple[list, list]:
    """(train rows, held-out rows): ``n`` rows drawn without replacement by a seeded
    permutation; both keep the input order. Invariant: disjoint, and together all rows."""
    if n < 0 or n >= len(rows):
        raise ValueError(f"--holdout {n}: must be >= 0 and less than the {len(rows)} input rows")
    held = set(random.Random(seed).sample(range(len(rows)), n))
    return ([r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held])


def table_columns(path: str, cols: list[str]) -> list[dict[str, str]]:
    """The values of ``cols`` in every row of a CSV/TSV/parquet table, in the order of
    ``read_table``'s rows; a missing column is a KeyError naming the table's columns."""
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq

            names = pq.read_schema(path).names
        except ImportError:
            raise ImportError("reading parquet needs pyarrow: pip install pyarrow") from None
        if set(cols) - set(names):
            raise KeyError(f"{path} has no column(s) {sorted(set(cols) - set(names))}; columns: {names}")
        table = pq.read_table(path, columns=cols).to_pydict()
        return [{c: "" if table[c][i] is None else str(table[c][i]) for c in cols} for i in range(len(table[cols[0]]))]
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter="\t" if path.endswith((".tsv", ".tab")) else ",")
        missing = set(cols) - set(reader.fieldnames or [])
        if missing:
            raise KeyError(f"{path} has no column(s) {sorted(missing)}; columns: {reader.fieldnames}")
        return [{c: (r[c] or "").strip() for c in cols} for r in reader]


def held_indices(count: int, n: int = 0, seed: int = 0, splits: Optional[list[str]] = None,
                 eval_splits: tuple[str, ...] = ()) -> set[int]:
    """The rows kept out of the shards: those whose split value is one of ``eval_splits``
    (``splits``: one value per row), else ``n`` rows drawn as ``split_holdout`` draws them."""
    if splits is not None:
        return {i for i, v in enumerate(splits) if v.strip().lower() in eval_splits}
    if n < 0 or n >= count:
        raise ValueError(f"--holdout {n}: must be >= 0 and less than the {count} input rows")
    return set(random.Random(seed).sample(range(count), n))


def class_folder_name(label: str) -> str:
    """A class label as one path component (``/`` and leading dots replaced)."""
    name = label.strip().replace(os.sep, "_").replace("/", "_").lstrip(".")
    return name or "_"


def write_class_folders(holdout_dir: str, labels: dict[str, str], out_dir: str) -> dict[str, int]:
    """The held-out images of ``holdout_dir`` (the flat retrieval folder; its test.json keeps
    each image's source path) also as an image-folder tree ``out_dir/<class>/<file>``, a
    zero-shot eval set (``format: imagefolder``; ``python -m infclip.eval.wds_export`` makes
    clip_benchmark's layout of it). ``labels``: source path -> class label. Returns images
    per class; an image without a label is left out."""
    entries = json.load(open(os.path.join(holdout_dir, "test.json")))
    per_class: Counter = Counter()
    for entry in entries:
        label = labels.get(entry.get("url", ""), "").strip()
        if not label:
            continue
        folder = os.path.join(out_dir, class_folder_name(label))
        os.makedirs(folder, exist_ok=True)
        shutil.copyfile(os.path.join(holdout_dir, entry["image"]), os.path.join(folder, os.path.basename(entry["image"])))
        per_class[label] += 1
    return dict(per_class)


def write_holdout(rows: list[tuple[str, Caption]], opts: BuildOptions, out_dir: str) -> BuildReport:
    """Held-out image-caption pairs as a retrieval folder in the ``flat`` layout
    (docs/eval.md): ``out_dir/images/<key>.<ext>`` and ``out_dir/test.json`` =
    ``[{"image": "images/<key>.<ext>", "caption": [caption]}, ...]``. Images go through the
    shards' own checks and re-encoding; skipped rows are counted like the shards'. The JSON is
    written last, atomically: a folder without it is no eval set."""
    report, t0 = BuildReport(), time.time()
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    entries = []
    for (path, caption), (status, data, ext, _) in _loaded(rows, opts):
        if status != "ok":
            report.skipped[status] += 1
            continue
        name = f"images/{report.written:09d}.{ext}"
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(data)
        entries.append({"image": name, "caption": [caption.strip()], "url": path})
        report.written += 1
    tmp = os.path.join(out_dir, "test.json.tmp")
    with open(tmp, "w") as f:
        json.dump(entries, f, indent=0)
    os.replace(tmp, os.path.join(out_dir, "test.json"))
    report.seconds = time.time() - t0
    return report


def _write_report(out_dir: str, report: BuildReport, total: int) -> None:
    summary = {"input_rows": total, "written": report.written, "skipped": dict(report.skipped),
               "shards": report.shards, "seconds": round(report.seconds, 2)}
    with open(os.path.join(out_dir, "build_stats.json"), "w") as f:
        json.dump(summary, f, indent=1, sort_keys=True)


def rows_from(source: str, image_col: str = "filepath", caption_col: str = "caption",
              image_root: Optional[str] = None, follow_links: bool = False) -> list[tuple[str, Caption]]:
    """Rows from a table file or an image folder (``follow_links``: see :func:`scan_folder`)."""
    if os.path.isdir(source):
        return scan_folder(source, follow_links)
    if not os.path.exists(source):
        raise FileNotFoundError(f"input {source!r} does not exist (expected a .csv/.tsv/.parquet or a folder)")
    return read_table(source, image_col, caption_col, image_root)


def summarize(report: BuildReport, out_dir: str) -> str:
    """One line: what was written, and every skipped sample by reason."""
    skipped = ", ".join(f"{k}={v}" for k, v in sorted(report.skipped.items())) or "none"
    return (f"wrote {report.written} samples in {report.shards} shards to {out_dir} "
            f"({report.seconds:.1f}s); skipped: {skipped}")
