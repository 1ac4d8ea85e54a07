"""Overlay the per-step training loss of runs (their ``metrics.jsonl``) and tabulate them.

The same training with ``loss.impl=vanilla`` and ``loss.impl=triton``
(same seed, same data order) must give overlapping curves. Writes a PNG (the curves and
their difference to the first run) and prints a Markdown table of the loss at a few
steps, the max |difference| over all common steps and the mean over the last 50.

    python scripts/bench/plot_loss_curves.py runs/v/metrics.jsonl runs/t/metrics.jsonl \
        --labels vanilla,triton --out docs/loss_curves.png

``--band K``: the first K runs (the same training under K seeds) are the noise band. Each
curve is smoothed over ``--smooth`` logged steps; the band is the smoothed runs' lowest and
highest value at each step. Every other run is inside the band when its mean distance to the
band's middle over the last 50 common steps is at most the band's mean width there (what the
seeds themselves differ by). A table of each run's final evaluation (``eval/*`` of its last
record that has them, e.g. a held-out contrastive task's loss and recall) follows.

    python scripts/bench/plot_loss_curves.py runs/bf16_s0/metrics.jsonl runs/bf16_s1/metrics.jsonl \
        runs/fp8_tw/metrics.jsonl --labels bf16-s0,bf16-s1,fp8-tensorwise --band 2 --out curves.png
"""

from __future__ import annotations

import argparse
import json
import re


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


QUALITY = re.compile(r"^eval/[^/]+/(loss|top[15]|(i2t|t2i)_r(1|5|10))$")  # the numbers a run is judged by


def read_final_evals(path: str) -> dict[str, float]:
    """The quality numbers (``QUALITY``: loss, recall@k, top-k of each eval task) of the last
    record that has any: the run's final evaluation."""
    last: dict[str, float] = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            evals = {k: float(v) for k, v in rec.items() if QUALITY.match(k) and isinstance(v, (int, float))}
            if evals:
                last = evals
    return last


def smooth(run: dict[int, float], window: int) -> dict[int, float]:
    """Trailing mean over the last ``window`` logged steps (fewer at the start)."""
    steps = sorted(run)
    out, total = {}, 0.0
    for i, s in enumerate(steps):
        total += run[s]
        if i >= window:
            total -= run[steps[i - window]]
        out[s] = total / min(i + 1, window)
    return out


def noise_band(runs: list[dict[int, float]], k: int, window: int) -> tuple[list[dict[int, float]], list[int],
                                                                            dict[int, float], dict[int, float]]:
    """(every run smoothed over ``window``, the steps all runs logged, the band's low and high
    there): the band is the lowest and highest of the first ``k`` smoothed runs at each step."""
    sm = [smooth(r, window) for r in runs]
    common = sorted(set.intersection(*(set(r) for r in sm)))
    if not common:
        raise SystemExit("the runs share no logged step")
    return sm, common, {s: min(r[s] for r in sm[:k]) for s in common}, {s: max(r[s] for r in sm[:k]) for s in common}


def band_report(runs: list[dict[int, float]], labels: list[str], k: int, window: int,
                tail: int = 50) -> tuple[str, dict[str, bool]]:
    """(report lines, {label: inside}) for runs ``k:`` against the band of runs ``:k``
    (smoothed over ``window``); see the module docstring for the rule."""
    sm, common, lo, hi = noise_band(runs, k, window)
    last = common[-tail:]
    width = sum(hi[s] - lo[s] for s in last) / len(last)
    lines = [f"noise band: {', '.join(labels[:k])} (smoothed over {window} steps); mean width over the last "
             f"{len(last)} steps {width:.4f}"]
    verdict = {}
    for lb, r in zip(labels[k:], sm[k:]):
        inside_share = sum(lo[s] <= r[s] <= hi[s] for s in common) / len(common)
        gap = sum(r[s] - (lo[s] + hi[s]) / 2 for s in last) / len(last)
        verdict[lb] = abs(gap) <= width
        lines.append(f"{lb}: {'inside' if verdict[lb] else 'OUTSIDE'} the band: mean distance to its middle over "
                     f"the last {len(last)} steps {gap:+.4f} (band width {width:.4f}); inside the band at "
                     f"{inside_share:.0%} of {len(common)} steps")
    return "\n".join(lines), verdict


