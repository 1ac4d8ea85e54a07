"""Fixtures for the eval tests: the generator's held-out split and a tiny open_clip model."""

import open_clip
import pytest
import torch

import infclip.model  # noqa: F401  registers infclip/model_configs (infclip-micro)
from infclip.data.synthetic import generate

MODEL = "infclip-micro"  # 32 px, 1 layer per tower, embed dim 32


@pytest.fixture(scope="session")
def synthetic(tmp_path_factory):
    """The data generator's dataset with a 37-image eval split (odd: uneven rank shards)."""
    return generate(str(tmp_path_factory.mktemp("syn") / "root"), num_train=8, num_eval=37, side=32, seed=0)


@pytest.fixture(scope="session")
def micro():
    """(model, tokenizer, float val preprocess) of a randomly initialized infclip-micro (seed 0)."""
    torch.manual_seed(0)
    model, _, preprocess = open_clip.create_model_and_transforms(MODEL)
    return model.eval(), open_clip.get_tokenizer(MODEL), preprocess


@pytest.fixture(scope="session")
def digits(tmp_path_factory):
    """scikit-learn's digits in four layouts and a tiny CLIP fitted to them (tests/eval/digits.py)."""
    import digits as digits_module

    return digits_module.make(tmp_path_factory.mktemp("digits"))


@pytest.fixture
def run_dir(tmp_path):
    """A run folder with checkpoints 1 and 2 of different micro models, written as the trainer
    writes them (model.pt, train.pt, rank file, open_clip's files, manifest last)."""
    from infclip.config import ModelConfig
    from infclip.export import checkpoint_writer
    from infclip.model import build_model
    from infclip.train import checkpoint as ckpt

    built = build_model(ModelConfig(name=MODEL))
    saver = ckpt.Checkpointer(tmp_path / "run", keep_last=3, rank=0, barrier=lambda: None,
                              on_publish=checkpoint_writer(built, ModelConfig(name=MODEL)))
    for step in (1, 2):
        torch.manual_seed(step)
        state = build_model(ModelConfig(name=MODEL)).model.state_dict()
        saver.save(step, state, {"step": step}, {"rng": ckpt.rng_state(), "data": {}})
    return tmp_path / "run"
