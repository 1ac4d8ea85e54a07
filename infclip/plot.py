"""``python -m infclip.plot RUN``: a run's learning curve and eval metrics as one PNG.

Reads ``RUN/metrics.jsonl`` (the training loss and learning rate of every logged step, the
in-training evals) and ``RUN/eval.jsonl`` (the eval command's results at a checkpoint's
step) and writes ``RUN/curves.png`` (or ``--out``): the loss against steps (the learning
rate on a second axis) and, when there are any, the eval metrics against steps. The trainer
writes the same file at the end of a run. A record of a step logged again after a resume
replaces the earlier one. Needs matplotlib (``pip install 'infclip[plot]'``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from infclip.records import read_records

PNG_NAME = "curves.png"
_BOOKKEEPING = ("_chance", "num_samples", "num_classes", "num_images", "num_texts", "seconds")


class PlotError(ValueError):
    """The plot cannot be drawn; the message names why and the fix."""


def read_curves(run: Path) -> tuple[dict[int, dict], dict[str, dict[int, float]]]:
    """(step -> {loss, lr} of the training records, eval metric -> {step: value})."""
    train: dict[int, dict] = {}
    evals: dict[str, dict[int, float]] = {}
    for name in ("metrics.jsonl", "eval.jsonl"):
        for rec in read_records(run / name):  # (a record cut short by a kill is left out)
            step = rec.get("step")
            if not isinstance(step, int):
                continue
            if isinstance(rec.get("loss"), (int, float)):
                train[step] = {"loss": rec["loss"], "lr": rec.get("lr")}
            for key, value in rec.items():
                if key.startswith("eval/") and not key.endswith(_BOOKKEEPING) and isinstance(value, (int, float)):
                    evals.setdefault(key[len("eval/"):], {})[step] = float(value)
    return train, evals


def plot_run(run: Path, out: Optional[Path] = None) -> Path:
    """Draws the run's curves into ``out`` (default ``RUN/curves.png``); returns the path."""
    run = Path(run)
    if not (run / "metrics.jsonl").is_file():
        raise PlotError(f"{run} has no metrics.jsonl: give a run folder the trainer wrote (runs/<name>)")
    train, evals = read_curves(run)
    if not train:
        raise PlotError(f"{run}/metrics.jsonl holds no logged training step yet: plot once the run has logged one")
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2 if evals else 1, figsize=(12 if evals else 6.5, 4.2), squeeze=False)
    _loss_panel(axes[0][0], train)
    if evals:
        _eval_panel(axes[0][1], evals)
        axes[0][1].set_xlim(axes[0][0].get_xlim())  # the same steps under both panels
    fig.suptitle(run.name)
    fig.tight_layout()
    out = Path(out) if out is not None else run / PNG_NAME
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotError("drawing the curves needs matplotlib: pip install 'infclip[plot]' (or pip install "
                        "matplotlib); metrics.jsonl holds the same numbers") from None
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def _loss_panel(ax, train: dict[int, dict]) -> None:
    steps = sorted(train)
    ax.plot(steps, [train[s]["loss"] for s in steps], color="tab:blue", label="training loss")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss", color="tab:blue")
    lrs = [train[s]["lr"] for s in steps]
    if all(isinstance(v, (int, float)) for v in lrs):
        twin = ax.twinx()
        twin.plot(steps, lrs, color="tab:gray", linestyle="--", linewidth=1)
        twin.set_ylabel("learning rate", color="tab:gray")
    ax.set_title("learning curve")
    ax.grid(alpha=0.3)


def _eval_panel(ax, evals: dict[str, dict[int, float]]) -> None:
    for name, points in sorted(evals.items()):
        steps = sorted(points)
        ax.plot(steps, [points[s] for s in steps], marker="o", markersize=3, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("metric")
    ax.set_title("evaluation")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infclip.plot", description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a run folder (runs/<name>)")
    p.add_argument("--out", default=None, help=f"PNG file to write (default: RUN/{PNG_NAME})")
    a = p.parse_args(argv)
    try:
        path = plot_run(Path(a.run).expanduser(), Path(a.out).expanduser() if a.out else None)
    except (PlotError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"curves written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
