"""A run is never lost or poisoned, on the real train.py: a damaged newest
checkpoint falls back to the previous intact one with identical losses after; a NaN put into
the weights by an update is caught before any save and the printed resume command works; a
resume with a new lr applies it; a refused resume leaves the run folder untouched; a second
training on a busy run_dir refuses; SIGTERM during the final eval keeps every step."""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch_testutils import (
    MICRO, ROOT, child_env, losses_by_step, records, reference_run, run, start, step_records, train_cmd,
    wait_for,
    wait_for_step,
)

from infclip.train import checkpoint as ckpt

STEPS = 8
COMMON = [f"steps={STEPS}", "checkpoint.every_n_steps=2", "checkpoint.keep_last=4",
          "schedule.kind=constant", "schedule.warmup_steps=0", "optim.lr=1e-3"]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return tmp_path_factory.mktemp("synthetic")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_root):
    """An uninterrupted run: its folder (checkpoints 2, 4, 6, 8) and its loss per step."""
    return reference_run(tmp_path_factory.mktemp("reference"), data_root, STEPS, *COMMON)


def _copy_until(reference, tmp_path, step):
    """The reference run folder as a run killed right after checkpointing ``step`` left it."""
    src, _ = reference
    run_dir = tmp_path / "run"
    shutil.copytree(src, run_dir)
    for p in ckpt.list_checkpoints(run_dir):
        if int(p.name[5:]) > step:
            shutil.rmtree(p)
    return run_dir


def _damage(path, how):
    target = path / ("train.pt" if how == "cut_train" else "model.pt")
    data = target.read_bytes()
    if how == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif how == "random":
        target.write_bytes(os.urandom(len(data)))
    else:
        target.write_bytes(data[:1000])


