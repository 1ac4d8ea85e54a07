"""The step pipeline inside the real trainer: prefetch depth and threading change nothing in
what is trained (losses and weights bit for bit), a SIGKILL with deep prefetch resumes
exactly, the progress line names the data wait and the loader rate, ``model.compile``
matches eager, and a batch that must repeat samples is warned about."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from engine_testutils import assert_grads_close, batch, config, engine_for, grads_of, tiny_clip

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "launch"))
from launch_testutils import losses_by_step, run, start_and_kill, train_cmd  # noqa: E402

from infclip.model import compile_towers  # noqa: E402
from infclip.train.pipeline import duplicate_warning  # noqa: E402

STEPS = ["steps=5", "checkpoint.every_n_steps=2"]


def _train(tmp_path, name: str, *overrides: str):
    run_dir = tmp_path / name
    proc = run(train_cmd(tmp_path / "data", run_dir, *STEPS, *overrides), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, proc


def _weights(run_dir):
    return torch.load(run_dir / "checkpoints" / "step_00000005" / "model.pt", weights_only=True)


def test_prefetch_depth_and_threading_train_bit_identically(tmp_path):
    runs = {
        "sync": _train(tmp_path, "sync", "memory.pipeline_thread=false")[0],
        "p0": _train(tmp_path, "p0", "memory.prefetch_steps=0")[0],
        "p2": _train(tmp_path, "p2", "memory.prefetch_steps=2")[0],
    }
    ref_losses, ref_w = losses_by_step(runs["sync"]), _weights(runs["sync"])
    assert sorted(ref_losses) == [1, 2, 3, 4, 5]
    for name in ("p0", "p2"):
        assert losses_by_step(runs[name]) == ref_losses, name
        w = _weights(runs[name])
        assert all(torch.equal(w[k], ref_w[k]) for k in ref_w), f"{name}: weights differ from the synchronous run"


def test_sigkill_with_deep_prefetch_resumes_exactly(tmp_path):
    """Two steps are prefetched beyond the one training when the kill lands: the checkpoint
    must hold the position of the last *trained* step, or the resumed run skips data."""
    ref_dir, _ = _train(tmp_path, "ref", "memory.prefetch_steps=1")
    run_dir, log = tmp_path / "killed", tmp_path / "killed.log"
    cmd = train_cmd(tmp_path / "data", run_dir, *STEPS, "memory.prefetch_steps=3")
    start_and_kill(cmd, run_dir, 3, tmp_path, log)
    second = run(cmd, cwd=tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    ref = {s: v[0] for s, v in losses_by_step(ref_dir).items()}
    for step, values in losses_by_step(run_dir).items():
        assert all(v == ref[step] for v in values), (step, values, ref[step])


def test_progress_line_shows_data_wait_and_loader_rate(tmp_path):
    _, proc = _train(tmp_path, "progress")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("step      5/"))
    assert "data_wait_pct=" in line and "loader_samples_per_s=" in line, line


def _compiler_missing() -> str:
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        return "torch.compile on CPU needs a C compiler (gcc/cc)"
    return ""


@pytest.mark.skipif(bool(_compiler_missing()), reason=_compiler_missing() or "compiler present")
def test_compiled_towers_match_eager_through_the_gradient_cache():
    local, micro = 8, 4
    cfg = config(local, micro)
    eager = tiny_clip(dropout=0.0, patch_dropout=0.0)
    compiled = tiny_clip(dropout=0.0, patch_dropout=0.0)
    names = compile_towers(compiled)
    assert names == ["visual", "transformer"]
    assert eager.state_dict().keys() == compiled.state_dict().keys()  # checkpoints unchanged
    images, tokens = batch(local)
    engine_for(cfg, eager).step(images, tokens)
    engine_for(cfg, compiled).step(images, tokens)
    assert_grads_close(grads_of(compiled), grads_of(eager), atol=1e-4, rtol=1e-4)


def test_duplicate_warnings():
    assert "larger than the dataset" in duplicate_warning(1024, 1000, 1, 8, resampled=False)
    assert "not a whole number of steps" in duplicate_warning(64, 1000, 1, 16, resampled=False)
    assert duplicate_warning(64, 1024, 1, 16, resampled=False) is None
    boundary = duplicate_warning(64, 1000, 1, 16, resampled=False)  # 62 loader batches, 4 per step
    assert boundary.startswith("note: ") and "up to 32 of its 64 samples twice" in boundary  # 2 + 2 straddle
    assert "one step in every 15.5" in boundary and "Nothing is wrong" in boundary
    assert "duplicate pairs" in duplicate_warning(32768, 100_000, 1, 256, resampled=True)
    assert duplicate_warning(256, 10_000_000, 1, 256, resampled=True) is None


def test_trainer_warns_when_a_step_repeats_samples(tmp_path):
    _, proc = _train(tmp_path, "dup", "steps=1", "batch.global_size=512", "data.synthetic_train=256",
                     "batch.micro_size=128")
    assert "larger than the dataset" in proc.stdout


def test_bad_prefetch_value_is_refused_before_training(tmp_path):
    proc = subprocess.run(train_cmd(tmp_path / "data", tmp_path / "bad", "memory.prefetch_steps=-1"),
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode != 0 and "memory.prefetch_steps" in (proc.stdout + proc.stderr)


@pytest.mark.skipif(bool(_compiler_missing()), reason=_compiler_missing() or "compiler present")
def test_compiled_towers_train_under_ddp_like_eager(tmp_path):
    """torchrun, 2 gloo ranks, gradient cache + offload: model.compile=true trains the same
    losses as eager (inductor's CPU kernels round differently: within 1e-4) and saves the
    same state-dict keys (no ``_orig_mod`` prefixes)."""
    runs = {}
    for name in ("eager", "compiled"):
        run_dir = tmp_path / name
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               *train_cmd(tmp_path / "data", run_dir, "steps=3", "checkpoint.every_n_steps=3",
                          "memory.offload=true", f"model.compile={str(name == 'compiled').lower()}")[1:]]
        proc = run(cmd, cwd=tmp_path, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[name] = run_dir
    eager, compiled = losses_by_step(runs["eager"]), losses_by_step(runs["compiled"])
    assert sorted(eager) == sorted(compiled) == [1, 2, 3]
    for step in eager:
        assert abs(compiled[step][0] - eager[step][0]) <= 1e-4 * abs(eager[step][0]), (step, compiled, eager)
    w_e = torch.load(runs["eager"] / "checkpoints" / "step_00000003" / "model.pt", weights_only=True)
    w_c = torch.load(runs["compiled"] / "checkpoints" / "step_00000003" / "model.pt", weights_only=True)
    assert w_e.keys() == w_c.keys()


@pytest.mark.parametrize("mode, kw", [("default", {}), ("max-autotune-no-cudagraphs", {"mode": "max-autotune-no-cudagraphs"})])
def test_compile_mode_reaches_torch_compile_and_is_said(monkeypatch, capsys, mode, kw):
    """model.compile_mode goes to each tower's torch.compile (inductor's default passes no mode)
    and a mode other than the default is named in a startup line."""
    from types import SimpleNamespace

    from infclip.train import build

    seen = []
    monkeypatch.setattr(build, "compile_towers", lambda model, **k: seen.append(k) or ["visual"])
    cfg = SimpleNamespace(model=SimpleNamespace(compile_mode=mode, compile_ddp_split=False))
    build._compile(cfg, SimpleNamespace(distributed=False, is_main=True), torch.nn.Linear(2, 2))
    assert seen == [kw]
    assert ("compile mode=" + mode in capsys.readouterr().out) == (mode != "default")
