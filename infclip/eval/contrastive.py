"""Held-out contrastive validation (open_clip's ``--val-data``): loss at a stated batch + recall.

The task's shards are in the training format (one caption per image). Every sample is encoded
once by each tower (strided over ranks, gathered like retrieval), then

* ``loss``: the mean, over the ``N // batch`` consecutive non-overlapping batches of ``batch``
  samples in shard order, of the run's own contrastive loss on that batch -- the loss a training
  step of ``batch`` pairs would see with the model's current logit scale (and bias, SigLIP).
  The last ``N % batch`` samples, which do not fill a batch, are dropped from the loss (they
  still count in the recall). The loss is the project's tiled loss (``infclip.loss``), so no
  batch x batch matrix is held beyond its tiles: any ``batch`` fits;
* ``i2t_r{1,5,10}`` / ``t2i_r{1,5,10}``: retrieval recall over all N samples (the retrieval
  task's metric code, chunked by ``eval.chunk_size``).

Batches are scored on rank ``c % W`` and the sums added over the group, so all ranks return
the same numbers. Costs: N image + N text forwards, plus (N // batch) * batch^2 * d loss flops
(2 * N * batch * d multiply-adds) and N^2 * d for the recall.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from infclip.eval.data import RetrievalData
from infclip.eval.embed import Runtime, all_reduce_sum, fp32
from infclip.eval.retrieval import embed_all, keep_decoded, recall_metrics, skipped_images

LossFn = Callable[..., Tensor]  # the trainer's signature: loss_fn(img, txt, scale, bias=None)


def default_loss_fn(model) -> LossFn:
    """CLIP's loss, or SigLIP's when the model has a logit bias (``python -m infclip.eval``;
    training passes the run's own ``loss.kind`` instead)."""
    from infclip.loss import clip_loss, siglip_loss

    if getattr(model, "logit_bias", None) is not None:
        return siglip_loss
    return clip_loss

def model_logits(model) -> tuple[Tensor, Optional[Tensor]]:
    """(exp(logit_scale), logit_bias or None) as fp32 0-dim tensors: what the training loss sees."""
    if getattr(model, "logit_scale", None) is None:
        raise ValueError("a contrastive eval task needs the model's logit_scale (an open_clip CLIP model)")
    scale = model.logit_scale.detach().float().exp().reshape(())
    bias = getattr(model, "logit_bias", None)
    return scale, (None if bias is None else bias.detach().float().reshape(()))


def batch_loss_mean(img: Tensor, txt: Tensor, batch: int, loss_fn: LossFn, scale: Tensor,
                    bias: Optional[Tensor], rt: Runtime) -> tuple[float, int]:
    """(mean loss over the N // batch full batches, their count); rank r scores batches r, r+W, ..."""
    count = img.shape[0] // batch
    total = torch.zeros((), dtype=torch.float64, device=img.device)
    extra = () if bias is None else (bias.to(img.device),)
    with fp32(rt):
        for c in range(rt.rank, count, rt.world_size):
            a, b = c * batch, (c + 1) * batch
            total += loss_fn(img[a:b], txt[a:b], scale.to(img.device), *extra).double()
    total = all_reduce_sum(total.reshape(1), rt)
    return float(total) / count, count


def evaluate_contrastive(model, tokenizer: Callable, data: RetrievalData, on_device: Optional[Callable],
                         batch_size: int, workers: int, chunk_size: int, rt: Runtime, *, batch: int,
                         loss_fn: Optional[LossFn] = None) -> dict[str, float]:
    """Loss at ``batch`` and recall over all of ``data`` (one caption per image, txt2img = identity)."""
    if len(data.images) < batch:
        raise ValueError(f"{len(data.images)} validation samples cannot fill one loss batch of {batch}")
    img, txt, ok = embed_all(model, tokenizer, data, on_device, batch_size, workers, rt)
    img, txt, txt2img = keep_decoded(img, txt, data.txt2img, ok)
    if img.shape[0] < batch:
        raise ValueError(f"{img.shape[0]} decodable validation samples cannot fill one loss batch of {batch}")
    scale, bias = model_logits(model)
    loss, count = batch_loss_mean(img, txt, batch, loss_fn or default_loss_fn(model), scale, bias, rt)
    out = {**recall_metrics(img, txt, txt2img, chunk_size, rt), **skipped_images(ok)}
    out.update(loss=loss, num_loss_batches=float(count), loss_batch_size=float(batch), logit_scale=float(scale))
    return out
