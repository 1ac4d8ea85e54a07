"""``python -m infclip.launch``: a requested stop of a 2-rank run (Ctrl-C, a scheduler's SIGTERM)
ends like a single process's: every rank checkpoints the same step, the stop is announced once,
the launcher exits 0 without torchrun's traceback, and the same command resumes.

Plain torchrun raises ``SignalException`` in its agent on such a signal: after its workers
stopped it printed that traceback and exited 1 (and its loader workers, forked with the
trainer's SIGINT handler, announced a Ctrl-C a second time).
"""

import os
import signal
import sys

import pytest
from launch_testutils import ROOT, child_env, run, start, step_records, train_cmd, wait_for_step

from infclip.train import checkpoint as ckpt

STEPS = 10
COMMON = [f"steps={STEPS}", "checkpoint.every_n_steps=4"]


def _launch_cmd(data_root, run_dir):
    return [sys.executable, "-m", "infclip.launch", "--standalone", "--nproc_per_node=2",
            *train_cmd(data_root, run_dir, *COMMON)[1:]]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_a_stop_signal_to_the_launcher_ends_without_traceback_and_resumes(tmp_path, sig):
    data_root, run_dir, log = tmp_path / "synthetic", tmp_path / "run", tmp_path / "first.log"
    env = child_env(PYTHONPATH=str(ROOT))
    # its own session, as a terminal's foreground job: the signal reaches the launcher only
    # (torchrun starts each worker in a session of its own)
    proc = start(_launch_cmd(data_root, run_dir), cwd=tmp_path, log=log, env=env)
    wait_for_step(proc, run_dir, 3, log)
    os.killpg(proc.pid, sig)
    rc = proc.wait(timeout=240)
    out = log.read_text()
    assert rc == 0, out[-4000:]
    for noise in ("Traceback", "ChildFailedError", "SignalException", "death signal"):
        assert noise not in out, out[-4000:]
    said = "interrupted: stopping after this step" if sig == signal.SIGINT else "SIGTERM: stopping after this step"
    assert out.count(said) == 1, out[-4000:]
    last = max(r["step"] for r in step_records(run_dir))
    assert 3 <= last < STEPS and "== stopped by signal" in out
    path = ckpt.list_checkpoints(run_dir)[-1]
    assert path.name == f"step_{last:08d}" and (path / "rank_00001.pt").exists()
    if sig != signal.SIGINT:
        return
    second = run(_launch_cmd(data_root, run_dir), cwd=tmp_path, env=env)
    both = second.stdout + second.stderr
    assert second.returncode == 0 and "Traceback" not in both, both[-4000:]
    assert f"step_{last:08d} at step {last}" in second.stdout, both[-4000:]
    assert max(r["step"] for r in step_records(run_dir)) == STEPS


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["usr1", "sigterm"])
def test_the_slurm_node_script_stops_cleanly_and_requeues_only_on_usr1(tmp_path, sig):
    """scripts/slurm/torchrun_node.sh (one node, 2 ranks, the launcher it starts) signalled as
    Slurm signals a job step: Slurm's warning (USR1) checkpoints, exits 0 and asks for a requeue;
    a cancel (SIGTERM) checkpoints and exits 0 without one; neither ends in a traceback."""
    import stat

    data_root, run_dir, log = tmp_path / "synthetic", tmp_path / "run", tmp_path / "node.log"
    calls = tmp_path / "scontrol_calls.txt"
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    env = child_env(NNODES="1", GPUS_PER_NODE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                    SLURM_NODEID="0", SLURM_JOB_ID="4243", INFCLIP_REPO=str(ROOT), INFCLIP_SCONTROL=str(scontrol),
                    PYTHON=sys.executable)
    cmd = ["bash", str(ROOT / "scripts" / "slurm" / "torchrun_node.sh"), *train_cmd(data_root, run_dir, *COMMON)[2:]]
    proc = start(cmd, cwd=tmp_path, log=log, env=env)
    wait_for_step(proc, run_dir, 3, log)
    os.killpg(proc.pid, sig)  # the job step's processes (the workers have sessions of their own)
    rc = proc.wait(timeout=240)
    out = log.read_text()
    assert rc == 0 and "Traceback" not in out and "SignalException" not in out, out[-4000:]
    last = max(r["step"] for r in step_records(run_dir))
    assert last < STEPS and ckpt.list_checkpoints(run_dir)[-1].name == f"step_{last:08d}"
    if sig == signal.SIGUSR1:
        assert calls.read_text().split() == ["requeue", "4243"]
    else:
        assert not calls.exists()  # a cancel is never requeued


def test_a_stop_is_forwarded_once_turns_restarts_off_and_a_second_ctrl_c_ends_the_launch(monkeypatch):
    """The launcher's handler, without a training: the first stop signal reaches each worker's
    process group and leaves the agent no restart (a restart would resume the stopped training);
    a second Ctrl-C takes torchrun's own path (SignalException: the workers get it and exit at once)."""
    import subprocess
    from types import SimpleNamespace

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from infclip import launch

    # (SIGINT at its default in the workers: a suite started in the background, `cmd &`, runs
    # with SIGINT ignored, and the workers would inherit that)
    workers = [subprocess.Popen(["sleep", "60"], start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) for _ in range(2)]
    try:
        group = SimpleNamespace(workers=[SimpleNamespace(id=w.pid) for w in workers])
        agent = SimpleNamespace(get_worker_group=lambda: group, _remaining_restarts=3)
        monkeypatch.setattr(launch._Stop, "agent", agent)
        monkeypatch.setattr(launch._Stop, "signal", 0)
        monkeypatch.setattr(launch._Stop, "interrupts", 0)
        launch._on_signal(signal.SIGINT, None)
        assert [w.wait(timeout=30) for w in workers] == [-signal.SIGINT] * 2
        assert agent._remaining_restarts == 0 and launch._Stop.signal == signal.SIGINT
        with pytest.raises(SignalException):
            launch._on_signal(signal.SIGINT, None)
    finally:
        for w in workers:
            w.kill()
            w.wait()


def test_a_rank_failing_after_a_stop_ends_the_launch_with_its_status_in_one_line(monkeypatch, capsys):
    """After a requested stop a rank's non-zero exit (here SIGKILL) is the launch's status, in one
    line instead of torchrun's report; without a stop request torchrun reports it as always."""
    from types import SimpleNamespace

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from infclip import launch

    def failing(args):
        raise ChildFailedError("train.py", {1: ProcessFailure(local_rank=1, pid=1, exitcode=-9, error_file="<N/A>")})

    monkeypatch.setattr(launch._Stop, "signal", int(signal.SIGTERM))
    with pytest.raises(SystemExit) as end:
        launch._run(SimpleNamespace(run=failing), None)
    assert end.value.code == 128 + 9
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rank 1 exited with status 137 after SIGTERM" in err
    monkeypatch.setattr(launch._Stop, "signal", 0)  # no stop requested: torchrun's own report
    with pytest.raises(ChildFailedError):
        launch._run(SimpleNamespace(run=failing), None)
