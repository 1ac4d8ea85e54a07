"""Checkpoint manifests: size and SHA-256 of every file of a checkpoint folder.

The trainer writes ``manifest.json`` last, after every other file of the folder (model,
optimizer, rank files, and whatever a publish hook added, e.g. open_clip export files), and
before the folder is renamed into place. A folder verifies when every file the manifest lists
is present with its size and hash. Both the trainer's resume and ``python -m infclip.eval``
verify before loading, so a truncated or overwritten file is reported by name instead of as
an unpickling traceback.

A folder without a manifest was written by an older version: it is accepted unverified
(with one warning per process), so old runs can still resume -- unless a sibling step folder
has a manifest: then this one lost its manifest (or never completed) and is damaged. A
manifest that is not the expected shape (an object whose ``files`` maps relative names inside
the folder to ``{"size": int, "sha256": 64 hex digits}``), or names a path outside the folder
(``..``, absolute, or through a link), makes its folder damaged too.

A folder that fails verification is never deleted: ``set_aside`` renames it to
``step_N.damaged`` (the trainer's resume, the eval command and the export all do), so the
newest intact checkpoint is used and pruning never counts the damaged one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Optional

MANIFEST = "manifest.json"
_CHUNK = 8 << 20
_warned: set[str] = set()


def file_digest(path: Path) -> str:
    """Hex SHA-256 of a file, read in 8 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: Path) -> Path:
    """Lists every regular file now in ``folder`` (recursively, the manifest itself
    excluded) with size and hash; written atomically and fsynced, so it is the last file."""
    files = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and rel != MANIFEST and not rel.endswith(".manifest.tmp"):
            files[rel] = {"size": p.stat().st_size, "sha256": file_digest(p)}
    tmp = folder / f"{MANIFEST}.manifest.tmp"
    with open(tmp, "w") as f:
        json.dump({"version": 1, "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)
    return folder / MANIFEST


def verify(folder: Path, need: tuple[str, ...] = (), only: Optional[tuple[str, ...]] = None) -> Optional[str]:
    """None when ``folder`` is intact, else one phrase saying what is wrong.

    Intact: every file the manifest lists (or only those in ``only``) has its recorded size
    and SHA-256, and every name in ``need`` is listed. Without a manifest (an older
    checkpoint) only the presence of ``need`` is checked, with a one-time warning.
    """
    folder = Path(folder)
    manifest = folder / MANIFEST
    if not manifest.is_file():
        missing = [n for n in need if not (folder / n).is_file()]
        if missing:
            return f"missing {', '.join(missing[:4])}"
        if _siblings_have_manifests(folder):
            return f"has no {MANIFEST} while other checkpoints beside it have one (removed, or never completed)"
        _warn_unverified(folder)
        return None
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    problem = _shape_problem(folder, files)
    if problem:
        return f"{MANIFEST} is malformed ({problem})"
    unlisted = [n for n in need if n not in files]
    if unlisted:
        added = [n for n in unlisted if (folder / n).is_file()]
        if added:  # present, but not there when the checkpoint was written: nothing vouches for it
            return f"{added[0]} is not in its {MANIFEST} (added or replaced after the checkpoint was written)"
        return f"missing {', '.join(unlisted[:4])}"
    for name, entry in files.items():
        if only is not None and name not in only:
            continue
        problem = _check_file(folder / name, entry)
        if problem:
            return f"{name} {problem}"
    return None


_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _shape_problem(folder: Path, files: object) -> Optional[str]:
    """None when ``files`` maps names inside ``folder`` to {size: int >= 0, sha256: hex}."""
    if not isinstance(files, dict):
        return f"'files' is a {type(files).__name__}, not an object"
    root = folder.resolve()
    for name, entry in files.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str) \
                or not _SHA256.match(entry["sha256"]) or type(entry.get("size")) is not int or entry["size"] < 0:
            return f"the entry of {name!r} is not {{\"size\": bytes, \"sha256\": hex digest}}"
        parts = Path(name).parts
        if not name or Path(name).is_absolute() or ".." in parts or not _inside(folder / name, root):
            return f"{name!r} is not a path inside the checkpoint folder"
    return None


def _inside(path: Path, root: Path) -> bool:
    """True when ``path`` (links followed) lies in ``root``."""
    try:
        path.resolve().relative_to(root)
    except (ValueError, OSError, RuntimeError):
        return False
    return True


def _siblings_have_manifests(folder: Path) -> bool:
    """Whether another step folder beside ``folder`` has a manifest (then this one should too)."""
    try:
        return any(p != folder and (p / MANIFEST).is_file() for p in folder.parent.glob("step_*"))
    except OSError:
        return False


def vanished(problem: str) -> bool:
    """True when ``verify``'s ``problem`` is only that files are gone (a folder being removed,
    e.g. pruned by a training while another process reads it), not bytes that changed."""
    return problem.endswith("is missing") or problem.startswith("missing ")


def set_aside(folder: Path) -> Optional[Path]:
    """Renames a damaged checkpoint folder to ``<name>.damaged`` (never deletes it); returns
    the new path, or None where that is not possible (a read-only run folder, a name taken)."""
    aside = folder.with_name(f"{folder.name}.damaged")
    try:
        if aside.exists():
            return None
        os.replace(folder, aside)
    except OSError:
        return None
    return aside


def _check_file(path: Path, entry: dict) -> Optional[str]:
    if not path.is_file():
        return "is missing"
    size = path.stat().st_size
    if size != entry["size"]:
        return f"has {size} bytes, the manifest says {entry['size']} (truncated or replaced)"
    if file_digest(path) != entry["sha256"]:
        return "does not match its SHA-256 in the manifest (overwritten or corrupted)"
    return None


def _warn_unverified(folder: Path) -> None:
    key = str(folder.parent)
    if key not in _warned:
        _warned.add(key)
        print(f"warning: checkpoint {folder} has no {MANIFEST} (written by an older version): "
              "loading it without verification", file=sys.stderr, flush=True)
