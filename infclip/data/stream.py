"""The global sample order and the per-worker streams that deliver it: shard order, shuffle,
decode, batch, tokenize.

The order does not depend on the number of ranks. It is made of ``S`` *streams* (lanes),
fixed for the life of a run (``data.streams``; by default ranks x workers of its first start,
``stream_world`` x workers). An epoch is ``G`` global loader batches; global batch ``g`` of an
epoch is the next batch of stream ``g % S``. Counting global batches from the run's start
(``n = epoch * G + g``), rank ``r`` of ``W`` takes ``n = r, r + W, r + 2W, ...``; its
DataLoader worker ``k % w`` delivers its ``k``-th. With ``W | S`` and ``w | S / W`` every batch
of one stream within an epoch comes from the same worker, so each worker holds a few whole
streams. Invariant: a step takes global batches ``[t * B, (t + 1) * B)`` (``B`` = global batch
/ loader batch) whatever ``W`` is, so a run checkpointed on ``W`` ranks resumes on ``W'``
(any divisor of ``S``) with the same samples in every later step, none repeated or skipped.

Everything random is a pure function of (seed, epoch, stream key, position), which is what
makes the resume position (:class:`Position`) exact. A stream's key is ``(l % stream_world,
l // stream_world)``: the (rank, worker) that read it at the run's first start, so with an
unchanged world the order is the per-(rank, worker) order of earlier versions.

* epoch mode: all shards are permuted with ``seed + epoch`` (the same on every rank), stream
  ``l`` reads ``[l::S]`` of them. A stream whose shards run out before its batch quota wraps
  around over its own shards (new permutation per pass); extra samples are dropped. A stream
  whose own shards give no sample in a whole pass (all empty or unreadable) borrows: it reads
  every shard of the run, in its own seeded order, so half-bad data still trains; only when a
  whole pass over every shard gives nothing does it stop, with the counts by reason.
* resampled mode: shards are drawn with replacement from a generator seeded with
  (seed, epoch, stream key), with per-source weights.

The shuffle buffer (one per stream), json caption choice and the image augmentation (torch
RNG, seeded per batch inside ``fork_rng``) follow the same seeds. A resumed stream replays its
raw stream (tar reading + shuffle, no decoding) up to its cursor and continues with identical
batches.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from PIL import Image
from torch.utils.data import IterableDataset, get_worker_info

from infclip.data.shards import IMAGE_EXTS, DataError, RawSample, iter_samples
from infclip.data.transforms import ImageDecodeError

MAX_EMPTY_DRAWS = 100  # resampled mode: consecutive shards with no sample before giving up


def mix_seed(*parts: Any) -> int:
    """A stable 63-bit seed from any tuple of ints/strings (Python's hash() is salted)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class StreamSpec:
    """What one rank's workers need (pickled into each DataLoader worker)."""

    urls: list[str]
    weights: list[float]  # per-url draw weight (resampled mode)
    resampled: bool
    seed: int
    rank: int
    world_size: int
    loader_batch: int
    epoch_batches: int  # G: global loader batches per epoch (all ranks together)
    shuffle_buffer: int  # samples per stream
    caption_key: str = "txt"
    json_caption_key: Optional[str] = None
    streams: int = 0  # S, the streams of the global order; 0: world_size (one per rank)
    stream_world: int = 0  # the world size that names the streams' seeds; 0: world_size

    def __post_init__(self) -> None:
        self.streams = self.streams or self.world_size
        self.stream_world = self.stream_world or self.world_size

    def stream_key(self, lane: int) -> tuple[int, int]:
        """The seed identity of stream ``lane``: the (rank, worker) that read it at the start."""
        return lane % self.stream_world, lane // self.stream_world

    def locate(self, n: int) -> tuple[int, int, int]:
        """(epoch, stream, the stream's batch index in that epoch) of global batch ``n``."""
        epoch, g = divmod(n, self.epoch_batches)
        return epoch, g % self.streams, g // self.streams


@dataclass
class Position:
    """Where the global order stands (valid between two steps, when every rank has taken the
    same number of loader batches).

    ``batches``: global loader batches consumed since the run began, by all ranks together.
    ``cursors[l]``: ``[epoch, batches, raw]`` of stream ``l`` after its last delivered batch
    (its batches and raw samples consumed in that epoch), or None if unknown here.
    """

    batches: int = 0
    cursors: list = field(default_factory=list)

    def start_of(self, spec: StreamSpec, epoch: int, lane: int) -> tuple[int, int]:
        """(batches done, raw cursor) of stream ``lane`` in ``epoch`` at this position;
        raises DataError when a stream that has delivered batches has no matching cursor."""
        now, g = divmod(self.batches, spec.epoch_batches)
        done = len(range(lane, g, spec.streams)) if epoch == now else 0
        if done == 0:
            return 0, 0
        cursor = self.cursors[lane] if lane < len(self.cursors) else None
        if cursor is None or list(cursor[:2]) != [epoch, done]:
            raise DataError(
                f"the saved data position is inconsistent: stream {lane} has delivered {done} batch(es) of "
                f"epoch {epoch} at global batch {self.batches}, but its cursor is {cursor}. The checkpoint's "
                "rank files do not belong together; resume from another checkpoint (resume=<its folder>)")
        return done, int(cursor[2])


# -- shard order ------------------------------------------------------------------------------


def epoch_shards(spec: StreamSpec, epoch: int, lane: int) -> list[str]:
    """Epoch mode: stream ``lane``'s disjoint share of the epoch's shard permutation."""
    order = list(spec.urls)
    random.Random(mix_seed("shards", spec.seed, epoch)).shuffle(order)
    return order[lane::spec.streams]


def shard_stream(spec: StreamSpec, epoch: int, lane: int) -> Iterator[Optional[str]]:
    """Infinite shard URLs for one stream; epoch mode wraps around its share and marks the end
    of each pass with ``None`` (the shuffle buffer is flushed there, so a pass never mixes with
    the next one and the first pass covers every sample exactly once)."""
    key = spec.stream_key(lane)
    if spec.resampled:
        rng = random.Random(mix_seed("resample", spec.seed, epoch, *key))
        while True:
            yield rng.choices(spec.urls, weights=spec.weights)[0]
    mine = epoch_shards(spec, epoch, lane)
    for wrap in range(1 << 62):
        order = list(mine)
        if wrap:
            random.Random(mix_seed("wrap", spec.seed, epoch, *key, wrap)).shuffle(order)
        yield from order
        yield None


def borrowed_shards(spec: StreamSpec, epoch: int, lane: int) -> Iterator[Optional[str]]:
    """Every shard of the run, in an order of this stream's own, pass after pass (``None`` at
    pass ends): what a stream reads once its own share gave nothing."""
    for wrap in range(1 << 62):
        order = list(spec.urls)
        random.Random(mix_seed("borrow", spec.seed, epoch, *spec.stream_key(lane), wrap)).shuffle(order)
        yield from order
        yield None


def raw_stream(spec: StreamSpec, epoch: int, lane: int, counts: Counter) -> Iterator[Optional[RawSample]]:
    """Samples of this stream's shards in order (``None`` at pass ends). A stream whose own
    share gives nothing for a whole pass switches to ``borrowed_shards``; it raises only when
    no shard of the run gives a sample (a whole pass over all of them, or MAX_EMPTY_DRAWS
    resampled draws, which already span every shard). Deterministic, so resume replays it."""
    empty, own, passed = 0, not spec.resampled, 0
    limit = MAX_EMPTY_DRAWS if spec.resampled else len(epoch_shards(spec, epoch, lane))
    urls = shard_stream(spec, epoch, lane)
    check_pass = own and lane == 0  # one line per run (stream 0), not one per stream
    while True:
        url = next(urls)
        if url is None:
            if check_pass and own:
                check_pass = False
                _warn_far_from_claim(passed, len(range(lane, spec.epoch_batches, spec.streams)) * spec.loader_batch,
                                     limit)
            yield None
            continue
        got = 0
        for sample in iter_samples(url, counts):
            got += 1
            yield sample
        passed += got
        empty = 0 if got else empty + 1
        if empty < max(limit, 1):
            continue
        if own and len(spec.urls) > limit:  # other workers' or ranks' shards may still deliver
            own, empty, limit = False, 0, len(spec.urls)
            urls = borrowed_shards(spec, epoch, lane)
            continue
        raise DataError(
            f"no training shard gives a sample: {empty} shards in a row were empty or unreadable "
            f"(last: {url}); skipped by reason so far: {dict(counts)}. Check data.shards (paths, "
            "permissions, tar format: python data/build_shards.py writes valid shards).")


FAR = 2.0  # a first pass this many times over or under the claimed count is worth a warning


def _warn_far_from_claim(read: int, claimed: int, shards: int) -> None:
    """One warning when a stream's first pass over its shards read far more or fewer samples
    than the claimed epoch (sizes.json / *_stats.json / data.num_samples) gives it."""
    if claimed <= 0 or claimed / FAR <= read <= claimed * FAR:
        return
    effect = "epochs repeat its samples" if read < claimed else "an epoch ends before most samples were read"
    print(f"warning: data: the first pass over stream 0's {shards} shards read {read} samples, but the "
          f"sample counts (sizes.json / *_stats.json / data.num_samples) give it {claimed} per epoch: the counts "
          f"do not describe these shards; {effect}. Fix the counting files or data.num_samples",
          file=sys.stderr, flush=True)


def shuffled(samples: Iterator[Optional[RawSample]], bufsize: int, rng: random.Random
             ) -> Iterator[RawSample]:
    """Shuffle buffer of ``bufsize`` samples (<= 1: pass through), flushed at ``None`` markers."""
    buf: list[RawSample] = []
    for sample in samples:
        if sample is None:
            rng.shuffle(buf)
            yield from buf
            buf = []
            continue
        buf.append(sample)
        if len(buf) >= max(bufsize, 1):
            i = rng.randrange(len(buf))
            buf[i], buf[-1] = buf[-1], buf[i]
            yield buf.pop()
    rng.shuffle(buf)
    yield from buf


# -- decoding ---------------------------------------------------------------------------------


class Skip(Exception):
    """A sample is unusable; ``reason`` names the counter it increments."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _caption(sample: RawSample, spec: StreamSpec, rng: random.Random) -> str:
    if spec.json_caption_key:
        if "json" not in sample:
            raise Skip("missing_json")
        try:
            value = json.loads(sample["json"]).get(spec.json_caption_key)
        except (ValueError, AttributeError):
            raise Skip("bad_json") from None
        if isinstance(value, list):
            value = rng.choice(value) if value else None
    else:
        raw = sample.get(spec.caption_key)
        value = None if raw is None else raw.decode("utf-8", errors="replace")
    if value is None:
        raise Skip("missing_caption")
    if not isinstance(value, str) or not value.strip():
        raise Skip("empty_caption")
    return value.strip()


def _image_bytes(sample: RawSample) -> bytes:
    ext = next((e for e in IMAGE_EXTS if e in sample), None)
    if ext is None:
        known = {"__key__", "__url__", "txt", "json"}
        raise Skip("unknown_extension" if set(sample) - known else "missing_image")
    return sample[ext]


def _transformed(sample: RawSample, transform: Callable) -> torch.Tensor:
    """The transform's output (see :func:`transform_bytes`)."""
    return transform_bytes(_image_bytes(sample), transform)


def transform_bytes(data: bytes, transform: Callable) -> torch.Tensor:
    """The CPU path's uint8 (3,H,W) image of the encoded file ``data``, or raise :class:`Skip`.
    A transform with ``decodes_bytes`` (e.g. ``DraftRandomResizedCrop``) gets the raw file and
    decodes it itself (so it can decode less than the full image): its ImageDecodeError counts
    as ``corrupt_image``. Any other gets the fully decoded RGB image. Also what the loader
    workers run for their share of a ``data.decode=device`` run (``data.cpu_decode_share``)."""
    if getattr(transform, "decodes_bytes", False):
        try:
            out = transform(data)
        except ImageDecodeError:
            raise Skip("corrupt_image") from None
        except Exception:
            raise Skip("transform_error") from None
    else:
        try:
            with Image.open(io.BytesIO(data)) as img:
                image = img.convert("RGB")  # forces the full decode here, not in the transform
        except Exception:
            raise Skip("corrupt_image") from None
        try:
            out = transform(image)
        except Exception:
            raise Skip("transform_error") from None
    if not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.dim() != 3:
        raise Skip("transform_error")
    return out


def route_hash(seed: int, raw: int, key: Any) -> int:
    """A 63-bit hash of (batch seed, stream position, sample key): which decoder a sample of a
    ``data.decode=device`` run goes to (``data.cpu_decode_share``). A pure function of what
    resume replays, so a resumed run routes every sample as the uninterrupted one did."""
    return mix_seed("cpu_share", seed, raw, key)


def decode(sample: RawSample, spec: StreamSpec, transform: Callable, rng: random.Random,
           route: Optional[int] = None) -> tuple[torch.Tensor, str]:
    """(uint8 image (3,H,W), caption) or raise :class:`Skip`. A transform with
    ``takes_bytes`` (``infclip.data.jpeg.JpegPacker``) gets the raw file and returns a packed
    uint8 row (the image is decoded on the training device), and ``route`` (the sample's
    :func:`route_hash`) when it splits samples between the workers and the GPU."""
    text = _caption(sample, spec, rng)
    if getattr(transform, "takes_bytes", False):
        data = _image_bytes(sample)
        return (transform(data) if route is None else transform(data, route=route)), text
    return _transformed(sample, transform), text


# -- the worker-side dataset ------------------------------------------------------------------


class BatchStream(IterableDataset):
    """Yields ``(images uint8 (B,3,H,W), tokens int64 (B,L), info)`` forever, epoch after epoch:
    this rank's share of the global order from ``position`` on, DataLoader worker ``p`` of
    ``workers`` delivering the rank's batches ``k = p, p + workers, ...`` (the DataLoader takes
    them round-robin, so they arrive in order). Needs ``workers | S / W`` (see the module doc).

    ``info`` = {"index" (global batch number since the run began), "epoch", "lane",
    "batch" (the stream's batch index in the epoch), "raw" (its cursor after this batch),
    "keys" (sample keys), "skips" (Counter delta)}. One DataLoader serves the whole run, so
    workers are forked once and prefetch across epoch boundaries.
    """

    def __init__(self, spec: StreamSpec, transform: Callable, tokenizer: Callable,
                 position: Position, workers: int):
        self.spec, self.transform, self.tokenizer = spec, transform, tokenizer
        self.position, self.workers = position, max(workers, 1)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, dict]]:
        info = get_worker_info()
        spec, physical = self.spec, (0 if info is None else info.id)
        lanes: dict[int, Iterator] = {}
        current = -1  # the epoch whose streams ``lanes`` holds (older ones are dropped)
        for k in range(physical, 1 << 62, self.workers):
            n = self.position.batches + spec.rank + k * spec.world_size
            epoch, lane, b = spec.locate(n)
            if epoch != current:
                lanes, current = {}, epoch
            if lane not in lanes:
                done, raw = self.position.start_of(spec, epoch, lane)
                lanes[lane] = self._lane(epoch, lane, done, raw)
            images, tokens, out = next(lanes[lane])
            if out["batch"] != b:  # another worker delivers batches of this stream: never mix them up
                raise DataError(f"loader worker {physical} of {self.workers} would deliver batch {out['batch']} of "
                                f"stream {lane} as its batch {b}: the worker count must divide the streams per rank "
                                f"({spec.streams} / {spec.world_size})")
            yield images, tokens, {**out, "index": n}

    def _lane(self, epoch: int, lane: int, done: int, raw: int
              ) -> Iterator[tuple[torch.Tensor, torch.Tensor, dict]]:
        """Stream ``lane``'s batches of ``epoch`` from its batch ``done`` (raw cursor ``raw``) on."""
        spec = self.spec
        counts: Counter = Counter()
        key = spec.stream_key(lane)
        rng = random.Random(mix_seed("shuffle", spec.seed, epoch, *key))
        stream = shuffled(raw_stream(spec, epoch, lane, counts), spec.shuffle_buffer, rng)
        for _ in range(raw):  # resume: replay the raw stream without decoding
            next(stream)
        counts.clear()  # skips before the cursor were counted by the run that consumed them
        for b in range(done, 1 << 62):
            seed = mix_seed("batch", spec.seed, epoch, *key, b)
            images, texts, keys, raw = self._batch(stream, counts, raw, seed)
            info = {"epoch": epoch, "lane": lane, "batch": b, "raw": raw, "keys": keys, "skips": dict(counts)}
            collate = getattr(self.transform, "collate", torch.stack)  # JpegPacker: PackedJpegs
            yield collate(images), self.tokenizer(texts), info
            counts.clear()

    def _batch(self, stream: Iterator[RawSample], counts: Counter, raw: int, seed: int
               ) -> tuple[list[torch.Tensor], list[str], list[str], int]:
        images: list[torch.Tensor] = []
        texts: list[str] = []
        keys: list[str] = []
        rng = random.Random(seed)
        split = getattr(self.transform, "cpu_share", 0.0) > 0  # data.cpu_decode_share: route by hash
        # Augmentations draw from torch's RNG (crops, jitter, erasing noise) and Python's global
        # one (open_clip's jitter/greyscale coins, timm's crops and erasing boxes): both are seeded
        # per batch and restored after (keep the caller's RNG untouched with workers=0).
        py_state = random.getstate()
        random.seed(seed)
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                while len(images) < self.spec.loader_batch:
                    sample = next(stream)
                    raw += 1
                    route = route_hash(seed, raw, sample.get("__key__")) if split else None
                    try:
                        image, text = decode(sample, self.spec, self.transform, rng, route)
                    except Skip as skip:
                        counts[skip.reason] += 1
                        continue
                    images.append(image)
                    texts.append(text)
                    keys.append(f"{sample.get('__url__')}/{sample.get('__key__')}")
        finally:
            random.setstate(py_state)
        return images, texts, keys, raw
