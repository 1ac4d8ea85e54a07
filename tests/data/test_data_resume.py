"""A saved position reproduces the remaining batches exactly (order, augmentation, skips)."""

import json

import pytest
import torch
from torchvision.transforms import Compose, PILToTensor, RandomResizedCrop

from data_helpers import IdTokenizer
from infclip.data.config import DataConfig
from infclip.data.pipeline import DataError, build_train_data

AUGMENT = Compose([RandomResizedCrop(8, scale=(0.08, 1.0)), PILToTensor()])


def _build(spec, seed=5, num_samples=8 * 12, **kw):
    cfg = DataConfig(kind="wds", shards=spec, **{"loader_batch": 5, "workers": 2, "shuffle_buffer": 7, **kw})
    return build_train_data(cfg, transform=AUGMENT, tokenizer=IdTokenizer(), rank=1, world_size=2, seed=seed,
                            num_samples=num_samples)


def _take(it, n):
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("resampled,split", [(False, 5), (True, 5), (False, 9), (True, 10)])
def test_resume_reproduces_the_remaining_stream(shards, tmp_path, resampled, split):
    shards([12] * 8)
    spec = str(tmp_path / "shards" / "{00000..00007}.tar")
    data = _build(spec, resampled=resampled)
    assert data.epoch_batches == 9  # odd: the worker round-robin shifts at every epoch boundary
    it = data.batches()
    _take(it, split)
    state = json.loads(json.dumps(data.state_dict()))  # plain, serializable
    assert state["position"] == 2 * split and state["epoch"] == split // 9  # global batches: both ranks took split
    reference = _take(it, 15)  # crosses one or two epoch boundaries
    assert data.state_dict()["epoch"] == (split + 15) // 9

    resumed = _build(spec, resampled=resampled)
    resumed.load_state_dict(state)
    again = _take(resumed.batches(), 15)
    for (ri, rt), (ai, at) in zip(reference, again):
        assert torch.equal(rt, at) and torch.equal(ri, ai)  # same samples, same random crops
    assert resumed.state_dict() == data.state_dict()

    fresh = _take(_build(spec, resampled=resampled).batches(), split + 15)
    assert all(torch.equal(f[1], r[1]) for f, r in zip(fresh[split:], reference))  # == uninterrupted run


def test_resume_with_another_worker_count_continues_the_same_stream(shards, tmp_path):
    """One worker then holds both streams of the rank: the batches are the same."""
    shards([12] * 8)
    spec = str(tmp_path / "shards" / "{00000..00007}.tar")
    data = _build(spec)
    it = data.batches()
    _take(it, 3)
    state = data.state_dict()
    reference = _take(it, 8)
    it.close()
    other = _build(spec, workers=1)
    other.load_state_dict(state)
    assert other.workers == 1
    again = _take(other.batches(), 8)
    assert all(torch.equal(r[1], a[1]) and torch.equal(r[0], a[0]) for r, a in zip(reference, again))


def test_resume_refuses_another_seed_or_dataset_size(shards, tmp_path):
    shards([12] * 8)
    spec = str(tmp_path / "shards" / "{00000..00007}.tar")
    state = _build(spec).state_dict()
    with pytest.raises(DataError, match="seed was 5 now 6"):
        _build(spec, seed=6).load_state_dict(state)
    with pytest.raises(DataError, match="num_samples was 96 now 80"):
        _build(spec, num_samples=80).load_state_dict(state)


def test_training_rng_is_untouched_by_in_process_loading(shards, tmp_path):
    shards([12] * 8)
    data = _build(str(tmp_path / "shards" / "{00000..00007}.tar"), workers=0)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    next(data.batches())
    assert torch.equal(torch.rand(3), expected)
