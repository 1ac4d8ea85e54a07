"""``python -m infclip.export``: a bad --out is one paragraph with exit 2, and the exported
open_clip files get the run's usual file mode (safetensors alone would write 0600)."""

import os
import stat

import pytest
import torch

from infclip.config import ModelConfig
from infclip.export import WEIGHTS_NAME, checkpoint_writer, main
from infclip.manifest import write_manifest
from infclip.model import build_model


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    """A run's checkpoint folder with model.pt and open_clip's files (infclip-micro)."""
    folder = tmp_path_factory.mktemp("run") / "checkpoints" / "step_00000001"
    built = build_model(ModelConfig(name="infclip-micro"))
    old = os.umask(0o022)
    try:
        checkpoint_writer(built, ModelConfig(name="infclip-micro"))(folder, built.model.state_dict())
    finally:
        os.umask(old)
    torch.save(built.model.state_dict(), folder / "model.pt")
    write_manifest(folder)
    return folder


def test_the_open_clip_weights_are_written_0644_like_every_other_checkpoint_file(step):
    assert stat.S_IMODE((step / WEIGHTS_NAME).stat().st_mode) == 0o644
    assert stat.S_IMODE((step / "open_clip_config.json").stat().st_mode) == 0o644


@pytest.mark.parametrize("where, match", [
    ("file", "cannot be used as the output folder (exists and is not a folder)"),
    ("itself", "is the checkpoint folder itself"),
    ("under_a_file", "cannot be used as the output folder (Not a directory)"),
])
def test_a_bad_out_is_one_paragraph_with_exit_2(step, tmp_path, capsys, where, match):
    (tmp_path / "f").write_text("x")
    out = {"file": tmp_path / "f", "itself": step, "under_a_file": tmp_path / "f" / "sub"}[where]
    assert main([str(step), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {out} ") and match in err and len(err.strip().splitlines()) == 1, err


def test_a_good_out_is_written(step, tmp_path, capsys):
    assert main([str(step), "--out", str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / WEIGHTS_NAME).is_file()
