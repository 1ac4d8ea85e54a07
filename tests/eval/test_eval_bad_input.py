"""The eval command's bad input is one paragraph (exit 2) before any work: an output path that
cannot be written, an empty image-folder root, a malformed run config.yaml or annotation file;
results that cannot be written at the end are printed, never lost."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from evalutils import OracleModel, number_tokenizer, png, to_tensor

from infclip.eval import EvalConfig, EvalConfigError, EvalTaskConfig, run_evals
from infclip.eval.data import DataError

REPO = Path(__file__).resolve().parents[2]


def _evaluate(task):
    cfg = EvalConfig(tasks=[task], batch_size=4, workers=0)
    return run_evals(OracleModel(), number_tokenizer, to_tensor, cfg, step=0, final=True, device="cpu")


def _eval_cmd(tmp_path, *args):
    cmd = [sys.executable, "-m", "infclip.eval", "checkpoint=none", "model=infclip-micro", "eval.workers=0",
           *args]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})


def test_an_unwritable_output_is_refused_before_any_work(tmp_path):
    (tmp_path / "file").write_text("a regular file")
    proc = _eval_cmd(tmp_path, f"output={tmp_path / 'file' / 'results.json'}",
                     f"synthetic_root={tmp_path / 'syn'}", "tasks=[synthetic_zeroshot]")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "cannot be written" in proc.stderr and "nothing was evaluated" in proc.stderr
    assert "Traceback" not in proc.stderr and "top1" not in proc.stdout
    assert not (tmp_path / "syn").exists()  # not even the dataset was made


def test_results_that_cannot_be_written_are_printed_and_named(monkeypatch, capsys, tmp_path):
    from omegaconf import OmegaConf

    import infclip.eval.__main__ as entry
    from infclip.eval import cli

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli, "write_results", full)
    cfg = OmegaConf.create({"output": str(tmp_path / "r.json"), "log_to_run": False, "wandb": "disabled"})
    monkeypatch.setattr(cli, "wandb_mode", lambda cfg, run: "disabled")
    with pytest.raises(EvalConfigError, match=r"r.json could not be written \(No space left on device\); the "
                                              r"results are printed above as JSON"):
        entry._report(cfg, None, EvalConfig(tasks=[]), {"eval/t/top1": 0.5}, [], 1, {})
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{"):])["eval/t/top1"] == 0.5


def test_write_results_is_atomic_and_leaves_no_temporary_file(tmp_path):
    from omegaconf import OmegaConf

    from infclip.eval import cli

    cfg = OmegaConf.create({"checkpoint": None, "model": "m", "precision": "fp32"})
    out = tmp_path / "r.json"
    cli.write_results(str(out), cfg, None, EvalConfig(tasks=[]), {"a": 1.0}, 1)
    assert json.loads(out.read_text())["metrics"] == {"a": 1.0} and os.listdir(tmp_path) == ["r.json"]


def test_an_empty_image_folder_root_is_a_data_error(tmp_path):
    (tmp_path / "empty").mkdir()
    task = EvalTaskConfig(name="f", kind="zeroshot", format="imagefolder", root=str(tmp_path / "empty"))
    with pytest.raises(DataError, match=r"holds no class folder.*root/<class name>/<image files>"):
        _evaluate(task)


@pytest.mark.parametrize("content, match", [
    ("{broken", r"not readable as JSON"),
    ('{"images": 3}', r"a flat annotation file holds a list of records, not a dict"),
    ('[{"image": "a.png"}]', r"record 0 is not"),
    ('[{"image": "../../etc/passwd", "caption": "x"}]', r"record 0's image '../../etc/passwd' is not a path inside"),
    ('[{"image": "/etc/passwd", "caption": "x"}]', r"is not a path inside"),
])
def test_a_malformed_flat_annotation_file_is_a_data_error(tmp_path, content, match):
    (tmp_path / "test.json").write_text(content)
    task = EvalTaskConfig(name="r", kind="retrieval", format="flat", root=str(tmp_path), annotations="test.json")
    with pytest.raises(DataError, match=match):
        _evaluate(task)


def test_a_malformed_karpathy_file_is_a_data_error(tmp_path):
    (tmp_path / "dataset_coco.json").write_text(json.dumps({"images": [{"split": "test", "sentences": []}]}))
    task = EvalTaskConfig(name="k", kind="retrieval", format="karpathy", root=str(tmp_path))
    with pytest.raises(DataError, match=r"image 0 lacks \"filename\""):
        _evaluate(task)


def test_a_malformed_run_config_is_one_paragraph(tmp_path):
    from infclip.eval.cli import load_run_config

    (tmp_path / "config.yaml").write_text("model: [unclosed\n  name: x: y\n")
    with pytest.raises(EvalConfigError, match=r"config.yaml cannot be read as the run's configuration"):
        load_run_config(tmp_path / "config.yaml")
    (tmp_path / "config.yaml").write_text("- a list\n")
    with pytest.raises(EvalConfigError, match=r"is not a YAML mapping"):
        load_run_config(tmp_path / "config.yaml")