@pytest.mark.parametrize("how", ["truncate", "random", "cut_train"])
def test_damaged_newest_checkpoint_falls_back_with_identical_losses(tmp_path, data_root, reference, how):
    from infclip.eval.cli import resolve_checkpoint

    run_dir = _copy_until(reference, tmp_path, 6)
    newest = run_dir / "checkpoints" / "step_00000006"
    _damage(newest, how)
    if how != "cut_train":  # the eval command skips a damaged model.pt too (and sets it aside: on a copy)
        copy = tmp_path / "copy"
        shutil.copytree(run_dir, copy)
        assert resolve_checkpoint(str(copy)) == str(copy / "checkpoints" / "step_00000004" / "model.pt")
        assert (copy / "checkpoints" / "step_00000006.damaged").is_dir()
    proc = run(train_cmd(data_root, run_dir, *COMMON), cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert f"skipping damaged checkpoint {newest}" in out and "Traceback" not in out
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000004'} at step 4" in out
    assert (run_dir / "checkpoints" / "step_00000006.damaged").is_dir()  # moved aside, not deleted
    got = losses_by_step(run_dir)  # steps 5-6 replayed: their old records were dropped
    assert {s: v for s, v in got.items()} == {s: [v] for s, v in reference[1].items()}


def test_nan_in_the_weights_is_caught_before_any_save_and_the_printed_resume_works(tmp_path, data_root):
    run_dir = tmp_path / "run"
    cmd = train_cmd(data_root, run_dir, *COMMON, "checkpoint.every_n_steps=1")
    proc = run(cmd, cwd=tmp_path, env=child_env(INFCLIP_INJECT_NAN_WEIGHTS_AT_STEPS="4"))
    err = proc.stderr
    assert proc.returncode == 2, proc.stdout[-2000:] + err[-3000:]
    assert "the update of step 4" in err and "made the weights non-finite" in err and "Traceback" not in err
    names = [p.name for p in ckpt.list_checkpoints(run_dir)]
    assert names == ["step_00000001", "step_00000002", "step_00000003"]  # nothing of step 4 written
    for p in ckpt.list_checkpoints(run_dir):
        weights, _, _ = ckpt.load(p, rank=0)
        assert all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point()), p
    assert f"newest finite checkpoint is {run_dir / 'checkpoints' / 'step_00000003'}" in err
    command = next(line.strip() for line in err.splitlines() if line.strip().startswith("python train.py"))
    assert f"resume={run_dir / 'checkpoints' / 'step_00000003'}" in command and "optim.lr=0.0001" in command
    # the command, exactly as printed, through a shell (python -> this interpreter)
    resumed = subprocess.run(["bash", "-c", shlex.quote(sys.executable) + command[len("python"):]],
                             cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    lrs = {r["step"]: r["lr"] for r in step_records(run_dir)}
    assert sorted(lrs) == list(range(1, STEPS + 1)) and all(lrs[s] == pytest.approx(1e-4) for s in range(4, STEPS + 1))


def test_resume_with_a_new_lr_applies_it_and_records_it(tmp_path, data_root, reference):
    run_dir = _copy_until(reference, tmp_path, 4)
    common = [o for o in COMMON if not o.startswith("optim.lr=")]
    proc = run(train_cmd(data_root, run_dir, *common, "optim.lr=3e-4"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("resume: ") and not x.startswith("resume: data at")]
    assert lines == ["resume: optim.lr changed 0.001 -> 0.0003; applied from step 5 (lr now 0.0003)"], lines
    lrs = {r["step"]: r["lr"] for r in step_records(run_dir)}
    assert [lrs[s] for s in range(1, 5)] == [1e-3] * 4 and [lrs[s] for s in range(5, 9)] == [3e-4] * 4
    change = [r for r in records(run_dir) if r.get("event") == "config_change"]
    assert change == [{**change[0], "step": 4, "changes": {"optim.lr": [1e-3, 3e-4]}}]


def _snapshot(run_dir):
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_a_refused_resume_leaves_the_run_folder_exactly_as_it_was(tmp_path, data_root, reference):
    run_dir = _copy_until(reference, tmp_path, 8)
    before = _snapshot(run_dir)
    proc = run(train_cmd(data_root, run_dir, *COMMON, "model.name=infclip-tiny"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "cannot resume" in proc.stderr and "model.name='infclip-micro'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert _snapshot(run_dir) == before  # config.yaml still says infclip-micro; no lock left


def test_a_second_training_on_a_busy_run_dir_refuses(tmp_path, data_root):
    run_dir, log = tmp_path / "run", tmp_path / "first.log"
    first = start(train_cmd(data_root, run_dir, "steps=400", "checkpoint.every_n_steps=0"), cwd=tmp_path, log=log)
    try:
        wait_for_step(first, run_dir, 1, log)
        second = run(train_cmd(data_root, run_dir, "steps=400"), cwd=tmp_path)
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
        assert f"run_dir {run_dir} is in use by another training (pid {first.pid}" in second.stderr
        assert "Traceback" not in second.stderr
        os.killpg(first.pid, signal.SIGTERM)  # the first one goes on undisturbed, then stops cleanly
        assert first.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    steps = [r["step"] for r in step_records(run_dir)]
    assert steps == list(range(1, len(steps) + 1))  # one writer: no interleaved records
    assert not (run_dir / "train.lock").exists()


def test_sigterm_during_the_final_eval_keeps_every_step(tmp_path, data_root):
    """The final checkpoint comes before the final eval, and the handlers stay installed
    through both: a SIGTERM as soon as the final checkpoint is reported (the final eval
    starts then; it takes ~0.3-2 s here with eval.batch_size=1) loses nothing and exits 0.
    (A fixed delay after the last step was a race: on a faster machine the eval had ended and
    the interpreter was tearing down, its signal handlers reset.)"""
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    micro = [o for o in MICRO if o != "eval.tasks=[]"]  # the quickstart's synthetic eval tasks
    cmd = [sys.executable, str(ROOT / "train.py"), f"data.synthetic_root={data_root}", f"run_dir={run_dir}",
           *micro, "steps=4", "checkpoint.every_n_steps=3", "eval.workers=0", "eval.batch_size=1"]
    proc = start(cmd, cwd=tmp_path, log=log)
    # the checkpoint's line is printed once the save is complete; the final eval starts then
    wait_for(proc, log, lambda: "checkpoints/step_00000004" in log.read_text(), "the final checkpoint")
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    assert ckpt.list_checkpoints(run_dir)[-1].name == "step_00000004"
    assert sorted(losses_by_step(run_dir)) == [1, 2, 3, 4]
    summary = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["summary"]
    assert summary["steps"] == 4 and any(k.startswith("eval/") for k in summary)  # the eval finished too
    # the line says what the signal does now (not "stopping after this step")
    assert "SIGTERM: training is over; finishing the final eval first, then exiting with status 0" in \
        log.read_text(), log.read_text()[-3000:]


def _loader_worker(trainer_pid, timeout=60):
    """The pid of the trainer's (only) DataLoader worker: a child process of it (/proc)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for children in Path(f"/proc/{trainer_pid}/task").glob("*/children"):
            pids = children.read_text().split()
            if pids:
                return int(pids[0])
        time.sleep(0.05)
    raise AssertionError("no loader worker found")


def _freeze_loader(tmp_path, data_root, *overrides):
    """Starts the reference's training and SIGSTOPs its loader worker after step 2 (a stand-in
    for an NFS stall or a hung pipe: command). Returns (process, run folder, log)."""
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    proc = start(train_cmd(data_root, run_dir, *COMMON, *overrides), cwd=tmp_path, log=log)
    wait_for_step(proc, run_dir, 2, log)
    os.kill(_loader_worker(proc.pid), signal.SIGSTOP)
    return proc, run_dir, log


def test_a_frozen_loader_worker_is_named_then_the_run_stops_with_a_checkpoint(tmp_path, data_root, reference):
    """A stalled loader worker printed nothing for minutes. Now: a warning naming the worker and
    its shard after data.stall_warn_s, a checkpoint of the last completed step and one
    paragraph (exit 2) after data.stall_abort_s; resume=auto then matches the reference."""
    proc, run_dir, log = _freeze_loader(tmp_path, data_root, "data.stall_warn_s=1", "data.stall_abort_s=4")
    try:
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text()
    last = max(r["step"] for r in step_records(run_dir))
    assert rc == 2 and "Traceback" not in out, out[-3000:]
    warning = next(x for x in out.splitlines() if "delivered nothing for" in x and x.startswith("warning:"))
    assert "data.stall_warn_s=1" in warning and "loader worker 0 (pid " in warning
    # the shard file when the worker froze inside it (a SIGSTOP may also land between shards)
    assert ("reading " in warning and ".tar" in warning) or "with no shard file open" in warning, warning
    assert "error (DataError): the data loader delivered nothing for" in out and "data.stall_abort_s=4" in out
    assert ckpt.list_checkpoints(run_dir)[-1].name == f"step_{last:08d}" and last < STEPS
    second = run(train_cmd(data_root, run_dir, *COMMON), cwd=tmp_path)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert losses_by_step(run_dir) == {s: [v] for s, v in reference[1].items()}


def test_sigterm_while_waiting_on_a_frozen_loader_checkpoints_and_exits_0(tmp_path, data_root, reference):
    """SIGTERM was not honoured within 60 s while the loader hung; now the step waiting for
    data is abandoned, the last completed step checkpointed, exit 0, and the resume is exact."""
    import time

    proc, run_dir, log = _freeze_loader(tmp_path, data_root, "data.stall_warn_s=1", "data.stall_abort_s=0")
    try:
        wait_for(proc, log, lambda: "delivered nothing for" in log.read_text(), "the stall warning")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # the trainer only: its worker is frozen
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text()
    assert rc == 0 and time.monotonic() - t0 < 30 and "Traceback" not in out, out[-3000:]
    last = max(r["step"] for r in step_records(run_dir))
    assert ckpt.list_checkpoints(run_dir)[-1].name == f"step_{last:08d}" and last < STEPS
    second = run(train_cmd(data_root, run_dir, *COMMON), cwd=tmp_path)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert losses_by_step(run_dir) == {s: [v] for s, v in reference[1].items()}


def test_a_stall_warning_names_the_shard_file_or_the_pipe_command_a_worker_waits_on(tmp_path):
    """What ``reading`` tells from /proc: an open shard file (an NFS read that hangs), or the
    command of a child process (a pipe: shard whose command hangs)."""
    from infclip.data.pipeline import reading

    shard = tmp_path / "00017.tar"
    shard.write_bytes(b"\0" * 1024)
    holder = subprocess.Popen([sys.executable, "-c", f"f = open({str(shard)!r}, 'rb'); import time; time.sleep(60)"],
                              start_new_session=True)
    piper = subprocess.Popen([sys.executable, "-c", "import subprocess; subprocess.run(['sleep', '60'])"],
                             start_new_session=True)
    try:
        import time

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (str(shard) in reading(holder.pid, [str(shard)])
                                                   and "`sleep 60`" in reading(piper.pid, [])):
            time.sleep(0.05)
        assert reading(holder.pid, [str(shard)]) == f"reading {shard}"
        assert reading(piper.pid, []).startswith("waiting on `sleep 60` (pid ")
    finally:
        for p in (holder, piper):
            os.killpg(p.pid, signal.SIGKILL)  # with its child
            p.wait()


@pytest.mark.parametrize("bad", ["image_pretrained", "pretrained"])
def test_weights_that_do_not_load_refuse_the_start_in_one_paragraph(tmp_path, data_root, bad):
    """model.image_pretrained whose keys match nothing trained a random tower with exit 0, and
    a model.pretrained that is neither a tag nor a file ended in a traceback: now one paragraph, exit 2, no run folder."""
    path = tmp_path / "unrelated.pt"
    torch.save({"encoder.weight": torch.ones(2, 2)}, path)
    override = f"model.image_pretrained={path}" if bad == "image_pretrained" else "model.pretrained=no-such-tag"
    proc = run(train_cmd(data_root, tmp_path / "run", *COMMON, override), cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stderr.startswith(f"error (ModelError): model.{bad}=")
    assert ("match nothing in the tower" if bad == "image_pretrained" else "cannot be loaded") in proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_run_dir_that_cannot_be_created_is_one_paragraph(tmp_path, data_root):
    """A run name too long for the file system is one paragraph, not a traceback."""
    from infclip.train.rundir import RunDirUnusable, acquire

    proc = run(train_cmd(data_root, tmp_path / ("x" * 300), *COMMON), cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith("error (RunDirUnusable): run_dir ") and "longer than the file system allows" in proc.stderr
    with pytest.raises(RunDirUnusable, match="cannot be created or written"):  # not writable (root too)
        acquire(Path("/proc/infclip-no-such-dir/run"))


def test_a_killed_loader_worker_ends_the_run_in_one_paragraph_with_a_checkpoint(tmp_path, data_root, reference):
    """SIGKILL to the loader worker (the out-of-memory killer's way) was a traceback; now one
    paragraph, exit 2, the last completed step checkpointed, and resume=auto matches."""
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    proc = start(train_cmd(data_root, run_dir, *COMMON), cwd=tmp_path, log=log)
    try:
        wait_for_step(proc, run_dir, 2, log)
        os.kill(_loader_worker(proc.pid), signal.SIGKILL)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text()
    assert rc == 2 and "Traceback" not in out and "error (DataError): a data loader worker died" in out, out[-3000:]
    last = max(r["step"] for r in step_records(run_dir))
    assert ckpt.list_checkpoints(run_dir)[-1].name == f"step_{last:08d}"
    second = run(train_cmd(data_root, run_dir, *COMMON), cwd=tmp_path)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert losses_by_step(run_dir) == {s: [v] for s, v in reference[1].items()}
