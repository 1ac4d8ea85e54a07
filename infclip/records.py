"""Reading a run's JSON-lines records (``metrics.jsonl``, ``eval.jsonl``): torch-free.

Invariant: a line cut short (a process killed while appending it) or holding anything but a
JSON object is left out, never fatal; an absent file has no records.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_records(path: Path) -> list[dict]:
    """The JSON objects of ``path``, one a line, in file order ([] if it is not a file)."""
    path = Path(path)
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out
