#!/usr/bin/env python
"""Collect a batch-size sweep into one CSV (and a PNG plot when matplotlib is installed).

    python scripts/slurm/gather.py runs/b32_sweep [--out runs/b32_sweep/sweep.csv]

Reads every run directory listed in ``<sweep dir>/sweep.json`` (written by sweep.py), or
else every ``<sweep dir>/*/metrics.jsonl``. Per run: global batch, lr and world size (from
the run's config.yaml and start records), the median step time and throughput over the
logged steps (the first logged step, which includes start-up, is left out when there are
others), peak GPU memory, the last loss, non-finite step count, and the newest value of
every ``eval/*`` metric. Runs that have not logged a step yet are listed with empty fields.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Optional

FIXED = ["run", "batch", "lr", "world_size", "steps_done", "step_time_s", "samples_per_s",
         "samples_per_s_per_gpu", "peak_gpu_mem_gb", "loss", "nonfinite_steps"]
_EVAL_BOOKKEEPING = ("_chance", "num_samples", "num_classes", "num_images", "num_texts", "seconds")


def read_metrics(path: Path) -> list[dict]:
    """Records of a metrics.jsonl; a line cut short by a kill is skipped, not fatal."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _config(run_dir: Path) -> dict:
    try:
        from omegaconf import OmegaConf

        return OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))
    except (ImportError, FileNotFoundError):
        return {}


def _median(values: list[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def summarize(run_dir: Path) -> dict[str, Any]:
    """One CSV row for a run directory."""
    records = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    cfg = _config(run_dir)
    steps = {r["step"]: r for r in records if "loss" in r and "step" in r}  # the last record of a step wins
    timed = [steps[s] for s in sorted(steps)]
    if len(timed) > 1:
        timed = timed[1:]  # the first logged step carries start-up costs
    starts = [r for r in records if r.get("event") == "start"]
    row: dict[str, Any] = {
        "run": run_dir.name,
        "batch": cfg.get("batch", {}).get("global_size"),
        "lr": cfg.get("optim", {}).get("lr"),
        "world_size": starts[-1].get("world_size") if starts else None,
        "steps_done": max(steps) if steps else 0,
        "step_time_s": _median([r["step_time"] for r in timed if "step_time" in r]),
        "samples_per_s": _median([r["samples_per_s"] for r in timed if "samples_per_s" in r]),
        "samples_per_s_per_gpu": _median([r["samples_per_s_per_gpu"] for r in timed if "samples_per_s_per_gpu" in r]),
        "peak_gpu_mem_gb": max((r.get("gpu_mem_gb", 0.0) for r in steps.values()), default=None),
        "loss": steps[max(steps)]["loss"] if steps else None,
        "nonfinite_steps": steps[max(steps)].get("nonfinite_steps") if steps else None,
    }
    for r in records:  # newest eval value of each metric, from step records and the summary
        flat = {**r, **r.get("summary", {})} if isinstance(r.get("summary"), dict) else r
        for k, v in flat.items():
            if k.startswith("eval/") and not k.endswith(_EVAL_BOOKKEEPING) and isinstance(v, (int, float)):
                row[k] = v
    return row


def run_dirs(sweep_dir: Path) -> list[Path]:
    manifest = sweep_dir / "sweep.json"
    if manifest.exists():
        return [Path(r["run_dir"]) for r in json.loads(manifest.read_text())["runs"]]
    return sorted(p.parent for p in sweep_dir.glob("*/metrics.jsonl"))


def write_csv(rows: list[dict], path: Path) -> None:
    extra = sorted({k for r in rows for k in r} - set(FIXED))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIXED + extra)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else v) for k, v in r.items()})


def plot_panels(rows: list[dict]) -> list[tuple[str, str]]:
    """(key, title) of each panel: throughput per GPU, peak GPU memory unless every run's is 0
    (CPU runs have none to show), and each eval metric."""
    evals = sorted({k for r in rows for k in r if k.startswith("eval/")})
    panels = [("samples_per_s_per_gpu", "samples/s per GPU")]
    if any(r.get("peak_gpu_mem_gb") for r in rows):
        panels.append(("peak_gpu_mem_gb", "peak GPU memory (GB)"))
    return panels + [(k, k) for k in evals]


def plot(rows: list[dict], path: Path) -> bool:
    """Throughput per GPU, peak memory and eval metrics against the global batch (log2)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in rows if r["batch"]]
    panels = plot_panels(rows)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        pts = sorted((r["batch"], r[key]) for r in rows if r.get(key) is not None)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("global batch")
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep_dir", type=Path)
    p.add_argument("--out", type=Path, default=None,
                   help="CSV path (default: <sweep_dir>/sweep.csv); the plot goes beside it")
    args = p.parse_args(argv)
    dirs = run_dirs(args.sweep_dir)
    if not dirs:
        print(f"error: no runs in {args.sweep_dir} (no sweep.json, no */metrics.jsonl)", file=sys.stderr)
        return 2
    rows = sorted((summarize(d) for d in dirs), key=lambda r: (r["batch"] is None, r["batch"] or 0))
    out = args.out or args.sweep_dir / "sweep.csv"
    write_csv(rows, out)
    print(f"wrote {out} ({len(rows)} runs)")
    png = out.with_suffix(".png")
    print(f"wrote {png}" if plot(rows, png) else "no plot: matplotlib is not installed (pip install matplotlib)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
