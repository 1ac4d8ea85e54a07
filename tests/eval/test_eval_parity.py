"""Parity on real images (scikit-learn's digits, made at test time): ``python -m infclip.eval``
equals an evaluation written with open_clip alone, and clip_benchmark (in the test extra), on
the same checkpoint -- loaded by both as ``local-dir:`` from the files the trainer's checkpoint
hook wrote."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # a fitted model on real images and several subprocess evaluations

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}


def _our_metrics(digits, tmp_path) -> dict:
    d = digits.root
    tasks = (f"[{{name: digits_folder, kind: zeroshot, root: {d}/imagefolder, format: imagefolder, "
             f"templates: {d}/templates.txt}}, {{name: digits_wds, kind: zeroshot, root: {d}/wds_digits}}, "
             f"{{name: digits_flat, kind: retrieval, format: flat, root: {d}/retrieval}}, "
             f"{{name: digits_rwds, kind: retrieval, format: wds, root: {d}/wds_digits_retrieval}}]")
    out = tmp_path / "ours.json"
    cmd = [sys.executable, "-m", "infclip.eval", f"checkpoint={digits.run}", f"tasks={tasks}", "eval.batch_size=64",
           "eval.workers=0", f"output={out}", "log_to_run=false"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["metrics"]


@pytest.fixture(scope="module")
def ours(digits, tmp_path_factory):
    return _our_metrics(digits, tmp_path_factory.mktemp("ours"))


def test_eval_command_equals_an_open_clip_only_evaluation(digits, ours, tmp_path):
    out = tmp_path / "reference.json"
    proc = subprocess.run([sys.executable, os.path.join(HERE, "open_clip_reference.py"), str(digits.checkpoint),
                           str(digits.root), str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in ENV.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = json.loads(out.read_text())
    assert ref.pop("infclip_imported") is False
    for task, metrics in ref.items():
        for name, value in metrics.items():
            assert ours[f"eval/{task}/{name}"] == pytest.approx(value, abs=1e-12), (task, name)
    # a real model: well above chance, with many mistakes (so that every decision is compared)
    assert 0.25 < ours["eval/digits_folder/top1"] < 0.9 and ours["eval/digits_folder/num_samples"] == 360
    assert ours["eval/digits_wds/top1"] == ours["eval/digits_folder/top1"]  # same images, two layouts


def _clip_benchmark(args: list[str], cwd) -> None:
    """``clip_benchmark eval ARGS``: the console script the test extra installs (1.6.2, with
    numpy < 2.4 and requests, as docs/eval.md states)."""
    exe = os.path.join(os.path.dirname(sys.executable), "clip_benchmark")
    assert os.path.exists(exe), "clip_benchmark is in the test extra: pip install -e '.[test]'"
    proc = subprocess.run([exe, "eval", *args], cwd=cwd, capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_clip_benchmark_gives_the_same_numbers(digits, ours, tmp_path):
    """clip_benchmark 1.6.2 runs `eval --model local-dir:<checkpoint folder>` on the wds copies."""
    results = {}
    for name, task in (("digits", "zeroshot_classification"), ("digits_retrieval", "zeroshot_retrieval")):
        out = tmp_path / f"{name}.json"
        args = ["--model", f"local-dir:{digits.checkpoint}", "--pretrained", "none", "--dataset", f"wds/{name}",
                "--dataset_root", str(digits.root / f"wds_{name}"), "--task", task, "--no_amp", "--batch_size", "64",
                "--num_workers", "0", "--output", str(out)]
        args += ["--recall_k", "1", "5", "10"] if "retrieval" in task else []
        _clip_benchmark(args, tmp_path)
        results[name] = json.loads(out.read_text())["metrics"]
    zs, rt = results["digits"], results["digits_retrieval"]
    assert zs["acc1"] == pytest.approx(ours["eval/digits_wds/top1"], abs=1e-12)
    assert zs["acc5"] == pytest.approx(ours["eval/digits_wds/top5"], abs=1e-12)
    assert zs["mean_per_class_recall"] == pytest.approx(ours["eval/digits_wds/mean_per_class_recall"], abs=1e-12)
    for k in (1, 5, 10):  # clip_benchmark's "image retrieval" is text->image, "text retrieval" image->text;
        # it averages hits in float32 (one hit of 360 images is 2.8e-3: 1e-6 still tells every hit apart)
        assert rt[f"image_retrieval_recall@{k}"] == pytest.approx(ours[f"eval/digits_rwds/t2i_r{k}"], abs=1e-6)
        assert rt[f"text_retrieval_recall@{k}"] == pytest.approx(ours[f"eval/digits_rwds/i2t_r{k}"], abs=1e-6)


def test_an_image_folder_exported_for_clip_benchmark_scores_as_in_the_eval_command(digits, ours, tmp_path):
    """docs/eval.md's recipe: python -m infclip.eval.wds_export <image folder> --out <dir>
    --templates <file>, then clip_benchmark eval --dataset wds/<name> --dataset_root <dir>."""
    out = tmp_path / "my_digits"
    proc = subprocess.run([sys.executable, "-m", "infclip.eval.wds_export", str(digits.root / "imagefolder"),
                           "--out", str(out), "--templates", str(digits.root / "templates.txt"), "--shard-size", "100"],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr
    assert "wrote 360 images of 10 classes in 4 shards" in proc.stdout
    result = tmp_path / "cb.json"
    _clip_benchmark(["--model", f"local-dir:{digits.checkpoint}", "--pretrained", "none", "--dataset", "wds/my_digits",
                     "--dataset_root", str(out), "--task", "zeroshot_classification", "--no_amp", "--batch_size", "64",
                     "--num_workers", "0", "--output", str(result)], tmp_path)
    metrics = json.loads(result.read_text())["metrics"]
    assert metrics["acc1"] == pytest.approx(ours["eval/digits_folder/top1"], abs=1e-12)
    assert metrics["mean_per_class_recall"] == pytest.approx(ours["eval/digits_folder/mean_per_class_recall"],
                                                             abs=1e-12)


def test_export_command_writes_a_folder_open_clip_loads(digits, tmp_path):
    """python -m infclip.export RUN --step N --out DIR: from the run's config.yaml and model.pt
    alone (open_clip files removed first), equal weights to the checkpoint's."""
    import shutil

    import torch
    from safetensors.torch import load_file

    bare = tmp_path / "run" / "checkpoints" / digits.checkpoint.name
    bare.mkdir(parents=True)
    shutil.copy(digits.run / "config.yaml", tmp_path / "run" / "config.yaml")
    shutil.copy(digits.checkpoint / "model.pt", bare / "model.pt")
    out = tmp_path / "exported"
    step = int(digits.checkpoint.name[5:])
    proc = subprocess.run([sys.executable, "-m", "infclip.export", str(tmp_path / "run"), "--step", str(step),
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = torch.load(bare / "model.pt", weights_only=True)
    exported = load_file(str(out / "open_clip_model.safetensors"))
    assert exported.keys() == state.keys() and all(torch.equal(exported[k], state[k]) for k in state)
    assert json.loads((out / "open_clip_config.json").read_text()) == \
        json.loads((digits.checkpoint / "open_clip_config.json").read_text())
    proc = subprocess.run([sys.executable, "-m", "infclip.export", str(tmp_path / "run"), "--step", "3",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 2 and "no checkpoint for --step 3" in proc.stderr
