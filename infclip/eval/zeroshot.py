"""Zero-shot classification: prompt-ensemble class embeddings, top-1/top-5, per-class recall.

Class embedding c = normalize(mean_t normalize(text(template_t(name_c)))), built with open_clip's
``build_zero_shot_classifier``; logits = image embedding . class embeddings. Each rank encodes
a strided share of the classes and of the images; only the class matrix (C x d) and per-class
hit counts cross ranks, so the sums equal those of one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import open_clip
import torch
import torch.nn.functional as F
from torch import Tensor

from infclip.eval.data import ZeroShotData
from infclip.eval.embed import Runtime, all_reduce_sum, encode_images, fp32, gather_strided, shard
from infclip.eval.metrics import chance_single, finite_rows, topk_hits

TOPK = (1, 5)


def class_embeddings(model, tokenizer: Callable, classnames: list[str], templates: list, batch_size: int,
                     rt: Runtime) -> Tensor:
    """(C, d) fp32 unit-norm class embeddings, identical on every rank."""
    mine = [classnames[i] for i in shard(len(classnames), rt)]
    local = torch.zeros(0, 0, device=rt.device)
    if mine:
        with rt.autocast():
            weights = open_clip.build_zero_shot_classifier(
                model, tokenizer, mine, templates,
                num_classes_per_batch=max(1, batch_size // len(templates)), device=rt.device)
        local = F.normalize(weights.T.float(), dim=-1)
    return gather_strided(local, len(classnames), rt)


def zeroshot_counts(img: Tensor, labels: Tensor, classes: Tensor) -> Tensor:
    """Per-class sums for one rank's images: (4, C) float64 rows = (top1 hits, top5 hits, count,
    images whose scores were not finite: misses).

    img: (n, d) unit-norm; labels: (n,) in [0, C); classes: (C, d) unit-norm.
    """
    num_classes = classes.shape[0]
    scores = img @ classes.T
    hits = topk_hits(scores, labels, TOPK)
    out = torch.zeros(4, num_classes, dtype=torch.float64, device=img.device)
    out[0].index_add_(0, labels, hits[1])
    out[1].index_add_(0, labels, hits[5])
    out[2].index_add_(0, labels, torch.ones_like(hits[1]))
    out[3].index_add_(0, labels, (~finite_rows(scores)).double())
    return out


def summarize(counts: Tensor, skipped: float = 0.0) -> dict[str, float]:
    """Metrics from summed per-class counts (4, C): top1, top5, mean per-class recall, chance;
    ``num_nonfinite`` (images scored as misses for non-finite scores) and ``num_skipped_images``
    (undecodable images, left out of every metric) only when there were any."""
    hit1, hit5, n, nonfinite = counts.sum(1).tolist()
    present = counts[2] > 0
    per_class = counts[0][present] / counts[2][present]
    num_classes = counts.shape[1]
    return {
        "top1": hit1 / n, "top5": hit5 / n, "mean_per_class_recall": float(per_class.mean()),
        "top1_chance": chance_single(num_classes, 1), "top5_chance": chance_single(num_classes, 5),
        "num_samples": n, "num_classes": float(num_classes),
        **({"num_nonfinite": nonfinite} if nonfinite else {}),
        **({"num_skipped_images": float(skipped)} if skipped else {}),
    }


def confusion_counts(img: Tensor, labels: Tensor, classes: Tensor) -> Tensor:
    """(C, C) float64: row = true class, column = top-1 prediction, for one rank's images;
    images with non-finite scores are left out (they count as misses in the metrics)."""
    num_classes = classes.shape[0]
    scores = img @ classes.T
    keep = finite_rows(scores)
    out = torch.zeros(num_classes * num_classes, dtype=torch.float64, device=img.device)
    flat = labels[keep] * num_classes + scores[keep].argmax(dim=1)
    out.index_add_(0, flat, torch.ones_like(flat, dtype=torch.float64))
    return out.view(num_classes, num_classes)


def evaluate_zeroshot(model, tokenizer: Callable, data: ZeroShotData, on_device: Optional[Callable],
                      batch_size: int, workers: int, chunk_size: int, rt: Runtime,
                      details: Optional[dict] = None) -> dict[str, float]:
    """Zero-shot metrics over all of ``data`` (sharded over the group; same result on every rank).
    ``details``: filled with the class names, the per-class counts and the confusion matrix
    (:func:`write_per_class` writes them), on every rank."""
    classes = class_embeddings(model, tokenizer, data.classnames, data.templates, batch_size, rt)
    indices = shard(len(data.images), rt)
    num_classes = len(data.classnames)
    counts = torch.zeros(5, num_classes, dtype=torch.float64, device=rt.device)  # row 4: skipped
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.float64, device=rt.device)
    if len(indices):
        img, ok = encode_images(model, data.images, indices, on_device, batch_size, workers, rt)
        labels = torch.tensor([data.images.labels[i] for i in indices], device=rt.device)
        counts[4].index_add_(0, labels[~ok], torch.ones(int((~ok).sum()), dtype=torch.float64, device=rt.device))
        img, labels = img[ok], labels[ok]
        with fp32(rt):
            for i in range(0, len(labels), chunk_size):  # logits never exceed chunk_size x C
                counts[:4] += zeroshot_counts(img[i:i + chunk_size], labels[i:i + chunk_size], classes)
                if details is not None:
                    confusion += confusion_counts(img[i:i + chunk_size], labels[i:i + chunk_size], classes)
    counts = all_reduce_sum(counts, rt)
    if not counts[2].sum():
        raise ValueError(f"none of the {len(data.images)} images could be decoded")
    if details is not None:
        details.update(classnames=list(data.classnames), counts=counts[:4].cpu(),
                       confusion=all_reduce_sum(confusion, rt).cpu())
    return summarize(counts[:4], skipped=float(counts[4].sum()))


def write_per_class(folder: Path, name: str, details: dict) -> tuple[Path, Path]:
    """``<folder>/<name>.csv`` (per class: images, top-1 and top-5 accuracy, i.e. recall) and
    ``<folder>/<name>_confusion.csv`` (true class rows, predicted class columns, image counts),
    as clip_benchmark's per-class report. Returns both paths."""
    import csv

    folder.mkdir(parents=True, exist_ok=True)
    counts, names = details["counts"], details["classnames"]
    per_class, matrix = folder / f"{name}.csv", folder / f"{name}_confusion.csv"
    with open(per_class, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["class", "images", "top1", "top5"])
        for c, cls in enumerate(names):
            n = int(counts[2, c])
            w.writerow([cls, n, f"{counts[0, c] / n:.6f}" if n else "", f"{counts[1, c] / n:.6f}" if n else ""])
    with open(matrix, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["true \\ predicted", *names])
        for cls, row in zip(names, details["confusion"].long().tolist()):
            w.writerow([cls, *row])
    return per_class, matrix
