"""Shard lists: brace expansion, existence checks, sample counting and robust tar reading.

Shard specs are webdataset URL strings: brace-expanded (``/data/laion/{00000..41407}.tar``),
``::``-joined lists, local paths, or ``pipe:`` commands (``pipe:aws s3 cp s3://b/{0..9}.tar -``).
Counting follows img2dataset: a ``sizes.json`` (``{"00000.tar": n}``) beside the shards wins,
else each shard's ``{stem}_stats.json`` ``successes`` field.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import tarfile
from collections import Counter
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

from webdataset.gopen import gopen
from webdataset.shardlists import expand_urls

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")


class DataError(ValueError):
    """The data configuration cannot work; the message names the key and the fix."""


class MissingShardsError(DataError, FileNotFoundError):
    """Configured local shards do not exist."""


@dataclass
class Source:
    """One expanded shard source."""

    urls: list[str]
    weight: float = 1.0
    num_samples: Optional[int] = None  # configured or counted; None when unknown
    counted_from: str = "unknown"  # where num_samples came from: a config key, sizes.json, *_stats.json


def folder_spec(spec: str) -> str:
    """A local folder given as a shard spec (the folder ``data/build_shards.py`` wrote) as the
    ``::``-list of its ``*.tar`` files in name order; any other spec unchanged. A folder
    without shards stays as it was (the existence check then names it)."""
    path = spec.strip()
    path = path[len("file://"):] if path.startswith("file://") else path
    if "{" in path or "::" in path or not is_local(path) or not os.path.isdir(path):
        return spec
    tars = sorted(n for n in os.listdir(path) if n.endswith(".tar"))
    return "::".join(os.path.join(path, n) for n in tars) if tars else spec


def expand(spec: str) -> list[str]:
    """Expand a brace/``::`` shard spec into a list of URLs (empty spec -> error)."""
    if not spec or not spec.strip():
        raise ValueError("empty shard spec; set data.shards=/path/{00000..00099}.tar")
    return list(expand_urls(spec.strip()))


def is_local(url: str) -> bool:
    return not url.startswith("pipe:") and ("://" not in url or url.startswith("file://"))


def _local_path(url: str) -> str:
    return url[len("file://"):] if url.startswith("file://") else url


def check_exist(urls: Sequence[str], show: int = 5) -> None:
    """Raise MissingShardsError (a FileNotFoundError) listing the first missing local shards
    (remote URLs are not checked)."""
    missing = [u for u in urls if is_local(u) and not os.path.exists(_local_path(u))]
    if missing:
        first = "\n  ".join(missing[:show])
        raise MissingShardsError(
            f"{len(missing)} of {len(urls)} local shards do not exist; first missing:\n  {first}\n"
            "Fix data.shards (brace range, folder) or remove the missing shards from it.")
    odd = [u for u in urls if is_local(u) and not _regular(_local_path(u))]
    if odd:
        more = f"; {len(odd)} such shards" if len(odd) > 1 else ""
        raise DataError(f"shard {odd[0]} is not a regular file (a FIFO, device or socket{more}): "
                        "reading it could block for ever. Remove it from data.shards, or stream it with "
                        "data.shards='pipe:cat <path>'")


def _regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


_COUNT_FIX = ("rewrite it ({\"00000.tar\": <samples>, ...}, as data/build_shards.py writes it), delete it "
              "to count from *_stats.json, or set data.num_samples")


def _load_count_file(path: str) -> object:
    """The parsed JSON of a counting file; DataError (naming it and the fix) when unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path} cannot be read as JSON ({e}); {_COUNT_FIX}") from None


