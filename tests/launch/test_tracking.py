"""Experiment tracking: a resumed run continues its wandb run id; git commit and overrides
are recorded in metrics.jsonl and the wandb config; only rank 0 writes."""

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

from omegaconf import OmegaConf

from infclip.train.logger import MetricsLogger, git_commit, run_info
from infclip.train.rundir import derive_run_dir

ROOT = Path(__file__).resolve().parents[2]


def _cfg(mode):
    return SimpleNamespace(progress=False, wandb_mode=mode, wandb_project="infclip-test", wandb_entity=None)


def test_wandb_offline_resume_keeps_run_id_and_logs_run_info(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    info = run_info(["batch.global_size=64"], SimpleNamespace(world_size=2))
    first = MetricsLogger(tmp_path, _cfg("offline"), True, 10, {"steps": 10})
    first.log_run_info(info)
    first.log(1, {"loss": 2.0}, echo=False)
    run_id = first._wandb.id
    assert first._wandb.config["run"]["overrides"] == ["batch.global_size=64"]
    first.close()
    second = MetricsLogger(tmp_path, _cfg("offline"), True, 10, {"steps": 10})  # the resumed process
    assert second._wandb is None  # nothing (wandb files included) is written before the first record
    second.log(2, {"loss": 1.0}, echo=False)
    assert second._wandb.id == run_id == (tmp_path / "wandb_id.txt").read_text()
    second.close()
    offline = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    # wandb names a second offline folder started in the same second "<stamp>-<id>-1"
    assert len(offline) == 2 and all(n.split("-")[3] == run_id for n in offline), offline
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert recs[0]["event"] == "start" and recs[0]["world_size"] == 2
    assert [r["step"] for r in recs[1:]] == [1, 2]


def test_non_main_ranks_write_nothing(tmp_path):
    logger = MetricsLogger(tmp_path, _cfg("offline"), False, 10, {})
    logger.log_run_info({"a": 1})
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert list(tmp_path.iterdir()) == []


def test_git_commit_is_the_checkout_head():
    got = git_commit()
    if (ROOT / ".git").exists():
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        assert got["git_commit"] == head and isinstance(got["git_dirty"], bool)
    else:
        assert got == {}


def test_run_dir_derivation():
    cfg = OmegaConf.create({"run_dir": None, "runs_root": "/r", "name": "vit"})
    assert derive_run_dir(cfg) == Path("/r/vit")  # outside a Hydra multirun
    cfg.run_dir = "/elsewhere/x"
    assert derive_run_dir(cfg) == Path("/elsewhere/x")
