"""The eval command on a run folder whose training prunes checkpoints while they are read
(``checkpoint.keep_last=1``): the newest remaining intact checkpoint is
read instead, said in one line, and results never land in the current directory."""

import json
import shutil

import pytest
import torch


def _evaluate(run_dir, synthetic):
    from hydra import compose, initialize_config_dir

    from infclip.eval import cli
    from infclip.eval.__main__ import evaluate

    cli.register()
    with initialize_config_dir(config_dir=str(cli.CONFIG_DIR), version_base=None):
        cfg = compose(config_name="eval", overrides=[
            f"checkpoint={run_dir}", f"synthetic_root={synthetic.root}", "tasks=[synthetic_zeroshot]",
            "device=cpu", "eval.workers=0", "eval.batch_size=64"])
    return evaluate(cfg)


def test_a_checkpoint_pruned_between_choosing_and_loading_falls_back_to_the_next_newest(
        run_dir, synthetic, monkeypatch, capsys, tmp_path):
    from infclip.eval import cli

    steps = run_dir / "checkpoints"
    real = cli.checkpoint_architecture
    pruned = []

    def prune_then_read(pretrained):  # the training's rmtree lands after the choice, before the read
        if not pruned:
            pruned.append(pretrained)
            shutil.rmtree(steps / "step_00000002")
        return real(pretrained)

    monkeypatch.setattr(cli, "checkpoint_architecture", prune_then_read)
    monkeypatch.chdir(tmp_path)
    metrics = _evaluate(run_dir, synthetic)
    assert pruned == [str(steps / "step_00000002" / "model.pt")]
    warnings = [x for x in capsys.readouterr().err.splitlines() if "was removed while it was read" in x]
    assert len(warnings) == 1 and str(steps / "step_00000002") in warnings[0]
    result = json.loads((steps / "step_00000001" / "eval.json").read_text())
    assert result["resolved"] == str(steps / "step_00000001" / "model.pt") and result["step"] == 1
    assert result["metrics"]["eval/synthetic_zeroshot/top1"] == metrics["eval/synthetic_zeroshot/top1"]
    assert not (tmp_path / "eval_results.json").exists()


def test_a_checkpoint_pruned_after_it_was_read_reports_beside_its_run_not_here(
        run_dir, synthetic, monkeypatch, tmp_path):
    import infclip.eval.__main__ as main

    steps = run_dir / "checkpoints"
    real = main.run_evals

    def prune_then_eval(*args, **kwargs):  # the model is in memory; the folder goes meanwhile
        shutil.rmtree(steps / "step_00000002")
        return real(*args, **kwargs)

    monkeypatch.setattr(main, "run_evals", prune_then_eval)
    monkeypatch.chdir(tmp_path)
    _evaluate(run_dir, synthetic)
    assert json.loads((run_dir / "eval_step_00000002.json").read_text())["step"] == 2
    assert not (tmp_path / "eval_results.json").exists() and not (steps / "step_00000002").exists()
    logged = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if r.get("event") == "eval_command"] == [2]


def test_verification_lists_again_when_pruning_replaces_the_newest(run_dir, monkeypatch, capsys):
    """keep_last=1: while step 2 is verified a step 3 is published and steps 1, 2 pruned."""
    import infclip.export as export
    from infclip.eval.cli import resolve_checkpoint

    steps = run_dir / "checkpoints"
    real = export.verify_loaded_files

    def publish_and_prune(folder):
        if (steps / "step_00000001").exists():
            shutil.copytree(steps / "step_00000002", steps / "step_00000003")
            shutil.rmtree(steps / "step_00000001")
            shutil.rmtree(steps / "step_00000002")
        return real(folder)

    monkeypatch.setattr(export, "verify_loaded_files", publish_and_prune)
    assert resolve_checkpoint(str(run_dir)) == str(steps / "step_00000003" / "model.pt")
    err = capsys.readouterr().err
    assert "step_00000002 was removed while it was verified" in err and "damaged" not in err


def test_a_named_step_folder_pruned_before_loading_is_said_so(run_dir, monkeypatch):
    """No fallback for a step folder named explicitly; the error says it vanished (it called
    the path an open_clip pretrained tag)."""
    from omegaconf import OmegaConf

    from infclip.eval import cli
    from infclip.eval.config import EvalConfigError

    step = run_dir / "checkpoints" / "step_00000002"
    resolved = cli.resolve_checkpoint(str(step))
    shutil.rmtree(step)
    cfg = OmegaConf.create({"model": None, "model_config_file": None})
    with pytest.raises(EvalConfigError, match="disappeared while it was read") as err:
        cli.build(cfg, torch.device("cpu"), resolved)
    assert "pretrained tag" not in str(err.value)
