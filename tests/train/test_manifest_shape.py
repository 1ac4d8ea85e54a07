"""A manifest.json of the wrong shape, or naming paths outside its folder, makes its checkpoint
damaged (set aside, the previous one used) instead of crashing resume, eval or export; a
checkpoint that lost its manifest among siblings that have one is not trusted."""

import json
import os

import pytest
import torch

from infclip.manifest import MANIFEST, verify
from infclip.train import checkpoint as ckpt

DIGEST = "0" * 64


def _saver(tmp_path):
    return ckpt.Checkpointer(tmp_path, keep_last=3, rank=0, barrier=lambda: None)


def _save(c, step):
    return c.save(step, {"w": torch.full((2,), float(step))}, {"step": step}, {"rng": ckpt.rng_state(), "data": {}})


@pytest.mark.parametrize("content, problem", [
    ({"files": []}, "'files' is a list, not an object"),
    ({"files": "model.pt"}, "'files' is a str"),
    ({"files": {"model.pt": 5}}, "the entry of 'model.pt' is not"),
    ({"files": {"model.pt": {"size": "12", "sha256": DIGEST}}}, "the entry of 'model.pt' is not"),
    ({"files": {"model.pt": {"size": 12, "sha256": None}}}, "the entry of 'model.pt' is not"),
    ({"files": {"../outside.pt": {"size": 1, "sha256": DIGEST}}}, "'../outside.pt' is not a path inside"),
    ({"files": {"/etc/passwd": {"size": 1, "sha256": DIGEST}}}, "'/etc/passwd' is not a path inside"),
    ({"files": {"link/x.pt": {"size": 1, "sha256": DIGEST}}}, "'link/x.pt' is not a path inside"),
])
def test_a_malformed_manifest_is_a_damaged_checkpoint(tmp_path, content, problem):
    c = _saver(tmp_path / "ckpt")
    _save(c, 1)
    newest = _save(c, 2)
    (newest / "link").symlink_to(tmp_path)  # a folder outside the checkpoint
    (newest / MANIFEST).write_text(json.dumps(content))
    assert problem in verify(newest)
    lines = []
    assert c.latest_loadable(1, warn=lines.append).name == "step_00000001"
    assert len(lines) == 1 and "manifest.json is malformed" in lines[0] and "step_00000002.damaged" in lines[0]


def test_a_checkpoint_that_lost_its_manifest_among_verified_ones_is_not_trusted(tmp_path):
    c = _saver(tmp_path / "ckpt")
    _save(c, 1)
    newest = _save(c, 2)
    os.remove(newest / MANIFEST)
    assert "has no manifest.json while other checkpoints beside it have one" in verify(newest)
    assert c.latest_loadable(1, warn=lambda line: None).name == "step_00000001"


def test_export_falls_back_from_a_malformed_manifest(tmp_path):
    from infclip.export import newest_intact

    c = _saver(tmp_path / "ckpt")
    _save(c, 1)
    newest = _save(c, 2)
    (newest / MANIFEST).write_text(json.dumps({"files": {"model.pt": 1}}))
    lines = []
    assert newest_intact(newest.parent, lines.append).name == "step_00000001"
    assert "malformed" in lines[0]


def test_an_unfinished_write_that_is_a_link_is_removed_not_its_target(tmp_path):
    c = _saver(tmp_path / "ckpt")
    first = _save(c, 1)
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("not ours")
    (first.parent / ".step_00000002.tmp").symlink_to(target)
    lines = []
    assert c.latest_loadable(1, warn=lines.append) == first
    assert not os.path.lexists(first.parent / ".step_00000002.tmp") and (target / "keep.txt").exists()
    assert (_save(c, 2) / MANIFEST).is_file()  # the save at that step then works
