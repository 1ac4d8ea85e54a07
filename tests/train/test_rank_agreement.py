"""Ranks never wait silently: different configurations are refused at the start, a peer that
never comes ends the wait after dist.join_timeout_s, and a stop signal is honoured while a
step is blocked (dist.stop_grace_s)."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from infclip.train.agreement import config_leaves, differences

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "model.name=infclip-micro", "data.synthetic_train=64", "data.synthetic_eval=8",
    "data.synthetic_image_size=32", "data.workers=0", "data.loader_batch=16",
    "batch.global_size=32", "batch.micro_size=16", "logging.wandb_mode=disabled",
    "logging.progress=false", "eval.tasks=[]",
]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(tmp_path, rank, world, port, *overrides):
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    cmd = [sys.executable, str(ROOT / "train.py"), f"data.synthetic_root={tmp_path / 'syn'}",
           f"run_dir={tmp_path / 'run'}", *TINY, *overrides]
    return subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_leaves_name_every_differing_key():
    a = config_leaves({"steps": 5, "optim": {"lr": 1e-3, "betas": [0.9, 0.98]}, "eval": {"tasks": []}})
    b = config_leaves({"steps": 8, "optim": {"lr": 1e-3, "betas": [0.9, 0.99]}, "eval": {"tasks": []}})
    assert differences(a, b) == ["optim.betas", "steps"]


@pytest.mark.timeout(300)
def test_ranks_started_with_different_steps_are_refused_naming_the_key(tmp_path):
    port = _free_port()
    procs = [_rank(tmp_path, 0, 2, port, "steps=5"), _rank(tmp_path, 1, 2, port, "steps=8")]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 2, err[-3000:]
        assert "Traceback" not in err
        assert "rank 1 differs from rank 0 in steps (5 on rank 0, 8 on rank 1)" in err, err[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.timeout(300)
def test_a_rank_whose_peers_never_come_says_so_and_stops(tmp_path):
    start = time.monotonic()
    proc = _rank(tmp_path, 0, 2, _free_port(), "steps=1", "dist.join_timeout_s=6")
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 2, err[-3000:]
    assert "rank 0: still waiting for the other ranks of WORLD_SIZE=2" in err
    assert "waited 6 s (dist.join_timeout_s)" in err and "Traceback" not in err
    assert time.monotonic() - start < 200  # not torch's 30 minutes


_BLOCKED = textwrap.dedent("""
    import threading, time
    from types import SimpleNamespace
    from infclip.train.signals import signals_handled

    state = SimpleNamespace(signal_received=0, stop_requested=False, interrupts=0)
    with signals_handled(state, 1.0):
        print("ready", flush=True)
        threading.Event().wait(120)  # a step blocked in C code (a collective whose peer is gone)
    print("returned", flush=True)
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_is_honoured_while_a_step_is_blocked(sig):
    proc = subprocess.Popen([sys.executable, "-c", _BLOCKED], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 128 + sig, (out, err)
    assert f"stop signal {signal.Signals(sig).name} received 1 s ago" in err and "dist.stop_grace_s" in err
    assert "returned" not in out


@pytest.mark.timeout(300)
def test_sigterm_ends_a_rank_blocked_in_a_collective(tmp_path):
    """Rank 1 frozen (SIGSTOP) mid-run: rank 0 waits in the step's collective; SIGTERM ends it
    after dist.stop_grace_s instead of torch's 30-minute timeout."""
    port = _free_port()
    extra = ("steps=500", "logging.every_n_steps=1", "dist.stop_grace_s=3")
    procs = [_rank(tmp_path, r, 2, port, *extra) for r in (0, 1)]
    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline and not (metrics.exists() and '"step": 2' in metrics.read_text()):
            time.sleep(0.5)
        assert '"step": 2' in metrics.read_text(), procs[0].stderr.read()[-2000:] if procs[0].poll() else ""
        procs[1].send_signal(signal.SIGSTOP)
        time.sleep(2)  # rank 0 is now inside a collective rank 1 never joins
        start = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        _, err = procs[0].communicate(timeout=120)
        assert procs[0].returncode == 128 + signal.SIGTERM, err[-2000:]
        assert "stop signal SIGTERM received 3 s ago" in err
        assert time.monotonic() - start < 100  # 3 s of grace, far from torch's 1800 s
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()
