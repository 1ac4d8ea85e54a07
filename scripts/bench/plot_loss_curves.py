"""Overlay the per-step training loss of runs (their ``metrics.jsonl``) and tabulate them.

The same training with ``loss.impl=vanilla`` and ``loss.impl=triton``
(same seed, same data order) must give overlapping curves. Writes a PNG (the curves and
their difference to the first run) and prints a Markdown table of the loss at a few
steps, the max |difference| over all common steps and the mean over the last 50.

    python scripts/bench/plot_loss_curves.py runs/v/metrics.jsonl runs/t/metrics.jsonl \
        --labels vanilla,triton --out docs/loss_curves.png
"""

from __future__ import annotations

import argparse
import json


def read_losses(path: str) -> dict[int, float]:
    """step -> loss of the step records (later records of a step replace earlier ones)."""
    out = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if "step" in rec and "loss" in rec:
                out[int(rec["step"])] = float(rec["loss"])
    return out


def table(runs: list[dict[int, float]], labels: list[str], at: list[int]) -> str:
    common = sorted(set.intersection(*(set(r) for r in runs)))
    if not common:
        raise SystemExit("the runs share no logged step")
    steps = [s for s in at if s in common] or common[:: max(1, len(common) // 5)]
    head = "| step | " + " | ".join(labels) + " | " + " | ".join(f"{lb} − {labels[0]}" for lb in labels[1:]) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(labels) - 1)]
    for s in steps:
        vals = [r[s] for r in runs]
        lines.append(f"| {s} | " + " | ".join(f"{v:.4f}" for v in vals) + " | "
                     + " | ".join(f"{v - vals[0]:+.4f}" for v in vals[1:]) + " |")
    for lb, r in zip(labels[1:], runs[1:]):
        diffs = [abs(r[s] - runs[0][s]) for s in common]
        worst = max(range(len(common)), key=lambda i: diffs[i])
        tail = common[-50:]
        mean_tail = sum(r[s] - runs[0][s] for s in tail) / len(tail)
        lines.append(f"\n{lb} vs {labels[0]}: {len(common)} common steps; max |diff| {diffs[worst]:.4f} at step "
                     f"{common[worst]}; mean diff over the last {len(tail)} steps {mean_tail:+.4f}")
    return "\n".join(lines)


def plot(runs: list[dict[int, float]], labels: list[str], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, dx) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for i, (r, lb) in enumerate(zip(runs, labels)):
        steps = sorted(r)
        ax.plot(steps, [r[s] for s in steps], lw=1.2, ls="-" if i == 0 else "--", label=lb)
    common = sorted(set.intersection(*(set(r) for r in runs)))
    for r, lb in zip(runs[1:], labels[1:]):
        dx.plot(common, [r[s] - runs[0][s] for s in common], lw=0.8, label=f"{lb} − {labels[0]}")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    dx.axhline(0, color="k", lw=0.5)
    dx.set_xlabel("step")
    dx.set_ylabel("difference")
    dx.legend(fontsize=8)
    dx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", nargs="+", help="metrics.jsonl files; the first is the reference")
    p.add_argument("--labels", default=None, help="comma-separated, one per file")
    p.add_argument("--at", default="1,10,50,100,200,300", help="steps for the table")
    p.add_argument("--title", default="same seed, same data: loss per step")
    p.add_argument("--out", default=None, help="PNG path (no plot if omitted)")
    args = p.parse_args()
    labels = args.labels.split(",") if args.labels else [f"run{i}" for i in range(len(args.metrics))]
    runs = [read_losses(m) for m in args.metrics]
    print(table(runs, labels, [int(s) for s in args.at.split(",")]))
    if args.out:
        plot(runs, labels, args.out, args.title)


if __name__ == "__main__":
    main()
