"""Training data: from a DataConfig to an infinite, resumable stream of uint8 batches.

``build_train_data`` resolves the shard sources (brace expansion, existence check, counting),
fixes the number of batches per epoch so that every rank yields the same count (DDP never
waits on a rank that ran dry), and returns a :class:`TrainData`. Per-sample work (decode,
augment, tokenize) runs in DataLoader workers; see :mod:`infclip.data.stream` for the
seeding that makes the resume position exact.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader

from infclip.data.config import DataConfig
from infclip.data.shards import DataError, Source, check_exist, count_samples_from, expand, folder_spec
from infclip.data.stream import BatchStream, Position, StreamSpec
from infclip.data.workers import AUTO, size_loader, this_machine

Batch = tuple[torch.Tensor, torch.Tensor]  # images uint8 (B,3,H,W), tokens int64 (B,L)


def resolve_sources(cfg: DataConfig, shards: Optional[str] = None,
                    num_samples: Optional[int] = None) -> list[Source]:
    """Expand, check and count the configured sources (``shards`` overrides the config). A
    local folder stands for the ``*.tar`` shards in it. Each source records where its sample
    count came from (the key that set it, or the files counted)."""
    if shards is not None:
        specs = [(shards, 1.0, num_samples, "given with the shards")]
    elif cfg.sources:
        specs = [(s.shards, s.weight, s.num_samples, f"data.sources[{i}].num_samples")
                 for i, s in enumerate(cfg.sources)]
    elif cfg.shards:
        # data.num_samples set: the counting files are not read
        specs = [(cfg.shards, 1.0, cfg.num_samples, "data.num_samples" if cfg.num_samples else "")]
    else:
        raise DataError("no training shards: set data.shards=/path/{00000..00099}.tar or data.sources")
    sources = []
    for spec, weight, n, key in specs:
        urls = expand(folder_spec(spec))
        check_exist(urls)
        if weight <= 0:
            raise DataError(f"source {spec!r} has weight {weight}; weights must be > 0")
        counted, origin = (n, key) if n is not None else count_samples_from(urls)
        sources.append(Source(urls, weight, counted, origin))
    return sources


def count_origin(cfg: DataConfig, sources: list[Source], num_samples: Optional[int]) -> str:
    """Where ``total_samples`` took the epoch's size from, in words."""
    if num_samples is not None:
        return "given with the shards"
    if cfg.num_samples is not None:
        return "set by data.num_samples"
    return "counted from " + " and ".join(sorted({s.counted_from for s in sources}, reverse=True))


def total_samples(cfg: DataConfig, sources: list[Source], num_samples: Optional[int]) -> int:
    """Samples per epoch: explicit argument > data.num_samples > sum of per-source counts."""
    n = num_samples if num_samples is not None else cfg.num_samples
    if n is not None:
        return n
    unknown = [s.urls[0] for s in sources if s.num_samples is None]
    if unknown:
        raise DataError(
            f"cannot count the samples of the source starting at {unknown[0]!r}: no sizes.json or "
            "*_stats.json beside its shards (or they are remote); set data.num_samples=<samples per "
            "epoch> (or data.sources[i].num_samples)")
    return sum(s.num_samples or 0 for s in sources)


def url_weights(sources: list[Source]) -> list[float]:
    """Per-shard draw weights so each source's share of *samples* follows its weight.

    With counts known, a shard of source s is drawn with probability proportional to
    weight_s / total_samples_s (then sources with big shards are not over-sampled); without
    counts, proportional to weight_s / num_shards_s (each source's share of *shards*).
    """
    known = all(s.num_samples for s in sources)
    weights = []
    for s in sources:
        denom = (s.num_samples if known else len(s.urls)) or 1
        weights += [s.weight / denom] * len(s.urls)
    return weights


