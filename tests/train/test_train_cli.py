"""The real train.py on tiny configs: metrics, checkpoints, resume, 2-process gloo."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# A micro model on a tiny synthetic set: seconds per run on 2 CPU cores.
TINY = [
    "model.name=infclip-micro", "data.synthetic_train=256", "data.synthetic_eval=32",
    "data.synthetic_image_size=32", "data.workers=0", "data.loader_batch=16",
    "batch.global_size=32", "batch.micro_size=16", "logging.every_n_steps=1",
    "logging.wandb_mode=disabled", "logging.progress=false", "eval.workers=0",
]


def _env(tmp_path):
    env = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def run_train(tmp_path, *overrides, torchrun_nproc=0, timeout=600):
    args = [str(ROOT / "train.py"), f"data.synthetic_root={tmp_path / 'synthetic'}", *TINY, *overrides]
    if torchrun_nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={torchrun_nproc}", *args]
    else:
        cmd = [sys.executable, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, f"train.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def metrics(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def losses(run_dir):
    return {m["step"]: m["loss"] for m in metrics(run_dir) if "loss" in m}


def test_trains_writes_metrics_checkpoint_and_eval(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(tmp_path, f"run_dir={run_dir}", "steps=4", "checkpoint.every_n_steps=2")
    ls = losses(run_dir)
    assert sorted(ls) == [1, 2, 3, 4] and all(v == v for v in ls.values())
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step_00000002", "step_00000004"]
    summary = metrics(run_dir)[-1]["summary"]
    assert any(k.startswith("eval/synthetic_zeroshot/") for k in summary), summary
    assert any(k.startswith("eval/synthetic_retrieval/") for k in summary), summary
    assert (run_dir / "config.yaml").exists() and "steps=4" in (run_dir / "overrides.txt").read_text()
    assert "done: 4 steps" in proc.stdout
    # weights load the way external tools (open_clip, clip_benchmark) load them
    import open_clip

    import infclip.model  # noqa: F401  (registers the tiny configs)

    model, _, _ = open_clip.create_model_and_transforms(
        "infclip-micro", pretrained=str(run_dir / "checkpoints" / "step_00000004" / "model.pt"))
    saved = torch.load(run_dir / "checkpoints" / "step_00000004" / "model.pt", weights_only=True)
    assert torch.equal(model.logit_scale.detach(), saved["logit_scale"])


def test_resume_continues_step_count_and_matches_uninterrupted(tmp_path):
    """A resumed run continues the step count and the losses of an uninterrupted one. The line
    naming the checkpoint comes first of the start's lines, before the model and data lines (it
    came after the data lines: the start read as a fresh one), in the terminal and in out.log;
    a resume refused for a key its state depends on (seed) stops before any model or data is built."""
    base = ["eval.tasks=[]", "checkpoint.every_n_steps=2"]
    full = tmp_path / "full"
    run_train(tmp_path, f"run_dir={full}", "steps=4", *base)
    part = tmp_path / "part"
    run_train(tmp_path, f"run_dir={part}", "steps=2", *base)
    proc = run_train(tmp_path, f"run_dir={part}", "steps=4", *base)
    for text in (proc.stdout, (part / "out.log").read_text().split("== start")[-1]):
        lines = [line for line in text.splitlines() if line.startswith(("resumed from", "data:"))]
        first = f"resumed from {part / 'checkpoints' / 'step_00000002'} at step 2"
        assert lines and lines[0].startswith(first), text
        assert sum(line.startswith("resumed from") for line in lines) == 1
    resumed = losses(part)
    assert sorted(resumed) == [1, 2, 3, 4]  # appended, not overwritten
    ref = losses(full)
    for step in (1, 2, 3, 4):
        assert resumed[step] == pytest.approx(ref[step], rel=1e-6, abs=1e-7), (step, resumed, ref)
    cmd = [sys.executable, str(ROOT / "train.py"), f"data.synthetic_root={tmp_path / 'synthetic'}", *TINY,
           f"run_dir={part}", "steps=6", *base, "seed=7"]
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(tmp_path), cwd=tmp_path)
    assert refused.returncode == 2 and "cannot resume" in refused.stderr and "seed=7" in refused.stderr
    assert "data:" not in refused.stdout and "resumed from" not in refused.stdout


def test_resume_none_into_a_used_run_dir_is_refused(tmp_path):
    run_dir = tmp_path / "used"
    run_train(tmp_path, f"run_dir={run_dir}", "steps=1", "eval.tasks=[]")
    cmd = [sys.executable, str(ROOT / "train.py"), f"data.synthetic_root={tmp_path / 'synthetic'}", *TINY,
           f"run_dir={run_dir}", "steps=2", "eval.tasks=[]", "resume=none"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(tmp_path), cwd=tmp_path)
    assert proc.returncode != 0
    assert "resume=none but" in proc.stderr and "step_00000001" in proc.stderr
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00000001"]


def test_two_process_gloo_run_takes_steps(tmp_path):
    run_dir = tmp_path / "ddp"
    run_train(tmp_path, f"run_dir={run_dir}", "steps=2", "eval.tasks=[]", torchrun_nproc=2)
    ls = losses(run_dir)
    assert sorted(ls) == [1, 2]
    assert (run_dir / "checkpoints" / "step_00000002" / "rank_00001.pt").exists()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)")
def test_two_process_run_leaves_no_native_threads_behind(tmp_path):
    """Once ``train`` returns, the process group's native threads are joined (not left to the
    interpreter's exit, where gloo's workers aborted a finished 2-rank run with SIGABRT,
    "terminate called without an active exception", about once in a few CI runs)."""
    probe = ROOT / "tests" / "_native_threads_probe.py"
    args = [str(probe), f"data.synthetic_root={tmp_path / 'synthetic'}", *TINY, f"run_dir={tmp_path / 'ddp'}",
            "steps=1", "eval.tasks=[]"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**_env(tmp_path), "PROBE_TARGET": "train"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = re.findall(r"native threads: before=(\d+) after=(\d+)", proc.stdout)
    assert len(counts) == 2, proc.stdout[-3000:]  # one line per rank
    for before, after in counts:
        assert int(after) <= int(before), f"native threads left after train returned: {counts}"


def test_pure_bf16_trains_bf16_weights_without_autocast(tmp_path):
    """precision.amp=pure_bf16 (open_clip's): the weights are bf16, the optimizer steps them,
    the loss stays finite and moves, eval runs, and the checkpoint holds bf16 tensors."""
    run_dir = tmp_path / "run"
    proc = run_train(tmp_path, f"run_dir={run_dir}", "steps=3", "precision.amp=pure_bf16")
    ls = losses(run_dir)
    assert sorted(ls) == [1, 2, 3] and all(math.isfinite(v) for v in ls.values())
    assert "done: 3 steps" in proc.stdout
    assert any(k.startswith("eval/synthetic_zeroshot/") for k in metrics(run_dir)[-1]["summary"])
    saved = torch.load(run_dir / "checkpoints" / "step_00000003" / "model.pt", weights_only=True)
    assert {t.dtype for t in saved.values() if t.is_floating_point()} == {torch.bfloat16}
    assert ls[3] != ls[1]  # the bf16 parameters were updated


def test_augmentations_and_preprocess_overrides_train_and_reach_the_export(tmp_path):
    """open_clip's --aug-cfg and --image-* as keys: the run trains on the CPU pipeline (chosen by
    decode=auto, saying why), and its checkpoint's open_clip_config.json carries the overrides,
    which open_clip's local-dir: loader picks up."""
    run_dir = tmp_path / "run"
    proc = run_train(tmp_path, f"run_dir={run_dir}", "steps=2", "eval.tasks=[]",
                     "data.color_jitter=[0.4,0.4,0.4,0.1]", "data.color_jitter_prob=0.8",
                     "data.gray_scale_prob=0.2", "data.re_prob=0.25",
                     "model.image_mean=[0.5,0.5,0.5]", "model.image_std=[0.5,0.5,0.5]",
                     "model.image_interpolation=bilinear", "model.image_resize_mode=squash")
    assert "data: decode=cpu (auto: data.color_jitter, data.gray_scale_prob, data.re_prob augment" in proc.stdout
    from infclip.data.transforms import pil_library  # the library that made the pixels, named

    assert f"; loader workers decode with {pil_library()})" in proc.stdout
    assert all(math.isfinite(v) for v in losses(run_dir).values())
    folder = run_dir / "checkpoints" / "step_00000002"
    pp = json.loads((folder / "open_clip_config.json").read_text())["preprocess_cfg"]
    assert pp == {**pp, "mean": [0.5] * 3, "std": [0.5] * 3, "interpolation": "bilinear", "resize_mode": "squash"}
    import open_clip

    _, _, preprocess = open_clip.create_model_and_transforms("local-dir:" + str(folder))
    norm = preprocess.transforms[-1]
    assert list(norm.mean) == [0.5] * 3 and list(norm.std) == [0.5] * 3
