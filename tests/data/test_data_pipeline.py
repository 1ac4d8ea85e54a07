"""The webdataset pipeline: counting, splitting, equal batch counts, resampling, mixing, pipe:."""

import os

import pytest
import torch
from torchvision.transforms import Compose, PILToTensor, Resize

from data_helpers import IdTokenizer, ids
from infclip.data.config import DataConfig, SourceConfig
from infclip.data.pipeline import DataError, build_train_data, resolve_sources, total_samples
from infclip.data.shards import count_samples, expand

TRANSFORM = Compose([Resize((8, 8)), PILToTensor()])


def _build(spec, rank=0, world=1, seed=0, num_samples=None, **kw):
    cfg = DataConfig(kind="wds", shards=spec, **{"loader_batch": 4, "workers": 0, "shuffle_buffer": 0, **kw})
    return build_train_data(cfg, transform=TRANSFORM, tokenizer=IdTokenizer(), rank=rank, world_size=world,
                            seed=seed, num_samples=num_samples)


def _epoch_batches(data):
    """Token batches of this rank's first epoch, read from the loader up to epoch 1's first batch."""
    out = []
    for _, tokens, info in data._loader():
        if info["epoch"] != data.epoch:
            return out
        out.append(tokens)


def _epoch_ids(data):
    return [i for tokens in _epoch_batches(data) for i in ids(tokens)]


def test_brace_expansion_and_counting(shards, tmp_path):
    paths = shards([5, 7, 3])
    spec = str(tmp_path / "shards" / "{00000..00002}.tar")
    assert expand(spec) == paths
    assert expand(f"{paths[0]}::{paths[2]}") == [paths[0], paths[2]]
    assert count_samples(paths) == 15  # sizes.json
    os.remove(tmp_path / "shards" / "sizes.json")
    assert count_samples(paths) == 15  # *_stats.json "successes"
    os.remove(tmp_path / "shards" / "00001_stats.json")
    assert count_samples(paths) is None
    with pytest.raises(DataError, match="data.num_samples"):
        _build(spec)
    assert _build(spec, num_samples=12).epoch_batches == 3


def test_missing_local_shards_are_listed(shards, tmp_path):
    shards([4, 4])
    spec = str(tmp_path / "shards" / "{00000..00009}.tar")
    with pytest.raises(FileNotFoundError, match=r"8 of 10 local shards do not exist") as err:
        _build(spec)
    assert "00002.tar" in str(err.value) and "00006.tar" in str(err.value)
    assert "00007.tar" not in str(err.value)  # only the first few are listed


def test_epoch_mode_splits_disjointly_and_covers_every_sample_once(shards, tmp_path):
    shards([16] * 8)
    spec = str(tmp_path / "shards" / "{00000..00007}.tar")
    per_rank = []
    for rank in range(2):
        data = _build(spec, rank=rank, world=2, workers=2, shuffle_buffer=10)
        assert data.epoch_batches == 16
        per_rank.append(_epoch_ids(data))
    assert set(per_rank[0]).isdisjoint(per_rank[1])
    everything = per_rank[0] + per_rank[1]
    assert sorted(everything) == list(range(128))
    # the epoch's shard order is shuffled with the seed: epoch 1 visits samples in another order
    data = _build(spec, rank=0, world=2, workers=2, shuffle_buffer=10)
    data.position.batches = data.spec.epoch_batches  # start at epoch 1
    assert _epoch_ids(data) != per_rank[0]


def test_equal_batch_counts_across_ranks_with_uneven_shards(shards, tmp_path):
    shards([30, 2, 2, 2, 30, 2, 2, 2, 3])
    spec = str(tmp_path / "shards" / "{00000..00008}.tar")
    counts = []
    for rank in range(2):
        data = _build(spec, rank=rank, world=2, workers=2)
        assert data.epoch_batches == 75 // (2 * 4)
        batches = _epoch_batches(data)
        assert all(len(t) == 4 for t in batches)
        counts.append(len(batches))
    assert counts == [9, 9]


def test_fewer_shards_than_ranks_times_workers_use_fewer_workers_and_say_so(shards, tmp_path, capsys):
    shards([4, 4, 4])
    spec = str(tmp_path / "shards" / "{00000..00002}.tar")
    data = _build(spec, world=2, workers=2)
    assert data.workers == 1 and "using 1 worker(s) per rank" in capsys.readouterr().out
    assert _build(spec, world=2, workers=2, resampled=True).workers == 2
    shards([4])  # one shard for two ranks: no worker layout reads it in epoch mode
    with pytest.raises(DataError, match="at least world_size x data.workers = 2 x 1 = 2 shards"):
        _build(str(tmp_path / "shards" / "00000.tar"), world=2, workers=2)


def test_resampled_mode_is_deterministic_per_seed_and_rank(shards, tmp_path):
    shards([8] * 4)
    spec = str(tmp_path / "shards" / "{00000..00003}.tar")

    def run(seed, rank=0, n=6):
        it = _build(spec, seed=seed, rank=rank, world=2, workers=2, resampled=True, shuffle_buffer=5).batches()
        return [ids(next(it)[1]) for _ in range(n)]  # 6 crosses an epoch (4 batches per epoch per rank)

    a = run(0)
    assert a == run(0)
    assert a[:4] != run(1, n=4)
    assert a[:4] != run(0, rank=1, n=4)


def test_weighted_mixing_of_sources(shards, tmp_path):
    shards([20] * 4, name="a")  # ids 0..79, 20 per shard
    shards([10] * 4, name="b", first_id=1000)  # ids 1000..1039, 10 per shard
    cfg = DataConfig(kind="wds", loader_batch=40, workers=0, shuffle_buffer=0, resampled=True, sources=[
        SourceConfig(shards=str(tmp_path / "a" / "{00000..00003}.tar"), weight=3.0),
        SourceConfig(shards=str(tmp_path / "b" / "{00000..00003}.tar"), weight=1.0, num_samples=40)])
    sources = resolve_sources(cfg)
    assert [s.num_samples for s in sources] == [80, 40] and total_samples(cfg, sources, None) == 120
    data = build_train_data(cfg, transform=TRANSFORM, tokenizer=IdTokenizer(), rank=0, world_size=1, seed=0)
    it = data.batches()
    got = [i for _ in range(60) for i in ids(next(it)[1])]
    frac_a = sum(i < 1000 for i in got) / len(got)
    assert 0.65 < frac_a < 0.85, frac_a  # weights 3:1 are shares of samples, whatever the shard sizes
    cfg.resampled = False
    with pytest.raises(DataError, match="resampled=true"):
        build_train_data(cfg, transform=TRANSFORM, tokenizer=IdTokenizer(), rank=0, world_size=1, seed=0)


def test_pipe_urls_and_json_captions(shards, tmp_path):
    shards([6, 6])
    spec = "pipe:cat " + str(tmp_path / "shards" / "{00000..00001}.tar")
    with pytest.raises(DataError, match="data.num_samples"):
        _build(spec)  # remote shards cannot be counted
    data = _build(spec, num_samples=12, json_caption_key="captions", loader_batch=6)
    got = sorted(_epoch_ids(data))
    assert got == list(range(12))  # captions came from json "captions": ["alt<id>"]
    assert data.skip_counts() == {}
