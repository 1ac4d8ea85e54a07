"""The device decode path's decoder choice (fallback order, the startup line) and its
decode-once-per-step cache, on the CPU (nvImageCodec's libjpeg-turbo backend or PIL)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from infclip.data import jpeg_backends
from infclip.data.jpeg import JpegDecoder, JpegPacker, PackedJpegs, unpack_header
from infclip.data.jpeg_backends import pil_decode, probe_jpeg, select_backend

S = 32


def packed(n: int, seed: int = 0) -> torch.Tensor:
    rows = []
    for k in range(n):
        rng = np.random.default_rng(seed + k)
        img = Image.fromarray(rng.integers(0, 256, (40 + 4 * k, 56, 3), dtype=np.uint8))
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=90)
        torch.manual_seed(seed + k)
        rows.append(JpegPacker(S)(buf.getvalue()))
    return PackedJpegs.collate(rows)


def test_a_cpu_device_gets_a_cpu_decoder_and_the_gpu_ones_are_refused_with_the_reason():
    sel = select_backend("cpu")
    assert sel.backend.name in ("cpu-nvimgcodec", "cpu-pil") and not sel.backend.on_sms
    for name in ("hardware", "cuda", "nvjpeg"):
        with pytest.raises(RuntimeError, match=f"{name}: needs a CUDA training device"):
            select_backend("cpu", name)


def test_without_nvimgcodec_the_fallback_is_pil_and_the_output_is_the_same(monkeypatch):
    rows = packed(3)
    first = JpegDecoder(S)(rows)
    monkeypatch.setattr(jpeg_backends, "_nvimgcodec", lambda: None)
    dec = JpegDecoder(S)
    assert dec.backend.name == "cpu-pil"
    assert (dec(rows) - first).abs().max() <= 1.01 * dec.normalizer.scale.max()  # within a level


def test_a_backend_that_decodes_wrongly_is_skipped_and_named(monkeypatch):
    """The probe image must decode to PIL's pixels: a broken decoder is not taken."""
    broken = jpeg_backends.Backend("cpu-nvimgcodec", False, lambda datas, stream: [
        torch.zeros(80, 96, 3, dtype=torch.uint8) for _ in datas])
    monkeypatch.setattr(jpeg_backends, "_nvimgcodec_backend", lambda *a, **k: broken)
    with pytest.raises(RuntimeError, match="levels away from PIL"):
        select_backend("cpu", "cpu")  # the cpu choice tries nvImageCodec first: broken here, then PIL
    # auto on a CPU device goes on to PIL, as the cpu choice's own fallback
    monkeypatch.setattr(jpeg_backends, "_build", lambda name, device, threads=1, options="": broken if name != "cpu"
                        else jpeg_backends._pil_backend(device))
    assert select_backend("cpu").backend.name == "cpu-pil"


def test_probe_and_pil_agree():
    data, ref = probe_jpeg()
    got = pil_decode(np.frombuffer(data, np.uint8)).numpy()
    assert np.array_equal(got, ref)
    assert pil_decode(np.frombuffer(b"\xff\xd8junk\xff\xd9", np.uint8)) is None


def test_marked_rows_are_decoded_once_per_step_and_pixels_are_identical():
    rows = packed(4)
    dec = JpegDecoder(S, keep_bytes=10 * 3 * S * S)
    dec.mark_reread(rows)  # the stager: the replay will read these rows again
    first = dec(rows)
    assert dec.decoded == 4
    second = dec(rows)  # the replay: the kept pixels, no decode
    assert dec.decoded == 4 and torch.equal(first, second)
    third = dec(rows)  # not kept twice: a third read decodes again, to the same pixels
    assert dec.decoded == 8 and torch.equal(first, third)


def test_beyond_the_budget_rows_are_decoded_again_and_a_step_end_forgets_kept_pixels():
    a, b = packed(4, seed=0), packed(4, seed=10)
    dec = JpegDecoder(S, keep_bytes=4 * 3 * S * S)  # room for one micro-batch
    for r in (a, b):
        dec.mark_reread(r)
    ya, yb = dec(a), dec(b)
    assert dec._kept_bytes == 4 * 3 * S * S  # a kept, b not (over the budget)
    assert torch.equal(dec(b), yb) and dec.decoded == 12  # b decoded again
    dec.cancel_prefetch()  # the stager's end of step
    assert dec._kept == {} and dec._kept_bytes == 0
    assert torch.equal(dec(a), ya) and dec.decoded == 16


def test_unmarked_rows_are_not_kept():
    rows = packed(2)
    dec = JpegDecoder(S, keep_bytes=1 << 20)
    dec(rows)
    assert dec._kept == {}


