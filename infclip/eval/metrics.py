"""Rank metrics with exact, deterministic tie handling.

For one query, let ``g`` be the number of negatives scoring strictly above the best positive
score ``s*``, ``e`` the negatives scoring exactly ``s*`` and ``p >= 1`` the positives scoring
``s*``. If ties were broken uniformly at random, the query is a hit at k with probability

    P(hit@k) = 0                                    if k <= g
             = 1 - C(e, k-g) / C(e+p, k-g)          if g < k <= g + e
             = 1                                    if k > g + e

(the first k-g tied items are all negatives with probability C(e, k-g)/C(e+p, k-g)).
We report the expectation -- no random numbers are drawn -- so a collapsed model (all
scores equal) scores exactly chance and never 100 %, while untied scores give the plain
top-k hit. Zero-shot top-k and text->image recall are the p = 1 case.

Non-finite scores: a query whose row of scores holds a NaN or an infinity cannot be ranked
and is a miss at every k (``finite_rows``); callers count such queries (``num_nonfinite``).
So a model whose embeddings collapsed to NaN (open_clip's classifier builder divides a zero
class embedding by its zero norm) scores 0, never 100 %.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
from torch import Tensor


def hit_probability(g: Tensor, e: Tensor, p: Tensor, k: int) -> Tensor:
    """P(hit@k) per query (float64) from counts g, e, p (int tensors of one shape)."""
    g, e, p = g.double(), e.double(), p.double()
    m = k - g  # tied slots left inside the top k
    prod = torch.ones_like(g)
    for i in range(k):  # C(e, m)/C(e+p, m) = prod_{i<m} (e-i)/(e+p-i)
        term = ((e - i).clamp(min=0) / (e + p - i).clamp(min=1)).clamp(max=1)
        prod = torch.where(m > i, prod * term, prod)
    return torch.where(m <= 0, torch.zeros_like(g), 1 - prod)


def finite_rows(scores: Tensor) -> Tensor:
    """(n,) bool: rows whose every score is finite (the others are misses)."""
    return torch.isfinite(scores).all(1)


def _misses_where_nonfinite(hits: dict[int, Tensor], finite: Tensor) -> dict[int, Tensor]:
    return {k: torch.where(finite, h, torch.zeros_like(h)) for k, h in hits.items()}


def topk_hits(scores: Tensor, target: Tensor, ks: tuple[int, ...]) -> dict[int, Tensor]:
    """Hit probabilities when exactly one column per row is positive; a row holding a
    non-finite score is a miss (0) at every k.

    scores: (n, C) float; target: (n,) int64 column of the positive. Returns {k: (n,) float64}.
    """
    pos = scores.gather(1, target[:, None])
    g = (scores > pos).sum(1)
    e = (scores == pos).sum(1) - 1  # the positive itself ties with itself
    p = torch.ones_like(g)
    return _misses_where_nonfinite({k: hit_probability(g, e, p, k) for k in ks}, finite_rows(scores))


def multi_positive_hits(scores: Tensor, positive: Tensor, ks: tuple[int, ...]) -> dict[int, Tensor]:
    """Hit probabilities when a row may have several positive columns (image -> its captions);
    a row holding a non-finite score is a miss (0) at every k.

    scores: (n, M) float; positive: (n, M) bool with >= 1 True per row. Returns {k: (n,) float64}.
    """
    best = scores.masked_fill(~positive, float("-inf")).amax(1, keepdim=True)
    g = ((scores > best) & ~positive).sum(1)
    e = ((scores == best) & ~positive).sum(1)
    p = ((scores == best) & positive).sum(1)
    return _misses_where_nonfinite({k: hit_probability(g, e, p, k) for k in ks}, finite_rows(scores))


def chance_single(num_candidates: int, k: int) -> float:
    """P(hit@k) of a random ranking with one positive among ``num_candidates``."""
    return min(k, num_candidates) / num_candidates


def chance_multi(num_candidates: int, positives_per_query: list[int], k: int) -> float:
    """Mean P(hit@k) of random rankings, query q having ``positives_per_query[q]`` positives."""
    total = 0.0
    for p, count in Counter(positives_per_query).items():
        miss = math.comb(num_candidates - p, k) / math.comb(num_candidates, k) if k <= num_candidates else 0.0
        total += count * (1.0 - miss)
    return total / len(positives_per_query)
