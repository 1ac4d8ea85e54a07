"""Every rank of a job must run the same configuration and the same code.

Ranks started by hand (or on nodes with different checkouts) could otherwise train with,
say, ``steps=5`` on one and ``steps=8`` on another: the first to finish would wait in a
collective for a partner that never comes. At the start, before anything is built, each rank
sends its resolved configuration (every leaf, dotted key -> value) and a digest of its source
files to every other; a difference is refused on every rank in one paragraph naming the keys.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch.distributed as dist
from omegaconf import OmegaConf

from infclip.config import ConfigError
from infclip.train.distributed import DistInfo, peers_missing

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("infclip", "kernels")  # packages whose code a run executes (plus train.py)
SHOWN = 5  # differing keys named in the message


def config_leaves(cfg: Any) -> dict[str, str]:
    """The resolved configuration as {dotted key: JSON text of its value}, lists and dicts whole."""
    tree = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else cfg
    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            out[prefix[:-1]] = json.dumps(node, sort_keys=True, default=str)

    walk(tree, "")
    return out


@lru_cache(maxsize=1)
def code_digest() -> str:
    """SHA-256 (first 16 hex digits) over the relative paths and contents of the run's sources."""
    h = hashlib.sha256()
    files = [ROOT / "train.py"] + sorted(p for pkg in SOURCES for p in (ROOT / pkg).rglob("*.py"))
    for path in files:
        if path.is_file():
            h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def differences(mine: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """Keys whose values differ (or that only one side has), sorted."""
    return sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))


def check_same_config(cfg: Any, info: DistInfo, join_timeout_s: float) -> None:
    """Refuses (ConfigError, on every rank) when any rank's configuration or code differs from
    rank 0's. A collective: every rank calls it once at the start. A peer that is gone or never
    answers raises PeersMissing."""
    if not info.distributed:
        return
    mine = (code_digest(), config_leaves(cfg))
    gathered: list = [None] * info.world_size
    try:
        dist.all_gather_object(gathered, mine)
    except (RuntimeError, dist.DistError) as e:
        raise peers_missing(info.rank, info.world_size, join_timeout_s, e) from None
    problems = [_describe(r, gathered[0], other) for r, other in enumerate(gathered) if other != gathered[0]]
    if problems:
        raise ConfigError("the ranks of this job were started differently: " + "; ".join(problems) +
                          ". Start every rank with the same command line (experiment and overrides) from the "
                          "same checkout")


def _describe(rank: int, first: tuple, other: tuple) -> str:
    """What rank ``rank`` has that rank 0 does not: its code, or the keys that differ."""
    if first[0] != other[0]:
        return f"rank {rank} runs other code than rank 0 (source digest {other[0]} vs {first[0]})"
    keys = differences(first[1], other[1])
    shown = ", ".join(f"{k} ({first[1].get(k, 'unset')} on rank 0, {other[1].get(k, 'unset')} on rank {rank})"
                      for k in keys[:SHOWN])
    more = f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
    return f"rank {rank} differs from rank 0 in {shown}{more}"
