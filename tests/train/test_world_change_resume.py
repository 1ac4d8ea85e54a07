"""The real train.py resumed on another number of gloo ranks: 2 ranks checkpoint, 1 rank goes
on, then 2 again; every sample of the epoch is trained exactly once across the changes, in the
same global batches (and losses) as an uninterrupted run on 1 rank."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_train_cli import TINY, _env, losses

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "tests" / "train" / "_sample_trace_probe.py"
# 256 samples in loader batches of 16: an epoch is 16 global loader batches, 4 steps of 64.
# data.streams=2 fixes the order whatever the world size at the start (the reference run has 1 rank).
EPOCH = {"batch.global_size": "64", "batch.micro_size": "16", "data.workers": "1", "data.streams": "2",
         "eval.tasks": "[]", "data.synthetic_train": "256"}
BATCHES_PER_STEP = 4


def _train(tmp_path, name, world, *overrides):
    """train.py through the probe on ``world`` gloo ranks; returns its stdout. Loader batches go
    to tmp_path/<name>.trace/, the run to tmp_path/<name>."""
    trace = tmp_path / f"{name}.trace"
    trace.mkdir()
    base = [o for o in TINY if o.split("=", 1)[0] not in EPOCH] + [f"{k}={v}" for k, v in EPOCH.items()]
    args = [str(PROBE), f"data.synthetic_root={tmp_path / 'synthetic'}", *base, f"run_dir={tmp_path / name}",
            *overrides]
    cmd = [sys.executable, *args]
    if world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**_env(tmp_path), "SAMPLE_TRACE": str(trace)},
                          cwd=tmp_path)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def _trained(tmp_path, name, first_step, last_step):
    """{global batch index: sample keys} of the loader batches run ``name`` trained (steps
    first_step..last_step; later indices were prefetched, not trained)."""
    lo, hi = (first_step - 1) * BATCHES_PER_STEP, last_step * BATCHES_PER_STEP
    out: dict[int, list] = {}
    for path in (tmp_path / f"{name}.trace").glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if lo <= rec["index"] < hi:
                assert rec["index"] not in out, f"{name}: global batch {rec['index']} delivered twice"
                out[rec["index"]] = rec["keys"]
    assert sorted(out) == list(range(lo, hi)), f"{name}: trained global batches {sorted(out)}"
    return out


def test_two_ranks_checkpoint_one_resumes_then_two_again_each_sample_once(tmp_path):
    _train(tmp_path, "a", 2, "steps=1")
    out_b = _train(tmp_path, "b", 1, "steps=2", f"resume={tmp_path / 'a' / 'checkpoints' / 'step_00000001'}")
    assert "resume: written on 2 rank(s), resuming on 1: the global sample order goes on at global loader batch 4" \
        in out_b and "data: 1 loader worker(s) per rank: data.workers=1 (as set" in out_b
    out_c = _train(tmp_path, "c", 2, "steps=4", f"resume={tmp_path / 'b' / 'checkpoints' / 'step_00000002'}")
    assert "resume: written on 1 rank(s), resuming on 2" in out_c and "same global batch (64 samples" in out_c
    seen = {**_trained(tmp_path, "a", 1, 1), **_trained(tmp_path, "b", 2, 2), **_trained(tmp_path, "c", 3, 4)}
    keys = [k for i in sorted(seen) for k in seen[i]]
    assert len(keys) == 256 and len(set(keys)) == 256  # the whole epoch, each sample once

    out_ref = _train(tmp_path, "ref", 1, "steps=4", "data.workers=auto")  # uninterrupted, on 1 rank
    assert "loader worker(s) per rank: data.workers=auto:" in out_ref
    assert _trained(tmp_path, "ref", 1, 4) == seen  # the same samples in the same global batches
    ref = losses(tmp_path / "ref")
    got = {**losses(tmp_path / "a"), **losses(tmp_path / "b"), **losses(tmp_path / "c")}
    assert sorted(got) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):  # a continuous curve: only the reduction order differs with the ranks
        assert got[step] == pytest.approx(ref[step], rel=1e-4), (step, got, ref)


def test_a_world_size_the_order_cannot_split_is_refused_before_the_model(tmp_path):
    """One rank with in-process loading makes an order of 1 stream: 2 ranks cannot split it.
    The start is refused with one paragraph before any model or data is built, and leaves the
    run folder as it was."""
    run_dir = tmp_path / "one"
    base = [o for o in TINY if not o.startswith("data.synthetic_root")]
    train = [sys.executable, str(ROOT / "train.py"), f"data.synthetic_root={tmp_path / 'synthetic'}", *base,
             f"run_dir={run_dir}", "eval.tasks=[]"]
    first = subprocess.run([*train, "steps=1"], capture_output=True, text=True, timeout=300, env=_env(tmp_path),
                           cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    before = sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*") if p.is_file())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *train[1:], "steps=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(tmp_path), cwd=tmp_path)
    assert proc.returncode != 0
    assert "error (ResumeError): no checkpoint in" in proc.stderr and "it resumes on 1 rank(s)" in proc.stderr
    assert "data: decode=" not in proc.stdout  # nothing was built
    after = sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*") if p.is_file())
    assert after == before
