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


def test_epochs_derive_steps_from_the_dataset_size(tmp_path):
    run_dir = tmp_path / "run"
    # 256 synthetic samples, 96 per step: ceil(256 / 96) = 3 steps for one epoch
    proc = run_train(tmp_path, f"run_dir={run_dir}", "epochs=1", "eval.tasks=[]", "batch.global_size=96")
    assert "epochs=1: 256 samples per epoch / batch.global_size=96 -> steps=3" in proc.stdout
    assert sorted(losses(run_dir)) == [1, 2, 3]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00000003"]


def test_epochs_and_steps_together_are_refused(tmp_path):
    err = _refused(tmp_path, "steps=5", "epochs=2")
    assert "both steps=5 and epochs=2" in err and "drop steps=" in err
    assert not (tmp_path / "refused").exists()


def test_epochs_without_a_known_dataset_size_are_refused(tmp_path):
    import tarfile

    from omegaconf import OmegaConf

    from infclip.config import ConfigError, TrainConfig
    from infclip.train.build import apply_epochs
    from infclip.train.distributed import DistInfo

    for i in range(2):  # shards without sizes.json or *_stats.json: their size is unknown
        with tarfile.open(tmp_path / f"{i:05d}.tar", "w"):
            pass
    cfg = OmegaConf.structured(TrainConfig)
    cfg.epochs, cfg.data.kind, cfg.data.shards = 2, "wds", str(tmp_path / "{00000..00001}.tar")
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=__import__("torch").device("cpu"))
    with pytest.raises(ConfigError, match=r"epochs=2 needs the dataset size.*data.num_samples.*epochs=null"):
        apply_epochs(cfg, info)
    cfg.data.num_samples = 1000  # known: ceil(2 * 1000 / 256) = 8
    apply_epochs(cfg, info)
    assert cfg.steps == 8