def _count(value: object, path: str, what: str) -> int:
    """A sample count: a non-negative integer (bools and floats are not counts)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DataError(f"{path}: {what} is {value!r}, not a sample count (an integer >= 0); {_COUNT_FIX}")
    return value


def _sizes(folder: str, sizes_cache: dict[str, Optional[dict]]) -> Optional[dict]:
    """The folder's sizes.json ({shard name: count}, every count checked), None if absent."""
    if folder not in sizes_cache:
        path = os.path.join(folder, "sizes.json")
        sizes = _load_count_file(path) if os.path.exists(path) else None
        if sizes is not None:
            if not isinstance(sizes, dict):
                raise DataError(f"{path} holds a {type(sizes).__name__}, not a {{shard name: count}} object; "
                                f"{_COUNT_FIX}")
            sizes = {str(k): _count(v, path, f"the count of {k!r}") for k, v in sizes.items()}
        sizes_cache[folder] = sizes
    return sizes_cache[folder]


def _shard_count(url: str, sizes_cache: dict[str, Optional[dict]]) -> tuple[Optional[int], str]:
    path = _local_path(url)
    folder, name = os.path.split(path)
    sizes = _sizes(folder, sizes_cache)
    if sizes is not None and name in sizes:
        return sizes[name], "sizes.json"
    stats = os.path.join(folder, os.path.splitext(name)[0] + "_stats.json")
    if os.path.exists(stats):
        data = _load_count_file(stats)
        if not isinstance(data, dict) or "successes" not in data:
            raise DataError(f"{stats} has no \"successes\" count (img2dataset's stats format); {_COUNT_FIX}")
        return _count(data["successes"], stats, '"successes"'), "*_stats.json"
    return None, "unknown"


def count_samples_from(urls: Sequence[str]) -> tuple[Optional[int], str]:
    """(total samples, the files counted: "sizes.json", "*_stats.json" or both joined), or
    (None, "unknown") if any shard is not covered (or remote). Raises DataError for a malformed
    file, a count that is not an integer >= 0, or a total of 0 (the run would wait for a first
    batch that never comes)."""
    cache: dict[str, Optional[dict]] = {}
    total, origins = 0, set()
    for url in urls:
        n, origin = _shard_count(url, cache) if is_local(url) else (None, "unknown")
        if n is None:
            return None, "unknown"
        total += n
        origins.add(origin)
    if urls and total == 0:
        folder = os.path.dirname(_local_path(urls[0])) or "."
        raise DataError(f"the counting files beside the shards (sizes.json / *_stats.json in {folder}) say the "
                        f"{len(urls)} shards hold 0 samples; {_COUNT_FIX}")
    return total, " and ".join(sorted(origins, reverse=True))


def count_samples(urls: Sequence[str]) -> Optional[int]:
    """Total samples from sizes.json / *_stats.json, or None if any shard is not covered
    (DataError as ``count_samples_from``)."""
    return count_samples_from(urls)[0]


# -- reading ----------------------------------------------------------------------------------

RawSample = dict  # {"__key__": str, "__url__": str, "<ext>": bytes, ...}


def split_name(name: str) -> tuple[str, str]:
    """``dir/abc.x.JPG`` -> (``dir/abc``, ``x.jpg``): webdataset's split, the key ends at the
    basename's first dot (extension lower-cased; "" when there is no dot)."""
    folder, base = os.path.split(name)
    stem, dot, ext = base.partition(".")
    return os.path.join(folder, stem) if folder else stem, ext.lower() if dot else ""


def _grouped(tar: tarfile.TarFile, url: str) -> Iterator[RawSample]:
    current: Optional[RawSample] = None
    for info in tar:
        if not info.isreg() or os.path.basename(info.name).startswith(("__", "._")):
            continue
        key, ext = split_name(info.name)
        if current is None or current["__key__"] != key:
            if current is not None:
                yield current  # complete before the next member is read: a cut loses only its sample
            current = {"__key__": key, "__url__": url}
        current[ext] = tar.extractfile(info).read()  # raises on a member cut short
        tar.members = []  # stream mode: do not keep every TarInfo
    _check_end_marker(tar)  # before the last sample: a cut header may have lost its other files
    if current is not None:
        yield current


