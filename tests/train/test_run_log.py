"""A run that shows itself: ``<run_dir>/out.log`` holds what the run printed (startup, progress,
eval, resume, summary), appended per start and untouched by a refused start; progress lines
carry the epoch, elapsed time and ETA in one number format, no GPU memory on CPU, and the
eval as a short table; the summary gives this process's steps and the whole run's time."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from infclip.plot import main as plot_main, read_curves
from infclip.train import logger as logger_mod
from infclip.train.logger import MetricsLogger, _num, clock, eval_table

ROOT = Path(__file__).resolve().parents[2]
FAST = ["model.name=infclip-micro", "batch.global_size=8", "batch.micro_size=4", "data.loader_batch=4",
        "data.workers=0", "logging.every_n_steps=1", "logging.progress=false", "logging.wandb_mode=disabled",
        "data.synthetic_train=64", "data.synthetic_eval=16", "eval.workers=0"]


def _train(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *FAST, f"data.synthetic_root={tmp_path / 'syn'}",
                           f"run_dir={tmp_path / 'run'}", *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1"))


def test_out_log_progress_lines_eval_table_and_summary_across_a_resume(tmp_path):
    first = _train(tmp_path, "steps=3")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    log = (tmp_path / "run" / "out.log").read_text()
    assert log.startswith("== start ") and "data: training on the embedded synthetic" in log
    steps = [x for x in log.splitlines() if x.startswith("step ")]
    assert [x.split()[1] for x in steps] == ["1/3", "2/3", "3/3"]
    for line in steps:  # the first line sets the ETA's pace (its step carries warm-up) and has none
        eta = r"" if line is steps[0] else r"  eta=\d:\d\d:\d\d"
        assert re.search(r"  epoch=0\.\d\d  elapsed=\d:\d\d:\d\d" + eta + "$", line), line
        assert "gpu_mem_gb" not in line and not re.search(r"\d\.\d+e\+\d", line), line  # CPU: no GPU memory
    table = log.split("eval at step 3:\n", 1)[1].splitlines()
    assert table[0].startswith("  synthetic_zeroshot   top1 0.") and " top5 0." in table[0]
    assert table[1].startswith("  synthetic_retrieval  i2t_r1 0.")
    assert "== done: 3 steps in " in log and first.stdout.strip().splitlines()[-1] in log
    drawn = importlib.util.find_spec("matplotlib") is not None
    assert (f"   curves: {tmp_path / 'run' / 'curves.png'}" if drawn else "   curves: not drawn (drawing the curves "
            "needs matplotlib: pip install 'infclip[plot]'") in log
    assert (tmp_path / "run" / "curves.png").is_file() == drawn

    _check_per_class(tmp_path / "run")

    second = _train(tmp_path, "steps=5")
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    log = (tmp_path / "run" / "out.log").read_text()
    assert log.count("== start ") == 2 and "resumed from" in log.split("== start ")[2]
    assert re.search(r"== done: steps 4-5 in [\d.]+ s in this process, 5 steps in [\d.]+ s over 2 starts", log)

    refused = _train(tmp_path, "steps=6", "resume=none")
    assert refused.returncode == 2 and "resume=none" in refused.stderr
    assert (tmp_path / "run" / "out.log").read_text() == log  # a refused start writes nothing


def test_numbers_clock_and_eval_table():
    assert [_num(x) for x in (45560.0, 8097, 2.5, 1e-4, 0.0, 0.01234, 8.954e-4, 2.0001)] == [
        "45560", "8097", "2.500", "0.0001000", "0.000", "0.01234", "0.0008954", "2.000"]
    assert clock(3725.4) == "1:02:05" and clock(-1) == "0:00:00"
    table = eval_table(7, {"eval/a/top1": 0.5, "eval/a/top1_chance": 0.1, "eval/long_name/i2t_r1": 0.25, "loss": 1.0})
    assert table == ["eval at step 7:", "  a          top1 0.5000", "  long_name  i2t_r1 0.2500"]


def test_python_m_infclip_plot_draws_the_run_and_refuses_a_folder_without_metrics(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    records = [{"event": "start", "time": 0}] + [{"step": s, "time": s, "loss": 3.0 / s, "lr": 1e-3} for s in (1, 2, 3)]
    records += [{"step": 3, "time": 4, "eval/a/top1": 0.5, "eval/a/top1_chance": 0.1, "eval/a/num_samples": 9},
                {"step": 2, "time": 5, "loss": 2.0, "lr": 1e-3}]  # a resumed run logged step 2 again
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 4, "lo')
    (run / "eval.jsonl").write_text(json.dumps({"step": 1, "event": "eval_command", "eval/a/top1": 0.25}) + "\n")
    train, evals = read_curves(run)
    assert {s: r["loss"] for s, r in train.items()} == {1: 3.0, 2: 2.0, 3: 1.0}
    assert evals == {"a/top1": {1: 0.25, 3: 0.5}}  # no chance or bookkeeping keys
    assert plot_main([str(tmp_path / "none")]) == 2
    assert "has no metrics.jsonl: give a run folder" in capsys.readouterr().err
    pytest.importorskip("matplotlib")
    assert plot_main([str(run)]) == 0
    from PIL import Image

    with Image.open(run / "curves.png") as png:
        assert png.format == "PNG" and png.size[0] > png.size[1] > 300  # two panels side by side


def _check_per_class(run: Path) -> None:
    """The final eval's per-class CSV and confusion matrix agree with its top-1 and mean
    per-class recall in metrics.jsonl."""
    import csv

    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in records if "eval/synthetic_zeroshot/top1" in r][-1]
    rows = list(csv.DictReader((run / "per_class" / "synthetic_zeroshot.csv").open()))
    matrix = list(csv.reader((run / "per_class" / "synthetic_zeroshot_confusion.csv").open()))
    assert len(rows) == len(matrix) - 1 == final["eval/synthetic_zeroshot/num_classes"] == len(matrix[0]) - 1
    counts = [[int(v) for v in row[1:]] for row in matrix[1:]]
    total = sum(map(sum, counts))
    assert total == sum(int(r["images"]) for r in rows) == final["eval/synthetic_zeroshot/num_samples"]
    assert sum(counts[i][i] for i in range(len(counts))) / total == pytest.approx(final["eval/synthetic_zeroshot/top1"])
    recalls = [float(r["top1"]) for r in rows if int(r["images"])]
    assert sum(recalls) / len(recalls) == pytest.approx(final["eval/synthetic_zeroshot/mean_per_class_recall"])


def test_the_confusion_matrix_counts_top1_predictions_and_leaves_out_non_finite_scores():
    import torch

    from infclip.eval.zeroshot import confusion_counts

    classes = torch.eye(3)
    img = torch.tensor([[1.0, 0, 0], [0, 0.2, 1.0], [0, 1.0, 0], [float("nan"), 0, 0]])
    matrix = confusion_counts(img, torch.tensor([0, 1, 1, 2]), classes)
    assert matrix.tolist() == [[1, 0, 0], [0, 1, 1], [0, 0, 0]]


def test_the_text_log_holds_lines_until_the_start_is_accepted_and_logs_the_error_that_ends_a_run(tmp_path, capsys):
    from infclip.train.textlog import text_log

    with pytest.raises(ValueError):
        with text_log(True):
            print("refused before the start")
            raise ValueError("a refused start")
    assert not list(tmp_path.iterdir())  # nothing written: the log never opened
    with pytest.raises(RuntimeError):
        with text_log(True) as log:
            print("startup line")
            log.open(tmp_path)
            print("progress\rstep 2")  # a bar's redraw: only the text after the carriage return
            raise RuntimeError("the run failed")
    lines = (tmp_path / "out.log").read_text().splitlines()
    assert lines[0].startswith("== start ") and lines[1:] == ["startup line", "step 2",
                                                             "error (RuntimeError): the run failed"]
    assert "startup line" in capsys.readouterr().out  # the terminal still sees everything


def test_eta_paces_the_steps_after_the_first_progress_line(tmp_path, monkeypatch, capsys):
    """A 100 s first step (compilation) then 1 s steps: the ETA counts 1 s a step, elapsed counts all;
    a resumed process starts a new pace."""
    now = [0.0]
    monkeypatch.setattr(logger_mod.time, "perf_counter", lambda: now[0])
    cfg = SimpleNamespace(progress=False, wandb_mode="disabled", tensorboard=False)
    log = MetricsLogger(tmp_path, cfg, enabled=True, total_steps=10, config_dict={})
    log.set_start(0)
    for step, t in ((1, 100.0), (2, 101.0), (4, 103.0)):
        now[0] = t
        log.log(step, {"loss": 1.0})
    log.set_start(4)
    for step, t in ((5, 150.0), (6, 152.0)):
        now[0] = t
        log.log(step, {"loss": 1.0})
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("step ")]
    assert [x.split("  ")[-2:] for x in lines] == [
        ["loss=1.000", "elapsed=0:01:40"], ["elapsed=0:01:41", "eta=0:00:08"], ["elapsed=0:01:43", "eta=0:00:06"],
        ["loss=1.000", "elapsed=0:00:47"], ["elapsed=0:00:49", "eta=0:00:08"]]
