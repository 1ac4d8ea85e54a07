"""Model construction through open_clip's factory: names, custom JSON, local weights, errors."""

import json

import pytest
import torch

from infclip.config import ConfigError, ModelConfig
from infclip.model import build_model, clamp_logit_scale


def test_named_tiny_model_with_tokenizer_and_preprocess():
    built = build_model(ModelConfig(name="infclip-micro"))
    assert built.image_size == 32 and len(built.mean) == 3
    tokens = built.tokenizer(["a red circle", "a blue star"])
    assert tokens.shape == (2, 16) and tokens.dtype == torch.long
    out = built.model(torch.randn(2, 3, 32, 32), tokens)
    assert out["image_features"].shape == (2, 32)
    assert torch.allclose(out["image_features"].norm(dim=-1), torch.ones(2), atol=1e-5)


def test_custom_json_config_and_local_pretrained_file(tmp_path):
    cfg = {"embed_dim": 16, "vision_cfg": {"image_size": 16, "layers": 1, "width": 16, "head_width": 8, "patch_size": 8},
           "text_cfg": {"context_length": 8, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 1}}
    path = tmp_path / "my-clip.json"
    path.write_text(json.dumps(cfg))
    first = build_model(ModelConfig(config_file=str(path), init_logit_scale=1.5))
    assert first.image_size == 16 and float(first.model.logit_scale.detach()) == 1.5
    weights = tmp_path / "w.pt"
    torch.save(first.model.state_dict(), weights)
    second = build_model(ModelConfig(config_file=str(path), pretrained=str(weights)))
    for (name, a), (_, b) in zip(first.model.state_dict().items(), second.model.state_dict().items()):
        assert torch.equal(a, b), name


def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(ValueError, match="model.name='no-such-model' is not an open_clip model config"):
        build_model(ModelConfig(name="no-such-model"))


def test_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="model.config_file"):
        build_model(ModelConfig(config_file=str(tmp_path / "absent.json")))
    with pytest.raises(ConfigError, match="model.pretrained"):
        build_model(ModelConfig(name="infclip-micro", pretrained=str(tmp_path / "absent.pt")))


def test_logit_scale_clamped_to_ln_100():
    built = build_model(ModelConfig(name="infclip-micro"))
    with torch.no_grad():
        built.model.logit_scale.fill_(7.0)
    clamp_logit_scale(built.model)
    assert float(built.model.logit_scale.detach().exp()) == pytest.approx(100.0, rel=1e-5)


def _micro(seed):
    torch.manual_seed(seed)
    return build_model(ModelConfig(name="infclip-micro")).model


def test_image_pretrained_loads_the_tower_strictly_from_its_own_or_a_whole_clip_state_dict(tmp_path):
    source = _micro(1)
    tower, whole = tmp_path / "tower.pt", tmp_path / "clip.pt"
    torch.save(source.visual.state_dict(), tower)
    torch.save(source.state_dict(), whole)
    for path in (tower, whole):
        built = build_model(ModelConfig(name="infclip-micro", image_pretrained=str(path))).model
        for k, v in source.visual.state_dict().items():
            assert torch.equal(built.visual.state_dict()[k], v), k
        assert not torch.equal(built.text_projection, source.text_projection)  # the text tower stays fresh


@pytest.mark.parametrize("content,expect", [
    (b"not a checkpoint", "cannot be loaded (UnpicklingError"),
    ({"foo.weight": torch.ones(2)}, "1 keys of the file match nothing in the tower (e.g. ['foo.weight'])"),
    ("other-shapes", "have other shapes (e.g. "),
])
def test_image_pretrained_that_does_not_fit_is_refused_in_one_paragraph(tmp_path, content, expect):
    """A pretrained image tower whose keys match nothing: open_clip caught the error (or loaded nothing with strict=False) and
    a random image tower was trained with exit 0."""
    path = tmp_path / "tower.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content == "other-shapes":
        state = _micro(1).visual.state_dict()
        state["proj"] = torch.zeros(3, 3)
        torch.save(state, path)
    else:
        torch.save(content, path)
    with pytest.raises(ConfigError) as err:
        build_model(ModelConfig(name="infclip-micro", image_pretrained=str(path)))
    message = str(err.value)
    assert message.startswith(f"model.image_pretrained={str(path)!r}") and expect in message and "\n" not in message


def test_a_pretrained_tag_that_is_neither_a_tag_nor_a_file_is_a_config_error():
    with pytest.raises(ConfigError, match="model.pretrained='no-such-tag' cannot be loaded into model.name='infclip-micro'"):
        build_model(ModelConfig(name="infclip-micro", pretrained="no-such-tag"))


def test_the_ddp_wrap_warns_nothing(tmp_path):
    """torch's deprecated broadcast_buffers argument printed a FutureWarning on every rank."""
    import warnings

    import torch
    import torch.distributed as dist

    from infclip.train.build import _wrap_ddp
    from infclip.train.distributed import DistInfo

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrapped = _wrap_ddp(torch.nn.Linear(3, 2), DistInfo(0, 2, 0, torch.device("cpu")))  # "distributed"
        assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
        assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]
    finally:
        dist.destroy_process_group()


def test_a_random_init_asked_for_is_not_announced_as_a_warning(caplog):
    """Without model.pretrained, open_clip's "initialized randomly" warning (printed before a
    resume's "resumed from ...") is left out; the model is built as before."""
    import logging

    from infclip.config import ModelConfig
    from infclip.model import build_model

    with caplog.at_level(logging.WARNING):
        built = build_model(ModelConfig(name="infclip-micro"))
    assert built.model is not None
    assert not [r for r in caplog.records if "initialized randomly" in r.getMessage()]
    logging.getLogger().warning("No pretrained weights loaded for model 'x'. Model initialized randomly.")
    assert [r for r in caplog.records if "initialized randomly" in r.getMessage()]  # the filter is gone again
