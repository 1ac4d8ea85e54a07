"""Mirror of a run's checkpoints on any fsspec file system (``checkpoint.remote``).

Layout: ``<remote>/checkpoints/step_XXXXXXXX/`` holds the same files as the local folder.

Invariant: a remote ``step_*`` folder is complete iff its ``manifest.json`` exists. Rank 0
uploads every other file first and the manifest last (an object store's put is atomic, a
file system's goes through a temporary name and a rename), so an upload cut short leaves a
folder without manifest: never listed as complete, removed by the next pruning. Re-uploading
a step removes its manifest first. Pruning keeps the newest ``keep_last`` complete folders
(and the one the run resumed from), as locally.

The local checkpoint is the source of truth: a failing upload or pruning is one warning
line and training goes on. A downloaded checkpoint is verified against its manifest
(``verify_checkpoint``) before it is renamed into the local run folder; one that fails is
named in a warning and the next older remote one is tried.
"""

from __future__ import annotations

import os
import posixpath
import shutil
from pathlib import Path
from typing import Callable, Optional

from infclip.manifest import MANIFEST
from infclip.train.checkpoint import _STEP_RE, verify_checkpoint


class RemoteCheckpoints:
    """Uploads published checkpoints to ``url`` and fetches the newest intact one (rank 0)."""

    def __init__(self, url: str, keep_last: int, warn: Callable[[str], None] = print):
        import fsspec

        self.url, self.keep_last, self.warn = url.rstrip("/"), keep_last, warn
        self.fs, root = fsspec.core.url_to_fs(self.url)
        self.root = posixpath.join(root, "checkpoints")

    def _remote(self, name: str, rel: str = "") -> str:
        """The remote path of checkpoint ``name`` (or of its file ``rel``)."""
        return posixpath.join(self.root, name, rel) if rel else posixpath.join(self.root, name)

    # -------------------------------------------------------------------- upload

    def mirror(self, folder: Path, protected: Optional[Path] = None) -> bool:
        """Uploads the published ``folder`` (manifest last) and prunes; True when it worked.
        Never raises: a failure is one warning line (training goes on)."""
        try:
            self._upload(folder)
        except Exception as e:
            self.warn(f"warning: could not mirror {folder.name} to {self.url} ({_why(e)}); training goes on, "
                      f"the local checkpoint is intact")
            return False
        try:
            self._prune(protected.name if protected is not None else None)
        except Exception as e:
            self.warn(f"warning: could not prune old checkpoints in {self.url} ({_why(e)})")
        return True

    def _upload(self, folder: Path) -> None:
        """Every file but the manifest, then the manifest: its presence marks the copy complete."""
        dest = self._remote(folder.name)
        if self.fs.exists(self._remote(folder.name, MANIFEST)):  # a re-saved step: incomplete first
            self.fs.rm(self._remote(folder.name, MANIFEST))
        files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
        for p in files:
            rel = p.relative_to(folder).as_posix()
            self.fs.makedirs(posixpath.dirname(posixpath.join(dest, rel)), exist_ok=True)
            self.fs.put_file(str(p), posixpath.join(dest, rel))
        tmp = self._remote(folder.name, MANIFEST + ".uploading")
        self.fs.put_file(str(folder / MANIFEST), tmp)
        self.fs.mv(tmp, self._remote(folder.name, MANIFEST))

    def _prune(self, protected: Optional[str]) -> None:
        """Keeps the newest ``keep_last`` complete folders (and ``protected``); removes older
        ones and incomplete ones older than the newest complete one."""
        complete, names = self.complete(), self._step_names()
        if not complete:
            return
        keep = set(complete[-self.keep_last:]) | {protected}
        newest = int(complete[-1][5:])
        for name in names:
            if name not in keep and (name in complete or int(name[5:]) < newest):
                self.fs.rm(self._remote(name), recursive=True)

    # -------------------------------------------------------------------- download

    def _step_names(self) -> list[str]:
        """Remote ``step_*`` folder names, oldest first ([] when there is no folder yet)."""
        try:
            entries = self.fs.ls(self.root, detail=False)
        except (FileNotFoundError, NotADirectoryError):  # nothing uploaded there yet
            return []
        names = [posixpath.basename(str(e).rstrip("/")) for e in entries]
        return sorted((n for n in names if _STEP_RE.match(n)), key=lambda n: int(n[5:]))

    def complete(self) -> list[str]:
        """Remote checkpoints whose manifest exists (uploaded to the end), oldest first."""
        return [n for n in self._step_names() if self.fs.exists(self._remote(n, MANIFEST))]

    def fetch_latest(self, local_root: Path, world_size: int) -> Optional[Path]:
        """Downloads the newest remote checkpoint that verifies for ``world_size`` ranks into
        ``local_root/step_N`` (through ``.step_N.tmp``); None when there is none. Failures
        (download, verification) are named in one warning line each; older ones are tried."""
        for name in reversed(self.complete()):
            tmp = local_root / f".{name}.tmp"
            try:
                self._download(name, tmp)
            except Exception as e:
                shutil.rmtree(tmp, ignore_errors=True)
                self.warn(f"warning: could not download {self._remote(name)} from {self.url} ({_why(e)})")
                continue
            problem = verify_checkpoint(tmp, world_size)
            if problem is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                self.warn(f"warning: skipping remote checkpoint {self.url}/checkpoints/{name}: {problem}; "
                          "trying the previous one")
                continue
            os.replace(tmp, local_root / name)
            return local_root / name
        return None

    def _download(self, name: str, dest: Path) -> None:
        """Every file of remote ``name`` into the fresh local folder ``dest`` (unverified)."""
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        base = self._remote(name)
        for path in self.fs.find(base):
            rel = posixpath.relpath(str(path), base)
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(str(path), str(dest / rel))


def _why(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
