"""JPEG decoding on the training device (``data.decode=device``): the loader ships bytes.

With ``data.decode=cpu`` each loader worker decodes a JPEG, crops and resizes it
(RandomResizedCrop, bicubic) and ships 224x224x3 uint8 pixels; decoding bounds the loader at
LAION's 256-512 px. With ``data.decode=device`` a worker only parses the JPEG header and draws
the *same* crop box from the *same* RNG stream the CPU path would use
(``RandomResizedCrop.get_params``), then packs header + bytes into a fixed-width uint8 row
(:class:`JpegPacker`). The trainer's :class:`JpegDecoder` decodes a micro-batch with the GPU's
JPEG engines (or nvJPEG, see :mod:`infclip.data.jpeg_backends`), then crops and resizes every
image with PIL's antialiased bicubic filter in one Triton launch that reads each decoded image
through its pointer (:mod:`infclip.kernels.resize`), rounds to 8-bit levels and normalizes.
It runs for each micro-batch in both passes of the gradient cache; decoding and resizing are
deterministic, so the replay sees the pixels the cache pass saw.

Packing: a worker's row is an int32 little-endian header ``[nbytes, top, left, height, width,
image_h, image_w, flags]`` then the JPEG's own bytes (no padding); a loader batch collates its
rows into one :class:`PackedJpegs` (an index and one byte buffer), and the step pipeline keeps
them in per-chunk byte arenas, so host memory per sample is the file's size plus 72 bytes of
index (a 20-60 KB LAION JPEG, against 150 KB of decoded 224-px pixels). The rows never go to
the device as such: the decoders read host bytes, so the stager hands them the host rows
(see ``reads_host``).

Hybrid split (``data.cpu_decode_share`` = f > 0, the idea of DALI's ``hw_decoder_load``): the
packer sends a deterministic fraction f of the samples (chosen by
:func:`infclip.data.stream.route_hash` of the batch seed, stream position and sample key, so a
resumed run routes them alike) through the CPU path's own transform (``cpu_transform``: decode,
the same crop from the same RNG draw, resize) and ships their uint8 pixels (3*S*S bytes, flag
``PIXELS``) in the row instead of the JPEG. They travel and are stored like JPEG bytes (the
same arenas, released after the step's last read), so the replay of a micro-batch the GPU
pixel cache did not keep re-reads the same pixels from host memory; the decoder uploads them
beside what the engines decode. Host cost: 3*S*S bytes instead of the JPEG's size for each
such sample, counted in the pipeline's host bytes and its ``memory.host_buffer_gb`` budget.

The worker re-encodes (baseline RGB JPEG, flag ``REENCODED``) what the GPU decoders should not
get: other formats (PNG, WebP, ...), progressive or CMYK JPEGs, and files over ``max_bytes``
(``data.jpeg_max_bytes``, a guard against huge files: downscaled until they fit). A file that does not parse or lacks its end
marker (truncated) is skipped and counted (``corrupt_image``) like on the CPU path. Damage
that only a full decode finds fails on the device: that image becomes black and is counted
in :attr:`JpegDecoder.failures` (a warning names the count).
"""

from __future__ import annotations

import contextlib
import io
import sys
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional, Sequence

import torch
from PIL import Image
from torch import Tensor, nn
from torchvision.transforms import RandomResizedCrop

from infclip.data.decode_trace import DecodeTrace
from infclip.kernels.resize import resized_crop, resized_crop_reference

HEADER_INTS = 8
HEADER = 4 * HEADER_INTS  # bytes
REENCODED = 1  # flags bit: the worker re-encoded the image (format, mode, progressive or size)
PIXELS = 2  # flags bit: the payload is the worker's decoded uint8 (3, S, S) image, not a JPEG
FLAGS = 7  # header column of the flags

if sys.byteorder != "little":  # the header is read back with a zero-copy int32 view
    raise ImportError("infclip.data.jpeg packs little-endian int32 headers; this host is big-endian")


