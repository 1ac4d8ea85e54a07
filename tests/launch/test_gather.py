"""gather.py turns a sweep's run directories into one CSV (+ PNG with matplotlib); a Hydra
multirun of the real train.py puts each sweep member in its own run directory."""

import csv
import importlib.util
import json
import sys
from pathlib import Path

from launch_testutils import ROOT, MICRO, child_env, run, step_records
from omegaconf import OmegaConf

sys.path.insert(0, str(ROOT / "scripts" / "slurm"))
import gather  # noqa: E402


def _fake_run(d: Path, batch: int, step_times: list[float], mem: list[float], evals: dict, truncated=False):
    d.mkdir(parents=True)
    OmegaConf.save(OmegaConf.create({"batch": {"global_size": batch}, "optim": {"lr": 1e-3}}), d / "config.yaml")
    lines = [json.dumps({"event": "start", "world_size": 8})]
    for i, (t, m) in enumerate(zip(step_times, mem), start=1):
        lines.append(json.dumps({"step": i, "loss": 10.0 - i, "step_time": t, "samples_per_s": batch / t,
                                 "samples_per_s_per_gpu": batch / t / 8, "gpu_mem_gb": m, "nonfinite_steps": 0}))
    lines.append(json.dumps({"step": len(step_times), "eval/imagenet/top1": 0.1}))
    lines.append(json.dumps({"step": len(step_times), "summary": evals}))
    text = "\n".join(lines) + "\n"
    if truncated:
        text += '{"step": 99, "loss": 1.'  # a record cut short by SIGKILL
    (d / "metrics.jsonl").write_text(text)


def test_gather_writes_one_row_per_run_sorted_by_batch(tmp_path, capsys):
    sw = tmp_path / "sweep"
    _fake_run(sw / "b65536", 65536, [30.0, 2.0, 4.0, 3.0], [10.0, 12.5, 12.0, 11.0],
              {"eval/imagenet/top1": 0.31, "eval/imagenet/top1_chance": 0.001}, truncated=True)
    _fake_run(sw / "b32768", 32768, [20.0, 1.0, 1.5], [6.0, 7.0, 7.5], {"eval/imagenet/top1": 0.25})
    assert gather.main([str(sw)]) == 0
    rows = list(csv.DictReader(open(sw / "sweep.csv")))
    assert [r["batch"] for r in rows] == ["32768", "65536"]
    big = rows[1]
    assert float(big["step_time_s"]) == 3.0  # median of steps 2-4: start-up step left out
    assert float(big["peak_gpu_mem_gb"]) == 12.5 and float(big["loss"]) == 6.0
    assert int(big["steps_done"]) == 4 and big["world_size"] == "8"
    assert float(big["eval/imagenet/top1"]) == 0.31  # the newest value (the final summary)
    assert "eval/imagenet/top1_chance" not in rows[0]
    has_mpl = importlib.util.find_spec("matplotlib") is not None
    assert (sw / "sweep.png").exists() == has_mpl
    assert ("no plot" in capsys.readouterr().out) != has_mpl


def test_hydra_multirun_gives_each_job_its_own_run_dir(tmp_path):
    """``train.py -m batch.global_size=32,64``: two run dirs under runs_root/name, named by
    the job's overrides, each with its own metrics; gather then reads them both."""
    micro = [o for o in MICRO if not o.startswith("batch.global_size")]
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", f"data.synthetic_root={tmp_path / 'syn'}", *micro,
           "steps=1", f"runs_root={tmp_path / 'runs'}", "name=sw", "batch.global_size=32,64",
           "hydra.job.config.override_dirname.exclude_keys=[data.synthetic_root,runs_root,name]"]
    proc = run(cmd, cwd=tmp_path, env=child_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    dirs = sorted(p.parent for p in (tmp_path / "runs" / "sw").glob("*/metrics.jsonl"))
    assert len(dirs) == 2, list((tmp_path / "runs").rglob("*"))
    assert all(len(step_records(d)) == 1 for d in dirs)
    assert sorted("batch.global_size=32," in d.name or "batch.global_size=64," in d.name for d in dirs) == [True, True]
    assert gather.main([str(tmp_path / "runs" / "sw")]) == 0
    rows = list(csv.DictReader(open(tmp_path / "runs" / "sw" / "sweep.csv")))
    assert [r["batch"] for r in rows] == ["32", "64"]


def test_the_sweep_plot_leaves_out_a_gpu_memory_panel_that_is_all_zero():
    rows = [{"batch": 32, "samples_per_s_per_gpu": 10.0, "peak_gpu_mem_gb": 0.0, "eval/a/top1": 0.5},
            {"batch": 64, "samples_per_s_per_gpu": 12.0, "peak_gpu_mem_gb": 0.0}]
    assert [k for k, _ in gather.plot_panels(rows)] == ["samples_per_s_per_gpu", "eval/a/top1"]
    rows[1]["peak_gpu_mem_gb"] = 3.5
    assert [k for k, _ in gather.plot_panels(rows)] == ["samples_per_s_per_gpu", "peak_gpu_mem_gb", "eval/a/top1"]
