"""Kill, preempt and resume the real train.py: the resumed losses equal an uninterrupted run's.

One uninterrupted reference run (module fixture); then a SIGKILL at a random step followed
by resume=auto; SIGUSR1 under a (fake) Slurm job: checkpoint, exit 0, ``scontrol requeue``,
then resume; SIGTERM (a user's scancel): checkpoint, exit 0, no requeue.
"""

import os
import random
import signal
import stat
import sys
import time
from pathlib import Path

import pytest
from launch_testutils import (
    child_env, losses_by_step, records, reference_run, run, start, start_and_kill, step_records, train_cmd,
    wait_for_step,
)

from infclip.train import checkpoint as ckpt

STEPS = 10
COMMON = [f"steps={STEPS}", "checkpoint.every_n_steps=2", "checkpoint.keep_last=2"]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return tmp_path_factory.mktemp("synthetic")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_root):
    """Losses of an uninterrupted run, one per step."""
    return reference_run(tmp_path_factory.mktemp("reference"), data_root, STEPS, *COMMON)[1]


def assert_same_losses(run_dir, reference):
    """Every logged loss (re-run steps included) equals the uninterrupted run's, exactly."""
    got = losses_by_step(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1)), sorted(got)
    for step, values in got.items():
        assert all(v == reference[step] for v in values), (step, values, reference[step])


