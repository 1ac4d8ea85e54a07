"""Arithmetic on time spans ``(start, end)``, shared by the profiler's step summary
(``infclip.train.profiling``) and the JPEG decoder's timeline (``infclip.data.decode_trace``).
Units are the caller's; spans may overlap and come in any order."""

from __future__ import annotations

Span = tuple[float, float]


def union(spans: list[Span]) -> list[Span]:
    """The union of ``spans`` as sorted, disjoint spans (touching ones merged)."""
    out: list[Span] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def covered(spans: list[Span]) -> float:
    """Length of the union of ``spans``."""
    return sum(b - a for a, b in union(spans))


def clip(spans: list[Span], a: float, b: float) -> list[Span]:
    """``spans`` cut to [a, b]; those outside it left out."""
    return [(max(x, a), min(y, b)) for x, y in spans if y > a and x < b]