def test_the_next_steps_rows_decoded_ahead_are_used_by_its_first_pass_and_kept_for_its_replay():
    now, nxt = packed(4, seed=0), packed(4, seed=20)
    dec = JpegDecoder(S, keep_bytes=1 << 20)
    want = JpegDecoder(S)(nxt)
    dec(now)
    dec.decode_ahead([lambda: nxt])  # during this step's replay
    dec._ahead_pool.shutdown(wait=True)
    assert dec.ahead_decoded == 1 and dec.decoded == 8
    dec.cancel_prefetch()  # this step ends: the next step's pixels stay
    dec.mark_reread(nxt)  # the next step's first pass, of rows its replay reads again
    assert torch.equal(dec(nxt), want) and dec.decoded == 8  # no second decode
    assert torch.equal(dec(nxt), want) and dec.decoded == 8  # its replay: still kept
    dec.cancel_prefetch()
    assert dec._kept == {} and dec._kept_bytes == 0


def test_decode_ahead_respects_the_budget_and_a_finished_step():
    a, b = packed(4, seed=0), packed(4, seed=30)
    dec = JpegDecoder(S, keep_bytes=4 * 3 * S * S)  # one micro-batch
    dec.mark_reread(a)
    dec(a)  # kept for this step's replay: the budget is full
    dec.decode_ahead([lambda: b])
    dec._ahead_pool.shutdown(wait=True)
    assert dec.ahead_decoded == 0 and dec._kept_bytes == 4 * 3 * S * S


def _refill(chunk: PackedJpegs, src: PackedJpegs, tag: tuple) -> PackedJpegs:
    """``src``'s JPEGs written over ``chunk``'s host memory (a pool chunk refilled), as the
    step pipeline hands them out: the same addresses, a new tag."""
    chunk.index.copy_(src.index)
    chunk.data[:src.data.numel()].copy_(src.data)
    return PackedJpegs(chunk.index, chunk.data, tag)


def _chunk(like: PackedJpegs) -> PackedJpegs:
    return PackedJpegs(torch.empty_like(like.index), torch.zeros(1 << 16, dtype=torch.uint8))


def test_kept_pixels_of_a_chunk_are_never_returned_for_later_rows_at_its_address():
    """A LiT ring refills a chunk with later rows at the same address: pixels decoded ahead for
    the old rows must not be taken for the new ones (they were, when keyed by address)."""
    a, b = packed(4, seed=0), packed(4, seed=40)
    chunk = _chunk(a)
    dec = JpegDecoder(S, keep_bytes=1 << 20)
    old = _refill(chunk, a, (1, "images", 0, 4))
    dec.decode_ahead([lambda: old])
    dec._ahead_pool.shutdown(wait=True)
    assert dec.ahead_decoded == 1
    new = _refill(chunk, b, (2, "images", 0, 4))
    assert new.data_ptr() == old.data_ptr()
    assert torch.equal(dec(new), JpegDecoder(S)(b))


def test_a_decode_ahead_never_reads_rows_the_step_already_decoded_and_released():
    """The step's first pass reached a micro-batch before the decode-ahead did, decoded it and
    released its chunk (refilled at once): the late decode-ahead must leave those rows alone.
    Before the claim it decoded the overwritten bytes (H200, LiT 65k: 15k samples dropped)."""
    import threading

    rows = _refill(_chunk(packed(4)), packed(4), (1, "images", 0, 4))
    want = JpegDecoder(S)(rows)
    gate = threading.Event()

    def late_fetch():
        gate.wait(10)  # the loader was late with these rows
        return rows

    dec = JpegDecoder(S, keep_bytes=1 << 20)
    dec.decode_ahead([late_fetch, lambda: None])  # step t's replay; None: rows already released
    dec.cancel_prefetch()  # step t ends
    assert torch.equal(dec(rows), want)  # step t+1's first pass decodes them itself ...
    rows.data.fill_(0)  # ... and releases them: the ring refills the chunk
    gate.set()
    dec._ahead_pool.shutdown(wait=True)
    assert dec.ahead_decoded == 0 and dec.failures == 0 and dec.drops == {}
    assert dec.decoded == 4


