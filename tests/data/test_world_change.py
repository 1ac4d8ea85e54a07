"""The global sample order: a position saved on W ranks continues on W' ranks with the same
global batches, every sample of the epoch delivered exactly once across the change."""

import pytest
import torch
from torchvision.transforms import Compose, PILToTensor, RandomResizedCrop

from data_helpers import IdTokenizer, ids
from infclip.data.config import DataConfig
from infclip.data.pipeline import DataError, build_train_data, fit_workers, merge_positions

AUGMENT = Compose([RandomResizedCrop(8, scale=(0.08, 1.0)), PILToTensor()])
SAMPLES = 8 * 12  # 8 shards of 12; loader batch 4: 24 global batches per epoch


def _rank(spec, rank, world, workers=2, **kw):
    cfg = DataConfig(kind="wds", shards=spec, **{"loader_batch": 4, "workers": workers, "shuffle_buffer": 6, **kw})
    return build_train_data(cfg, transform=AUGMENT, tokenizer=IdTokenizer(), rank=rank, world_size=world, seed=3,
                            num_samples=SAMPLES)


def _global(ranks, steps, per_step):
    """Global batches in order: each of ``steps`` steps takes ``per_step`` batches from every
    rank; rank r's k-th batch is global batch r + k * W."""
    its = [r.batches() for r in ranks]
    out = []
    for _ in range(steps):
        taken = [[next(it) for _ in range(per_step)] for it in its]
        out += [taken[r][k] for k in range(per_step) for r in range(len(ranks))]
    for it in its:
        it.close()
    return out


