"""Encoding images and texts on one rank's shard, and the collectives that reassemble them.

Sharding is strided: rank r of W owns global indices r, r+W, r+2W, ... of a dataset, so the
shards differ in size by at most one and the global order is recovered without exchanging
indices. With a gloo group tensors travel on the CPU, with NCCL on the model's device.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Subset

from infclip.data.pipeline import ignore_stop_signals
from infclip.eval.data import ImageList


@dataclass
class Runtime:
    """Where an evaluation runs: device, this rank's place in the group, the autocast context."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    group: Any = None
    autocast: Callable[[], ContextManager] = field(default=contextlib.nullcontext)

    @property
    def comm_device(self) -> torch.device:
        if self.world_size > 1 and dist.get_backend(self.group) == "nccl":
            return self.device
        return torch.device("cpu")


def fp32(rt: Runtime) -> ContextManager:
    """Scores and rank counts run outside any caller's autocast: bf16 logits would create ties."""
    return torch.autocast(rt.device.type, enabled=False)


def shard(n: int, rt: Runtime) -> range:
    """This rank's global indices of an n-item dataset."""
    return range(rt.rank, n, rt.world_size)


def all_reduce_sum(t: Tensor, rt: Runtime) -> Tensor:
    """Sum ``t`` over the group (identity on one rank); returns a tensor on t's device."""
    if rt.world_size == 1:
        return t
    buf = t.to(rt.comm_device)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=rt.group)
    return buf.to(t.device)


def gather_strided(x: Tensor, n: int, rt: Runtime) -> Tensor:
    """Reassemble per-rank rows (rank r holds global rows r::W) into all n rows, on every rank.

    x: (len(shard(n)), d) -> (n, d) on x's device, in global order. Ranks holding no row may
    pass a (0, 0) tensor: the width is agreed with a MAX reduction.
    """
    if rt.world_size == 1:
        return x
    width = torch.tensor([x.shape[1] if x.numel() else 0], device=rt.comm_device)
    dist.all_reduce(width, op=dist.ReduceOp.MAX, group=rt.group)
    rows = -(-n // rt.world_size)
    buf = torch.zeros(rows, int(width), dtype=torch.float32, device=rt.comm_device)
    if x.numel():
        buf[: x.shape[0]] = x.to(buf)
    parts = [torch.empty_like(buf) for _ in range(rt.world_size)]
    dist.all_gather(parts, buf, group=rt.group)
    out = torch.empty(n, int(width), dtype=torch.float32, device=x.device)
    for r, part in enumerate(parts):
        count = len(range(r, n, rt.world_size))
        out[r::rt.world_size] = part[:count].to(x.device)
    return out


def split_preprocess(preprocess: Any) -> tuple[Callable, Optional[Callable]]:
    """(per-image CPU transform, optional batched on-device transform).

    ``preprocess`` is a callable PIL -> float tensor (open_clip's val transform), or a pair
    (PIL -> uint8 tensor, batched uint8 tensor on device -> normalized float tensor).
    """
    if isinstance(preprocess, (tuple, list)):
        cpu, dev = preprocess
        return cpu, dev
    return preprocess, None


def _worker_init(worker_id: int) -> None:
    """Workers ignore SIGTERM/SIGUSR1 like the training loader's (a preemption signal during an
    eval lets the trainer checkpoint), and die with their parent (Linux): a worker never
    outlives the evaluation that started it, whatever ends that process."""
    ignore_stop_signals(worker_id)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def collate_decoded(items: list) -> tuple[Optional[Tensor], Tensor]:
    """(stacked images of the decoded items or None, their positions in the batch): items whose
    image is None (undecodable, see :class:`ImageList`) are left out."""
    good = [j for j, item in enumerate(items) if item[0] is not None]
    images = torch.stack([items[j][0] for j in good]) if good else None
    return images, torch.tensor(good, dtype=torch.int64)


def encode_images(model, images: ImageList, indices: Sequence[int], on_device: Optional[Callable],
                  batch_size: int, workers: int, rt: Runtime) -> tuple[Tensor, Tensor]:
    """(normalized image embeddings of ``images[indices]`` in that order, (len(indices), d)
    fp32; bool mask of the images that decoded). Rows of undecodable images are zero and
    their mask entry False: callers leave them out of every metric and count them."""
    if len(indices) == 0:
        return torch.zeros(0, 0, device=rt.device), torch.zeros(0, dtype=torch.bool, device=rt.device)
    # Own generator: the global RNG stays untouched.
    loader = DataLoader(Subset(images, list(indices)), batch_size=batch_size, num_workers=workers,
                        shuffle=False, generator=torch.Generator(), worker_init_fn=_worker_init,
                        collate_fn=collate_decoded)
    rows, embs, start = [], [], 0
    for batch, good in loader:
        if batch is not None:
            batch = batch.to(rt.device, non_blocking=True)
            with rt.autocast():
                if on_device is not None:
                    batch = on_device(batch)
                emb = model.encode_image(batch, normalize=True)
            embs.append(F.normalize(emb.float(), dim=-1))  # re-normalize in fp32 after low-precision autocast
            rows.append(good + start)
        start += batch_size
    ok = torch.zeros(len(indices), dtype=torch.bool, device=rt.device)
    if not embs:
        return torch.zeros(len(indices), 0, device=rt.device), ok
    emb = torch.cat(embs)
    out = torch.zeros(len(indices), emb.shape[1], device=rt.device)
    at = torch.cat(rows).to(rt.device)
    out[at], ok[at] = emb, True
    return out, ok


def gather_mask(ok: Tensor, n: int, rt: Runtime) -> Tensor:
    """The decoded-image masks of all ranks, (n,) bool in global order, on every rank."""
    return gather_strided(ok.float()[:, None], n, rt)[:, 0] > 0.5


def encode_texts(model, tokenizer: Callable, texts: Sequence[str], batch_size: int, rt: Runtime) -> Tensor:
    """Normalized text embeddings: (len(texts), d) fp32 on rt.device (empty (0, 0) if no text)."""
    out = []
    for i in range(0, len(texts), batch_size):
        tokens = tokenizer(list(texts[i:i + batch_size])).to(rt.device)
        with rt.autocast():
            emb = model.encode_text(tokens, normalize=True)
        out.append(F.normalize(emb.float(), dim=-1))
    return torch.cat(out) if out else torch.zeros(0, 0, device=rt.device)
