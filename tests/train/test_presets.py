"""A broken or unknown preset, and a run name with path separators, are one paragraph with
exit status 2 before Hydra composes anything."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from infclip.config import ConfigError
from infclip.presets import check_presets

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


def _train(tmp_path, *args):
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "WANDB_MODE": "disabled"})


def test_a_broken_preset_in_a_config_dir_is_one_paragraph(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("steps: [1, 2\nmodel:\n  name: x\n")
    proc = _train(tmp_path, "--config-dir", str(tmp_path), "experiment=mine")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert f"preset {tmp_path / 'experiment' / 'mine.yaml'} is not valid YAML at line" in proc.stderr


def test_an_unknown_experiment_lists_the_presets(tmp_path):
    proc = _train(tmp_path, "experiment=nosuch")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "experiment=nosuch: no such preset; choose one of [" in proc.stderr and "'quickstart'" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_presets_of_a_config_dir_count_and_non_mappings_are_refused(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("steps: 3\n")
    check_presets(["--config-dir", str(tmp_path), "experiment=mine"], CONFIGS)
    check_presets(["experiment=quickstart", "loss=siglip"], CONFIGS)
    (tmp_path / "experiment" / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"list.yaml holds a YAML list, not a mapping"):
        check_presets([f"--config-dir={tmp_path}", "experiment=mine"], CONFIGS)
    with pytest.raises(ConfigError, match=r"loss=nosuch: no such preset; choose one of \['clip', 'nt_xent', 's"):
        check_presets(["loss=nosuch"], CONFIGS)


@pytest.mark.parametrize("name", ["../../x", "a/b", ".."])
def test_a_run_name_with_path_separators_is_refused(name):
    from hydra import compose, initialize_config_dir

    from infclip.config import register_configs, validate

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"name={name}"])
    with pytest.raises(ConfigError, match=r"must be a plain folder name"):
        validate(cfg, 1)
