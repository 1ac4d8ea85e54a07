"""Shard writer for the img2dataset layout.

Output folder::

    00000.tar            {key}.jpg  {key}.txt  {key}.json   (one triple per sample)
    00000_stats.json     {"count": n, "successes": n, "failed_to_download": 0, ...}
    00001.tar ...
    sizes.json           {"00000.tar": n, "00001.tar": m, ...}

This is what img2dataset produces (plus parquet files we do not write), so the training
pipeline counts samples the same way for downloaded and generated data. The tars are written
like ``webdataset.TarWriter`` (the same bytes: :class:`TarWriter` mirrors it with ``tarfile``,
so this module needs no webdataset) with a fixed mtime/owner, so the bytes of a shard depend
only on what was written (determinism); this module adds the numbering, limits and statistics.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from dataclasses import dataclass, field
from typing import Any, Optional

SHARD_DIGITS = 5


@dataclass
class ShardStats:
    """What the writer produced: shard file names and samples per shard."""

    sizes: dict[str, int] = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return sum(self.sizes.values())

    @property
    def num_shards(self) -> int:
        return len(self.sizes)

    def brace_spec(self, out_dir: str) -> str:
        """Brace-expanded shard spec covering every written shard, e.g. ``dir/{00000..00015}.tar``."""
        if not self.sizes:
            raise ValueError(f"no shards were written to {out_dir}")
        first, last = 0, self.num_shards - 1
        if first == last:
            return os.path.join(out_dir, f"{first:0{SHARD_DIGITS}d}.tar")
        return os.path.join(out_dir, f"{{{first:0{SHARD_DIGITS}d}..{last:0{SHARD_DIGITS}d}}}.tar")


def write_sizes(out_dir: str, sizes: dict[str, int]) -> None:
    """Write ``sizes.json`` (``{"00000.tar": n, ...}``), the file sample counting reads first."""
    with open(os.path.join(out_dir, "sizes.json"), "w") as f:
        json.dump(sizes, f, indent=1, sort_keys=True)


class TarWriter:
    """``webdataset.TarWriter(path, encoder=False)``'s output with ``tarfile`` alone: each
    ``write({"__key__": k, ext: bytes, ...})`` adds members ``k.ext`` in sorted ``ext`` order
    (img2dataset's order: jpg, json, txt), each with the given owner, mode and mtime."""

    def __init__(self, path: str, user: str, group: str, mode: int, mtime: float):
        self.user, self.group, self.mode, self.mtime = user, group, mode, mtime
        self._file = open(path, "wb")
        self._tar = tarfile.open(fileobj=self._file, mode="w|")

    def write(self, sample: dict[str, Any]) -> None:
        key = sample["__key__"]
        for ext in sorted(k for k in sample if not k.startswith("_")):
            data = sample[ext]
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise ValueError(f"{key}.{ext} must be bytes, got {type(data).__name__}")
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mtime, info.mode = len(data), self.mtime, self.mode
            info.uname, info.gname = self.user, self.group
            self._tar.addfile(info, io.BytesIO(data))

    def close(self) -> None:
        self._tar.close()
        self._file.close()


def tar_writer(path: str) -> TarWriter:
    """A tar writer of raw bytes with a fixed mtime, owner and mode, so a tar's bytes depend
    only on the samples written."""
    return TarWriter(path, user="infclip", group="infclip", mode=0o644, mtime=0)


class ShardWriter:
    """Write samples into numbered tar shards with a per-shard sample and byte limit.

    Use as a context manager; ``close()`` finishes the last shard and writes ``sizes.json``
    (unless ``write_sizes=False``: writers in parallel processes, each owning some shards of
    one folder, leave it to their parent, which merges their ``stats.sizes``).
    """

    def __init__(self, out_dir: str, max_samples: int = 10_000, max_bytes: Optional[int] = None,
                 start_shard: int = 0, write_sizes: bool = True):
        if max_samples <= 0:
            raise ValueError(f"max_samples must be > 0, got {max_samples}")
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir, self.max_samples, self.max_bytes = out_dir, max_samples, max_bytes
        self.write_sizes = write_sizes
        self.stats = ShardStats()
        self._index = start_shard
        self._tar: Optional[TarWriter] = None
        self._count = self._bytes = 0

    def write(self, key: str, image: bytes, caption: str, meta: Optional[dict[str, Any]] = None,
              ext: str = "jpg") -> None:
        """Add one sample ``{key}.{ext}``, ``{key}.txt`` and ``{key}.json`` (meta + key + caption)."""
        if "." in key or "/" in key:
            raise ValueError(f"sample key {key!r} must not contain '.' or '/'")
        size = len(image) + len(caption.encode())
        full = self._tar is not None and (
            self._count >= self.max_samples
            or (self.max_bytes is not None and self._count and self._bytes + size > self.max_bytes))
        if full:
            self._finish_shard()
        if self._tar is None:
            self._tar = tar_writer(self._shard_path())
        record = {"key": key, "caption": caption, "status": "success", **(meta or {})}
        self._tar.write({"__key__": key, ext: image, "txt": caption.encode("utf-8"),
                         "json": json.dumps(record, sort_keys=True).encode("utf-8")})
        self._count += 1
        self._bytes += size

    def _shard_name(self) -> str:
        return f"{self._index:0{SHARD_DIGITS}d}"

    def _shard_path(self) -> str:
        return os.path.join(self.out_dir, self._shard_name() + ".tar")

    def _finish_shard(self) -> None:
        assert self._tar is not None
        self._tar.close()
        name = self._shard_name()
        stats = {"count": self._count, "successes": self._count, "failed_to_download": 0,
                 "failed_to_resize": 0, "status_dict": {"success": self._count}}
        with open(os.path.join(self.out_dir, f"{name}_stats.json"), "w") as f:
            json.dump(stats, f, indent=1, sort_keys=True)
        self.stats.sizes[name + ".tar"] = self._count
        self._tar, self._count, self._bytes = None, 0, 0
        self._index += 1

    def close(self) -> ShardStats:
        if self._tar is not None:
            self._finish_shard()
        if self.write_sizes:
            write_sizes(self.out_dir, self.stats.sizes)
        return self.stats

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
