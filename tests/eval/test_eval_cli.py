"""``python -m infclip.eval`` on a run folder written in the trainer's checkpoint layout."""

import json
import os
import subprocess
import sys

import pytest
import torch

from infclip.eval import EvalConfig, EvalConfigError, run_evals
from infclip.eval.cli import resolve_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _save(run_dir, step, model):
    folder = run_dir / "checkpoints" / f"step_{step:08d}"
    folder.mkdir(parents=True)
    torch.save(model.state_dict(), folder / "model.pt")
    return folder / "model.pt"


def test_resolve_checkpoint_forms(tmp_path, micro):
    run = tmp_path / "run"
    _save(run, 5, micro[0])
    latest = _save(run, 12, micro[0])
    (run / "checkpoints" / ".step_00000020.tmp").mkdir()  # an unfinished save is ignored
    assert resolve_checkpoint(str(run)) == str(latest)
    assert resolve_checkpoint(str(latest.parent)) == str(latest)
    assert resolve_checkpoint(str(latest)) == str(latest)
    assert resolve_checkpoint("laion2b_s34b_b79k") == "laion2b_s34b_b79k"  # an open_clip tag
    assert resolve_checkpoint("none") is None
    with pytest.raises(EvalConfigError, match="checkpoint=.*does not exist"):
        resolve_checkpoint(str(tmp_path / "missing" / "model.pt"))
    with pytest.raises(EvalConfigError, match="no model.pt"):
        resolve_checkpoint(str(tmp_path))


