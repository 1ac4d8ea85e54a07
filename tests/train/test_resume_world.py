"""Which checkpoints another number of ranks can continue, and the refusals that name the fix."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from infclip.config import ConfigError, register_configs, validate
from infclip.train import checkpoint as ckpt
from infclip.train.resume import ResumeError, _explicit_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def _data(streams):
    """A saved data position of a global order with ``streams`` streams, at its start."""
    return {"position": 0, "epoch": 0, "cursors": [None] * streams, "streams": streams, "stream_world": 2,
            "epoch_batches": 8, "num_samples": 64, "loader_batch": 8, "seed": 0, "resampled": False,
            "world_size": 2, "workers": 2, "skips": {}}


def _two_rank_checkpoint(tmp_path, data):
    """Step 1 as two ranks write it: rank 0's save, rank 1's file beside it, the manifest over both."""
    path = ckpt.Checkpointer(tmp_path, keep_last=2, rank=0, barrier=lambda: None).save(
        1, {"w": torch.zeros(2)}, {"step": 1}, {"rng": ckpt.rng_state(), "data": data})
    torch.save({"rng": ckpt.rng_state(), "data": data}, path / "rank_00001.pt")
    ckpt.write_manifest(path)
    return path


def test_a_checkpoint_resumes_on_the_divisors_of_its_streams(tmp_path):
    path = _two_rank_checkpoint(tmp_path, _data(4))
    assert ckpt.saved_world_size(path) == 2
    assert [ckpt.verify_checkpoint(path, w) for w in (1, 2, 4)] == [None, None, None]
    problem = ckpt.verify_checkpoint(path, 3)
    assert "4 streams" in problem and "1, 2, 4 rank(s)" in problem and "for world size 3" in problem
    with pytest.raises(ResumeError, match=r"cannot resume 3 rank\(s\).*1, 2, 4 rank\(s\)"):
        _explicit_checkpoint(path, 3)
    saver = ckpt.Checkpointer(tmp_path, keep_last=2, rank=0, barrier=lambda: None)
    assert saver.latest_loadable(world_size=1) == path
    assert saver.latest_loadable(world_size=3, warn=lambda line: None) is None and path.is_dir()  # kept, not moved aside
    model, _, rank_state = ckpt.load(path, rank=3)  # a rank the old world did not have
    assert rank_state is None and torch.equal(model["w"], torch.zeros(2))
    assert [s["data"]["streams"] for s in ckpt.load_rank_states(path)] == [4, 4]


def test_a_missing_rank_file_is_damage_not_another_world(tmp_path):
    path = _two_rank_checkpoint(tmp_path, _data(4))
    (path / "manifest.json").unlink()  # an older checkpoint, without a manifest
    (path / "rank_00000.pt").unlink()
    assert "not those of a complete world" in ckpt.verify_checkpoint(path, 1)


def test_data_streams_must_be_a_multiple_of_the_world_size():
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["data.streams=4", "batch.global_size=384",
                                                      "batch.micro_size=64"])
    validate(cfg, 2)
    with pytest.raises(ConfigError, match=r"data.streams=4 is not a multiple of the world size 3"):
        validate(cfg, 3)


def test_a_world_no_checkpoint_can_split_is_refused_before_the_model(tmp_path):
    from types import SimpleNamespace

    from infclip.train.resume import world_problem

    path = _two_rank_checkpoint(tmp_path, _data(4))
    auto = SimpleNamespace(resume="auto", checkpoint=SimpleNamespace(remote=None))
    assert world_problem(auto, tmp_path, 1) is None and world_problem(auto, tmp_path, 4) is None
    assert "1, 2, 4 rank(s)" in world_problem(auto, tmp_path, 3)
    explicit = SimpleNamespace(resume=str(path), checkpoint=SimpleNamespace(remote=None))
    assert f"resume='{path}' cannot resume 3 rank(s)" in world_problem(explicit, tmp_path / "elsewhere", 3)
    assert world_problem(SimpleNamespace(resume="none"), tmp_path, 3) is None
    remote = SimpleNamespace(resume="auto", checkpoint=SimpleNamespace(remote="memory://x"))
    assert world_problem(remote, tmp_path, 3) is None  # the remote may hold others: decided later