@dataclass
class TrainData:
    """Infinite batches for one rank: its share of the global order (:mod:`infclip.data.stream`),
    with a resumable position and skip counters."""

    spec: StreamSpec
    transform: Callable
    tokenizer: Callable
    workers: int
    num_samples: int
    pin_memory: bool = False  # pin loader batches (only useful if they go to the GPU as they are)
    origin: str = ""  # where num_samples came from, in words ("counted from sizes.json", ...)
    wanted_workers: Optional[int] = None  # data.workers as asked (a resume on another layout refits to it)

    def __post_init__(self) -> None:
        self.position = Position(cursors=[None] * self.spec.streams)
        self._skips: Counter = Counter()
        self._iter: Any = None  # the DataLoader's iterator while batches() runs (for waiting_on)
        if self.wanted_workers is None:
            self.wanted_workers = self.workers

    @property
    def epoch_batches(self) -> int:
        """Loader batches per epoch per rank (exact when the world size divides the epoch's
        global batches, as at the run's first start)."""
        return self.spec.epoch_batches // self.spec.world_size

    @property
    def epoch(self) -> int:
        """The epoch of the next global batch."""
        return self.position.batches // self.spec.epoch_batches

    def batches(self) -> Iterator[Batch]:
        """Yield (images, tokens) forever; epochs advance by themselves. Call once per run.
        Closing the generator shuts the loader's workers down (then, not whenever the
        iterator happens to be garbage-collected: a reference held elsewhere, e.g. by a
        traceback, would keep workers that ignore SIGTERM alive until exit)."""
        it = self._iter = iter(self._loader())
        try:
            for images, tokens, info in it:
                self._advance(info)
                yield images, tokens
        finally:
            self._iter = None
            shutdown = getattr(it, "_shutdown_workers", None)  # torch's multi-worker iterator
            if shutdown is not None:
                shutdown()

    def _advance(self, info: dict) -> None:
        """One loader batch of this rank taken: each rank takes one of every ``W`` global
        batches, so once all ranks have taken it the world has consumed ``W`` more."""
        self.position.batches += self.spec.world_size
        self.position.cursors[info["lane"]] = [info["epoch"], info["batch"] + 1, info["raw"]]
        self._skips.update(info["skips"])

    def waiting_on(self) -> str:
        """Which loader worker the next batch must come from (batches arrive in order) and what
        it is reading, for a stall warning: ``loader worker 1 (pid 4242) reading /d/00017.tar``.
        Thread-safe enough for a message: it only reads the iterator's bookkeeping."""
        it = self._iter
        try:  # torch's in-order multi-worker iterator: task index -> (worker id, ...)
            worker = it._task_info[it._rcvd_idx][0]
            pid = it._workers[worker].pid
        except (AttributeError, KeyError, IndexError, TypeError):
            return "the data loader (in-process or its worker unknown)"
        return f"loader worker {worker} (pid {pid}) {reading(pid, self.spec.urls)}"

    def _loader(self) -> DataLoader:
        if self.workers:  # HF tokenizers warn (and may deadlock) when used across fork()
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        position = Position(self.position.batches, [None if c is None else list(c) for c in self.position.cursors])
        dataset = BatchStream(self.spec, self.transform, self.tokenizer, position, self.workers)
        # An explicit generator: creating the loader must not draw from the trainer's torch RNG
        # (the workers' seeds come from mix_seed, not from the loader's base seed).
        return DataLoader(dataset, batch_size=None, num_workers=self.workers,
                          pin_memory=self.pin_memory, persistent_workers=False,
                          prefetch_factor=2 if self.workers else None, worker_init_fn=ignore_stop_signals,
                          generator=torch.Generator().manual_seed(self.spec.seed))

    def skip_counts(self) -> dict[str, int]:
        """Skipped samples/shards by reason, summed over this rank's workers since the start."""
        return dict(self._skips)

    def state_dict(self) -> dict[str, Any]:
        """The resume position (valid between two ``next()`` calls on ``batches()``). Only the
        cursors of streams this rank delivered (or resumed with) are known here: a checkpoint
        holds every rank's, and :func:`merge_positions` joins them."""
        s, p = self.spec, self.position
        return {"position": p.batches, "epoch": self.epoch, "cursors": [None if c is None else list(c) for c in p.cursors],
                "streams": s.streams, "stream_world": s.stream_world, "epoch_batches": s.epoch_batches,
                "num_samples": self.num_samples, "loader_batch": s.loader_batch, "seed": s.seed,
                "resampled": s.resampled, "world_size": s.world_size, "workers": self.workers,
                "skips": dict(self._skips)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved global position (one rank's state, or :func:`merge_positions` of
        a checkpoint's): the saved order (streams, epoch length) is taken over; the worker
        count is refitted to divide this rank's streams. Raises DataError, naming the keys and
        the fix, when the order cannot continue here (other seed, mode or data, or a world
        size that does not divide the streams)."""
        state = _current_form(state, self.spec.rank)
        self._refuse_other_data(state)
        streams, world = int(state["streams"]), self.spec.world_size
        if streams % world:
            raise DataError(_world_refusal(streams, world, int(state.get("world_size") or 0)))
        self.workers = fit_workers(self.wanted_workers, streams // world)
        self.spec = replace(self.spec, streams=streams, stream_world=int(state["stream_world"]),
                            epoch_batches=int(state["epoch_batches"]))
        cursors = [None if c is None else list(c) for c in state["cursors"]]
        self.position = Position(int(state["position"]), cursors + [None] * (streams - len(cursors)))
        self._check_cursors()
        self._skips = Counter(state.get("skips", {}) if self.spec.rank == 0 else {})

    def _refuse_other_data(self, state: dict[str, Any]) -> None:
        """The saved order belongs to this seed, mode, loader batch and number of samples."""
        s = self.spec
        mine: dict[str, Any] = {"seed": s.seed, "resampled": s.resampled}
        if "num_samples" in state:
            mine.update(num_samples=self.num_samples, loader_batch=s.loader_batch)
        else:  # an earlier version's: its epoch length is what these settings made of it
            world0 = int(state["stream_world"])
            mine["epoch_batches"] = world0 * (self.num_samples // (world0 * s.loader_batch))
        diff = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if diff:
            raise DataError(
                "cannot resume the data position exactly: " + ", ".join(
                    f"{k} was {a} now {b}" for k, (a, b) in diff.items())
                + "; restore these settings (seed, data.resampled, data.num_samples, data.loader_batch, the "
                "shards), or start a new run from the checkpoint's weights (model.pretrained=<checkpoint>/model.pt, "
                "another run_dir): its data position and optimizer state start afresh")

    def _check_cursors(self) -> None:
        """Every stream this rank continues mid-epoch has its cursor (never guess a position)."""
        s, start = self.spec, self.position.batches
        epoch = start // s.epoch_batches
        for k in range(s.streams):
            n = start + s.rank + k * s.world_size
            if n // s.epoch_batches == epoch:
                self.position.start_of(s, epoch, s.locate(n)[1])

    def describe(self) -> str:
        """Where this rank's share of the global order starts, for the startup line."""
        s, n = self.spec, self.position.batches
        epoch, g = divmod(n, s.epoch_batches)
        return (f"global loader batch {n} (epoch {epoch}, {g} of {s.epoch_batches}); {s.streams} streams "
                f"(data.streams), {s.streams // s.world_size} per rank on {max(self.workers, 1)} "
                f"{'worker(s)' if self.workers else 'in-process loader'}")


def merge_positions(states: list[dict[str, Any]]) -> dict[str, Any]:
    """The global position of a checkpoint from its ranks' saved states (rank ``r``'s at index
    ``r``): each stream's newest cursor, the skips summed. Raises DataError when the ranks do not
    agree on the order or the position (rank files that do not belong together)."""
    forms = [_current_form(s, r) for r, s in enumerate(states)]
    shared = ("position", "streams", "stream_world", "epoch_batches", "seed", "resampled")
    for key in shared:
        values = {repr(f.get(key)) for f in forms}
        if len(values) > 1:
            raise DataError(f"the checkpoint's rank files disagree on the data position ({key}: {sorted(values)}); "
                            "they do not belong together. Resume from another checkpoint (resume=<its folder>)")
    cursors: list = [None] * int(forms[0]["streams"])
    for form in forms:
        for lane, c in enumerate(form["cursors"]):
            if c is not None and (cursors[lane] is None or list(c) > cursors[lane]):
                cursors[lane] = list(c)
    skips: Counter = Counter()
    for form in forms:
        skips.update(form.get("skips", {}))
    return {**forms[0], "cursors": cursors, "skips": dict(skips), "world_size": len(states)}


def order_streams(state: dict[str, Any]) -> Optional[int]:
    """The streams of a saved data position's global order (None: no position saved)."""
    if not state or "cursors" not in state:
        return None
    return int(_current_form(state, 0)["streams"])


def _current_form(state: dict[str, Any], rank: int) -> dict[str, Any]:
    """A saved data position in the global form; a per-rank one of an earlier version (cursors
    per worker of rank ``rank``) is the same order with streams = world size x workers."""
    if not state or "cursors" not in state:
        raise DataError("the checkpoint holds no data position; resume from another checkpoint "
                        "(resume=<its folder>), or start a new run from its weights (model.pretrained=<it>/model.pt)")
    if "streams" in state:
        return state
    world, workers = int(state["world_size"]), max(int(state["workers"]), 1)
    per_rank = int(state["epoch_batches"])
    cursors: list = [None] * (world * workers)
    for w, raw in enumerate(state["cursors"]):
        done = len(range(w, min(int(state["batch"]), per_rank), workers))
        if done:
            cursors[rank + world * w] = [int(state["epoch"]), done, int(raw)]
    return {**state, "position": int(state["epoch"]) * per_rank * world + int(state["batch"]) * world,
            "streams": world * workers, "stream_world": world, "epoch_batches": per_rank * world,
            "cursors": cursors}


def _world_refusal(streams: int, world: int, saved_world: int) -> str:
    fits = [d for d in range(1, streams + 1) if streams % d == 0]
    written = f" (written on {saved_world} rank(s))" if saved_world else ""
    return (f"cannot resume the data position on {world} rank(s): the run's global sample order{written} has "
            f"{streams} streams (data.streams: ranks x data.workers at the run's first start, unless set), and "
            f"each rank must take a whole number of them. Resume on {', '.join(map(str, fits))} rank(s), or start "
            "a new run from the checkpoint's weights (model.pretrained=<checkpoint>/model.pt, another run_dir). "
            "To keep more world sizes open, start runs with data.streams set to a number with many divisors "
            "(e.g. 48)")


def fit_workers(wanted: int, per_rank: int) -> int:
    """The most loader workers, at most ``wanted``, that divide a rank's ``per_rank`` streams
    (each worker then holds whole streams); 0 stays 0 (in-process loading)."""
    if wanted <= 0:
        return 0
    return max(d for d in range(1, min(wanted, per_rank) + 1) if per_rank % d == 0)


def reading(pid: int, urls: list[str]) -> str:
    """What process ``pid`` reads, from Linux's /proc: the shard files it has open, else the
    commands of its child processes (a ``pipe:`` shard's command); a phrase either way."""
    try:
        targets = {os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()}
    except OSError:
        return "(what it reads is unknown: no /proc)"
    shards = sorted(t for t in targets if t in set(urls) or t.endswith((".tar", ".tar.gz", ".tgz")))
    if shards:
        return "reading " + ", ".join(shards[:3])
    commands = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in _quiet_read(children).split():
            cmd = _quiet_read(Path(f"/proc/{child}/cmdline")).replace("\0", " ").strip()
            commands.append(f"`{cmd[:200]}` (pid {child})")
    if commands:
        return "waiting on " + ", ".join(commands[:3])
    return "with no shard file open (between shards, or blocked in decoding)"


def _quiet_read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def ignore_stop_signals(worker_id: int) -> None:
    """Slurm and torchrun signal every process of a job (cgroup / process group), and a
    terminal's Ctrl-C every process of its foreground group, so the workers get the trainer's
    SIGTERM/SIGUSR1/SIGINT too (a worker forked with the trainer's handler would also announce
    the stop a second time). By default they would die (torch re-raises
    a SIGTERM that did not come from the parent), and the trainer's SIGCHLD check would then
    abort it mid-step instead of letting it checkpoint. The trainer alone decides when to stop;
    the workers exit with it (their parent watchdog) or by SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGINT):  # SIGHUP: a closed terminal's
        signal.signal(sig, signal.SIG_IGN)


def stop_workers(timeout_s: float = 5.0) -> int:
    """SIGKILL the daemonic child processes (loader workers) still alive ``timeout_s`` after
    their loader was shut down; returns how many were killed.

    The workers ignore SIGTERM (``ignore_stop_signals``), so torch's own shutdown (a short
    join, then SIGTERM) cannot stop one that is busy, and Python's exit would then wait for
    it forever (multiprocessing joins every child at exit; the worker's parent watchdog
    never fires while the parent waits). Call it after the loader's iterator is closed."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in multiprocessing.active_children() if p.daemon]
    for p in alive:
        _quietly(p.join, max(0.0, deadline - time.monotonic()))
    killed = [p for p in alive if p.is_alive()]
    for p in killed:
        p.kill()
        _quietly(p.join, 5.0)
    return len(killed)


def _quietly(fn: Callable, *args) -> None:
    """Run ``fn``; a RuntimeError from torch's SIGCHLD handler ("DataLoader worker ... is
    killed by signal") for a worker still registered with a live loader must not stop the
    remaining kills."""
    try:
        fn(*args)
    except RuntimeError as e:
        print(f"stop_workers: {e}", flush=True)


def build_train_data(cfg: DataConfig, *, transform: Callable, tokenizer: Callable, rank: int,
                     world_size: int, seed: int, shards: Optional[str] = None,
                     num_samples: Optional[int] = None) -> TrainData:
    """Build one rank's training stream, at the start of a fresh global order.

    ``transform``: PIL.Image -> uint8 (3,H,W) (see :mod:`infclip.data.transforms`);
    ``tokenizer``: list[str] -> int64 (N, L). Streams: cfg.streams, else world_size x the
    workers per rank. Global batches per epoch: num_samples // cfg.loader_batch with
    cfg.streams, else world_size x (num_samples // (world_size * cfg.loader_batch)); partial
    batches are dropped.
    """
    sources = resolve_sources(cfg, shards, num_samples)
    total = total_samples(cfg, sources, num_samples)
    urls = [u for s in sources for u in s.urls]
    wanted = _workers(cfg.workers, world_size)
    workers = _fit_workers(cfg, urls, world_size, wanted)
    streams = cfg.streams or world_size * max(workers, 1)
    if streams % world_size:
        raise DataError(f"data.streams={streams} must be a multiple of the world size {world_size} "
                        "(each rank takes whole streams); set data.streams to a multiple of it, or null")
    workers = _fit_streams(workers, streams // world_size)
    _check_layout(cfg, sources, urls, world_size, workers, streams)
    per_rank = total // (world_size * cfg.loader_batch)
    if per_rank == 0:
        raise DataError(
            f"an epoch of {total} samples gives no full batch of data.loader_batch={cfg.loader_batch} "
            f"on each of {world_size} ranks; lower data.loader_batch or add data")
    # data.streams set: the order is a function of the data, seed and streams alone (seeds named
    # by the stream, every full loader batch in the epoch); default: the first start's layout
    # (seeds named by its (rank, worker), an epoch every rank divides): earlier versions' order
    world0 = 1 if cfg.streams else world_size
    spec = StreamSpec(urls=urls, weights=url_weights(sources), resampled=cfg.resampled, seed=seed,
                      rank=rank, world_size=world_size, loader_batch=cfg.loader_batch,
                      epoch_batches=world0 * (total // (world0 * cfg.loader_batch)),
                      shuffle_buffer=cfg.shuffle_buffer, caption_key=cfg.caption_key,
                      json_caption_key=cfg.json_caption_key, streams=streams, stream_world=world0)
    # No pinning here: the trainer copies loader batches into its own (pinned) step buffer.
    data = TrainData(spec, transform, tokenizer, workers, total, pin_memory=False, wanted_workers=wanted)
    data.origin = count_origin(cfg, sources, num_samples)
    return data



def _workers(workers: Any, world_size: int) -> int:
    """data.workers as a number ("auto" sized for loader workers that decode; the trainer
    resolves it itself, knowing where images are decoded)."""
    if workers != AUTO:
        return max(int(workers), 0)
    return size_loader(this_machine(world_size), "cpu").workers


def _fit_workers(cfg: DataConfig, urls: list[str], world_size: int, workers: int) -> int:
    """Epoch mode reads each shard in one worker: with fewer shards than world x workers, use
    as many workers per rank as there are shards for each (saying so), not refuse the run."""
    if cfg.streams or cfg.resampled or workers <= 1 or len(urls) >= world_size * workers:
        return workers
    fit = max(1, len(urls) // world_size)
    print(f"data: {len(urls)} shard(s) for {world_size} rank(s) x data.workers={workers} in epoch mode: "
          f"using {fit} worker(s) per rank (more, smaller shards or data.resampled=true use them all)", flush=True)
    return fit


def _fit_streams(workers: int, per_rank: int) -> int:
    """data.streams set: the workers refitted to divide a rank's streams, saying so."""
    fit = fit_workers(workers, per_rank)
    if fit != workers:
        print(f"data: {per_rank} stream(s) per rank (data.streams): using {fit} loader worker(s) per rank, "
              f"not {workers} (each worker holds whole streams: their number divides the streams per rank)",
              flush=True)
    return fit


def _check_layout(cfg: DataConfig, sources: list[Source], urls: list[str], world_size: int,
                  workers: int, streams: int) -> None:
    if cfg.resampled:
        return
    if len({s.weight for s in sources}) > 1:
        raise DataError("data.sources with different weights need data.resampled=true "
                        "(epoch mode reads every shard once per epoch)")
    if len(urls) >= streams:
        return
    if cfg.streams:
        raise DataError(f"epoch mode reads each shard in one stream: data.streams={streams} needs at least "
                        f"{streams} shards, but there are {len(urls)}; lower data.streams, use more (smaller) "
                        "shards, or set data.resampled=true")
    raise DataError(
        f"epoch mode needs at least world_size x data.workers = {world_size} x {max(workers, 1)} "
        f"= {streams} shards, but there are {len(urls)}; lower data.workers, use more (smaller) "
        "shards, or set data.resampled=true")