def _check_end_marker(tar: tarfile.TarFile) -> None:
    """Raise ``tarfile.ReadError`` unless the archive ended with its end-of-archive block.

    tarfile stops silently at a header cut short (or a file cut exactly between members), as
    if the archive had ended there; the last sample would then lose its remaining files (and
    count as, say, ``missing_caption``). Complete archives end with a 512-byte zero block,
    which tarfile has read in full when it stops: its stream position is 512 past the offset
    of that block. (Stream mode only; other modes are left alone.)
    """
    pos = getattr(tar.fileobj, "pos", None)
    if tar.mode == "r" and pos is not None and pos - tar.offset < tarfile.BLOCKSIZE:
        raise tarfile.ReadError(f"archive cut short at byte {pos} (no end-of-archive block)")


PIPE_WAIT_S = 60.0  # after its stream ended, how long a pipe: command may take to exit
PIPE_DRAIN_BYTES = 1 << 20  # read after the end-of-archive block: a tar's zero padding (tar pads to 10 KiB records)


def _open(url: str) -> tuple:
    """(binary stream, the pipe: command's process or None). A ``pipe:`` command is read to its
    end before its exit status is looked at (webdataset's Pipe polls it after every read, so a
    command that exits non-zero right after writing lost its last samples, or not, by timing)."""
    if url.startswith("pipe:"):
        proc = subprocess.Popen(url[len("pipe:"):], shell=True, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        return proc.stdout, proc
    return gopen(url, "rb"), None


def _close(stream, proc, read_to_end: bool) -> bool:
    """Closes a shard's stream; False when its pipe: command failed (a non-zero exit after the
    stream was read to its end). A stream left early (the reader stopped) ends its command.

    tarfile stops at the end-of-archive block, before the archive's zero padding; a pipe:
    command still writing that padding would die of SIGPIPE when the stream closes and look
    failed. So a pipe read to its end is drained first (up to ``PIPE_DRAIN_BYTES``); a command
    that writes more than that after its archive is ended without counting a failure."""
    if proc is not None and read_to_end and not _drained(stream):
        read_to_end = False
    try:
        stream.close()
    except Exception:  # a gopen stream of another kind that reports a failure here
        return False
    if proc is None:
        return True
    if not read_to_end:
        proc.kill()
        proc.wait()
        return True
    try:
        return proc.wait(timeout=PIPE_WAIT_S) == 0
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False


def _drained(stream) -> bool:
    """Reads ``stream`` to its end, discarding; False when more than ``PIPE_DRAIN_BYTES`` remain
    (or the read fails)."""
    left = PIPE_DRAIN_BYTES
    try:
        while left > 0:
            chunk = stream.read(min(left, 1 << 16))
            if not chunk:
                return True
            left -= len(chunk)
        return not stream.read(1)
    except (OSError, ValueError):
        return False


def iter_samples(url: str, counts: Counter) -> Iterator[RawSample]:
    """Samples of one shard, grouped by key; never raises for bad data.

    A shard that cannot be opened or read at all counts ``unreadable_shard``; one that breaks
    after some samples (inside a member or a header, or without its end-of-archive block)
    counts ``truncated_tar`` (the sample being read when it broke is lost with it); a valid
    archive without a sample counts ``empty_shard``; a ``pipe:`` command that exits non-zero
    after a clean read counts ``pipe_error``.
    """
    yielded, failed, finished = 0, False, False
    try:
        stream, proc = _open(url)
    except Exception:
        counts["unreadable_shard"] += 1
        return
    try:
        with tarfile.open(fileobj=stream, mode="r|*") as tar:
            for sample in _grouped(tar, url):
                yielded += 1
                yield sample
    except (tarfile.TarError, OSError, EOFError, ValueError):
        failed = True
        counts["truncated_tar" if yielded else "unreadable_shard"] += 1
    else:
        finished = True
        if not yielded:
            counts["empty_shard"] += 1
    finally:
        if not _close(stream, proc, finished or failed) and not failed:
            counts["pipe_error"] += 1
