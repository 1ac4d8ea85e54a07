"""The step engine: one optimizer step's gradients at any global batch (gradient cache).

One step on each rank, with b/W local samples split into K micro-batches:

1. **Cache pass** (no grad): encode each micro-batch, keep its normalized embeddings
   (fp32 or bf16) and the RNG state (CPU + CUDA) it was encoded under. Locked LiT towers
   are run here once (their embeddings or trunk features are cached, see ``lit``).
2. **Loss**: one call of the loss on all local embeddings (the ring spans the ranks) gives
   d loss / d embeddings and d loss / d logit_scale, scaled by the GradScaler if any.
   On a timed step with several ranks, one all-reduce of one element first: the time this
   rank waits there for the slowest rank's cache pass is the ``rank_wait`` lap, so the
   ``loss`` lap holds the loss alone (without it the ring's first hop would wait instead).
3. **Replay** (with grad): re-encode each micro-batch under its recorded RNG state (dropout,
   drop-path, patch dropout replay bit for bit) and back-propagate its cached embedding
   gradients. ``no_sync`` on all but the last micro-batch, so DDP all-reduces once. The
   logit scale (and the SigLIP logit bias, the only parameters outside the towers) gets
   its gradient exactly once: its cached gradient is back-propagated through the last
   replay's own ``logit_scale.exp()`` (``logit_bias``) output, inside the DDP-synchronized
   backward.

BatchNorm (e.g. open_clip's ResNet towers, timm CNNs): in training mode BN normalizes with
the micro-batch's own statistics, identical in both passes, so the replay reproduces the
cache pass exactly; its running statistics are restored after each cache-pass encode, so
they are updated once per micro-batch (by the replay), as in a plain step per micro-batch.
Statistics are per micro-batch (not per global batch), as in any gradient cache.

The loss is called as ``loss_fn(img, txt, logit_scale.exp())``, or with ``logit_bias`` as a
fourth argument when the model has one (SigLIP). With ``loss.duplicates`` on, each pass-1
micro-batch's captions (and images, ``loss.duplicate_key=caption+image``) are hashed into
group ids (``infclip.data.dedup``; content hashes, so they are global across ranks with no
communication), passed as ``group_ids=``; the step's ``duplicate_pairs`` (unordered pairs
of the global batch with one id: one all-gather of b int64 across ranks) go to the metrics.

GPU memory: inputs (b/W samples, or 2 micro-batches with offload; see ``offload``)
+ embeddings and their gradients, O(b/W c) + max(loss working set, one micro-batch's
encoder activations). It does not otherwise grow with the global batch.

With one micro-batch and ``memory.grad_cache`` "auto"/"off" the step is ordinary training:
one forward with grad, the loss, one backward.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from infclip.config import ConfigError, micro_size
from infclip.loss.ring import global_mean_loss
from infclip.train.lit import LockPlan, lock_plan
from infclip.train.profiling import mark_phase_end
from infclip.train.offload import InputStager
from infclip.train.pipeline import RowsReleased, TensorFeed

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepOutput:
    loss: Tensor  # detached local loss (this rank's rows)
    global_loss: Tensor  # detached mean of the local losses over ranks (for logging)
    timings: dict[str, float] = field(default_factory=dict)  # seconds: cache_pass, [rank_wait,] loss, replay
    metrics: dict[str, float | Tensor] = field(default_factory=dict)  # e.g. duplicate_pairs (0-d, loss.duplicates on)


@dataclass(frozen=True)
class EngineSettings:
    """Run-time facts derived once from the config (see ``build_engine``)."""

    local: int  # samples per rank per step (global_size / world)
    micro: int  # samples per encoder pass
    grad_cache: bool  # two-pass gradient cache (else: plain forward/backward, micro == local)
    cache_dtype: torch.dtype  # cached embeddings and their gradients
    offload: bool  # stream micro-batches from pinned host memory
    amp: Optional[torch.dtype]  # autocast dtype for the encoders (None: fp32)
    input_dtype: torch.dtype = torch.float32  # normalized images handed to the towers (pure_bf16: bf16)
    duplicates: str = "off"  # loss.duplicates: "off" computes no group ids at all
    duplicate_key: str = "caption"  # loss.duplicate_key: "caption" | "caption+image"
    decode_ahead_early: bool = False  # data.decode_ahead_from == "first_pass" (see _ahead_early)

    @property
    def num_micro(self) -> int:
        return self.local // self.micro


def build_engine(cfg: Any, model: nn.Module, *, device, normalizer: Callable[[Tensor], Tensor],
                 loss_fn: Callable[[Tensor, Tensor, Tensor], Tensor], scaler=None, group=None,
                 world_size: int = 1) -> "StepEngine":
    """The step engine for ``cfg`` (a ``TrainConfig``); call after ``lit.apply_locks``."""
    local = cfg.batch.global_size // world_size
    micro = micro_size(cfg, world_size)
    mode = cfg.memory.grad_cache
    if mode == "off" and micro != local:
        raise ConfigError(
            f"memory.grad_cache=off needs batch.micro_size == per-rank batch ({local}), got {micro}: "
            "plain accumulation would change the contrastive loss; use memory.grad_cache=auto"
        )
    settings = EngineSettings(
        local=local, micro=micro, grad_cache=mode == "on" or (mode == "auto" and micro < local),
        cache_dtype=_DTYPES[cfg.memory.cache_dtype], offload=cfg.memory.offload,
        amp=None if cfg.precision.amp in ("fp32", "pure_bf16") else _DTYPES[cfg.precision.amp],
        # pure_bf16: the weights are bf16 (build.py) and no autocast casts the images for them
        input_dtype=torch.bfloat16 if cfg.precision.amp == "pure_bf16" else torch.float32,
        duplicates=cfg.loss.duplicates, duplicate_key=cfg.loss.duplicate_key,
        decode_ahead_early=cfg.data.decode_ahead_from == "first_pass",
    )
    plan = lock_plan(unwrap(model), cfg.model)
    return StepEngine(model, settings, device=device, normalizer=normalizer, loss_fn=loss_fn,
                      scaler=scaler, group=group, world_size=world_size, plan=plan)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


@dataclass
class _Micro:
    """One micro-batch's tower inputs after the locked trunks ran (pass 1)."""

    img_in: Optional[Tensor]  # tower input: normalized images, trunk features, or None (frozen)
    txt_in: Optional[Tensor]
    img_emb: Optional[Tensor] = None  # frozen tower: its cached embedding
    txt_emb: Optional[Tensor] = None


