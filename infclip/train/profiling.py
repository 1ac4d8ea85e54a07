"""One training step under the PyTorch profiler (``logging.profile_step=N``).

Step N (1-based, counted from the run's first step) runs inside ``torch.profiler.profile``
with the CUDA activity on. CUPTI records every kernel and copy of the process, whichever
thread or library launched it: the towers, the loss, the resize kernel of the decode
threads and the JPEG decoders' own kernels (nvImageCodec / nvJPEG on their internal
streams). Rank r writes into ``<run_dir>/profile/``:

* ``step_N_rank_r.json.gz``: the Chrome trace (open in Perfetto or chrome://tracing);
* ``step_N_rank_r.md``: what the GPU did in the step, read off that trace: the step's wall
  time, the time any kernel ran (union over streams) and so the GPU's idle share; the same per
  phase (cache pass, loss, replay, optimizer: the engine marks each phase's end after a CUDA
  sync); per stream and per kernel name the busy time, count and mean duration; and the
  longest stretches the GPU sat idle, with the GPU events on either side.

Invariant: profiling changes no result of the step (the profiler observes only).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import torch

from infclip.spans import clip, covered

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
PHASE_MARK = "infclip.phase_end."  # a CPU range marking the end of a step phase (after its CUDA sync)


def mark_phase_end(name: str) -> None:
    """Mark the end of phase ``name`` in a profiled step (an empty profiler range; outside a
    profile it costs about a microsecond). The engine marks its phases after synchronizing."""
    with torch.profiler.record_function(PHASE_MARK + name):
        pass


def _gaps(gpu: list[dict], spans: list[tuple[float, float]], t0: float, top: int) -> list[str]:
    """The ``top`` longest stretches with no GPU event between the first and the last one:
    offset from the step's start, length, the GPU events around them."""
    order = sorted(range(len(spans)), key=lambda k: spans[k][0])
    gaps, end, last = [], float("-inf"), None
    for k in order:
        a, b = spans[k]
        if last is not None and a > end:
            gaps.append((a - end, end, last, k))
        if b > end:
            end, last = b, k
    lines = ["", "| GPU idle at (ms into the step) | for ms | after | before |", "|---|---|---|---|"]
    for length, at, before, after in sorted(gaps, reverse=True)[:top]:
        lines.append(f"| {(at - t0) / 1e3:.1f} | {length / 1e3:.2f} | {gpu[before].get('name', '?')[:50]} | "
                     f"{gpu[after].get('name', '?')[:50]} |")
    return lines


def _phases(events: list[dict], spans: list[tuple[float, float]], t0: float, t1: float) -> list[str]:
    """Wall and GPU-busy time of each phase between the engine's marks (``PHASE_MARK``)."""
    marks = sorted((float(e["ts"]), e["name"][len(PHASE_MARK):]) for e in events
                   if str(e.get("name", "")).startswith(PHASE_MARK))
    if not marks:
        return []
    lines = ["", "| phase (ends at its mark) | wall s | GPU busy s | busy % |", "|---|---|---|---|"]
    starts = [t0] + [ts for ts, _ in marks]
    for a, (b, label) in zip(starts, marks + [(t1, "after the optimizer")]):
        busy = covered(clip(spans, a, b)) / 1e6
        wall = (b - a) / 1e6
        lines.append(f"| {label} | {wall:.3f} | {busy:.3f} | {100 * busy / max(wall, 1e-12):.1f} |")
    return lines


def summarize_trace(events: list[dict], wall_s: float, top: int = 25) -> str:
    """Markdown summary of a Chrome trace's GPU events (``cat`` in ``GPU_CATS``, ``ts`` and
    ``dur`` in microseconds): busy time of the GPU (union over streams) against ``wall_s``;
    per phase of the step where the engine marked them (``PHASE_MARK`` ranges); per stream;
    the ``top`` kernel names by total time; the longest stretches the GPU sat idle."""
    gpu = [e for e in events if e.get("cat") in GPU_CATS and "dur" in e and "ts" in e]
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu]
    timed = [e for e in events if "ts" in e and e.get("ph") in ("X", "i", "I", None)]
    t0 = min((float(e["ts"]) for e in timed), default=0.0)
    t1 = max((float(e["ts"]) + float(e.get("dur", 0)) for e in timed), default=0.0)
    busy = covered(spans) / 1e6
    lines = [f"step wall time {wall_s:.3f} s; GPU busy (any kernel or copy, union over streams) {busy:.3f} s "
             f"= {100 * busy / max(wall_s, 1e-9):.1f} %; {len(gpu)} GPU events"]
    lines += _phases(events, spans, t0, t1)
    per_stream: dict = defaultdict(list)
    for e, s in zip(gpu, spans):
        per_stream[e.get("args", {}).get("stream", "?")].append((s, e))
    lines += ["", "| stream | busy s | events | top kernel |", "|---|---|---|---|"]
    stream_busy = {k: covered([s for s, _ in items]) for k, items in per_stream.items()}
    for stream in sorted(per_stream, key=lambda k: -stream_busy[k]):
        items = per_stream[stream]
        names: dict = defaultdict(float)
        for _, e in items:
            names[e.get("name", "?")] += float(e["dur"])
        head = max(names, key=names.get)
        lines.append(f"| {stream} | {stream_busy[stream] / 1e6:.3f} | {len(items)} | {head[:70]} |")
    by_name: dict = defaultdict(lambda: [0.0, 0])
    for e in gpu:
        by_name[e.get("name", "?")][0] += float(e["dur"])
        by_name[e.get("name", "?")][1] += 1
    lines += ["", "| kernel / copy | total s | count | mean us |", "|---|---|---|---|"]
    for name, (dur, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| {name[:90]} | {dur / 1e6:.3f} | {n} | {dur / n:.1f} |")
    if gpu:
        lines += _gaps(gpu, spans, t0, top=10)
    return "\n".join(lines) + "\n"


@contextmanager
def profiled_step(run_dir: Path, step: int, rank: int, enabled: bool) -> Iterator[Optional[Path]]:
    """Profile the enclosed step when ``enabled`` (the CPU activity, and CUDA's where there is
    a GPU: all threads' kernels) and
    write its trace and summary; yields the summary's path (None when not profiling)."""
    if not enabled:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    out = Path(run_dir) / "profile"
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"step_{step}_rank_{rank}"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        yield stem.with_suffix(".md")
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        part = Path(tmp) / "trace.json.gz"
        with open(raw, "rb") as src, gzip.open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 24)  # traces of large steps run to GBs: streamed
        os.replace(part, stem.with_suffix(".json.gz"))
        with open(raw, "rb") as src:
            events = json.load(src).get("traceEvents", [])
    summary = stem.with_suffix(".md")
    part = summary.with_suffix(".md.part")
    part.write_text(summarize_trace(events, wall))
    os.replace(part, summary)