def test_sigkill_at_random_step_then_resume_matches_uninterrupted(tmp_path, data_root, reference):
    run_dir, log = tmp_path / "run", tmp_path / "first.log"
    kill_at = random.Random().randint(2, STEPS - 2)
    print(f"SIGKILL after step {kill_at} is logged")
    start_and_kill(train_cmd(data_root, run_dir, *COMMON), run_dir, kill_at, tmp_path, log)
    before = (run_dir / "metrics.jsonl").read_text()
    # the kill may land mid-step or mid-checkpoint: resume=auto takes the newest complete one
    latest = ckpt.Checkpointer(run_dir, 2, 0, lambda: None).latest_loadable(world_size=1)

    second = run(train_cmd(data_root, run_dir, *COMMON), cwd=tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    if latest is not None:
        assert f"resumed from {latest}" in second.stdout
    after = (run_dir / "metrics.jsonl").read_text()
    resumed_at = int(latest.name[5:]) if latest is not None else 0
    kept = [line for line in before.splitlines() if not _after_step(line, resumed_at)]
    # same run dir, metrics continued: the records up to the resumed step stay, those of the
    # steps the kill lost (and that are replayed) are dropped, so every step is logged once
    assert after.startswith("\n".join(kept))
    assert sum(r.get("event") == "start" for r in records(run_dir)) == 2
    assert_same_losses(run_dir, reference)
    assert all(len(v) == 1 for v in losses_by_step(run_dir).values())
    assert [p.name for p in ckpt.list_checkpoints(run_dir)][-1] == f"step_{STEPS:08d}"


def _after_step(line, step):
    """A metrics line of a step after ``step`` (or cut short by the kill)."""
    import json

    try:
        rec = json.loads(line)
    except ValueError:
        return True
    return isinstance(rec.get("step"), int) and rec["step"] > step


def _fake_scontrol(tmp_path):
    calls = tmp_path / "scontrol_calls.txt"
    script = tmp_path / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script, calls


def _signal_mid_run(tmp_path, data_root, sig, env):
    """Sends ``sig`` after step 3 to the whole process group, data-loader workers included
    (as Slurm and torchrun do); returns (returncode, log text, last logged step)."""
    run_dir, log = tmp_path / "run", tmp_path / "first.log"
    proc = start(train_cmd(data_root, run_dir, *COMMON), cwd=tmp_path, log=log, env=env)
    wait_for_step(proc, run_dir, 3, log)
    os.killpg(proc.pid, sig)
    rc = proc.wait(timeout=120)
    return rc, log.read_text(), max(r["step"] for r in step_records(run_dir))


def test_sigusr1_under_slurm_checkpoints_exits_0_requeues_and_resumes(tmp_path, data_root, reference):
    scontrol, calls = _fake_scontrol(tmp_path)
    env = child_env(SLURM_JOB_ID="4242", INFCLIP_SCONTROL=str(scontrol))
    rc, out, last = _signal_mid_run(tmp_path, data_root, signal.SIGUSR1, env)
    assert rc == 0, out[-3000:]
    assert last < STEPS and "stopped by signal" in out
    assert ckpt.list_checkpoints(tmp_path / "run")[-1].name == f"step_{last:08d}"  # the step it stopped at
    assert calls.read_text().split() == ["requeue", "4242"]
    # the requeued job starts again with the same command: it resumes and matches
    second = run(train_cmd(data_root, tmp_path / "run", *COMMON), cwd=tmp_path)
    assert second.returncode == 0 and f"step_{last:08d} at step {last}" in second.stdout, second.stdout[-2000:]
    assert_same_losses(tmp_path / "run", reference)


def test_sigterm_checkpoints_and_exits_0_without_requeue(tmp_path, data_root, reference):
    scontrol, calls = _fake_scontrol(tmp_path)
    env = child_env(SLURM_JOB_ID="4242", INFCLIP_SCONTROL=str(scontrol))
    rc, out, last = _signal_mid_run(tmp_path, data_root, signal.SIGTERM, env)
    assert rc == 0, out[-3000:]
    path = ckpt.list_checkpoints(tmp_path / "run")[-1]
    assert path.name == f"step_{last:08d}" and last < STEPS
    model, train_state, _ = ckpt.load(path, rank=0)
    assert train_state["step"] == last and "logit_scale" in model
    assert not calls.exists()  # SIGTERM is a cancel (or Slurm's own preemption): never requeue
    for step in range(1, last + 1):
        assert losses_by_step(tmp_path / "run")[step] == [reference[step]]


def test_ctrl_c_checkpoints_the_last_step_exits_0_and_resumes_exactly(tmp_path, data_root, reference):
    """SIGINT to the process group (a terminal's Ctrl-C) is a stop signal like SIGTERM: it
    was a KeyboardInterrupt traceback, exit 130, no checkpoint."""
    rc, out, last = _signal_mid_run(tmp_path, data_root, signal.SIGINT, child_env())
    assert rc == 0 and "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    # once, though the group's loader worker got the SIGINT too (forked with the trainer's handler,
    # it announced the stop a second time)
    assert out.count("interrupted: stopping after this step with a checkpoint") == 1, out[-3000:]
    assert ckpt.list_checkpoints(tmp_path / "run")[-1].name == f"step_{last:08d}" and last < STEPS
    assert not list((tmp_path / "run" / "checkpoints").glob(".step_*.tmp"))
    second = run(train_cmd(data_root, tmp_path / "run", *COMMON), cwd=tmp_path)
    assert second.returncode == 0 and f"step_{last:08d} at step {last}" in second.stdout, second.stdout[-2000:]
    assert_same_losses(tmp_path / "run", reference)


def test_a_second_ctrl_c_exits_at_once_with_status_130(tmp_path):
    """The handler itself, in a child process: the first SIGINT is recorded as SIGTERM (never
    a requeue) and announced; the second ends the process at once, though nothing returns."""
    script = (
        "import os, signal, sys, time, types\n"
        "from infclip.train.signals import install_signal_handlers\n"
        "state = types.SimpleNamespace(signal_received=0)\n"
        "install_signal_handlers(state)\n"
        "os.kill(os.getpid(), signal.SIGINT); time.sleep(0.2)\n"
        "print('recorded', state.signal_received, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGINT); time.sleep(30)\n"
        "print('still running', flush=True)\n"
    )
    t0 = time.monotonic()
    proc = run([sys.executable, "-c", script], cwd=tmp_path, env=child_env(PYTHONPATH=str(Path(ckpt.__file__).parents[2])))
    assert proc.returncode == 130 and time.monotonic() - t0 < 20, proc.stdout + proc.stderr
    assert proc.stdout.split() == ["recorded", str(int(signal.SIGTERM))]
    assert "interrupt again to exit at once" in proc.stderr and "exiting now without a checkpoint" in proc.stderr


def _worker_pid(torchrun_pid, rank, timeout=120):
    """The pid of torchrun's worker with RANK=rank (read from /proc)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for task in Path(f"/proc/{torchrun_pid}/task").glob("*"):
            for pid in (task / "children").read_text().split():
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                if f"RANK={rank}".encode() in env:
                    return int(pid)
        time.sleep(0.1)
    raise AssertionError(f"no worker with RANK={rank}")


def test_usr1_to_one_rank_stops_every_rank_after_the_same_step_and_rank0_requeues(tmp_path, data_root):
    """torchrun, 2 gloo ranks: the warning reaches rank 1 only; both ranks still stop after
    the same step (the signal is all-reduced), write one complete checkpoint, exit 0, and
    rank 0 (which got no signal itself) requeues the job exactly once."""
    scontrol, calls = _fake_scontrol(tmp_path)
    env = child_env(SLURM_JOB_ID="77", INFCLIP_SCONTROL=str(scontrol))
    run_dir, log = tmp_path / "run", tmp_path / "ddp.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           *train_cmd(data_root, run_dir, *COMMON)[1:]]
    proc = start(cmd, cwd=tmp_path, log=log, env=env)
    rank1 = _worker_pid(proc.pid, 1)
    wait_for_step(proc, run_dir, 2, log)
    os.kill(rank1, signal.SIGUSR1)
    assert proc.wait(timeout=180) == 0, log.read_text()[-3000:]
    last = max(r["step"] for r in step_records(run_dir))
    assert last < STEPS and "stopped by signal" in log.read_text()
    path = ckpt.list_checkpoints(run_dir)[-1]
    assert path.name == f"step_{last:08d}"
    assert ckpt.Checkpointer(run_dir, 2, 0, lambda: None).latest_loadable(world_size=2) == path
    assert calls.read_text().split() == ["requeue", "77"]