class StepEngine:
    """Computes one optimizer step's gradients (see the module docs)."""

    def __init__(self, model: nn.Module, settings: EngineSettings, *, device, normalizer, loss_fn,
                 scaler=None, group=None, world_size: int = 1, plan: Optional[LockPlan] = None):
        self.model, self.core = model, unwrap(model)
        self.s = settings
        self.device = torch.device(device)
        self.normalizer, self.loss_fn, self.scaler = normalizer, loss_fn, scaler
        self.group, self.world_size = group, world_size
        self.plan = plan or LockPlan()
        # A normalizer that decodes JPEG rows itself (data.decode=device) reads them from host memory.
        host = ("images",) if getattr(normalizer, "reads_host", False) else ()
        self.stager = InputStager(self.device, settings.offload, host_fields=host, host_reader=normalizer)
        self.measure_timings = True  # synchronize CUDA at phase boundaries to time them
        self.next_feed: Optional[Callable[[], Any]] = None  # the pipeline's next feed (decode ahead)
        self.on_micro: Optional[Callable[[str, int, int], None]] = None  # (phase, done, total) after each micro-batch
        self._ahead_queued = False  # this step's images were handed to the decode-ahead last step
        self.measure_memory = False  # CUDA: peak bytes per phase into last_phase_peaks (resets peak stats)
        self.last_phase_peaks: dict[str, int] = {}
        self._ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        self._step_metrics: dict[str, float | Tensor] = {}  # this step's extra metrics (duplicate_pairs: 0-d)
        self._norms = [m for m in self.core.modules()
                       if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
        self._cached_rows = _SteadyRows()  # the loss's embedding inputs, at one address step after step

    # ------------------------------------------------------------------------- step
    def step(self, images: Tensor, tokens: Tensor) -> StepOutput:
        """Gradients of one step into ``.grad`` (see module docs); images uint8 (b/W,3,H,W)."""
        if images.shape[0] != self.s.local or tokens.shape[0] != self.s.local:
            raise ValueError(
                f"engine.step expects the per-rank batch of {self.s.local} samples, got images "
                f"{tuple(images.shape)} and tokens {tuple(tokens.shape)}"
            )
        return self.step_feed(TensorFeed({"images": images, "tokens": tokens}))

    def streamable_inputs(self) -> tuple[str, ...]:
        """Inputs read by the cache pass only (pass 2 does not re-run their tower): with the
        gradient cache and offload they can stream through the step pipeline's ring."""
        if not (self.s.grad_cache and self.s.offload):
            return ()
        return tuple(n for n in ("images", "tokens") if n not in self._replayed_inputs())

    def _replayed_inputs(self) -> set[str]:
        """The inputs pass 2 re-reads (those of the towers it re-runs from raw input)."""
        return set(self._schedule()[self.s.num_micro][1]) if self.s.num_micro else set()

    def step_feed(self, inputs) -> StepOutput:
        """As :meth:`step`, reading the per-rank rows from a feed (see ``pipeline``) as they arrive."""
        self._step_metrics: dict[str, float] = {}
        if self.s.grad_cache:
            loss, timings = self._cached_step(inputs)
        else:
            loss, timings = self._plain_step(inputs)
        return StepOutput(loss.detach(), self._global_mean(loss.detach()), timings, self._step_metrics)

    def _plain_step(self, inputs: dict) -> tuple[Tensor, dict]:
        """Ordinary training: one forward with grad on the whole local batch, one backward."""
        clock = self._clock()
        batches = self.stager.stream(inputs, self.s.local, [(0, ("images", "tokens"))])
        batch = next(batches)
        ids = self._group_ids(batch)
        m = self._prepare(batch)
        img, txt, extras = self._encode(self.model, m)
        clock.lap("cache_pass")
        img, txt = _same_dtype(img, txt)
        keep = self._kept_rows([self._dropped()], img.shape[0])
        if keep is not None:
            img, txt = img[keep], txt[keep]
        loss = self.loss_fn(img, txt, *extras, **self._duplicates(ids, keep))
        clock.lap("loss")
        self._scaled(loss).backward()
        _drain(batches)  # the stager marks the input buffers free only after the backward
        clock.lap("replay")
        return loss, clock.laps

    def _cached_step(self, inputs: dict) -> tuple[Tensor, dict]:
        clock = self._clock()
        k_n = self.s.num_micro
        batches = self.stager.stream(inputs, self.s.micro, self._schedule())
        micros, rngs, img_c, txt_c, dropped, ids = [], [], [], [], [], []
        early, self._ahead_queued = self._ahead_early(), False
        for k in range(k_n):  # pass 1: cache embeddings + RNG states, no graph
            if early and not self._ahead_queued:
                self._ahead_queued = self._decode_next_step_ahead()
            with torch.no_grad():
                batch = next(batches)
                ids.append(self._group_ids(batch))
                m = self._prepare(batch)
                dropped.append(self._dropped())
                rngs.append(_rng_state(self.device))
                with _running_stats_kept(self._norms):  # the replay updates them, once
                    img, txt, _ = self._encode(self.core, m)
            micros.append(self._keep_for_replay(m))
            img_c.append(_cache(img, m.img_emb, self.s.cache_dtype))
            txt_c.append(_cache(txt, m.txt_emb, self.s.cache_dtype))
            self._done_micro("cache pass", k, k_n)
        clock.lap("cache_pass")
        mark = getattr(self.normalizer, "mark_first_pass_end", None)  # a decoding normalizer's busy share
        if mark is not None:
            mark()
        if self.measure_timings and self._ranked():
            self._wait_for_ranks()
            clock.lap("rank_wait")
        keep = self._kept_rows(dropped, self.s.local)
        ids = None if ids[0] is None else torch.cat(ids)
        img_all, txt_all = self._cached_rows.concat("img", img_c), self._cached_rows.concat("txt", txt_c)
        loss, g_img, g_txt, g_extras = self._loss_grads(img_all, txt_all, keep, ids)
        del img_c, txt_c, img_all, txt_all
        clock.lap("loss")
        if not self._ahead_queued:
            self._ahead_queued = self._decode_next_step_ahead()
        for k in range(k_n):  # pass 2: replay with grad, back-propagate the cached gradients
            self._replay(k, next(batches), micros[k], rngs[k], g_img, g_txt, g_extras)
            micros[k] = None  # release cached trunk features as we go
            self._done_micro("replay", k, k_n)
        _drain(batches)
        clock.lap("replay")
        return loss, clock.laps

    # ------------------------------------------------------------------------- pieces
    def _done_micro(self, phase: str, k: int, k_n: int) -> None:
        if self.on_micro is not None:
            self.on_micro(phase, k + 1, k_n)

    def _schedule(self) -> list:
        """Which inputs each stage needs: pass 1 all; pass 2 only the towers re-run from raw input."""
        again = [n for n, t in (("images", self.plan.image), ("tokens", self.plan.text)) if t.mode == "train"]
        k_n = self.s.num_micro
        return [(k, ("images", "tokens")) for k in range(k_n)] + [(k, tuple(again)) for k in range(k_n)]

    def _prepare(self, batch: dict) -> _Micro:
        """Normalize images; run locked trunks / frozen towers once (no grad, eval mode)."""
        with torch.no_grad(), self._autocast():
            m = _Micro(self._images(batch), batch["tokens"])
            for side, tower in (("img", self.plan.image), ("txt", self.plan.text)):
                x = getattr(m, f"{side}_in")
                if tower.mode == "frozen":
                    enc = self.core.encode_image if side == "img" else self.core.encode_text
                    setattr(m, f"{side}_emb", enc(x, normalize=True))
                    setattr(m, f"{side}_in", None)
                elif tower.mode == "split":
                    setattr(m, f"{side}_in", tower.trunk(x))
        return m

    def _keep_for_replay(self, m: _Micro) -> _Micro:
        """Drop raw inputs of towers that pass 2 re-stages (only trunk features stay cached)."""
        if self.plan.image.mode == "train":
            m.img_in = None  # normalized float images: never held beyond their micro-batch
        if self.plan.text.mode == "train":
            m.txt_in = None
        return m

    def _encode(self, net: nn.Module, m: _Micro) -> tuple[Optional[Tensor], Optional[Tensor], list]:
        """The model's own forward (through DDP when ``net`` is the wrapper) on the tower inputs.

        Returns (image emb, text emb, [logit_scale.exp()] or [logit_scale.exp(), logit_bias]).
        """
        with self._autocast(), self.plan.head_only():
            out = net(image=m.img_in, text=m.txt_in)
        if isinstance(out, dict):
            img, txt = out["image_features"], out["text_features"]
            extras = [out["logit_scale"]] + ([out["logit_bias"]] if "logit_bias" in out else [])
        else:
            img, txt, extras = out[0], out[1], list(out[2:])
        return (m.img_emb if img is None else img), (m.txt_emb if txt is None else txt), extras

    def _ahead_early(self) -> bool:
        """Whether this step's first pass may already hand the next step's images to the
        decode-ahead (``data.decode_ahead_from=first_pass``): only where the replay re-reads no
        images (a locked image tower) and this step's own images were handed to it during the
        last step. The decode-ahead thread takes its work in order, so the next step's images
        decode after this step's queued ones. Where the first pass still decodes some of its
        own (a keep budget smaller than the step, or a micro-batch it claimed before the
        decode-ahead reached it), those and the next step's share the decoder. (In a first
        step, or after a step whose pipeline had no next feed, the first pass decodes its
        images itself, and the decode-ahead starts after the loss as for trained image
        towers.)"""
        if not (self.s.decode_ahead_early and self._ahead_queued):
            return False
        return self.s.num_micro > 0 and "images" not in self._replayed_inputs()

    def _decode_next_step_ahead(self) -> bool:
        """Let a decoding normalizer start on the next step's images (``next_feed``, set by
        the loop, returns the feed the pipeline fills next, or None). Returns whether it did
        (False: no decoding normalizer, no next feed yet, no host image rows, or a normalizer
        that queued nothing: ``decode_ahead`` returned False, e.g. no keep budget)."""
        ahead = getattr(self.normalizer, "decode_ahead", None)
        nxt = self.next_feed() if (ahead is not None and self.next_feed is not None) else None
        if nxt is None or "images" not in self.stager.host_fields:
            return False
        micro = self.s.micro

        def fetch(k: int):
            try:
                return nxt.rows("images", k * micro, (k + 1) * micro, count_wait=False)
            except RowsReleased:  # the next step already read them itself (a streamed ring)
                return None

        return bool(ahead([lambda k=k: fetch(k) for k in range(self.s.num_micro)]))

    def _dropped(self) -> Optional[Tensor]:
        """bool (micro,) of the samples the normalizer could not decode (device JPEG decode), or None."""
        return getattr(self.normalizer, "last_dropped", None)

    def _kept_rows(self, dropped: list, rows: int) -> Optional[Tensor]:
        """Indices of the local rows the loss sees, or None for all of them.

        Samples the device decoder dropped are left out (their embeddings get zero gradient).
        With several ranks the loss needs equal local sizes, so every rank leaves out as many
        rows as the rank that dropped most (its last kept ones): one all-reduce of a scalar per
        step, made only when the normalizer can drop at all (then on every rank, every step).
        """
        if not getattr(self.normalizer, "reads_host", False):
            return None
        mask = torch.zeros(rows, dtype=torch.bool)
        micro = rows // max(len(dropped), 1)
        for k, d in enumerate(dropped):
            if d is not None:
                mask[k * micro:k * micro + d.numel()] |= d.cpu()
        n_drop = int(mask.sum())
        if self._ranked():
            import torch.distributed as dist

            most = torch.tensor([n_drop], dtype=torch.int64, device=self.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
            extra = int(most.item()) - n_drop
            if extra:
                mask[(~mask).nonzero().flatten()[-extra:]] = True
        if not mask.any():
            return None
        return (~mask).nonzero().flatten().to(self.device)

    def _group_ids(self, batch: dict) -> Optional[Tensor]:
        """(micro,) int64 duplicate group ids of a micro-batch (``infclip.data.dedup``), or None
        when loss.duplicates is off (then nothing is hashed)."""
        if self.s.duplicates == "off":
            return None
        from infclip.data.dedup import group_ids

        images = batch["images"] if self.s.duplicate_key == "caption+image" else None
        return group_ids(batch["tokens"], images).to(self.device)

    def _duplicates(self, ids: Optional[Tensor], keep: Optional[Tensor]) -> dict:
        """The loss's ``group_ids`` keyword for the rows it sees ({} when off); records the
        global batch's ``duplicate_pairs`` in this step's metrics."""
        if ids is None:
            return {}
        from infclip.loss.duplicates import duplicate_pairs_device

        ids = ids if keep is None else ids[keep]
        every = ids
        if self._ranked():  # the count is over the global batch
            import torch.distributed as dist

            parts = [torch.empty_like(ids) for _ in range(self.world_size)]
            dist.all_gather(parts, ids, group=self.group)
            every = torch.cat(parts)
        # A 0-d device tensor: no host sync before the loss's kernels are queued (the loop
        # reads it with the step's other metrics).
        self._step_metrics["duplicate_pairs"] = duplicate_pairs_device(every)
        return {"group_ids": ids}

    def _loss_grads(self, img: Tensor, txt: Tensor, keep: Optional[Tensor] = None, ids: Optional[Tensor] = None):
        """One loss call on all local embeddings -> (loss, d img, d txt, [d extras]), scaled.
        ``keep``: indices of the rows the loss sees (the others get zero gradients); ``ids``:
        the local rows' duplicate group ids (None: loss.duplicates off)."""
        img.requires_grad_(self.plan.image.mode != "frozen")
        txt.requires_grad_(self.plan.text.mode != "frozen")
        # The loss sees s = exp(logit_scale) (and the bias) as leaves; their gradients are
        # pushed through the last replay's own outputs, so logit_scale.grad = dL/ds * s.
        extras = [self.core.logit_scale.detach().exp().reshape(())]
        if getattr(self.core, "logit_bias", None) is not None:
            extras.append(self.core.logit_bias.detach().reshape(()))
        for leaf, param in zip(extras, (self.core.logit_scale, getattr(self.core, "logit_bias", None))):
            leaf.requires_grad_(param.requires_grad)
        seen = (img, txt) if keep is None else (img[keep], txt[keep])
        loss = self.loss_fn(*seen, *extras, **self._duplicates(ids, keep))
        wrt = [t for t in (img, txt, *extras) if t.requires_grad]
        grads = iter(torch.autograd.grad(self._scaled(loss), wrt) if wrt else ())
        g_img, g_txt, *g_extras = (next(grads) if t.requires_grad else None for t in (img, txt, *extras))
        return loss, g_img, g_txt, g_extras

    def _replay(self, k: int, batch: dict, m: _Micro, rng, g_img, g_txt, g_extras) -> None:
        """Re-encode micro-batch ``k`` under its pass-1 RNG state and back-propagate."""
        if self.plan.image.mode == "train":
            m.img_in = self._images(batch)
        if self.plan.text.mode == "train":
            m.txt_in = batch["tokens"]
        last = k == self.s.num_micro - 1
        # Only the last micro-batch's backward all-reduces (DDP buckets fire once per step).
        sync = nullcontext() if (last or not self._ddp) else self.model.no_sync()
        rows = slice(k * self.s.micro, (k + 1) * self.s.micro)
        with sync, _replayed_rng(self.device, rng):
            img, txt, extras = self._encode(self.model, m)
            outs, grads = [], []
            for emb, g, fresh in ((img, g_img, m.img_emb is None), (txt, g_txt, m.txt_emb is None)):
                if g is not None and fresh:
                    outs.append(emb)
                    grads.append(g[rows].to(emb.dtype))
            for out, g in zip(extras, g_extras):
                if last and g is not None:  # once per step, inside the synchronized backward
                    outs.append(out)
                    grads.append(g.reshape(out.shape).to(out.dtype))
            if outs:
                torch.autograd.backward(outs, grads)

    def _clock(self) -> "_Clock":
        self.last_phase_peaks = {}
        return _Clock(self.device, self.measure_timings, self.last_phase_peaks if self.measure_memory else None,
                      on_lap=getattr(self.normalizer, "mark_phase", None))

    def _scaled(self, loss: Tensor) -> Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def _images(self, batch: dict) -> Tensor:
        """The micro-batch's uint8 images, normalized, in the towers' input dtype."""
        return self.normalizer(batch["images"]).to(self.s.input_dtype)

    def _autocast(self):
        if self.s.amp is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.s.amp)

    def _ranked(self) -> bool:
        """Whether the step spans several ranks (collectives over ``group``)."""
        return self.group is not None and self.world_size > 1

    def _wait_for_ranks(self) -> None:
        """One all-reduce of one element over the group: returns (its device work done at the
        clock's next sync) once every rank has reached it. Every rank calls it on the same
        steps (``measure_timings`` follows the step number and the config alone)."""
        import torch.distributed as dist

        dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)

    def _global_mean(self, loss: Tensor) -> Tensor:
        if not self._ranked():
            return loss
        return global_mean_loss(loss, self.group)  # one all-reduce of a scalar


