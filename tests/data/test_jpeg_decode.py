"""data.decode=device: the worker packs JPEG bytes and the crop box the CPU path would draw;
the decoder's pixels match the CPU transform's within one 8-bit level; what nvJPEG should not
get is re-encoded, what does not parse is skipped, what fails on the device is counted."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import RandomResizedCrop

from infclip.data.jpeg import HEADER, REENCODED, JpegDecoder, JpegPacker, PackedJpegs, unpack_header
from infclip.data.stream import Skip
from infclip.data.transforms import train_transform

S = 48  # model input side: small keeps the CPU test fast


def photo(width: int, height: int, seed: int, fmt: str = "JPEG", mode: str = "RGB", **save) -> bytes:
    """Smooth colour fields + an edge + grain: content where resampling errors would show."""
    g = torch.Generator().manual_seed(seed)
    small = torch.randint(0, 256, (4, 4, 3), generator=g, dtype=torch.uint8)
    img = Image.fromarray(small.numpy()).resize((width, height), Image.Resampling.BICUBIC)
    grain = (torch.rand((height, width, 3), generator=g) * 40).to(torch.uint8)
    pixels = torch.from_numpy(np.asarray(img).copy()).clamp(max=215) + grain
    pixels[: height // 3, : width // 2] = 250  # a sharp edge
    img = Image.fromarray(pixels.numpy()).convert(mode)
    buf = io.BytesIO()
    img.save(buf, format=fmt, **({"quality": 92} if fmt == "JPEG" else {}), **save)
    return buf.getvalue()


def cpu_path(data: bytes, seed: int) -> torch.Tensor:
    """uint8 (3, S, S): what a worker ships with data.decode=cpu, under the batch seed."""
    torch.manual_seed(seed)
    return train_transform(S)(Image.open(io.BytesIO(data)).convert("RGB"))


def levels(decoder: JpegDecoder, out: torch.Tensor) -> torch.Tensor:
    """The decoder's normalized floats back to 8-bit levels."""
    return ((out - decoder.normalizer.shift) / decoder.normalizer.scale).round()


def test_packer_keeps_the_bytes_and_draws_the_cpu_paths_crop():
    data = photo(90, 70, seed=1)
    torch.manual_seed(7)
    row = JpegPacker(S)(data)
    torch.manual_seed(7)
    box = RandomResizedCrop.get_params(Image.open(io.BytesIO(data)), [0.08, 1.0], [0.75, 1.3333333])
    header = unpack_header(row[None])[0].tolist()
    assert row.shape == (HEADER + len(data),) and row.dtype == torch.uint8  # the file's own size
    assert header == [len(data), *box, 70, 90, 0]
    assert bytes(row[HEADER:HEADER + len(data)].tolist()) == data


@pytest.mark.parametrize("sizes", [[(64, 64)] * 3, [(90, 70), (40, 120), (64, 64), (200, 150)]])
def test_decoder_matches_the_cpu_transform_within_one_level(sizes):
    """Same-size batches (stacked) and mixed sizes (padded canvas), grey and colour."""
    packer, decoder = JpegPacker(S), JpegDecoder(S, chunk=3)
    datas = [photo(w, h, seed=i, mode="L" if i == 1 else "RGB") for i, (w, h) in enumerate(sizes)]
    rows, refs = [], []
    for i, data in enumerate(datas):
        torch.manual_seed(100 + i)
        rows.append(packer(data))
        refs.append(cpu_path(data, 100 + i))
    out = decoder(PackedJpegs.collate(rows))
    assert out.shape == (len(sizes), 3, S, S) and out.dtype == torch.float32
    diff = (levels(decoder, out) - torch.stack(refs).float()).abs()
    assert diff.max() <= 1, diff.max()
    assert diff.mean() < 0.35, diff.mean()  # JPEG decoder rounding (IDCT) and float vs fixed-point weights


