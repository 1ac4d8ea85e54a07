"""A timeline of the JPEG decoder's work in one training step (``logging.decode_trace_step=N``).

Where the decoder bounds a step (``decode_busy_pct`` near 100 %) the step can be no shorter
than its decode work; where it works less than all of the step while still bounding it, the
question is *when* it idles. The PyTorch profiler answers that only at a cost (it slows the
host several-fold, and the decoder is a host-driven chain), so the decoder records its own
spans, cheaply, for one step:

* ``spans``: (start, end, source, images) of each decode call, ``source`` the thread that
  made it: "ahead" (the next step's micro-batches, during this step's replay and on into
  the next step's first pass), "prefetch" (the micro-batch after the one the towers are on),
  "inline" (the training thread itself, when nothing was prefetched);
* ``waits``: (start, end) of the training thread waiting for a prefetched micro-batch;
* ``hits``: micro-batches the training side found already decoded (kept pixels);
* ``marks``: (time, name) of the step's phase ends as the engine's clock laps them
  ("cache_pass", "loss", "replay"; the gradient cache's step and the plain one alike; with
  several ranks "rank_wait" between the first two);
* ``queued``: when the next step's micro-batches were handed to the decode-ahead
  (``data.decode_ahead_from``: during the first pass under a locked image tower, else after
  the loss).

A decode under way when the trace stops is in it up to the stop; one begun before the trace
started is clipped to it and counts in the first phase.

Times are ``time.perf_counter()`` seconds; the summary gives them relative to the trace's
start. Invariant: tracing changes no result (it appends to lists under the decoder's lock).
Layering: data only; the trainer starts and stops a trace and prints its summary.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from infclip.spans import clip, union

MIN_GAP_S = 0.005  # idle stretches shorter than this are not listed (thread hand-offs)


@dataclass
class DecodeTrace:
    """One step's decoder timeline (see the module docs); ``origin``: the step's start."""

    origin: float
    spans: list[tuple[float, float, str, int]] = field(default_factory=list)
    waits: list[tuple[float, float]] = field(default_factory=list)
    hits: int = 0
    marks: list[tuple[float, str]] = field(default_factory=list)
    end: float | None = None
    queued: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class PhaseSummary:
    """The decoder in one phase [start, end) of the step (seconds from the step's start):
    ``busy`` the union of decode spans inside it, ``gaps`` its idle stretches of at least
    ``MIN_GAP_S`` as (offset from the step's start, length), longest first, ``calls`` decode
    calls by source (a call counts in the phase where it started, or the first), ``wait`` the
    training thread's waits for decoded micro-batches."""

    name: str
    start: float
    end: float
    busy: float
    gaps: list[tuple[float, float]]
    calls: dict[str, int]
    wait: float

    @property
    def wall(self) -> float:
        return self.end - self.start


def phase_bounds(trace: DecodeTrace) -> list[tuple[str, float, float]]:
    """(name, start, end) of each phase in seconds from the step's start: the marks in time
    order, then "rest" (the optimizer and the step's bookkeeping) up to ``trace.end``."""
    end = (trace.end if trace.end is not None else max([trace.origin] + [m[0] for m in trace.marks])) - trace.origin
    out, t = [], 0.0
    for when, name in sorted(trace.marks):
        out.append((name, t, when - trace.origin))
        t = when - trace.origin
    if end > t:
        out.append(("rest", t, end))
    return out


def summarize(trace: DecodeTrace) -> list[PhaseSummary]:
    """Per phase, and a last entry "step" for the whole step: busy time, idle gaps, calls
    by source and the training thread's waits (see ``PhaseSummary``)."""
    spans = union([(a - trace.origin, b - trace.origin) for a, b, _, _ in trace.spans])
    waits = [(a - trace.origin, b - trace.origin) for a, b in trace.waits]
    phases = phase_bounds(trace)
    whole = ("step", 0.0, phases[-1][2] if phases else 0.0)
    out = []
    for name, a, b in phases + [whole]:
        inside = clip(spans, a, b)
        busy = sum(y - x for x, y in inside)
        edges = [a] + [t for s in inside for t in s] + [b]
        gaps = [(x, y - x) for x, y in zip(edges[::2], edges[1::2]) if y - x >= MIN_GAP_S]
        calls: dict[str, int] = {}
        for s0, _, src, _ in trace.spans:
            if a <= max(s0 - trace.origin, 0.0) < b:  # a call begun before the step: its first phase
                calls[src] = calls.get(src, 0) + 1
        wait = sum(y - x for x, y in clip(waits, a, b))
        out.append(PhaseSummary(name, a, b, busy, sorted(gaps, key=lambda g: -g[1]), calls, wait))
    return out


def format_summary(step: int, trace: DecodeTrace, top: int = 3) -> str:
    """Lines for the log: per phase its wall time, the decoder's busy share, the longest idle
    stretches (at +offset from the step's start) and the decode calls by source."""
    bounds = phase_bounds(trace)
    handed = "; ".join(f"the next step's images handed to the decode-ahead at +{t - trace.origin:.3f} s"
                       f" (in {_phase_at(bounds, t - trace.origin)})" for t in trace.queued)
    lines = [f"decode trace, step {step} (times from the step's start; {trace.hits} micro-batch reads "
             f"found their pixels decoded already{'; ' + handed if handed else ''}):"]
    for p in summarize(trace):
        share = 100.0 * p.busy / p.wall if p.wall > 0 else 0.0
        gaps = ", ".join(f"{g:.3f} s at +{t:.3f}" for t, g in p.gaps[:top]) or "none"
        calls = " ".join(f"{k} {v}" for k, v in sorted(p.calls.items())) or "no calls"
        lines.append(f"  {p.name:<10} +{p.start:7.3f} .. +{p.end:7.3f} s: decoder busy {p.busy:.3f} s "
                     f"({share:.0f} %), idle {p.wall - p.busy:.3f} s in {len(p.gaps)} stretch(es) "
                     f"(longest: {gaps}); calls: {calls}; training thread waited {p.wait:.3f} s")
    return "\n".join(lines)


def _phase_at(bounds: list[tuple[str, float, float]], t: float) -> str:
    """The name of the phase holding ``t`` (seconds from the step's start), or "step"."""
    return next((name for name, a, b in bounds if a <= t < b), "step")


def write_trace(path: Path, step: int, trace: DecodeTrace) -> Path:
    """The raw trace and its summary as JSON at ``path``, written atomically."""
    doc = {"step": step, "trace": asdict(trace),
           "phases": [{**asdict(p), "wall": p.wall} for p in summarize(trace)]}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.chmod(tmp, 0o644)  # as the run directory's other files (mkstemp makes it 0600)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path
