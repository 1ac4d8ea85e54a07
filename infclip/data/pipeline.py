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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader

from infclip.data.config import DataConfig
from infclip.data.shards import DataError, Source, check_exist, count_samples, expand
from infclip.data.stream import BatchStream, EpochPlan, StreamSpec

Batch = tuple[torch.Tensor, torch.Tensor]  # images uint8 (B,3,H,W), tokens int64 (B,L)


def resolve_sources(cfg: DataConfig, shards: Optional[str] = None,
                    num_samples: Optional[int] = None) -> list[Source]:
    """Expand, check and count the configured sources (``shards`` overrides the config)."""
    if shards is not None:
        specs = [(shards, 1.0, num_samples)]
    elif cfg.sources:
        specs = [(s.shards, s.weight, s.num_samples) for s in cfg.sources]
    elif cfg.shards:
        specs = [(cfg.shards, 1.0, cfg.num_samples)]  # data.num_samples set: the counting files are not read
    else:
        raise DataError("no training shards: set data.shards=/path/{00000..00099}.tar or data.sources")
    sources = []
    for spec, weight, n in specs:
        urls = expand(spec)
        check_exist(urls)
        if weight <= 0:
            raise DataError(f"source {spec!r} has weight {weight}; weights must be > 0")
        sources.append(Source(urls, weight, n if n is not None else count_samples(urls)))
    return sources


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
    """Infinite batches for one rank with a resumable position and skip counters."""

    spec: StreamSpec
    transform: Callable
    tokenizer: Callable
    workers: int
    num_samples: int
    pin_memory: bool = False  # pin loader batches (only useful if they go to the GPU as they are)

    def __post_init__(self) -> None:
        self.plan = EpochPlan(cursors=[0] * max(self.workers, 1))
        self._skips: Counter = Counter()
        self._iter: Any = None  # the DataLoader's iterator while batches() runs (for waiting_on)

    @property
    def epoch_batches(self) -> int:
        """Batches per epoch per rank (the same on every rank)."""
        return self.spec.epoch_batches

    def batches(self) -> Iterator[Batch]:
        """Yield (images, tokens) forever; epochs advance by themselves. Call once per run.
        Closing the generator shuts the loader's workers down (then, not whenever the
        iterator happens to be garbage-collected: a reference held elsewhere, e.g. by a
        traceback, would keep workers that ignore SIGTERM alive until exit)."""
        it = self._iter = iter(self._loader())
        try:
            for images, tokens, info in it:
                if info["epoch"] != self.plan.epoch:  # the first batch of the next epoch
                    self.plan = EpochPlan(epoch=info["epoch"], cursors=[0] * max(self.workers, 1))
                self.plan.batch += 1
                self.plan.cursors[info["worker"]] = info["raw"]
                self._skips.update(info["skips"])
                yield images, tokens
        finally:
            self._iter = None
            shutdown = getattr(it, "_shutdown_workers", None)  # torch's multi-worker iterator
            if shutdown is not None:
                shutdown()

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
        plan = EpochPlan(self.plan.epoch, self.plan.batch, list(self.plan.cursors))
        dataset = BatchStream(self.spec, self.transform, self.tokenizer, plan, self.workers)
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
        """The resume position (valid between two ``next()`` calls on ``batches()``)."""
        s = self.spec
        return {"epoch": self.plan.epoch, "batch": self.plan.batch, "cursors": list(self.plan.cursors),
                "workers": self.workers, "world_size": s.world_size, "seed": s.seed,
                "resampled": s.resampled, "epoch_batches": s.epoch_batches,
                "skips": dict(self._skips)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position; the layout (workers, world size, seed, mode) must match."""
        s = self.spec
        mine = {"workers": self.workers, "world_size": s.world_size, "seed": s.seed,
                "resampled": s.resampled, "epoch_batches": s.epoch_batches}
        diff = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if diff:
            raise DataError(
                "cannot resume the data position exactly: " + ", ".join(
                    f"{k} was {a} now {b}" for k, (a, b) in diff.items())
                + "; restore these settings (data.workers, world size, seed, data.resampled, "
                "data.num_samples, data.loader_batch), or start a new run from the checkpoint's weights "
                "(model.pretrained=<checkpoint>/model.pt, another run_dir): its data position and "
                "optimizer state start afresh")
        self.plan = EpochPlan(state["epoch"], state["batch"], list(state["cursors"]))
        self._skips = Counter(state.get("skips", {}))


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
    """Slurm and torchrun signal every process of a job (cgroup / process group), so the
    workers get the trainer's SIGTERM/SIGUSR1 too. By default they would die (torch re-raises
    a SIGTERM that did not come from the parent), and the trainer's SIGCHLD check would then
    abort it mid-step instead of letting it checkpoint. The trainer alone decides when to stop;
    the workers exit with it (their parent watchdog) or by SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):  # SIGHUP: a closed terminal's
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
    """Build one rank's training stream.

    ``transform``: PIL.Image -> uint8 (3,H,W) (see :mod:`infclip.data.transforms`);
    ``tokenizer``: list[str] -> int64 (N, L). Batches per epoch per rank =
    num_samples // (world_size * cfg.loader_batch); partial batches are dropped.
    """
    sources = resolve_sources(cfg, shards, num_samples)
    total = total_samples(cfg, sources, num_samples)
    urls = [u for s in sources for u in s.urls]
    workers = _fit_workers(cfg, urls, world_size, max(cfg.workers, 0))
    _check_layout(cfg, sources, urls, world_size, workers)
    epoch_batches = total // (world_size * cfg.loader_batch)
    if epoch_batches == 0:
        raise DataError(
            f"an epoch of {total} samples gives no full batch of data.loader_batch={cfg.loader_batch} "
            f"on each of {world_size} ranks; lower data.loader_batch or add data")
    spec = StreamSpec(urls=urls, weights=url_weights(sources), resampled=cfg.resampled, seed=seed,
                      rank=rank, world_size=world_size, loader_batch=cfg.loader_batch,
                      epoch_batches=epoch_batches, shuffle_buffer=cfg.shuffle_buffer,
                      caption_key=cfg.caption_key, json_caption_key=cfg.json_caption_key)
    # No pinning here: the trainer copies loader batches into its own (pinned) step buffer.
    return TrainData(spec, transform, tokenizer, workers, total, pin_memory=False)


def _fit_workers(cfg: DataConfig, urls: list[str], world_size: int, workers: int) -> int:
    """Epoch mode reads each shard in one worker: with fewer shards than world x workers, use
    as many workers per rank as there are shards for each (saying so), not refuse the run."""
    if cfg.resampled or workers <= 1 or len(urls) >= world_size * workers:
        return workers
    fit = max(1, len(urls) // world_size)
    print(f"data: {len(urls)} shard(s) for {world_size} rank(s) x data.workers={workers} in epoch mode: "
          f"using {fit} worker(s) per rank (more, smaller shards or data.resampled=true use them all)", flush=True)
    return fit


def _check_layout(cfg: DataConfig, sources: list[Source], urls: list[str], world_size: int,
                  workers: int) -> None:
    if cfg.resampled:
        return
    if len({s.weight for s in sources}) > 1:
        raise DataError("data.sources with different weights need data.resampled=true "
                        "(epoch mode reads every shard once per epoch)")
    slots = world_size * max(workers, 1)
    if len(urls) < slots:
        raise DataError(
            f"epoch mode needs at least world_size x data.workers = {world_size} x {max(workers, 1)} "
            f"= {slots} shards, but there are {len(urls)}; lower data.workers, use more (smaller) "
            "shards, or set data.resampled=true")
