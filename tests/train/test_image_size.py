"""model.image_size (open_clip's force_image_size): the model, its transforms and its
checkpoints follow it; data.image_size must agree with it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import open_clip
import pytest
import torch
from test_config import _compose
from test_train_cli import metrics, run_train

from infclip.config import ConfigError, ModelConfig, validate
from infclip.model import build_model
from infclip.train.build import _check_image_size


def test_tiny_vit_built_at_another_side_takes_that_input():
    """infclip-micro is 32 px with 8-px patches; at 48 px its grid is 6x6 (+ CLS)."""
    built = build_model(ModelConfig(name="infclip-micro", image_size=48))
    visual = built.model.visual
    assert built.image_size == 48 and tuple(visual.image_size) == (48, 48)
    assert visual.positional_embedding.shape[0] == 6 * 6 + 1
    from PIL import Image

    assert built.preprocess_val(Image.new("RGB", (100, 70))).shape == (3, 48, 48)
    with torch.no_grad():
        assert built.model.encode_image(torch.rand(2, 3, 48, 48)).shape == (2, 32)


def test_pretrained_weights_of_another_side_get_interpolated_position_embeddings(tmp_path):
    """A 32-px checkpoint loads into the 48-px model (open_clip resizes the position grid);
    every other tensor is the checkpoint's."""
    small = build_model(ModelConfig(name="infclip-micro")).model
    torch.save(small.state_dict(), tmp_path / "small.pt")
    big = build_model(ModelConfig(name="infclip-micro", image_size=48, pretrained=str(tmp_path / "small.pt"))).model
    assert big.visual.positional_embedding.shape[0] == 37
    assert torch.equal(big.visual.positional_embedding[0], small.visual.positional_embedding[0])  # CLS kept
    assert torch.equal(big.visual.conv1.weight, small.visual.conv1.weight)


_OPEN_CLIP_ALONE = textwrap.dedent("""
    import json, sys, torch, open_clip
    folder, out = sys.argv[1], sys.argv[2]
    model, _, preprocess = open_clip.create_model_and_transforms("local-dir:" + folder)
    torch.manual_seed(0)
    with torch.no_grad():
        emb = model.eval().encode_image(torch.rand(2, 3, 48, 48))
    torch.save({"emb": emb, "size": list(model.visual.image_size), "crop": preprocess.transforms[0].size,
                "infclip_imported": any(m.startswith("infclip") for m in sys.modules)}, out)
""")


def test_a_run_at_model_image_size_trains_and_its_checkpoint_opens_in_open_clip_at_that_size(tmp_path):
    """train.py on infclip-micro at 48 px (its own side is 32) with patch dropout: training and
    eval run at 48 px, open_clip_config.json records vision_cfg.image_size=48 (and no
    patch_dropout), and open_clip alone opens the checkpoint at 48 px with our embeddings."""
    run = tmp_path / "run"
    run_train(tmp_path, f"run_dir={run}", "steps=2", "model.image_size=48", "model.patch_dropout=0.5")
    summary = metrics(run)[-1]["summary"]
    assert any(k.startswith("eval/synthetic_zeroshot/") for k in summary), summary
    folder = run / "checkpoints" / "step_00000002"
    vision = json.loads((folder / "open_clip_config.json").read_text())["model_cfg"]["vision_cfg"]
    assert vision["image_size"] == 48 and "patch_dropout" not in vision
    out = tmp_path / "theirs.pt"
    proc = subprocess.run([sys.executable, "-c", _OPEN_CLIP_ALONE, str(folder), str(out)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = torch.load(out)
    assert theirs["size"] == [48, 48] and theirs["infclip_imported"] is False
    assert theirs["crop"] in (48, (48, 48), [48, 48])
    ours = build_model(ModelConfig(name="infclip-micro", image_size=48, pretrained=str(folder / "model.pt"))).model
    torch.manual_seed(0)
    with torch.no_grad():
        assert torch.equal(ours.eval().encode_image(torch.rand(2, 3, 48, 48)), theirs["emb"])
    # python -m infclip.export rebuilding the files from model.pt + the run's config.yaml
    from infclip.export import export

    again = export(folder, tmp_path / "exported", model="infclip-micro")
    assert json.loads((again / "open_clip_config.json").read_text())["model_cfg"]["vision_cfg"]["image_size"] == 48
    assert open_clip.create_model_and_transforms("local-dir:" + str(again))[0].visual.image_size == (48, 48)


def test_data_and_model_image_size_that_disagree_are_refused_naming_both():
    with pytest.raises(ConfigError, match=r"data.image_size=32 but model.image_size=48.*drop data.image_size"):
        validate(_compose("model.image_size=48", "data.image_size=32"), 1)
    validate(_compose("model.image_size=48", "data.image_size=48"), 1)  # agreeing: fine
    with pytest.raises(ConfigError, match=r"model.image_size must be > 0"):
        validate(_compose("model.image_size=0"), 1)


def test_preflight_checks_patches_and_lets_model_image_size_rebuild_the_model():
    cfg = _compose("model.name=infclip-micro", "model.image_size=50")
    with pytest.raises(ConfigError, match=r"model.image_size=50 is not a multiple of .* 8-px patches; "
                                          r"set model.image_size=48 or 56"):
        _check_image_size(cfg)
    _check_image_size(_compose("model.name=infclip-micro", "model.image_size=48", "data.image_size=48"))
    with pytest.raises(ConfigError, match=r"data.image_size=48 but model.name=infclip-micro takes 32-px .*"
                                          r"model.image_size=48"):
        _check_image_size(_compose("model.name=infclip-micro", "data.image_size=48"))


def test_mismatch_exits_2_before_any_work(tmp_path):
    proc = subprocess.run([sys.executable, _train_py(), "model.image_size=48",
                           "data.image_size=32", f"run_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "data.image_size=32 but model.image_size=48" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def _train_py() -> str:
    from test_train_cli import ROOT

    return str(ROOT / "train.py")


def test_resuming_at_another_model_image_size_is_refused(tmp_path):
    from infclip.train.resume import ResumeError, _refuse_fixed_changes

    with pytest.raises(ResumeError, match=r"model.image_size=48: it was written with model.image_size=None"):
        _refuse_fixed_changes({"model": {"image_size": None}}, {"model": {"image_size": 48}}, tmp_path)
    _refuse_fixed_changes({"model": {"patch_dropout": 0.0}}, {"model": {"patch_dropout": 0.5}}, tmp_path)