def _resumed(spec, world, states, workers=2, **kw):
    ranks = [_rank(spec, r, world, workers, **kw) for r in range(world)]
    for r in ranks:
        r.load_state_dict(merge_positions(states))
    return ranks


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2), (2, 4)])
def test_a_world_change_continues_the_same_global_batches(shards, tmp_path, before, after):
    """2 -> 1, 1 -> 2 and 2 -> 4 ranks (data.streams=4) after 3 global steps of 4 batches: the
    remaining batches equal the uninterrupted run's, and the epoch's samples are each delivered
    once (the epoch ends within the resumed part)."""
    shards([12] * 8)
    spec = str(tmp_path / "shards" / "{00000..00007}.tar")
    streams = {"streams": 4}  # 1 rank x 2 workers alone would make 2, which 4 ranks cannot split
    first = [_rank(spec, r, before, **streams) for r in range(before)]
    head = _global(first, 3, 4 // before)
    states = [r.state_dict() for r in first]
    assert {s["position"] for s in states} == {12}
    tail = _global(_resumed(spec, after, states, **streams), 4, 4 // after)  # through the epoch's end
    reference = _global([_rank(spec, r, before, **streams) for r in range(before)], 7, 4 // before)
    for (ri, rt), (ti, tt) in zip(reference[12:], tail):
        assert torch.equal(rt, tt) and torch.equal(ri, ti)  # same samples, same crops, same order
    epoch = [i for _, tokens in (head + tail)[:24] for i in ids(tokens)]
    assert sorted(epoch) == list(range(SAMPLES))


def test_default_streams_follow_the_first_start_and_resume_on_its_divisors(shards, tmp_path):
    """Without data.streams the order has ranks x workers streams of the first start (its
    per-(rank, worker) order): 2 x 2 = 4 resumes on 1, 2 or 4 ranks and is refused on 3."""
    shards([12] * 8)
    spec = str(tmp_path / "shards" / "{00000..00007}.tar")
    first = [_rank(spec, r, 2) for r in range(2)]
    head = _global(first, 2, 3)
    states = [r.state_dict() for r in first]
    assert states[0]["streams"] == 4 and states[0]["stream_world"] == 2
    ranks = _resumed(spec, 1, states, workers=3)
    assert ranks[0].workers == 2  # 3 workers cannot split 4 streams evenly: 2 hold 2 each
    assert "global loader batch 12 (epoch 0, 12 of 24); 4 streams" in ranks[0].describe()
    tail = _global(ranks, 2, 6)
    assert sorted(i for _, t in head + tail for i in ids(t)) == list(range(SAMPLES))
    with pytest.raises(DataError, match=r"on 3 rank\(s\).*4 streams.*Resume on 1, 2, 4 rank\(s\)"):
        _rank(spec, 0, 3, workers=1).load_state_dict(merge_positions(states))


def test_a_world_that_does_not_divide_the_epoch_crosses_its_end_in_order(shards, tmp_path):
    """92 samples in loader batches of 4 with data.streams: an epoch of 23 global batches, which
    neither 2 nor 4 ranks divide; resumed on 4, the ranks take 6, 6, 6, 5 of epoch 0 and the
    order across its end is the uninterrupted one."""
    shards([12] * 8)
    spec = str(tmp_path / "shards" / "{00000..00007}.tar")

    def rank(r, world):
        cfg = DataConfig(kind="wds", shards=spec, loader_batch=4, workers=1, shuffle_buffer=6, streams=4)
        return build_train_data(cfg, transform=AUGMENT, tokenizer=IdTokenizer(), rank=r, world_size=world, seed=3,
                                num_samples=92)

    first = [rank(r, 2) for r in range(2)]
    assert first[0].spec.epoch_batches == 23  # every full loader batch, whatever the world size
    _global(first, 2, 2)
    states = [r.state_dict() for r in first]
    resumed = [rank(r, 4) for r in range(4)]
    for r in resumed:
        r.load_state_dict(merge_positions(states))
    tail = _global(resumed, 8, 1)  # global batches 8..39: across the end of epoch 0 (23)
    reference = _global([rank(r, 2) for r in range(2)], 20, 1)[8:40]
    assert [ids(t) for _, t in tail] == [ids(t) for _, t in reference]


def test_an_earlier_per_rank_position_is_read_as_the_same_order(shards, tmp_path):
    """A checkpoint of the per-rank form (cursors per worker, batches per rank) names the
    same place in the order as the global form."""
    shards([12] * 8)
    spec = str(tmp_path / "shards" / "{00000..00007}.tar")
    first = [_rank(spec, r, 2) for r in range(2)]
    _global(first, 1, 5)  # 5 batches per rank: workers 0, 1 delivered 3, 2
    states = [r.state_dict() for r in first]
    raw = [[s["cursors"][r + 2 * w][2] for w in range(2)] for r, s in enumerate(states)]  # stream r + 2w
    legacy = [{"epoch": 0, "batch": 5, "cursors": raw[r], "workers": 2,
               "world_size": 2, "seed": 3, "resampled": False, "epoch_batches": 12, "skips": {}}
              for r, s in enumerate(states)]
    got, want = merge_positions(legacy), merge_positions(states)
    resumed = _rank(spec, 0, 2)
    resumed.load_state_dict(got)  # checked by its epoch length: 2 x (96 // (2 x 4)) = 24
    with pytest.raises(DataError, match="epoch_batches was 12 now 24"):  # an earlier version's of other data
        _rank(spec, 0, 2).load_state_dict(merge_positions([{**s, "epoch_batches": 6} for s in legacy]))
    assert [got[k] for k in ("position", "streams", "stream_world", "epoch_batches", "cursors")] == \
        [want[k] for k in ("position", "streams", "stream_world", "epoch_batches", "cursors")]


def test_rank_files_of_different_positions_are_refused(shards, tmp_path):
    shards([12] * 8)
    spec = str(tmp_path / "shards" / "{00000..00007}.tar")
    first = [_rank(spec, r, 2) for r in range(2)]
    its = [r.batches() for r in first]
    next(its[0]), next(its[0]), next(its[1])
    with pytest.raises(DataError, match="disagree on the data position"):
        merge_positions([r.state_dict() for r in first])
    lost = first[0].state_dict()
    lost["cursors"][0] = None  # a stream that delivered batches without its cursor
    with pytest.raises(DataError, match="stream 0 has delivered 1 batch"):
        _rank(spec, 0, 2).load_state_dict(lost)


@pytest.mark.parametrize("wanted,per_rank,fit", [(8, 16, 8), (14, 16, 8), (3, 4, 2), (5, 7, 1), (0, 4, 0), (9, 2, 2)])
def test_fit_workers_divides_the_streams_per_rank(wanted, per_rank, fit):
    assert fit_workers(wanted, per_rank) == fit
