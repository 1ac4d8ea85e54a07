"""Rank metrics: exact tie handling against brute force, chunked == unchunked retrieval."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from infclip.eval.embed import Runtime
from infclip.eval.metrics import chance_multi, hit_probability, multi_positive_hits, topk_hits
from infclip.eval.retrieval import RECALL_K, recall_sums


def brute_hit(g: int, e: int, p: int, k: int) -> float:
    """Enumerate every placement of the p positives among the e + p tied slots."""
    hits = total = 0
    for pos in itertools.combinations(range(e + p), p):
        total += 1
        hits += g + min(pos) < k
    return hits / total


@pytest.mark.parametrize("g,e,p", [(0, 0, 1), (0, 3, 1), (2, 4, 2), (1, 6, 3), (7, 2, 1), (0, 9, 5), (3, 0, 2)])
def test_hit_probability_matches_enumeration(g, e, p):
    for k in (1, 2, 5, 10):
        got = hit_probability(torch.tensor([g]), torch.tensor([e]), torch.tensor([p]), k)
        assert float(got) == pytest.approx(brute_hit(g, e, p, k), abs=1e-12), (g, e, p, k)


def test_chance_multi_matches_enumeration():
    m, k = 7, 3
    for p in (1, 2, 4):
        hits = sum(any(j < p for j in top) for top in itertools.combinations(range(m), k))
        assert chance_multi(m, [p], k) == pytest.approx(hits / math.comb(m, k))


def test_untied_scores_give_plain_topk():
    torch.manual_seed(0)
    scores, target = torch.randn(50, 12), torch.randint(0, 12, (50,))
    hits = topk_hits(scores, target, (1, 5))
    for k in (1, 5):
        ref = (scores.topk(k, dim=1).indices == target[:, None]).any(1).double()
        assert torch.equal(hits[k], ref)


def test_collapsed_scores_give_chance():
    scores = torch.zeros(4, 20)  # every candidate ties
    positive = torch.zeros(4, 20, dtype=torch.bool)
    positive[:, :5] = True
    hits = multi_positive_hits(scores, positive, (1, 10))
    assert hits[1].tolist() == pytest.approx([5 / 20] * 4)
    assert hits[10].tolist() == pytest.approx([chance_multi(20, [5], 10)] * 4)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_scores_are_misses(bad):
    """A NaN/inf anywhere in a query's row (its positive or a negative): a miss at every k."""
    scores = torch.zeros(3, 6)
    scores[:, 2] = 1.0  # the positive is clearly first: a hit when finite
    scores[0, :] = bad  # every score (open_clip's NaN classifier of a zero-norm class embedding)
    scores[1, 2] = bad  # the positive only
    scores[2, 4] = bad  # one negative only
    target = torch.full((3,), 2)
    hits = topk_hits(scores, target, (1, 5))
    assert hits[1].tolist() == [0.0, 0.0, 0.0] and hits[5].tolist() == [0.0, 0.0, 0.0]
    positive = F.one_hot(target, 6).bool()
    multi = multi_positive_hits(scores, positive, (1, 5))
    assert multi[1].tolist() == [0.0, 0.0, 0.0] and multi[5].tolist() == [0.0, 0.0, 0.0]
    finite = torch.zeros(3, 6).index_fill_(1, torch.tensor([2]), 1.0)
    assert topk_hits(finite, target, (1,))[1].tolist() == [1.0, 1.0, 1.0]  # the same rows, finite: hits


def test_a_collapsed_classifier_scores_zero_and_is_counted():
    """NaN class embeddings: top-1 and top-5 are 0 (they were 1.0), each image is counted."""
    from infclip.eval.zeroshot import summarize, zeroshot_counts

    img = F.normalize(torch.randn(9, 4), dim=1)
    classes = torch.full((7, 4), math.nan)
    result = summarize(zeroshot_counts(img, torch.arange(9) % 7, classes))
    assert result["top1"] == 0.0 and result["top5"] == 0.0 and result["num_nonfinite"] == 9
    healthy = summarize(zeroshot_counts(img, torch.arange(9) % 7, F.normalize(torch.randn(7, 4), dim=1)))
    assert "num_nonfinite" not in healthy  # only reported when there were any


def test_retrieval_counts_nonfinite_queries_of_both_directions():
    from infclip.eval.retrieval import summarize

    img, txt = F.normalize(torch.randn(5, 4), dim=1), F.normalize(torch.randn(10, 4), dim=1)
    txt[3] = math.nan  # one caption: every image query's row holds it; one text query
    txt2img = torch.arange(10) % 5
    sums = recall_sums(img, txt, txt2img, chunk_size=2, rt=Runtime(torch.device("cpu")))
    assert sums[:, -1].tolist() == [5.0, 1.0] and sums[0, :-1].tolist() == [0.0, 0.0, 0.0]
    assert summarize(sums, txt2img.tolist(), 5)["num_nonfinite"] == 6


def _reference_recall(img, txt, txt2img):
    """Full-matrix top-k recall (no ties in the inputs)."""
    sims = img @ txt.T
    out = []
    for k in RECALL_K:
        top = sims.topk(k, dim=1).indices
        out.append((txt2img[top] == torch.arange(img.shape[0])[:, None]).any(1).double().sum())
    for k in RECALL_K:
        top = sims.T.topk(k, dim=1).indices
        out.append((top == txt2img[:, None]).any(1).double().sum())
    return torch.stack(out).view(2, len(RECALL_K))


def test_recall_sums_match_full_matrix_reference():
    torch.manual_seed(1)
    img, txt = F.normalize(torch.randn(23, 8), dim=1), F.normalize(torch.randn(70, 8), dim=1)
    txt2img = torch.arange(70) % 23
    got = recall_sums(img, txt, txt2img, chunk_size=1000, rt=Runtime(torch.device("cpu")))
    assert torch.allclose(got[:, :len(RECALL_K)], _reference_recall(img, txt, txt2img), atol=1e-12)
    assert got[:, -1].tolist() == [0.0, 0.0]  # no query with non-finite scores


@pytest.mark.parametrize("chunk", [1, 4, 7, 23])
def test_chunked_equals_unchunked(chunk):
    torch.manual_seed(2)
    img = F.normalize(torch.randn(23, 6), dim=1)
    txt = F.normalize(torch.randn(60, 6), dim=1)
    txt[30:40] = txt[0:10]  # duplicated captions: exact ties across images
    txt2img = torch.randint(0, 23, (60,))
    txt2img[:23] = torch.arange(23)  # every image has a caption
    rt = Runtime(torch.device("cpu"))
    full = recall_sums(img, txt, txt2img, chunk_size=10_000, rt=rt)
    assert torch.allclose(recall_sums(img, txt, txt2img, chunk_size=chunk, rt=rt), full, atol=1e-9)