def test_eval_command_on_a_run_folder(tmp_path, synthetic, micro):
    model, tokenizer, preprocess = micro
    run = tmp_path / "run"
    torch.manual_seed(1)
    other = type(model)(**_micro_cfg())  # different weights at the older step
    _save(run, 5, other)
    path = _save(run, 10, model)
    out = tmp_path / "results.json"
    cmd = [sys.executable, "-m", "infclip.eval", f"checkpoint={run}", "model=infclip-micro",
           f"synthetic_root={synthetic.root}", "eval.workers=0", "eval.batch_size=16", f"output={out}",
           "+task.synthetic_retrieval.max_samples=12"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "synthetic_zeroshot" in proc.stdout and "i2t_r1" in proc.stdout
    result = json.loads(out.read_text())
    assert result["resolved"] == str(path) and result["step"] == 10
    tasks = synthetic.eval_tasks()
    tasks[1].max_samples = 12
    expected = run_evals(model, tokenizer, preprocess, EvalConfig(tasks=tasks, workers=0), step=0, final=True,
                         device="cpu")
    strip = lambda m: {k: v for k, v in m.items() if not k.endswith("seconds")}  # noqa: E731
    assert strip(result["metrics"]) == pytest.approx(strip(expected), abs=1e-9)


def _compose(overrides):
    from hydra import compose, initialize_config_dir

    from infclip.eval import cli

    cli.register()
    with initialize_config_dir(config_dir=str(cli.CONFIG_DIR), version_base=None):
        return compose(config_name="eval", overrides=overrides)


def test_every_preset_composes_into_a_valid_task(synthetic):
    from infclip.eval.cli import CONFIG_DIR, build_eval_config

    names = sorted(p.stem for p in (CONFIG_DIR / "eval_task").glob("*.yaml"))
    assert {"imagenet", "imagenet_v2", "imagenet_r", "imagenet_a", "imagenet_o", "objectnet", "coco",
            "flickr30k", "synthetic_zeroshot", "synthetic_retrieval"} <= set(names)
    cfg = _compose(["checkpoint=none", f"tasks=[{','.join(names)}]", "data_root=/d",
                    f"synthetic_root={synthetic.root}", "+task.coco.split=val"])
    tasks = {t.name: t for t in build_eval_config(cfg).tasks}
    assert tasks["imagenet"].root == "/d/imagenet/val" and tasks["imagenet"].classnames == "imagenet"
    assert tasks["coco"].kind == "retrieval" and tasks["coco"].split == "val"  # the override applied
    assert tasks["synthetic_zeroshot"].root == f"{synthetic.root}/eval/zeroshot"
    assert tasks["flickr30k"].annotations == "/d/flickr30k/dataset_flickr30k.json"


def test_unknown_task_and_stray_override_are_rejected():
    from infclip.eval.cli import build_eval_config

    with pytest.raises(EvalConfigError, match="unknown task 'imagenet-1k'.*imagenet"):
        build_eval_config(_compose(["checkpoint=none", "tasks=[imagenet-1k]"]))
    with pytest.raises(EvalConfigError, match="task.coco overrides a task that is not in tasks"):
        build_eval_config(_compose(["checkpoint=none", "tasks=[imagenet]", "+task.coco.split=val"]))


def _micro_cfg():
    import open_clip

    cfg = open_clip.get_model_config("infclip-micro")
    return {"embed_dim": cfg["embed_dim"], "vision_cfg": cfg["vision_cfg"], "text_cfg": cfg["text_cfg"]}


def test_a_run_folder_is_evaluated_on_its_own_tasks_by_default(tmp_path, synthetic, micro):
    """No tasks=: the run's own eval.tasks (its config.yaml), not the synthetic presets."""
    from omegaconf import OmegaConf

    from infclip.eval.cli import plan_tasks, task_source

    run = tmp_path / "run"
    _save(run, 3, micro[0])
    zs = synthetic.eval_tasks()[0]
    mine = {"name": "mine", "kind": "zeroshot", "root": zs.root, "format": zs.format, "split": zs.split}
    OmegaConf.save({"eval": {"tasks": [mine]}}, run / "config.yaml")
    for checkpoint in (run, run / "checkpoints" / "step_00000003", run / "checkpoints" / "step_00000003" / "model.pt"):
        cfg = _compose([f"checkpoint={checkpoint}"])
        tasks, _ = plan_tasks(cfg)
        assert [(t.name, t.root) for t in tasks] == [("mine", zs.root)]
        assert task_source(cfg) == f"{run / 'config.yaml'} eval.tasks"
    assert [t.name for t in plan_tasks(_compose([f"checkpoint={run}", "tasks=[synthetic_zeroshot]",
                                                 f"synthetic_root={synthetic.root}"]))[0]] == ["synthetic_zeroshot"]
    OmegaConf.save({"eval": {"tasks": []}}, run / "config.yaml")
    with pytest.raises(EvalConfigError, match="evaluated no tasks"):
        plan_tasks(_compose([f"checkpoint={run}"]))


def test_a_run_on_its_own_data_is_not_evaluated_on_the_synthetic_tasks_the_trainer_skipped(tmp_path, micro):
    """A data.kind=wds run whose config still lists the quick start's synthetic tasks: the
    trainer skipped them, so does the eval command (its other tasks stay); none left: refused
    with the way to name tasks, not near-chance numbers appended to the run's eval.jsonl."""
    from omegaconf import OmegaConf

    from infclip.eval.cli import plan_tasks

    run = tmp_path / "run"
    _save(run, 3, micro[0])
    synthetic = {"name": "synthetic_zeroshot", "kind": "zeroshot", "root": "synthetic:zeroshot", "format": "wds"}
    held = {"name": "holdout", "kind": "retrieval", "format": "flat", "root": str(tmp_path / "holdout")}
    (tmp_path / "holdout").mkdir()
    (tmp_path / "holdout" / "test.json").write_text('[{"image": "a.png", "caption": ["a"]}]')
    OmegaConf.save({"data": {"kind": "wds"}, "eval": {"tasks": [synthetic, held]}}, run / "config.yaml")
    assert [t.name for t in plan_tasks(_compose([f"checkpoint={run}"]))[0]] == ["holdout"]
    OmegaConf.save({"data": {"kind": "wds"}, "eval": {"tasks": [synthetic]}}, run / "config.yaml")
    with pytest.raises(EvalConfigError, match=r"evaluated no tasks .* only the embedded synthetic set's.*tasks=\[\{"):
        plan_tasks(_compose([f"checkpoint={run}"]))
