"""infclip.train.slurm: which job gets requeued, and the env:// variables of submitit tasks."""

import sys
import types

from infclip.train import slurm


def _fake_scontrol(tmp_path, rc=0):
    calls = tmp_path / "calls.txt"
    script = tmp_path / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\necho "boom" >&2\nexit {rc}\n')
    script.chmod(0o755)
    return script, calls


def test_requeue_names_the_job_or_array_task(tmp_path, monkeypatch):
    script, calls = _fake_scontrol(tmp_path)
    monkeypatch.setenv("INFCLIP_SCONTROL", str(script))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    assert slurm.requeue() is False and not calls.exists()  # not under Slurm: nothing to do
    monkeypatch.setenv("SLURM_JOB_ID", "1001")
    assert slurm.requeue() is True
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "900")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "7")
    assert slurm.requeue() is True
    monkeypatch.setenv("INFCLIP_REQUEUE", "0")
    assert slurm.requeue() is False
    assert calls.read_text().splitlines() == ["requeue 1001", "requeue 900_7"]


def test_requeue_failure_is_reported_not_raised(tmp_path, monkeypatch, capsys):
    script, _ = _fake_scontrol(tmp_path, rc=1)
    monkeypatch.setenv("INFCLIP_SCONTROL", str(script))
    monkeypatch.setenv("SLURM_JOB_ID", "1001")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    assert slurm.requeue() is False
    assert "boom" in capsys.readouterr().err


def test_submitit_env_is_exported_only_for_multi_task_submitit_jobs(monkeypatch):
    exported = []

    class TorchDistributedEnvironment:
        def export(self, set_cuda_visible_devices=True, overwrite=False):
            assert set_cuda_visible_devices is False  # the trainer selects cuda:LOCAL_RANK itself
            exported.append(True)

    fake = types.SimpleNamespace(helpers=types.SimpleNamespace(TorchDistributedEnvironment=TorchDistributedEnvironment))
    monkeypatch.setitem(sys.modules, "submitit", fake)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    slurm.export_submitit_env()  # plain sbatch/srun: torchrun sets the variables
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    slurm.export_submitit_env()
    assert exported == [True]
    monkeypatch.setenv("RANK", "3")  # already set (torchrun inside a submitit job): leave alone
    slurm.export_submitit_env()
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    slurm.export_submitit_env()
    assert exported == [True]