@pytest.mark.parametrize("case", ["png", "progressive", "cmyk", "too_large"])
def test_what_nvjpeg_should_not_get_is_reencoded(case):
    max_bytes = 65536
    if case == "png":
        data = photo(60, 50, seed=3, fmt="PNG")
    elif case == "progressive":
        data = photo(60, 50, seed=3, progressive=True)
    elif case == "cmyk":
        data = photo(60, 50, seed=3, mode="CMYK")
    else:
        data, max_bytes = photo(400, 300, seed=3), 6000
        assert len(data) > max_bytes
    row = JpegPacker(S, max_bytes=max_bytes)(data)
    n, top, left, h, w, img_h, img_w, flags = unpack_header(row[None])[0].tolist()
    assert flags & REENCODED and n <= max_bytes
    with Image.open(io.BytesIO(bytes(row[HEADER:HEADER + n].tolist()))) as im:
        assert im.format == "JPEG" and im.mode == "RGB" and not im.info.get("progressive")
        assert im.size == (img_w, img_h)
    assert 0 <= top and top + h <= img_h and 0 <= left and left + w <= img_w
    if case == "too_large":
        assert min(img_w, img_h) <= 2 * S  # downscaled until it fit
    else:
        assert (img_w, img_h) == (60, 50)
    out = JpegDecoder(S)(row[None])
    assert torch.isfinite(out).all()


