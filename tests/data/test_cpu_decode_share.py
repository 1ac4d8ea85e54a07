"""data.cpu_decode_share: with data.decode=device the loader workers decode a hashed fraction
of the samples with the CPU path's own transform and ship the pixels beside the other samples'
JPEG bytes. The choice is reproducible (resume), the pixels are the CPU path's exactly, the
other samples are packed as without the share, both gradient-cache passes see the same pixels,
host bytes count the pixels, and share 0 changes nothing."""

from __future__ import annotations

import json

import pytest
import torch

from data_helpers import IdTokenizer, jpeg
from infclip.data import stream
from infclip.data.config import DataConfig, check_data_config
from infclip.data.jpeg import PIXELS, JpegDecoder, JpegPacker, PackedJpegs
from infclip.data.pipeline import build_train_data
from infclip.data.stream import Skip, route_hash
from infclip.data.transforms import train_transform
from infclip.data.writer import ShardWriter
from infclip.train.pipeline import PipelineSettings, StepPipeline, _PackedPool

S = 12  # model input side (sources are 40 px: crops both shrink and, for small boxes, enlarge)
BAD = {5, 23, 40}  # sample ids whose image is not an image at all (skipped by both paths)


def _shards(folder, n_shards: int = 4, per: int = 16) -> str:
    with ShardWriter(str(folder), max_samples=per) as w:
        for gid in range(n_shards * per):
            data = b"\xff\xd8 not a jpeg" if gid in BAD else jpeg(gid * 7, side=40)
            w.write(f"s{gid:06d}", data, f"s{gid:06d}")
            if (gid + 1) % per == 0:
                w._finish_shard()
    return str(folder / f"{{00000..{n_shards - 1:05d}}}.tar")


def _packer(share: float) -> JpegPacker:
    return JpegPacker(S, cpu_share=share, cpu_transform=train_transform(S) if share else None)


def _data(spec: str, transform, workers: int = 0):
    cfg = DataConfig(kind="wds", shards=spec, loader_batch=6, workers=workers, shuffle_buffer=5, resampled=True)
    return build_train_data(cfg, transform=transform, tokenizer=IdTokenizer(), rank=0, world_size=1, seed=3,
                            num_samples=60)


def _take(data, n: int) -> list:
    it = data.batches()
    out = [next(it) for _ in range(n)]
    it.close()
    return out


def _rows(packed: PackedJpegs) -> list[tuple[list[int], bytes]]:
    """(header, payload) of every sample: what a packed batch says, whatever its buffer layout."""
    return [(h[:8], bytes(p)) for h, p in zip(packed.index.tolist(), packed.payloads())]


@pytest.fixture
def spec(tmp_path):
    return _shards(tmp_path / "shards")


def test_the_routed_fraction_is_the_share_and_a_pure_function_of_seed_position_and_key():
    for share in (0.15, 0.5):
        packer = _packer(share)
        taken = [packer.takes_cpu(route_hash(seed, raw, f"k{raw % 97}")) for seed in range(20) for raw in range(1000)]
        assert abs(sum(taken) / len(taken) - share) < 0.012  # 20,000 draws: sd 0.0035 at 0.5
    assert route_hash(1, 2, "a") == route_hash(1, 2, "a") != route_hash(2, 2, "a")
    assert not JpegPacker(S).takes_cpu(0)  # share 0: nothing is routed, whatever the hash


def test_share_zero_packs_bit_for_bit_as_before_and_hashes_nothing(spec, monkeypatch):
    before = _take(_data(spec, JpegPacker(S)), 6)

    def no_hash(*a):
        raise AssertionError("share 0 must not route samples")

    monkeypatch.setattr(stream, "route_hash", no_hash)
    after = _take(_data(spec, _packer(0.0)), 6)
    for (bi, bt), (ai, at) in zip(before, after):
        assert torch.equal(bi.index, ai.index) and torch.equal(bi.data, ai.data) and torch.equal(bt, at)


def test_cpu_decoded_samples_are_the_cpu_paths_pixels_and_the_rest_pack_as_without_the_share(spec):
    n = 10
    cpu_data, zero_data, share_data = _data(spec, train_transform(S)), _data(spec, _packer(0.0)), _data(spec, _packer(0.4))
    cpu, zero, share = _take(cpu_data, n), _take(zero_data, n), _take(share_data, n)
    routed = 0
    for (ci, ct), (zi, zt), (si, st) in zip(cpu, zero, share):
        assert torch.equal(ct, zt) and torch.equal(ct, st)  # the same samples in the same order
        pix = si.pixel_mask()
        routed += int(pix.sum())
        for k, ((head, payload), zero_row) in enumerate(zip(_rows(si), _rows(zi))):
            if pix[k]:  # the CPU path's pixels, exactly
                assert head == [3 * S * S, 0, 0, S, S, S, S, PIXELS]
                assert torch.equal(torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(3, S, S), ci[k])
            else:  # the JPEG and the crop box share 0 packs: the workers' RNG stream did not move
                assert (head, payload) == zero_row
    assert 0.2 < routed / (n * 6) < 0.6  # 60 samples at 0.4 (sd 0.063)
    assert cpu_data.skip_counts() == zero_data.skip_counts() == share_data.skip_counts()
    assert share_data.skip_counts().get("corrupt_image", 0) >= 1  # a bad file is dropped and counted