@dataclass
class JpegPacker:
    """Worker side: raw image bytes -> packed uint8 row ``(HEADER + max_bytes,)``.

    The crop box is drawn with torchvision's ``RandomResizedCrop.get_params`` from torch's
    global RNG (seeded per loader batch by the stream), so a batch gets the boxes the CPU
    transform would have used. Raises ``infclip.data.stream.Skip("corrupt_image")`` for bytes
    that do not parse.
    """

    image_size: int
    max_bytes: int = 1 << 20
    scale: Sequence[float] = (0.08, 1.0)
    ratio: Sequence[float] = (0.75, 1.3333333)
    # data.cpu_decode_share: the fraction of samples decoded here by ``cpu_transform`` (the CPU
    # path's train transform, uint8 (3, S, S) out) and shipped as pixels; 0: none
    cpu_share: float = 0.0
    cpu_transform: Optional[Callable] = None
    takes_bytes: ClassVar[bool] = True  # the stream passes raw bytes, not a decoded PIL image

    def __post_init__(self) -> None:
        if not 0.0 <= self.cpu_share < 1.0:
            raise ValueError(f"data.cpu_decode_share must be in [0, 1), got {self.cpu_share}")
        if self.cpu_share > 0 and self.cpu_transform is None:
            raise ValueError("JpegPacker(cpu_share > 0) needs cpu_transform (the CPU path's train transform)")

    def takes_cpu(self, route: Optional[int]) -> bool:
        """Whether the sample with this :func:`~infclip.data.stream.route_hash` is decoded here."""
        return route is not None and self.cpu_share > 0 and route < self.cpu_share * 2.0**63

    def __call__(self, data: bytes, route: Optional[int] = None) -> Tensor:
        if self.takes_cpu(route):
            return self._pixels(data)
        data, (width, height), flags = self._baseline(data)
        probe = torch.zeros(()).expand(1, height, width)  # get_params reads only the shape
        top, left, h, w = RandomResizedCrop.get_params(probe, list(self.scale), list(self.ratio))
        row = torch.empty(HEADER + len(data), dtype=torch.uint8)
        header = torch.tensor([len(data), top, left, h, w, height, width, flags], dtype=torch.int32)
        row[:HEADER] = header.view(torch.uint8)
        row[HEADER:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return row

    def _pixels(self, data: bytes) -> Tensor:
        """A row of the CPU path's pixels: header ``[3*S*S, 0, 0, S, S, S, S, PIXELS]`` then
        uint8 (3, S, S). The transform draws its crop from the same torch RNG stream as the
        packer would (one ``get_params``), so the following samples' crops do not move; a file
        it cannot decode raises ``Skip`` exactly as on the CPU path (dropped and counted)."""
        from infclip.data.stream import Skip, transform_bytes

        image, s = transform_bytes(data, self.cpu_transform), self.image_size
        if tuple(image.shape) != (3, s, s):
            raise Skip("transform_error")
        row = torch.empty(HEADER + 3 * s * s, dtype=torch.uint8)
        row[:HEADER] = torch.tensor([3 * s * s, 0, 0, s, s, s, s, PIXELS], dtype=torch.int32).view(torch.uint8)
        row[HEADER:] = image.reshape(-1)
        return row

    @staticmethod
    def collate(rows: Sequence[Tensor]) -> "PackedJpegs":
        """The stream's batch of packer rows (instead of ``torch.stack``)."""
        return PackedJpegs.collate(rows)

    def _baseline(self, data: bytes) -> tuple[bytes, tuple[int, int], int]:
        """(bytes nvJPEG can take, (width, height), flags); re-encodes what it cannot."""
        from infclip.data.stream import Skip

        if data[:2] == b"\xff\xd8" and not (data.endswith(b"\xff\xd9") or data.rstrip(b"\0").endswith(b"\xff\xd9")):
            raise Skip("corrupt_image")  # truncated JPEG (no end marker): PIL would pad it with grey
        try:
            with Image.open(io.BytesIO(data)) as im:
                progressive = bool(im.info.get("progressive") or im.info.get("progression"))
                if im.format == "JPEG" and im.mode in ("RGB", "L") and not progressive and len(data) <= self.max_bytes:
                    return data, im.size, 0
                rgb = im.convert("RGB")  # full decode: the format/mode/size slow path
        except Exception:
            raise Skip("corrupt_image") from None
        return self._reencode(rgb)

    def _reencode(self, img: Image.Image) -> tuple[bytes, tuple[int, int], int]:
        """Baseline RGB JPEG of ``img`` that fits the row: full size first, then smaller."""
        for side, quality in ((None, 90), (None, 75), (2 * self.image_size, 90),
                              (2 * self.image_size, 75), (self.image_size, 75), (self.image_size, 50)):
            im = img
            if side is not None and min(img.size) > side:
                k = side / min(img.size)
                im = img.resize((max(1, round(img.width * k)), max(1, round(img.height * k))),
                                Image.Resampling.BICUBIC)
            buf = io.BytesIO()
            im.save(buf, format="JPEG", quality=quality)
            if buf.tell() <= self.max_bytes:
                return buf.getvalue(), im.size, REENCODED
        from infclip.data.stream import Skip

        raise Skip("image_too_large")


INDEX = HEADER_INTS + 1  # PackedJpegs.index columns: the header, then the byte offset


class PackedJpegs:
    """A batch of packed JPEGs, each at its own length (host memory ~ the files' own size).

    ``index``: int64 (B, 9) ``[nbytes, top, left, height, width, image_h, image_w, flags,
    offset]``; ``data``: uint8 (N,), sample k's JPEG is ``data[offset_k:offset_k + nbytes_k]``.
    Invariant: every (offset, nbytes) lies inside ``data``. Slicing rows keeps ``data`` (the
    offsets stay valid); the step pipeline's pools hand out slices of a chunk's arena.

    ``tag``: which rows of which step these are (the step pipeline sets ``(step, field,
    start, stop)``), or None. A pool chunk is refilled with later rows at the same address, so
    the decoder keys what it keeps by ``tag`` where there is one, never by address alone.
    """

    def __init__(self, index: Tensor, data: Tensor, tag: Optional[tuple] = None):
        if index.dtype != torch.int64 or index.dim() != 2 or index.shape[1] != INDEX:
            raise ValueError(f"PackedJpegs.index must be int64 (B, {INDEX}), got {index.dtype} {tuple(index.shape)}")
        self.index, self.data, self.tag = index, data, tag

    @classmethod
    def collate(cls, rows: Sequence[Tensor]) -> "PackedJpegs":
        """From packer rows (uint8 ``HEADER + nbytes`` each): one index and one byte buffer."""
        heads = torch.stack([r[:HEADER].view(torch.int32) for r in rows]).to(torch.int64)
        sizes = heads[:, 0]
        offsets = torch.cumsum(sizes, 0) - sizes
        data = torch.cat([r[HEADER:HEADER + int(n)] for r, n in zip(rows, sizes.tolist())]) if rows else \
            torch.empty(0, dtype=torch.uint8)
        return cls(torch.cat([heads, offsets[:, None]], 1), data)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.index.shape[0],)

    def __len__(self) -> int:
        return self.index.shape[0]

    def __getitem__(self, rows: slice) -> "PackedJpegs":
        if not isinstance(rows, slice):
            raise TypeError("PackedJpegs rows are taken by slice")
        return PackedJpegs(self.index[rows], self.data)

    def data_ptr(self) -> int:  # identity of these rows (the decoder's per-step cache key)
        return self.index.data_ptr()

    def payloads(self) -> list:
        """Each sample's JPEG bytes as a numpy view into ``data`` (no copy)."""
        host = self.data.numpy()
        return [host[o:o + n] for n, o in self.index[:, [0, HEADER_INTS]].tolist()]

    def pixel_mask(self) -> Tensor:
        """bool (B,): rows whose payload is worker-decoded pixels (``PIXELS``), not a JPEG."""
        return (self.index[:, FLAGS] & PIXELS) != 0

    def nbytes(self) -> int:
        """Bytes these rows occupy in host memory: their JPEGs (and pixels) plus the index."""
        return int(self.index[:, 0].sum()) + self.index.numel() * 8