def test_unparseable_or_truncated_files_are_skipped_like_on_the_cpu_path():
    data = photo(64, 64, seed=4)
    for bad in (b"not an image at all", data[: len(data) // 2]):
        with pytest.raises(Skip) as info:
            JpegPacker(S)(bad)
        assert info.value.reason == "corrupt_image"


def test_an_image_no_decoder_can_read_is_dropped_and_counted():
    good = JpegPacker(S)(photo(64, 64, seed=5))
    bad = good.clone()
    junk = torch.randint(0, 256, (500,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    bad[HEADER:HEADER + 500] = junk  # the header check passed in the worker; the bytes rotted after
    bad[:4] = torch.tensor([500], dtype=torch.int32).view(torch.uint8)
    decoder = JpegDecoder(S)
    with pytest.warns(UserWarning, match="left out of the loss"):
        out = decoder(PackedJpegs.collate([good, bad]))
    assert decoder.failures == 1 and decoder.drops == {"undecodable": 1}
    assert decoder.last_dropped.tolist() == [False, True]
    assert decoder.stats()["decode_dropped/undecodable"] == 1
    assert torch.equal(out[0], decoder(PackedJpegs.collate([good]))[0])  # its neighbour is untouched
    assert decoder.last_dropped is None  # a clean micro-batch reports no drops


def test_an_image_the_device_backend_fails_on_is_decoded_by_pil_not_dropped(monkeypatch):
    rows = PackedJpegs.collate([JpegPacker(S)(photo(64, 64, seed=s)) for s in range(3)])
    decoder = JpegDecoder(S)
    want = decoder(rows)
    real = decoder.backend.decode_fn
    monkeypatch.setattr(decoder.backend, "decode_fn", lambda datas, stream: [None, *real(datas, stream)[1:]])
    got = decoder(rows)
    assert decoder.failures == 1 and decoder.drops == {} and decoder.last_dropped is None
    assert (levels(decoder, got) - levels(decoder, want)).abs().max() <= 1


def test_rows_that_are_not_packed_jpegs_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="data.decode=device"):
        JpegDecoder(S)(torch.zeros(2, 3, S, S, dtype=torch.uint8))


def test_autocast_does_not_change_the_pixels():
    """Pass 1 of the gradient cache decodes under autocast, the replay outside it."""
    rows = PackedJpegs.collate([JpegPacker(S)(photo(90, 70, seed=s)) for s in range(3)])
    decoder = JpegDecoder(S)
    plain = decoder(rows)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(decoder(rows), plain)


def test_decode_threads_never_touch_autocast_state(monkeypatch):
    """A decode in a thread of its own (prefetch, decode-ahead) must not enter or leave
    autocast: its global cast cache is cleared under a mutex while holding the GIL, which
    deadlocked against a training thread compiling under autocast. The main thread's decode
    under autocast still switches it off (float32 reference matmuls)."""
    import threading

    from infclip.data import jpeg

    calls = []
    real = torch.autocast
    monkeypatch.setattr(jpeg.torch, "autocast", lambda *a, **k: calls.append(threading.current_thread().name)
                        or real(*a, **k))
    rows = PackedJpegs.collate([JpegPacker(S)(photo(80, 60, seed=s)) for s in range(2)])
    decoder = JpegDecoder(S)
    decoder.prefetch(lambda: rows)
    out = decoder(rows)  # decoded in the prefetch thread
    assert decoder.decoded == 2 and calls == []
    with real("cpu", dtype=torch.bfloat16):
        again = decoder(rows)  # the main thread, autocast on
    assert calls == [threading.current_thread().name] and torch.equal(again, out)


def test_prefetched_decodes_are_picked_up_in_order_and_cancelled_cleanly():
    rows = [PackedJpegs.collate([JpegPacker(S)(photo(64 + 8 * k, 64, seed=k + i)) for i in range(2)]) for k in range(3)]
    decoder = JpegDecoder(S)
    direct = [decoder(r) for r in rows]
    fetched = []
    for k, r in enumerate(rows):
        decoder.prefetch(lambda r=r, k=k: fetched.append(k) or r)
    assert all(torch.equal(decoder(r), d) for r, d in zip(rows[:2], direct[:2]))
    decoder.cancel_prefetch()  # the third was never consumed
    assert decoder._pending == [] and sorted(fetched) == [0, 1, 2]
    assert torch.equal(decoder(rows[2]), direct[2])  # decoded afresh, not a stale prefetch


def test_decode_rate_counts_decoding_not_the_wait_for_another_threads_decode(monkeypatch):
    """Two threads decode at once: the decodes run one at a time, and decode_s (the progress
    line's decode_imgs_per_s denominator) is their decoding time, not also the time one of
    them waited for the other (which made the rate under-read beside the decode-ahead thread).

    The decoder's clock is a controlled one that only a decode advances (0.3 s each), so the
    sums are exact whatever the machine's load; a real 0.2 s pause inside the first decode
    lets the second thread arrive and wait for it."""
    import threading
    import time
    import types

    from infclip.data import jpeg

    rows = PackedJpegs.collate([JpegPacker(S)(photo(64, 48, seed=k)) for k in range(2)])
    decoder = JpegDecoder(S)
    real = decoder._decode_resize
    now = [100.0]
    monkeypatch.setattr(jpeg, "time", types.SimpleNamespace(perf_counter=lambda: now[0], monotonic=time.monotonic,
                                                            time=time.time, sleep=time.sleep))
    inside = []

    def slow(r):
        inside.append(threading.get_ident())
        now[0] += 0.3
        time.sleep(0.2)
        return real(r)

    monkeypatch.setattr(decoder, "_decode_resize", slow)
    threads = [threading.Thread(target=decoder._decode_timed, args=(rows,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(inside) == 2 and decoder.decoded == 4
    assert decoder.decode_s == pytest.approx(0.6)  # each decode's own 0.3 s, no waiting counted
    # the trainer's per-step busy time: the decode work since the previous stats() call
    first = decoder.stats()
    assert first["decode_busy_s"] == decoder.decode_s and first["decode_imgs_per_s"] == 4 / decoder.decode_s
    assert decoder.stats()["decode_busy_s"] == 0.0
    decoder._decode_timed(rows)
    assert decoder.stats()["decode_busy_s"] == pytest.approx(0.3)
    # the first pass's share: the work up to the trainer's mark, reported once
    decoder._decode_timed(rows)
    decoder.mark_first_pass_end()
    decoder._decode_timed(rows)  # (the replay's, or the next step's decoded ahead)
    got = decoder.stats()
    assert got["decode_busy_first_s"] == pytest.approx(0.3) and got["decode_busy_s"] == pytest.approx(0.6)
    assert "decode_busy_first_s" not in decoder.stats()
