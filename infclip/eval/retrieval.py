"""Image-text retrieval: image->text and text->image Recall@{1,5,10}, in chunks.

image->text: image i is a hit at k if any of its captions ranks in the top k of all M
captions; text->image: caption j is a hit if its image ranks in the top k of all N images
(ties: exact expectation, see :mod:`infclip.eval.metrics`). Each rank encodes a strided
share of the images and captions; the embeddings are gathered on every rank, and each rank
scores every W-th chunk of ``chunk_size`` query rows, so no similarity block is larger than
chunk_size x max(N, M). The per-rank hit sums are added over the group.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from infclip.eval.data import RetrievalData
from infclip.eval.embed import (Runtime, all_reduce_sum, encode_images, encode_texts, fp32, gather_mask,
                                gather_strided, shard)
from infclip.eval.metrics import chance_multi, chance_single, finite_rows, multi_positive_hits, topk_hits

RECALL_K = (1, 5, 10)


def _my_chunks(n: int, chunk_size: int, rt: Runtime) -> list[tuple[int, int]]:
    starts = range(0, n, chunk_size)
    return [(a, min(a + chunk_size, n)) for c, a in enumerate(starts) if c % rt.world_size == rt.rank]


def recall_sums(img: Tensor, txt: Tensor, txt2img: Tensor, chunk_size: int, rt: Runtime) -> Tensor:
    """This rank's hit sums (float64, shape (2, len(RECALL_K) + 1)): row 0 image->text, row 1
    text->image; the last column counts the queries whose scores were not finite (misses).

    img: (N, d), txt: (M, d) unit-norm, all rows on every rank; txt2img: (M,) int64 in [0, N).
    """
    sums = torch.zeros(2, len(RECALL_K) + 1, dtype=torch.float64, device=img.device)
    for a, b in _my_chunks(img.shape[0], chunk_size, rt):
        positive = txt2img[None, :] == torch.arange(a, b, device=img.device)[:, None]  # (b-a, M)
        scores = img[a:b] @ txt.T
        hits = multi_positive_hits(scores, positive, RECALL_K)
        sums[0] += torch.stack([*(hits[k].sum() for k in RECALL_K), (~finite_rows(scores)).sum().double()])
    for a, b in _my_chunks(txt.shape[0], chunk_size, rt):
        scores = txt[a:b] @ img.T
        hits = topk_hits(scores, txt2img[a:b], RECALL_K)
        sums[1] += torch.stack([*(hits[k].sum() for k in RECALL_K), (~finite_rows(scores)).sum().double()])
    return sums


def summarize(sums: Tensor, txt2img: list[int], num_images: int) -> dict[str, float]:
    """Recall metrics and their chance levels from the summed hits; ``num_nonfinite`` (queries
    of both directions scored as misses for non-finite scores) only when there were any."""
    num_texts = len(txt2img)
    per_image = torch.bincount(torch.tensor(txt2img), minlength=num_images).tolist()
    out: dict[str, float] = {}
    for j, k in enumerate(RECALL_K):
        out[f"i2t_r{k}"] = float(sums[0, j]) / num_images
    for j, k in enumerate(RECALL_K):
        out[f"t2i_r{k}"] = float(sums[1, j]) / num_texts
    for k in RECALL_K:
        out[f"i2t_r{k}_chance"] = chance_multi(num_texts, per_image, k)
        out[f"t2i_r{k}_chance"] = chance_single(num_images, k)
    out["num_images"], out["num_texts"] = float(num_images), float(num_texts)
    nonfinite = float(sums[:, -1].sum())
    if nonfinite:
        out["num_nonfinite"] = nonfinite
    return out


def evaluate_retrieval(model, tokenizer: Callable, data: RetrievalData, on_device: Optional[Callable],
                       batch_size: int, workers: int, chunk_size: int, rt: Runtime) -> dict[str, float]:
    """Retrieval metrics over all of ``data`` (sharded over the group; same result on every rank)."""
    img, txt, ok = embed_all(model, tokenizer, data, on_device, batch_size, workers, rt)
    img, txt, txt2img = keep_decoded(img, txt, data.txt2img, ok)
    return {**recall_metrics(img, txt, txt2img, chunk_size, rt), **skipped_images(ok)}


def embed_all(model, tokenizer: Callable, data: RetrievalData, on_device: Optional[Callable],
              batch_size: int, workers: int, rt: Runtime) -> tuple[Tensor, Tensor, Tensor]:
    """Unit-norm fp32 embeddings of all N images and M captions and the (N,) mask of images
    that decoded, on every rank (each rank encodes its strided share: one forward of each
    tower per sample over the group)."""
    n, m = len(data.images), len(data.captions)
    img_idx, txt_idx = shard(n, rt), shard(m, rt)
    img, ok = encode_images(model, data.images, img_idx, on_device, batch_size, workers, rt)
    txt = encode_texts(model, tokenizer, [data.captions[j] for j in txt_idx], batch_size, rt)
    return gather_strided(img, n, rt), gather_strided(txt, m, rt), gather_mask(ok, n, rt)


def keep_decoded(img: Tensor, txt: Tensor, txt2img: list[int], ok: Tensor) -> tuple[Tensor, Tensor, list[int]]:
    """Leave out the undecodable images and their captions (the same on every rank): the
    metrics are those of the dataset without them. Raises ValueError when no image is left."""
    if not bool(ok.any()):
        raise ValueError(f"none of the {len(ok)} images could be decoded")
    if bool(ok.all()):
        return img, txt, list(txt2img)
    keep = ok.tolist()
    new_index = torch.cumsum(ok.long(), 0).sub(1).tolist()
    texts = [j for j, i in enumerate(txt2img) if keep[i]]
    return img[ok], txt[texts], [new_index[txt2img[j]] for j in texts]


def skipped_images(ok: Tensor) -> dict[str, float]:
    """``num_skipped_images`` when some images could not be decoded, else nothing."""
    skipped = int((~ok).sum())
    return {"num_skipped_images": float(skipped)} if skipped else {}


def recall_metrics(img: Tensor, txt: Tensor, txt2img: list[int], chunk_size: int, rt: Runtime) -> dict[str, float]:
    """Recall metrics of the embeddings of N images and M captions; caption j shows image txt2img[j]."""
    n = img.shape[0]
    index = torch.tensor(txt2img, dtype=torch.int64, device=img.device)
    with fp32(rt):
        sums = all_reduce_sum(recall_sums(img, txt, index, chunk_size, rt), rt)
    return summarize(sums.cpu(), txt2img, n)