# ----------------------------------------------------------------------------- helpers


def _drain(it) -> None:
    for _ in it:
        raise RuntimeError("input stager yielded more micro-batches than the step consumed")


class _SteadyRows:
    """The cached embeddings concatenated for the loss, into the same buffer every step where
    the step is small: the one-GPU loss replays CUDA graphs only for inputs at the addresses it
    captured (``infclip.kernels.clip.graphs``), and at b <= ``STEADY_ROWS`` the host's launches,
    not the GPU, bound its call. A buffer is kept per name (at most 2 x 16k x c x 2 bytes, 64 MB
    at c = 1024) and replaced when the shape, dtype or device changes; larger steps concatenate
    into fresh memory that is freed after the loss, as before (no extra memory at 1M rows).

    Each call returns a detached alias of the buffer (a new leaf, the same storage): the
    previous step's alias and its autograd graph are gone by then (the engine drops them
    before the replay ends), so nothing still reads what is overwritten."""

    STEADY_ROWS = 16384

    def __init__(self):
        self._bufs: dict[str, Tensor] = {}

    def concat(self, name: str, parts: list[Tensor]) -> Tensor:
        rows = sum(p.shape[0] for p in parts)
        if rows > self.STEADY_ROWS:
            self._bufs.pop(name, None)
            return torch.cat(parts)
        shape, first = (rows, *parts[0].shape[1:]), parts[0]
        buf = self._bufs.get(name)
        if buf is None or buf.shape != shape or buf.dtype != first.dtype or buf.device != first.device:
            buf = self._bufs[name] = torch.empty(shape, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            torch.cat(parts, out=buf)
        return buf.detach()


def _cache(emb: Optional[Tensor], frozen: Optional[Tensor], dtype: torch.dtype) -> Tensor:
    return (frozen if emb is None else emb).detach().to(dtype)


def _same_dtype(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    if a.dtype == b.dtype:
        return a, b
    dt = torch.promote_types(a.dtype, b.dtype)
    return a.to(dt), b.to(dt)


def _rng_state(device: torch.device) -> tuple[Tensor, Optional[Tensor]]:
    """CPU and (on CUDA) this device's generator state; patch dropout draws on the CPU one."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextmanager
def _running_stats_kept(norms: list):
    """Restore the BatchNorm running statistics (mean, var, batch count) on exit."""
    saved = [[b.clone() for b in m.buffers(recurse=False)] for m in norms]
    try:
        yield
    finally:
        for m, bufs in zip(norms, saved):
            for b, old in zip(m.buffers(recurse=False), bufs):
                b.copy_(old)


@contextmanager
def _replayed_rng(device: torch.device, state):
    """Run under a recorded RNG state; the ambient state is restored afterwards."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


class _Clock:
    """Phase timer; synchronizes CUDA at each lap only when ``sync`` (measuring). With a
    ``peaks`` dict (CUDA), also records each phase's peak allocated bytes; ``on_lap(name,
    time)`` hears each phase's end (a decoding normalizer's trace)."""

    def __init__(self, device: torch.device, sync: bool, peaks: Optional[dict] = None,
                 on_lap: Optional[Callable[[str, float], None]] = None):
        self.on_lap = on_lap
        self.peaks = peaks if device.type == "cuda" else None
        self.sync = (sync or self.peaks is not None) and device.type == "cuda"
        self.device = device
        self.laps: dict[str, float] = {}
        if self.peaks is not None:
            torch.cuda.reset_peak_memory_stats(device)
        self._t = self._now()

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self, name: str) -> None:
        t = self._now()
        mark_phase_end(name)  # a profiled step's summary splits the step here
        if self.on_lap is not None:  # a decoding normalizer's trace splits the step here too
            self.on_lap(name, t)
        self.laps[name] = t - self._t
        if self.peaks is not None:
            self.peaks[name] = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._t = t
