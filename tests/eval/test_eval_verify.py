"""Every file the eval command, the export and resume load is verified against the
checkpoint's manifest: a tampered open_clip_model.safetensors (its text
projection zeroed, same size) is a damaged checkpoint: warned about, set aside, fallen back from."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from infclip.eval.config import EvalConfigError
from infclip.export import WEIGHTS_NAME, ExportError, find_checkpoint
from infclip.train import checkpoint as ckpt

MODEL = "infclip-micro"




def _zero_text_projection(folder):
    """The fault-injection pass's tampering: same size, same header, other bytes."""
    path = folder / WEIGHTS_NAME
    size = path.stat().st_size
    state = load_file(str(path))
    state["text_projection"] = torch.zeros_like(state["text_projection"])
    save_file(state, str(path), metadata={"format": "pt"})
    assert path.stat().st_size == size


def test_eval_falls_back_from_a_tampered_safetensors_and_loads_the_intact_weights(run_dir, capsys):
    from omegaconf import OmegaConf

    from infclip.eval.cli import build, resolve_checkpoint

    steps = run_dir / "checkpoints"
    _zero_text_projection(steps / "step_00000002")
    resolved = resolve_checkpoint(str(run_dir))
    assert resolved == str(steps / "step_00000001" / "model.pt")
    err = capsys.readouterr().err
    assert f"skipping damaged checkpoint {steps / 'step_00000002'}: {WEIGHTS_NAME} does not match" in err
    assert (steps / "step_00000002.damaged").is_dir() and not (steps / "step_00000002").exists()
    cfg = OmegaConf.create({"model": None, "model_config_file": None})
    model, _, _ = build(cfg, torch.device("cpu"), resolved)  # open_clip's local-dir: of step 1
    saved = torch.load(resolved, weights_only=True)
    assert torch.equal(model.text_projection, saved["text_projection"]) and saved["text_projection"].abs().sum() > 0


def test_eval_refuses_an_explicit_step_folder_whose_safetensors_was_tampered(run_dir):
    from infclip.eval.cli import resolve_checkpoint

    step = run_dir / "checkpoints" / "step_00000002"
    _zero_text_projection(step)
    with pytest.raises(EvalConfigError, match=f"{WEIGHTS_NAME} does not match its SHA-256"):
        resolve_checkpoint(str(step))
    with pytest.raises(EvalConfigError, match=f"{WEIGHTS_NAME} does not match its SHA-256"):
        resolve_checkpoint(str(step / "model.pt"))


def test_a_weights_file_added_after_the_checkpoint_was_written_is_not_trusted(run_dir):
    from infclip.eval.cli import resolve_checkpoint

    step = run_dir / "checkpoints" / "step_00000002"
    (step / "tokenizer_config.json").write_text("{}")  # open_clip's local-dir: would read it
    with pytest.raises(EvalConfigError, match="tokenizer_config.json is not in its manifest.json"):
        resolve_checkpoint(str(step))


def test_export_falls_back_from_a_tampered_safetensors_and_refuses_it_by_step(run_dir):
    steps = run_dir / "checkpoints"
    _zero_text_projection(steps / "step_00000002")
    with pytest.raises(ExportError, match=f"step_00000002 is damaged: {WEIGHTS_NAME} does not match"):
        find_checkpoint(run_dir, 2)
    lines = []
    assert find_checkpoint(run_dir, None, warn=lines.append) == steps / "step_00000001"
    assert len(lines) == 1 and WEIGHTS_NAME in lines[0] and "step_00000002.damaged" in lines[0]


def test_resume_falls_back_from_a_tampered_safetensors(run_dir):
    _zero_text_projection(run_dir / "checkpoints" / "step_00000002")
    saver = ckpt.Checkpointer(run_dir, keep_last=3, rank=0, barrier=lambda: None)
    lines = []
    assert saver.latest_loadable(world_size=1, warn=lines.append).name == "step_00000001"
    assert len(lines) == 1 and WEIGHTS_NAME in lines[0]


def test_a_model_with_zeroed_text_projection_never_scores_100_and_is_reported(synthetic, micro):
    """Defect 2: its class embeddings are NaN (open_clip normalizes a zero mean); it scored
    top-1 = top-5 = 100 %. Now 0, every image counted, and the eval command warns."""
    import copy

    from infclip.eval import EvalConfig, run_evals
    from infclip.eval.cli import nonfinite_warnings

    model, tokenizer, preprocess = micro
    collapsed = copy.deepcopy(model)
    with torch.no_grad():
        collapsed.text_projection.zero_()
    tasks = [t for t in synthetic.eval_tasks() if t.kind == "zeroshot"]
    metrics = run_evals(collapsed, tokenizer, preprocess, EvalConfig(tasks=tasks, workers=0), step=0, final=True,
                        device="cpu")
    name = tasks[0].name
    assert metrics[f"eval/{name}/top1"] == 0.0 and metrics[f"eval/{name}/top5"] == 0.0
    assert metrics[f"eval/{name}/num_nonfinite"] == metrics[f"eval/{name}/num_samples"] == 37
    assert nonfinite_warnings(metrics) == [
        f"warning: {name}: 37 of 37 queries scored non-finite similarities (the model's embeddings are NaN/inf: "
        "collapsed or damaged weights); counted as misses"]
    healthy = run_evals(model, tokenizer, preprocess, EvalConfig(tasks=tasks, workers=0), step=0, final=True,
                        device="cpu")
    assert f"eval/{name}/num_nonfinite" not in healthy and nonfinite_warnings(healthy) == []


def test_the_eval_command_reports_its_errors_in_one_paragraph_with_exit_2(tmp_path):
    """An EvalConfigError is one paragraph, not a traceback (the command had no handler)."""
    import subprocess
    import sys
    from pathlib import Path

    missing = tmp_path / "absent" / "model.pt"
    proc = subprocess.run([sys.executable, "-m", "infclip.eval", f"checkpoint={missing}", "device=cpu"],
                          cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith(f"error (EvalConfigError): checkpoint={str(missing)!r} does not exist")


def test_the_eval_command_blames_the_architecture_only_for_a_mismatch(tmp_path):
    """A refused pickle or a vanished file was reported as a wrong architecture (defect 11)."""
    import collections
    import datetime

    from omegaconf import OmegaConf

    from infclip.eval.cli import _load_failure, build

    path = tmp_path / "model.pt"
    torch.save(collections.OrderedDict(w=torch.ones(1), when=datetime.datetime(2020, 1, 1)), path)
    cfg = OmegaConf.create({"model": MODEL, "model_config_file": None})
    with pytest.raises(EvalConfigError) as err:
        build(cfg, torch.device("cpu"), str(path))
    assert "loading it would run pickled code, which is refused" in str(err.value)
    assert "architecture" not in str(err.value)
    gone = _load_failure(str(path), MODEL, FileNotFoundError(2, "No such file or directory"))
    assert "disappeared while it was read" in gone and "architecture" not in gone
    torch.save({"w": torch.ones(1)}, path)
    with pytest.raises(EvalConfigError, match="does not load into model='infclip-micro'.*architecture it was trained"):
        build(cfg, torch.device("cpu"), str(path))