def unpack_header(rows) -> Tensor:
    """int32 (B, 8) ``[nbytes, top, left, height, width, image_h, image_w, flags]`` of packed rows
    (a :class:`PackedJpegs`, or packer rows stacked into uint8 (B, >HEADER))."""
    if isinstance(rows, PackedJpegs):
        return rows.index[:, :HEADER_INTS].to(torch.int32)
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] <= HEADER:
        raise ValueError(f"packed JPEG rows must be uint8 (B, {HEADER}+max_bytes), got {rows.dtype} "
                         f"{tuple(rows.shape)}: was the loader built with data.decode=device?")
    head = torch.empty((rows.shape[0], HEADER), dtype=torch.uint8)
    head.copy_(rows[:, :HEADER])  # (a 1-row slice counts as contiguous whatever its stride)
    return head.view(torch.int32)


def _source() -> str:
    """Which of the decoder's callers runs this decode (for a trace): "ahead" (the next step's
    decode-ahead thread), "prefetch" (the micro-batch after the towers' one) or "inline"."""
    name = threading.current_thread().name
    return "ahead" if name.startswith("jpeg-ahead") else "prefetch" if name.startswith("jpeg-decode") else "inline"


def _autocast_off(device_type: str):
    """autocast disabled for ``device_type``, touching autocast state only where it is on: a
    decode thread (autocast off, as every new thread) must never enter or leave autocast
    (its global cast cache is cleared under a mutex while holding the GIL)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


class JpegDecoder(nn.Module):
    """Device side: packed JPEGs (host, :class:`PackedJpegs`) -> normalized float
    images (B, 3, S, S) on ``device``, equal to the CPU path's ``Normalizer(train_transform(img))``
    up to JPEG decoder rounding (NVJPG / nvJPEG vs libjpeg-turbo IDCT) and +-1 level of resampling.

    ``backend``: ``data.device_decoder`` (auto: the GPU's JPEG engines, else nvImageCodec's
    CUDA decoder, else torchvision's nvJPEG; see :mod:`infclip.data.jpeg_backends`).
    ``keep_bytes``: device memory for decoded uint8 pixels kept between the two passes of the
    gradient cache (rows the stager marks with :meth:`mark_reread`): a kept micro-batch is
    decoded once per step, the rest again in the replay. Invariant: a row's pixels are the
    same whichever pass decodes them (deterministic decode and resize, no autocast).
    ``decode_threads``: nvImageCodec decoder instances decoding parts of a micro-batch at once
    (``data.decode_threads``); ``decoder_options``: nvImageCodec options added to theirs
    (``data.decoder_options``).
    ``chunk``: images resized together on a CPU device (bounds the reference's padded canvas:
    chunk x 3 x H x W floats); on CUDA the kernel takes a whole micro-batch at once.
    ``roi`` (``data.decode_roi``): decode only each sample's crop box (nvImageCodec's
    region-of-interest decode), not the whole stored image; the resize then reads the region
    whole. Taken only where the backend decodes regions (``Backend.roi``). libjpeg-turbo
    decodes a region to the full decode's pixels bit for bit; the resize places its samples
    relative to the box's offset in fp32, so at large offsets a value may differ by one level.

    A sample no decoder can read (the device backend, then PIL on the host) is *dropped*:
    its slot holds zeros, :attr:`last_dropped` marks it for the engine (which leaves it out of
    the loss), and :attr:`drops` counts it by reason.
    """

    reads_host: ClassVar[bool] = True  # the input stager passes host rows (decoders read CPU bytes)

    def __init__(self, image_size: int, mean: Optional[Sequence[float]] = None,
                 std: Optional[Sequence[float]] = None, device: torch.device | str = "cpu", chunk: int = 256,
                 backend: str = "auto", keep_bytes: int = 0, decode_threads: int = 1, roi: bool = False,
                 decoder_options: str = ""):
        super().__init__()
        from infclip.data.jpeg_backends import select_backend
        from infclip.data.transforms import Normalizer

        self.size, self.chunk, self.device = image_size, chunk, torch.device(device)
        self.normalizer = Normalizer(mean, std).to(self.device)
        self.selection = select_backend(self.device, backend, decode_threads, decoder_options)
        self.backend = self.selection.backend
        self.roi = bool(roi) and self.backend.roi
        self.failures = 0  # images the device backend failed on (re-decoded by PIL or dropped)
        self.drops: dict[str, int] = {}  # dropped samples by reason
        self.last_dropped: Optional[Tensor] = None  # bool (B,) of the last forward, None if none
        self.decoded = 0  # images decoded on the device (both passes)
        self.cpu_pixels = 0  # worker-decoded images uploaded (data.cpu_decode_share; both passes)
        self.decode_s = 0.0  # seconds the decode thread spent decoding (its rate's denominator)
        self._decode_s_seen = 0.0  # decode_s at the previous stats() (its per-step busy time)
        self._first_pass_busy: Optional[float] = None  # decode work up to the trainer's first-pass end
        # The decoders write on a stream of ours that we synchronize first: memory they get
        # from the caching allocator is then no longer read or written by earlier work.
        # High priority: the resize kernels are small and the towers' large ones would otherwise
        # starve them (a decode beside 8k^3 matmuls fell from 11.7k to 3k images/s, H200).
        self._stream = torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda" else None
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pending: list[Future] = []
        self._lock = threading.Lock()
        self._decode_lock = threading.Lock()
        self.keep_bytes = keep_bytes
        self._reread: set = set()  # keys of rows that will be read again this step
        self._kept: dict = {}  # key -> (uint8 images, dropped mask, event, step generation)
        self._kept_bytes = 0
        self._gen = 0  # step generation: kept pixels of older generations are stale
        self._inflight: dict = {}  # key -> threading.Event of a decode-ahead in progress
        # Keys the training side decodes itself this step: the decode-ahead leaves them alone,
        # since their host rows may be released and refilled as soon as that decode is done.
        self._claimed: set = set()
        self._ahead_pool: Optional[ThreadPoolExecutor] = None
        self.ahead_decoded = 0  # micro-batches decoded ahead (during the previous step's replay)
        self._hold: dict[int, list] = {}  # thread -> its last decoded images (read by pointer)
        self._trace: Optional[DecodeTrace] = None  # one step's timeline (logging.decode_trace_step)
        self._running: Optional[tuple[float, str, int]] = None  # (start, source, images) of the decode under way

    def describe(self) -> str:
        """The startup line's decoder part."""
        keep = f", decoded pixels kept between passes up to {self.keep_bytes / 2**30:.1f} GB"
        roi = ", only each crop decoded (data.decode_roi)" if self.roi else ""
        return self.selection.describe() + roi + (keep if self.keep_bytes else "")

    def stats(self) -> dict[str, float]:
        """Decoder counters for the progress line: images/s of decode work, fallbacks, drops, and
        ``decode_busy_s``: seconds of decode work since the previous call (the trainer calls it
        once per step; its share of the step says whether decoding bounds the step)."""
        with self._lock:
            total = self._decode_s_now()
            busy = total - self._decode_s_seen
            first, self._first_pass_busy = self._first_pass_busy, None
            self._decode_s_seen = total
        rate = self.decoded / total if total > 0 else 0.0
        firsts = {} if first is None else {"decode_busy_first_s": first}
        return {"decode_imgs_per_s": rate, "decode_busy_s": busy, **firsts, "decode_failures": self.failures,
                "decode_ahead": self.ahead_decoded,
                "decode_cpu_pixels": self.cpu_pixels,
                **{f"decode_dropped/{k}": v for k, v in self.drops.items()}}

    def mark_first_pass_end(self) -> None:
        """The trainer's first pass (the gradient cache's) ended: the next ``stats`` also reports
        ``decode_busy_first_s``, the decode work from the previous ``stats`` up to here. Where
        only the first pass decodes (LiT), the step's busy share under-reads how much decoding
        bounds that pass; this is its share."""
        with self._lock:
            self._first_pass_busy = self._decode_s_now() - self._decode_s_seen

    def _decode_s_now(self) -> float:
        """``decode_s`` with the decode under way counted up to now (call under ``_lock``): a
        decode across a step's end counts in each step for its part, not all in the step it
        ends in (which read over 100 % there)."""
        return self.decode_s + (time.perf_counter() - self._running[0] if self._running is not None else 0.0)

    # -- one step's timeline (logging.decode_trace_step) ---------------------------------
    def start_trace(self) -> None:
        """Record this step's decode calls, waits and phase ends (``decode_trace``)."""
        with self._lock:
            self._trace = DecodeTrace(time.perf_counter())

    def stop_trace(self) -> Optional[DecodeTrace]:
        """The trace since ``start_trace`` (None if none), recording stopped; a decode still
        under way (the next step's decode-ahead, typically) is in it up to now."""
        with self._lock:
            trace, self._trace = self._trace, None
            if trace is not None:
                trace.end = time.perf_counter()
                if self._running is not None:
                    start, source, images = self._running
                    trace.spans.append((start, trace.end, source, images))
        return trace

    def _note_wait(self, t0: float) -> None:
        """The training thread waited from ``t0`` until now for decoded pixels (if tracing)."""
        with self._lock:
            if self._trace is not None:
                self._trace.waits.append((t0, time.perf_counter()))

    def mark_phase(self, name: str, when: float) -> None:
        """The engine's clock ended phase ``name`` at ``when`` (perf_counter); kept if tracing."""
        with self._lock:
            if self._trace is not None:
                self._trace.marks.append((when, name))

    # -- decode once per step ---------------------------------------------------------
    @staticmethod
    def _key(rows) -> tuple:
        """What identifies ``rows`` within the run: their step pipeline tag (step, field, rows),
        else (address, shape), which is unique only within one step."""
        tag = getattr(rows, "tag", None)
        return ("tag", *tag) if tag is not None else (rows.data_ptr(), tuple(rows.shape))

    def mark_reread(self, rows: Tensor) -> None:
        """The stager's hint: ``rows`` will be read again this step (the replay), so their
        decoded pixels are worth keeping on the device (within ``keep_bytes``)."""
        if self.keep_bytes:
            with self._lock:
                self._reread.add(self._key(rows))

    def end_step(self) -> None:
        """Forget this step's kept pixels and hints (its host rows may be refilled after
        this); pixels decoded ahead for the next step stay."""
        with self._lock:
            self._reread.clear()
            self._claimed.clear()
            for key in [k for k, v in self._kept.items() if v[3] <= self._gen]:
                self._kept_bytes -= self._kept.pop(key)[0].numel()
            self._gen += 1

    def decode_ahead(self, fetchers: Sequence[Callable[[], Tensor]]) -> bool:
        """Decode the *next* step's micro-batches (``fetchers`` return their host rows,
        waiting for the loader, or None once those rows were released) in a thread of their
        own, in order, after what that thread was given before: handed over after this
        step's loss, they decode while its replay runs, which needs no decoding (the JPEG
        engines would otherwise idle through it); under a locked image tower they may be
        handed over during the first pass (``data.decode_ahead_from=first_pass``). Results
        are kept (within ``keep_bytes``, checked per micro-batch) for the next step's first
        pass. Returns whether anything was queued (False without a keep budget).

        Invariant: a decode-ahead reads host rows only while they cannot be released. The
        training side releases rows only after its own read of them, which either waits for a
        decode-ahead in flight (:meth:`_take_kept`) or first *claims* them; a claimed key is
        never decoded ahead. (A streamed LiT ring frees a chunk as soon as the first pass read
        it, so without the claim a late decode-ahead read bytes being overwritten.)"""
        if not self.keep_bytes:
            return False
        if self._ahead_pool is None:
            self._ahead_pool = ThreadPoolExecutor(1, thread_name_prefix="jpeg-ahead")
        gen = self._gen + 1
        with self._lock:
            if self._trace is not None:
                self._trace.queued.append(time.perf_counter())
        for fetch in fetchers:
            self._ahead_pool.submit(self._ahead_one, fetch, gen)
        return True

    def _ahead_one(self, fetch: Callable[[], Optional[Tensor]], gen: int) -> None:
        rows = fetch()
        if rows is None:
            return  # already read and released by the training side
        key, need = self._key(rows), rows.shape[0] * 3 * self.size * self.size
        with self._lock:
            if gen <= self._gen - 1 or key in self._kept or key in self._inflight or key in self._claimed \
                    or self._kept_bytes + need > self.keep_bytes:
                return  # step over, decoded or being decoded by its pass, or no room: its pass decodes it
            self._inflight[key] = threading.Event()
            self._kept_bytes += need  # reserved
        try:
            out, dropped, done = self._decode_timed(rows)
            with self._lock:
                self._kept[key] = (out, dropped, done, max(gen, self._gen))
                self.ahead_decoded += 1
        except BaseException:
            with self._lock:
                self._kept_bytes -= need
            raise
        finally:
            with self._lock:
                self._inflight.pop(key).set()

    def _take_kept(self, rows: Tensor):
        """Kept pixels of ``rows`` (waiting for a decode-ahead of them in progress), or None.
        They stay kept when the rows will be read again this step."""
        key = self._key(rows)
        with self._lock:
            pending = self._inflight.get(key)
            if pending is None and key not in self._kept:
                if self.keep_bytes:  # (decode-ahead runs only with a budget)
                    self._claimed.add(key)  # ours now: no decode-ahead may start on these rows
                return None
        if pending is not None:
            t0 = time.perf_counter()
            pending.wait()
            if self._trace is not None and _source() == "inline":  # the training thread waited
                self._note_wait(t0)
        with self._lock:
            got = self._kept.get(key)
            if got is None:
                if self.keep_bytes:
                    self._claimed.add(key)
                return None
            if key in self._reread:  # the cache pass read of rows the replay reads again
                self._reread.discard(key)
                self._kept[key] = (*got[:3], self._gen)
            else:
                self._kept_bytes -= self._kept.pop(key)[0].numel()
            return got[:3]

    def _maybe_keep(self, rows: Tensor, out: Tensor, dropped, done) -> None:
        key = self._key(rows)
        with self._lock:
            if key in self._reread and self._kept_bytes + out.numel() <= self.keep_bytes:
                self._reread.discard(key)
                self._kept[key] = (out, dropped, done, self._gen)
                self._kept_bytes += out.numel()

    # -- prefetch: the next micro-batch decodes in a thread while this one computes -------
    def prefetch(self, fetch_rows: Callable[[], Tensor]) -> None:
        """Start decoding the rows ``fetch_rows()`` returns (called in the decode thread: it
        may wait for the loader); a later ``forward`` on the same rows picks the result up.
        Ahead of time the decode overlaps the encoders instead of stalling their queue."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="jpeg-decode")
        self._pending.append(self._pool.submit(self._decode_on_stream, fetch_rows))

    def cancel_prefetch(self) -> None:
        """Drop prefetched results and kept pixels (the step ended or failed); waits for
        running decodes, so no thread reads host rows after the caller releases them."""
        pending, self._pending = self._pending, []
        for fut in pending:
            fut.exception()  # wait; an error of a dropped prefetch is not the caller's
        self.end_step()

    def _decode_on_stream(self, fetch_rows: Callable[[], Tensor]):
        """(rows, uint8 images, dropped mask or None, event after them or None on the CPU)."""
        rows = fetch_rows()
        kept = self._take_kept(rows)
        if kept is not None:
            if self._trace is not None:
                with self._lock:
                    if self._trace is not None:
                        self._trace.hits += 1
            return (rows, *kept)
        out, dropped, done = self._decode_timed(rows)
        self._maybe_keep(rows, out, dropped, done)
        return rows, out, dropped, done

    def _decode_timed(self, rows: Tensor):
        """(uint8 images, dropped mask, event or None) of ``rows``, decoded now. One decode at a
        time (``_decode_lock``); ``decode_s`` counts the time decoding, not the wait for the
        lock, so ``decode_imgs_per_s`` is the rate of the decode work itself (where every image
        is decoded once per step, decoding is the step's bound when that rate equals the step's
        samples/s; replays that decode again count their images too)."""
        # One decode + resize at a time (the prefetch and decode-ahead threads share the
        # decoders): on CUDA the resize that reads a decode's images is enqueued before the next
        # decode, which reuses their buffers, is (stream order keeps the rest).
        pixels = int(rows.pixel_mask().sum()) if isinstance(rows, PackedJpegs) else 0
        with self._decode_lock:
            t0 = time.perf_counter()
            with self._lock:  # under way: counted by stats() and a trace's stop up to their time
                self._running = (t0, _source(), rows.shape[0])
            try:
                out, dropped, done = self._decode_now(rows)
            except BaseException:
                with self._lock:
                    self._running = None
                raise
            elapsed = time.perf_counter() - t0
            with self._lock:  # one update: no reader sees the decode neither running nor counted
                self._running = None
                self.decode_s += elapsed
                self.decoded += rows.shape[0] - pixels
                self.cpu_pixels += pixels
                if self._trace is not None:
                    self._trace.spans.append((t0, t0 + elapsed, _source(), rows.shape[0]))
        return out, dropped, done

    def _decode_now(self, rows: Tensor):
        """(uint8 images, dropped mask, event or None) of ``rows``: the decode and resize, on
        our stream on CUDA (under ``_decode_lock``)."""
        if self._stream is None:
            with _autocast_off("cpu"):  # the CPU reference's matmuls stay float32
                out, dropped = self._decode_resize(rows)
            return out, dropped, None
        # No autocast context here: nothing on this path is autocast-sensitive (a Triton
        # kernel and uint8 copies), and entering/leaving autocast in a decode thread while
        # the training thread compiles deadlocked (autocast's global cast-cache mutex vs
        # the GIL: seen at 262,144 under model.compile).
        with torch.cuda.stream(self._stream):
            self._stream.synchronize()  # its earlier work (and the blocks it freed) is done
            out, dropped = self._decode_resize(rows)
            done = torch.cuda.Event()
            done.record(self._stream)
        return out, dropped, done

    def _prefetched(self, rows: Tensor):
        while self._pending:
            got, out, dropped, done = self._pending.pop(0).result()
            if got.data_ptr() == rows.data_ptr() and got.shape == rows.shape:
                return out, dropped, done
        return None

    def forward(self, rows: Tensor) -> Tensor:
        """Normalized float32 images; autocast is off inside, so every pass decodes identically."""
        t0 = time.perf_counter()
        hit = self._prefetched(rows)
        if self._trace is not None:  # the wait for prefetched results, matched or not
            self._note_wait(t0)
        if hit is None:
            _, out, dropped, done = self._decode_on_stream(lambda: rows)
        else:
            out, dropped, done = hit
        self.last_dropped = dropped
        if done is None:
            return self.normalizer(out)
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(done)
        out.record_stream(compute)
        return self.normalizer(out)  # the CPU path's own uint8 -> float step

    def _decode_resize(self, rows: PackedJpegs) -> tuple[Tensor, Optional[Tensor]]:
        """uint8 (B, 3, S, S) on the device, in the current stream, and the dropped mask."""
        if not isinstance(rows, PackedJpegs):
            unpack_header(rows)  # raises the paragraph for what is no packed batch at all
            rows = PackedJpegs.collate(list(rows))
        pixels = rows.pixel_mask()
        if pixels.any():
            return self._mixed(rows, pixels)
        return self._decode_resize_jpegs(rows)

    def _mixed(self, rows: PackedJpegs, pixels: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        """A micro-batch of JPEGs and worker-decoded pixels (data.cpu_decode_share): the
        pixels are copied into their slots as they are (the CPU path's own), the JPEGs decoded
        and resized as usual, in the current stream."""
        s, n = self.size, 3 * self.size * self.size
        out = torch.empty((len(rows), 3, s, s), dtype=torch.uint8, device=self.device)
        pix = pixels.nonzero().flatten()
        sizes, offsets = rows.index[pix, 0].tolist(), rows.index[pix, HEADER_INTS].tolist()
        if any(size != n for size in sizes):
            raise ValueError(f"worker-decoded pixels of {sizes[0]} bytes do not fit {s}x{s} images: the loader's "
                             f"data.image_size differs from the decoder's")
        for k, o in zip(pix.tolist(), offsets):  # pinned arena (offload): asynchronous copies
            out[k].copy_(rows.data[o:o + n].view(3, s, s), non_blocking=True)
        jpegs = (~pixels).nonzero().flatten()
        if not len(jpegs):
            return out, None
        decoded, dropped = self._decode_resize_jpegs(PackedJpegs(rows.index[jpegs], rows.data))
        on_device = jpegs.to(self.device)
        out.index_copy_(0, on_device, decoded)
        if dropped is None:
            return out, None
        mask = torch.zeros(len(rows), dtype=torch.bool)
        mask[jpegs[dropped]] = True
        return out, mask

    def _decode_resize_jpegs(self, rows: PackedJpegs) -> tuple[Tensor, Optional[Tensor]]:
        """uint8 (B, 3, S, S) of JPEG rows only, in the current stream, and the dropped mask."""
        header = unpack_header(rows).tolist()
        datas = rows.payloads()
        images, dropped = self._decode(datas, header)
        # The decoded images stay referenced until this thread's next decode, which first
        # synchronizes the stream: the resize kernel reads them by pointer, after we return.
        self._hold[threading.get_ident()] = images
        boxes = rows.index[:, 1:5]
        if self.roi:  # each image is its crop already: the box is the whole of it
            boxes = torch.cat([torch.zeros_like(boxes[:, :2]), boxes[:, 2:]], 1)
        if self.device.type == "cuda":  # one launch, each image read through its own pointer
            out = resized_crop(images, boxes, self.size)
        else:  # the plain PyTorch statement of the same math, a chunk of images at a time
            out = torch.empty((len(datas), 3, self.size, self.size), dtype=torch.uint8, device=self.device)
            for a in range(0, len(datas), self.chunk):
                out[a:a + self.chunk] = resized_crop_reference(images[a:a + self.chunk], boxes[a:a + self.chunk],
                                                               self.size)
        if dropped is not None:
            out[dropped.to(self.device)] = 0
        return out, dropped

    def _decode(self, datas: list, header: list[list[int]]) -> tuple[list[Tensor], Optional[Tensor]]:
        """(H, W, 3) uint8 per image on the device (with ``roi``: its crop box, (h, w, 3)). An
        image the backend fails on is decoded by PIL on the host (counted in ``failures``);
        one PIL cannot read either is dropped."""
        from infclip.data.jpeg_backends import pil_decode

        regions = [h[1:5] for h in header] if self.roi else None  # (top, left, height, width)
        want = [(h[3], h[4]) if self.roi else (h[5], h[6]) for h in header]
        images = self.backend.decode(datas, self._stream, regions)
        bad = [k for k, im in enumerate(images) if im is None or tuple(im.shape[:2]) != want[k]]
        if not bad:
            return images, None
        dropped = torch.zeros(len(datas), dtype=torch.bool)
        for k in bad:
            self.failures += 1
            im = pil_decode(datas[k])
            if im is None or tuple(im.shape[:2]) != (header[k][5], header[k][6]):
                dropped[k] = True
                reason = "undecodable" if im is None else "size_mismatch"
                self.drops[reason] = self.drops.get(reason, 0) + 1
                im = torch.zeros((*want[k], 3), dtype=torch.uint8)
            elif self.roi:
                t, x, h, w = header[k][1:5]
                im = im[t:t + h, x:x + w].contiguous()
            images[k] = im.to(self.device, non_blocking=False)
        if dropped.any():
            warnings.warn(f"data.decode=device: {int(dropped.sum())} sample(s) of a micro-batch could not be "
                          f"decoded and are left out of the loss ({sum(self.drops.values())} so far)", stacklevel=2)
        return images, (dropped if dropped.any() else None)