def test_region_of_interest_decode_gives_the_full_decodes_pixels(monkeypatch):
    """data.decode_roi: only each crop box is decoded (nvImageCodec), the output equals the
    full decode's (bit for bit at these small offsets: the resize's fp32 sample positions
    could move a value by one level at large ones); a backend without regions (PIL) decodes
    whole images; an image the backend fails on is cropped from PIL's full decode."""
    rows = packed(6, seed=50)
    full = JpegDecoder(S)
    roi = JpegDecoder(S, roi=True)
    if full.backend.name != "cpu-nvimgcodec":
        pytest.skip("nvImageCodec's CPU backend is not installed")  # (installed by the README's command)
    assert roi.roi and "data.decode_roi" in roi.describe() and "data.decode_roi" not in full.describe()
    assert torch.equal(roi(rows), full(rows))
    seen = []
    real = roi.backend.decode_fn

    def spy(datas, stream, regions=None):
        seen.append(regions)
        outs = real(datas, stream, regions)
        outs[1] = None  # the backend fails on one image: PIL decodes it whole, then it is cropped
        return outs

    monkeypatch.setattr(roi.backend, "decode_fn", spy)
    assert torch.equal(roi(rows), full(rows)) and roi.failures == 1 and roi.drops == {}
    assert seen[0] == unpack_header(rows)[:, 1:5].tolist()  # (top, left, height, width) per image
    monkeypatch.setattr(jpeg_backends, "_nvimgcodec", lambda: None)
    pil = JpegDecoder(S, roi=True)
    assert pil.backend.name == "cpu-pil" and not pil.roi
    with pytest.raises(ValueError, match="does not decode regions"):
        pil.backend.decode(rows.payloads(), None, [[0, 0, 1, 1]] * 6)


class _CaiOwner:
    """Stands in for a decoder's device image: exposes a tensor's geometry as
    ``__cuda_array_interface__`` (strides in bytes; None when C-contiguous, as the protocol allows)."""

    def __init__(self, t, typestr="|u1", omit_strides=False):
        self.t = t
        self.__cuda_array_interface__ = {
            "shape": tuple(t.shape), "typestr": typestr, "data": (t.data_ptr(), False), "version": 3,
            "strides": None if omit_strides else tuple(s * t.element_size() for s in t.stride())}


@pytest.mark.parametrize("layout", ["contiguous", "row_padded", "no_strides"])
def test_device_image_gives_the_resize_index_a_tensor_would(layout):
    from infclip.data.jpeg_backends import DeviceImage
    from infclip.kernels.resize import crop_index

    base = torch.randint(0, 255, (20, 40, 3), dtype=torch.uint8)
    t = base[:, :31] if layout == "row_padded" else base  # rows pitched wider than the image
    img = DeviceImage(_CaiOwner(t, omit_strides=layout == "no_strides"), torch.device("cpu"))
    assert img.shape == tuple(t.shape) and img.dim() == 3 and img.dtype == torch.uint8
    assert img.data_ptr() == t.data_ptr() and img.stride() == t.stride()
    boxes = torch.tensor([[2, 3, 10, 20]])
    assert torch.equal(crop_index([img], boxes), crop_index([t], boxes))


def test_device_image_refuses_what_is_no_uint8_image():
    from infclip.data.jpeg_backends import DeviceImage

    with pytest.raises(ValueError, match="not \\(H, W, C\\) uint8"):
        DeviceImage(_CaiOwner(torch.zeros(4, 4, 3), typestr="<f4"), torch.device("cpu"))
    with pytest.raises(ValueError, match="not \\(H, W, C\\) uint8"):
        DeviceImage(_CaiOwner(torch.zeros(4, 4, dtype=torch.uint8)), torch.device("cpu"))


def test_decoder_options_are_appended_to_the_decoders_own_and_named_in_the_startup_line(monkeypatch):
    """data.decoder_options reaches every nvImageCodec decoder the backend builds, after the
    options the backend sets itself; the decoder still decodes as PIL does."""
    nv = pytest.importorskip("nvidia.nvimgcodec")
    seen = []

    class Spy:
        def __getattr__(self, name):
            return getattr(nv, name)

        def Decoder(self, **kw):  # noqa: N802 (nvImageCodec's name)
            seen.append(kw["options"])
            return nv.Decoder(**kw)

    monkeypatch.setattr(jpeg_backends, "_nvimgcodec", lambda: Spy())
    backend = jpeg_backends._nvimgcodec_backend("cpu", torch.device("cpu"),
                                                options=" nvjpeg_hw_decoder:force_legacy_batch=1 ")
    assert seen == [":fancy_upsampling=1 :enable_roi_fancy_upsampling=1 nvjpeg_hw_decoder:force_batch_single=1 "
                    "nvjpeg_hw_decoder:force_legacy_batch=1"]
    assert "options 'nvjpeg_hw_decoder:force_legacy_batch=1'" in jpeg_backends.Selection(backend, []).describe()
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (48, 40, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
    got = backend.decode([np.frombuffer(buf.getvalue(), np.uint8)])[0]
    ref = pil_decode(np.frombuffer(buf.getvalue(), np.uint8))
    assert got.shape == ref.shape and (got.int() - ref.int()).abs().float().mean() <= 1.0