def evals_table(evals: list[dict[str, float]], labels: list[str]) -> str:
    """Markdown table of the runs' final evaluation numbers (one column per metric any run has,
    numbers in order: r1, r5, r10)."""
    keys = sorted(set().union(*evals), key=lambda k: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", k)])
    if not keys:
        return "(no run logged an evaluation)"
    lines = ["| run | " + " | ".join(k.removeprefix("eval/") for k in keys) + " |", "|" + "---|" * (len(keys) + 1)]
    for lb, e in zip(labels, evals):
        lines.append(f"| {lb} | " + " | ".join(f"{e[k]:.4f}" if k in e else "—" for k in keys) + " |")
    return "\n".join(lines)


def plot(runs: list[dict[int, float]], labels: list[str], path: str, title: str, band: int = 0,
         window: int = 1) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, dx) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    if band:
        runs, common, lo, hi = noise_band(runs, band, window)
        ax.fill_between(common, [lo[s] for s in common], [hi[s] for s in common], color="0.8", label="noise band")
        half = [(hi[s] - lo[s]) / 2 for s in common]
        dx.fill_between(common, [-h for h in half], half, color="0.8")
    else:
        common = sorted(set.intersection(*(set(r) for r in runs)))
    for i, (r, lb) in enumerate(zip(runs, labels)):
        steps = sorted(r)
        ax.plot(steps, [r[s] for s in steps], lw=1.2, ls="-" if i == 0 else "--", label=lb)
    if band:  # each other run against the band's middle
        for r, lb in zip(runs[band:], labels[band:]):
            dx.plot(common, [r[s] - (lo[s] + hi[s]) / 2 for s in common], lw=0.8, label=f"{lb} − band middle")
    else:
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


def main(argv: list[str] | None = None) -> dict[str, bool]:
    """Prints the tables (and writes the plot); returns {label: inside the band} with --band."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", nargs="+", help="metrics.jsonl files; the first is the reference")
    p.add_argument("--labels", default=None, help="comma-separated, one per file")
    p.add_argument("--at", default="1,10,50,100,200,300", help="steps for the table")
    p.add_argument("--title", default=None, help="default: what the runs are (same seed; or a band of seeds)")
    p.add_argument("--out", default=None, help="PNG path (no plot if omitted)")
    p.add_argument("--band", type=int, default=0,
                   help="the first K runs (seeds of one training) are the noise band the others are judged by")
    p.add_argument("--smooth", type=int, default=20, help="with --band: trailing mean over this many logged steps")
    args = p.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [f"run{i}" for i in range(len(args.metrics))]
    if len(labels) != len(args.metrics):
        p.error(f"--labels names {len(labels)} runs for {len(args.metrics)} metrics files")
    if args.band and not 2 <= args.band < len(args.metrics):
        p.error(f"--band {args.band}: the band needs at least 2 runs (seeds) and at least one run to judge "
                f"after them; got {len(args.metrics)} metrics files")
    if args.smooth < 1:
        p.error(f"--smooth {args.smooth}: a trailing mean needs at least 1 step (1: no smoothing)")
    runs = [read_losses(m) for m in args.metrics]
    print(table(runs, labels, [int(s) for s in args.at.split(",")]))
    verdict = {}
    if args.band:
        text, verdict = band_report(runs, labels, args.band, args.smooth)
        print("\n" + text)
        print("\n" + evals_table([read_final_evals(m) for m in args.metrics], labels))
    if args.out:
        title = args.title or (f"training loss, mean of the last {args.smooth} steps; band: {args.band} seeds"
                               if args.band else "same seed, same data: loss per step")
        plot(runs, labels, args.out, title, args.band, args.smooth)
    return verdict


if __name__ == "__main__":
    main()
