"""JPEG draft decoding in the CPU train transform (DraftRandomResizedCrop): same crops and RNG
use as the full decode, small pixel differences, draft only where the crop allows it, corrupt
and truncated images skipped without consuming random draws, deterministic."""

import io
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from torchvision.transforms import RandomResizedCrop

from data_helpers import IdTokenizer, ids
from infclip.data.config import DataConfig
from infclip.data.pipeline import build_train_data
from infclip.data.transforms import (DraftRandomResizedCrop, ImageDecodeError, draft_factor,
                                     train_transform)
from infclip.data.writer import ShardWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
from photos import bundled_photos, make_sample  # noqa: E402  (the benchmarks' photo writer)


def _encode(img, fmt="JPEG", **kw):
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


@pytest.fixture(scope="module")
def src():
    return bundled_photos(["sklearn"])


@pytest.fixture(scope="module")
def photos(src):
    """Real photographs as JPEGs: the two originals (640x427, q90) and 8 derived at side 512."""
    derived = [make_sample(src, 0, i, 512, (85, 95))[0] for i in range(8)]
    return [_encode(p.image, quality=90) for p in src] + derived


def _run(transform, data, seed, full_decode):
    torch.manual_seed(seed)
    if full_decode:  # what the loader does for a transform without decodes_bytes
        with Image.open(io.BytesIO(data)) as img:
            data = img.convert("RGB")
    out = transform(data)
    return out, torch.rand(1).item()  # the next draw tells whether the RNG use matched


def _boxes(monkeypatch):
    seen = []
    original = RandomResizedCrop.get_params

    def record(img, scale, ratio):
        seen.append(original(img, scale, ratio))
        return seen[-1]
    monkeypatch.setattr(RandomResizedCrop, "get_params", staticmethod(record))
    return seen


def test_same_boxes_rng_use_and_close_pixels(photos, monkeypatch):
    size, draft, full = 112, train_transform(112), train_transform(112, draft=False)
    seen, diffs, drafted = _boxes(monkeypatch), [], 0
    for k, data in enumerate(photos):
        for seed in range(6):
            a, next_a = _run(draft, data, seed, full_decode=False)
            b, next_b = _run(full, data, seed, full_decode=True)
            assert seen[-1] == seen[-2] and next_a == next_b  # same box, same draws after it
            _, _, h, w = seen[-1]
            drafted += draft_factor(w, h, size) > 1
            diffs.append((a.float() - b.float()).abs().mean().item())
            assert a.shape == b.shape == (3, size, size) and a.dtype == torch.uint8
    assert drafted >= len(diffs) // 4  # the comparison covers drafted crops
    assert max(diffs) < 3.0 and sum(diffs) / len(diffs) < 1.5, diffs


def test_draft_factor_and_decoded_size(photos):
    assert [draft_factor(w, h, 100) for w, h in ((99, 400), (200, 199), (200, 200), (400, 800), (900, 801))] \
        == [1, 1, 2, 4, 8]
    cases = [(64, (400, 300), 4, (160, 107)), (64, (260, 200), 2, (320, 214)), (64, (120, 127), 1, (640, 427)),
             (64, (640, 427), 4, (160, 107)), (48, (600, 400), 8, (80, 54))]
    for out, (w, h), r, size in cases:
        img = Image.open(io.BytesIO(photos[0]))  # 640 x 427
        rgb, got = DraftRandomResizedCrop(out).decode(img, w, h)
        assert (got, rgb.size, rgb.mode) == (r, size, "RGB")
        rgb, got = DraftRandomResizedCrop(64, draft=False).decode(Image.open(io.BytesIO(photos[0])), w, h)
        assert (got, rgb.size) == (1, (640, 427))


@pytest.mark.parametrize("fmt,mode,drafts", [("JPEG", "L", True), ("JPEG", "CMYK", False),
                                             ("PNG", "RGB", False), ("WEBP", "RGB", False)])
def test_other_modes_and_formats(photos, fmt, mode, drafts):
    base = Image.open(io.BytesIO(photos[0])).convert(mode)
    data = _encode(base, fmt)
    rgb, r = DraftRandomResizedCrop(64).decode(Image.open(io.BytesIO(data)), 600, 400)
    assert (r > 1) == drafts and rgb.mode == "RGB"
    assert rgb.size == ((160, 107) if drafts else (640, 427))
    if not drafts:  # the full-decode fallback is exactly today's transform
        a, _ = _run(train_transform(64), data, 3, full_decode=False)
        b, _ = _run(train_transform(64, draft=False), data, 3, full_decode=True)
        assert torch.equal(a, b)


def test_small_crops_are_bit_identical_and_deterministic(src, photos):
    stored = [make_sample(src, 1, i, 96, (85, 95))[0] for i in range(6)]
    draft, full = train_transform(64), train_transform(64, draft=False)  # r = 1: crops < 128
    for data in stored:
        for seed in range(4):
            assert torch.equal(_run(draft, data, seed, False)[0], _run(full, data, seed, True)[0])
    for data in photos[:3]:  # drafted crops are deterministic too
        assert torch.equal(_run(draft, data, 7, False)[0], _run(draft, data, 7, False)[0])


def test_undecodable_bytes_raise_without_consuming_draws(photos):
    t = DraftRandomResizedCrop(32)
    truncated = photos[0][: len(photos[0]) // 2]
    for bad in (b"not an image", photos[0][:40], truncated):
        torch.manual_seed(0)
        with pytest.raises(ImageDecodeError):
            t(bad)
        after_bad = torch.rand(1).item()
        torch.manual_seed(0)
        assert after_bad == torch.rand(1).item()


def _mixed_shards(folder, photos_96, n_good):
    """One shard: good photos (ids 0..), a truncated JPEG and garbage bytes between them."""
    with ShardWriter(str(folder), max_samples=10_000) as w:
        for i in range(n_good):
            w.write(f"g{i:04d}", photos_96[i], f"s{i:06d}")
            if i % 5 == 2:
                w.write(f"t{i:04d}", photos_96[i][: len(photos_96[i]) // 2], "s999999")
            if i % 5 == 4:
                w.write(f"c{i:04d}", b"\xff\xd8garbage", "s999998")
    return str(folder / "00000.tar")


def _epoch(spec, transform, n):
    cfg = DataConfig(kind="wds", shards=spec, loader_batch=4, workers=0, shuffle_buffer=0)
    data = build_train_data(cfg, transform=transform, tokenizer=IdTokenizer(), rank=0, world_size=1,
                            seed=3, num_samples=n)
    it = data.batches()
    batches = [next(it) for _ in range(data.epoch_batches)]
    it.close()
    return batches, data.skip_counts()


def test_loader_skips_corrupt_and_truncated_like_the_full_decode(src, tmp_path):
    stored = [make_sample(src, 2, i, 96, (85, 95))[0] for i in range(12)]
    spec = _mixed_shards(tmp_path / "s", stored, 12)
    got, skips = _epoch(spec, train_transform(64), 12)  # crops < 128 px: r = 1
    want, want_skips = _epoch(spec, train_transform(64, draft=False), 12)
    assert skips == want_skips == {"corrupt_image": 4}
    assert [ids(t) for _, t in got] == [ids(t) for _, t in want] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(got, want))  # r = 1 here: identical pixels
    drafted, _ = _epoch(spec, train_transform(24), 12)  # crops >= 48 px decode at 1/2
    again, _ = _epoch(spec, train_transform(24), 12)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(drafted, again))