def test_a_cpu_routed_file_that_does_not_decode_is_skipped_like_on_the_cpu_path():
    packer = _packer(0.5)
    with pytest.raises(Skip) as e:
        packer(b"\xff\xd8 not a jpeg", route=0)  # hash 0: routed to the workers
    assert e.value.reason == "corrupt_image"
    torch.manual_seed(1)
    row = packer(jpeg(3, side=40), route=0)
    assert row.shape == (32 + 3 * S * S,)


def test_the_routing_resumes_exactly(spec):
    data = _data(spec, _packer(0.4), workers=2)
    it = data.batches()
    for _ in range(4):
        next(it)
    state = json.loads(json.dumps(data.state_dict()))
    reference = [next(it) for _ in range(6)]
    it.close()
    resumed = _data(spec, _packer(0.4), workers=2)
    resumed.load_state_dict(state)
    again = _take(resumed, 6)
    for (ri, rt), (ai, at) in zip(reference, again):
        assert torch.equal(rt, at) and _rows(ri) == _rows(ai)  # same samples, same routes, same pixels
    assert any(bool(r[0].pixel_mask().any()) for r in reference)


def test_a_mixed_micro_batch_decodes_to_the_cpu_pixels_and_the_jpegs_own_decode(spec):
    zero, share = _take(_data(spec, _packer(0.0)), 3), _take(_data(spec, _packer(0.4)), 3)
    rows = PackedJpegs.collate([r for b, _ in share for r in _packer_rows(b)])
    ref_rows = PackedJpegs.collate([r for b, _ in zero for r in _packer_rows(b)])
    pix = rows.pixel_mask()
    assert 0 < int(pix.sum()) < len(rows)
    dec = JpegDecoder(S, device="cpu")
    out, dropped = dec._decode_resize(rows)
    ref, _ = JpegDecoder(S, device="cpu")._decode_resize(ref_rows)
    assert dropped is None
    payloads = rows.payloads()
    for k in range(len(rows)):
        if pix[k]:
            assert torch.equal(out[k], torch.from_numpy(payloads[k].copy()).view(3, S, S))
        else:
            assert torch.equal(out[k], ref[k])  # decoded exactly as without the share
    dec(rows)
    assert dec.stats()["decode_cpu_pixels"] == int(pix.sum()) and dec.decoded == len(rows) - int(pix.sum())


def _packer_rows(packed: PackedJpegs) -> list[torch.Tensor]:
    """A collated batch back to packer rows (header + payload), to regroup samples."""
    out = []
    for head, payload in zip(packed.index[:, :8].to(torch.int32), packed.payloads()):
        out.append(torch.cat([head.contiguous().view(torch.uint8), torch.from_numpy(payload.copy())]))
    return out


@pytest.mark.parametrize("keep_bytes", [0, 1 << 20])
def test_both_passes_see_identical_pixels_kept_on_device_or_re_read_from_host(spec, keep_bytes):
    (rows, _), = _take(_data(spec, _packer(0.5)), 1)
    dec = JpegDecoder(S, device="cpu", keep_bytes=keep_bytes)
    dec.mark_reread(rows)  # the stager's hint: the replay reads these rows again
    first, second = dec(rows), dec(rows)
    assert torch.equal(first, second)
    jpegs = len(rows) - int(rows.pixel_mask().sum())
    assert dec.decoded == (jpegs if keep_bytes else 2 * jpegs)  # kept: decoded once per step


def test_host_bytes_count_the_pixels_and_the_pipeline_counts_cpu_decoded_samples(spec):
    batches = _take(_data(spec, _packer(0.4)), 8)
    exact = sum(b.nbytes() for b, _ in batches) / sum(len(b) for b, _ in batches)
    jpeg_only = sum(int(b.index[~b.pixel_mask(), 0].sum()) for b, _ in batches) / sum(len(b) for b, _ in batches)
    pixels = sum(int(b.pixel_mask().sum()) for b, _ in batches)
    assert exact > jpeg_only + 0.2 * 3 * S * S  # the pixels are in the count
    settings = PipelineSettings(local=12, pin=False, prefetch_steps=0, threaded=False)
    pipe = StepPipeline(iter(batches), lambda: {}, settings)
    for _ in range(4):
        feed = pipe.next()
        feed.full("images")
        pipe.release(feed)
    per_sample = pipe.image_bytes_per_sample()  # arenas sized from the first batch (x SLACK), grown if needed
    assert jpeg_only + 0.2 * 3 * S * S < per_sample
    assert 0.9 * exact <= per_sample <= 1.25 * _PackedPool.SLACK * exact
    assert pipe.cpu_decoded == pixels
    assert pipe.loader_rate() > 0 and pipe.cpu_decoded_rate() > 0
    pipe.close()


@pytest.mark.parametrize("share,decode,ok", [(0.0, "cpu", True), (0.3, "device", True), (0.3, "auto", True),
                                              (0.3, "cpu", False), (1.0, "device", False), (-0.1, "device", False)])
def test_the_share_is_validated_with_the_key_and_the_fix(share, decode, ok):
    cfg = DataConfig(decode=decode, cpu_decode_share=share)
    if ok:
        check_data_config(cfg)
        return
    with pytest.raises(ValueError, match="data.cpu_decode_share") as e:
        check_data_config(cfg)
    assert ("data.decode=cpu" in str(e.value)) == (decode == "cpu")
