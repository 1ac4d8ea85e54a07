"""Tracking and run-length options of the real train.py: TensorBoard event files and
``epochs`` (steps derived from the dataset size)."""

import subprocess
import sys

import pytest

from tests.train.test_train_cli import ROOT, TINY, _env, losses, run_train


def _refused(tmp_path, *overrides) -> str:
    """stderr of a train.py start that must be refused (exit 2, one paragraph)."""
    cmd = [sys.executable, str(ROOT / "train.py"), f"data.synthetic_root={tmp_path / 'synthetic'}", *TINY,
           f"run_dir={tmp_path / 'refused'}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-3000:])
    return proc.stderr


def _tb_scalars(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_tensorboard_events_hold_the_logged_losses(tmp_path):
    pytest.importorskip("tensorboard")
    run_dir = tmp_path / "run"
    run_train(tmp_path, f"run_dir={run_dir}", "steps=3", "eval.tasks=[]", "logging.tensorboard=true")
    assert any((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    tb, ref = _tb_scalars(run_dir, "loss"), losses(run_dir)
    assert sorted(tb) == sorted(ref) == [1, 2, 3]
    for step, value in ref.items():  # event files store float32
        assert tb[step] == pytest.approx(value, rel=1e-6), (step, tb, ref)
    assert set(_tb_scalars(run_dir, "lr")) == {1, 2, 3}


def test_tensorboard_missing_is_refused_before_the_model(tmp_path, monkeypatch):
    import importlib.util

    from omegaconf import OmegaConf

    from infclip.config import ConfigError, TrainConfig
    from infclip.train.build import preflight

    cfg = OmegaConf.structured(TrainConfig)
    cfg.logging.tensorboard, cfg.eval.tasks = True, []
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "tensorboard" else real(n, *a))
    with pytest.raises(ConfigError, match=r"logging.tensorboard=true.*pip install tensorboard"):
        preflight(cfg)
