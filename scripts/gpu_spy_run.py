"""Per-thread summary of a py-spy raw (collapsed) profile, as written by scripts/gpu_spy_run.sh.

    python3 scripts/gpu_spy_run.py spy_idle.txt [--threads 6] [--frames 3] [--top 8]

A raw line is ``thread (tid): name;frame (file:line);...;leaf (file:line) count``. Prints the
threads by samples (all threads of an --idle profile have the same count; a --gil profile
counts only the samples where the thread held the GIL), then for the busiest threads the
share of samples per leaf chain (the last ``--frames`` frames, innermost first).
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path


def parse(path: Path) -> list[tuple[list[str], int]]:
    """[(frames, count)]: frames[0] is the thread, the rest outermost to innermost."""
    out = []
    for line in path.read_text().splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if stack and n.isdigit():
            out.append((stack.split(";"), int(n)))
    return out


def short(frame: str) -> str:
    """'fn (path/file.py:123)' -> 'fn:123'."""
    name, _, where = frame.partition(" (")
    return f"{name}:{where.rstrip(')').rpartition(':')[2]}" if where else name


def summarize(stacks: list[tuple[list[str], int]], threads: int, frames: int, top: int) -> str:
    per_thread: dict = collections.defaultdict(collections.Counter)
    for f, n in stacks:
        per_thread[f[0]][" <- ".join(short(x) for x in reversed(f[1:][-frames:]))] += n
    totals = {t: sum(c.values()) for t, c in per_thread.items()}
    lines = [f"{sum(totals.values())} samples over {len(totals)} threads"]
    for t in sorted(totals, key=lambda t: -totals[t])[:threads]:
        lines.append(f"== {t}: {totals[t]}")
        for chain, n in per_thread[t].most_common(top):
            lines.append(f"  {100 * n / totals[t]:5.1f}%  {chain[:200]}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("raw", type=Path)
    p.add_argument("--threads", type=int, default=6)
    p.add_argument("--frames", type=int, default=3)
    p.add_argument("--top", type=int, default=8)
    a = p.parse_args(argv)
    print(summarize(parse(a.raw), a.threads, a.frames, a.top))


if __name__ == "__main__":
    main()
