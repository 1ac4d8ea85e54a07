"""The run_dir lock: one training per run directory; a lock left by a dead process is
taken over; a live or remote holder is named in the refusal; released at exit."""

import json
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from infclip.train.rundir import LOCK_NAME, RunDirBusy, acquire, release, run_dir_lock


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write_lock(run_dir, **holder):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                 "start": time.time(), "token": "x", **holder}))


def test_second_acquire_refuses_and_names_the_holder(tmp_path):
    token = acquire(tmp_path / "run")
    with pytest.raises(RunDirBusy, match=rf"in use by another training \(pid {os.getpid()} on host"):
        acquire(tmp_path / "run")
    release(tmp_path / "run", token)
    assert not (tmp_path / "run" / LOCK_NAME).exists()
    release(tmp_path / "run", acquire(tmp_path / "run"))  # free again


def test_stale_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path, capsys):
    _write_lock(tmp_path / "run", pid=_dead_pid(), start=time.time() - 60)
    token = acquire(tmp_path / "run")
    assert "taking over the stale lock" in capsys.readouterr().err
    assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["token"] == token


def test_reused_pid_is_stale_but_a_lock_from_another_host_is_not(tmp_path):
    _write_lock(tmp_path / "a", start=time.time())  # held by this live process, which started before it
    with pytest.raises(RunDirBusy):
        acquire(tmp_path / "a")
    _write_lock(tmp_path / "b", start=0.0)  # taken in 1970: the pid now runs a younger process (reused)
    acquire(tmp_path / "b")
    _write_lock(tmp_path / "c", host="another-host", pid=_dead_pid())
    with pytest.raises(RunDirBusy, match="another-host"):
        acquire(tmp_path / "c")


def test_requeued_slurm_job_takes_over_its_own_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    _write_lock(tmp_path / "run", host="node-that-died", pid=1, slurm_job="4242")
    acquire(tmp_path / "run")


def test_context_only_rank0_holds_it_and_a_created_folder_is_removed_when_nothing_was_written(tmp_path):
    rank1 = SimpleNamespace(is_main=False, distributed=False)
    with run_dir_lock(tmp_path / "r1", rank1):
        assert not (tmp_path / "r1").exists()
    rank0 = SimpleNamespace(is_main=True, distributed=False)
    with run_dir_lock(tmp_path / "r0", rank0):
        assert (tmp_path / "r0" / LOCK_NAME).is_file()
    assert not (tmp_path / "r0").exists()  # a refused start leaves no empty folder behind
    with pytest.raises(RuntimeError):
        with run_dir_lock(tmp_path / "r2", rank0):
            (tmp_path / "r2" / "config.yaml").write_text("x")
            raise RuntimeError("build failed")
    assert sorted(p.name for p in (tmp_path / "r2").iterdir()) == ["config.yaml"]  # lock released


def test_a_fresh_empty_lock_is_reported_as_such_not_as_pid_none(tmp_path):
    (tmp_path / LOCK_NAME).write_text("")
    with pytest.raises(RunDirBusy) as err:
        acquire(tmp_path)
    text = str(err.value)
    assert "empty or unreadable and less than a minute old" in text
    assert "None" not in text and "1970" not in text


def test_a_start_that_cannot_write_its_lock_leaves_none_behind(tmp_path, monkeypatch):
    import errno

    from infclip.train import rundir

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rundir.json, "dump", full)
    with pytest.raises(rundir.RunDirUnusable, match="the disk is full"):
        acquire(tmp_path / "run")
    assert not (tmp_path / "run" / LOCK_NAME).exists()
