"""Duplicate-aware negatives for the CLIP loss: pairs of one group (the same caption or image) are not negatives.

Every pair i carries a group id g_i (int64; equal ids: the same caption, or caption and
image). With x_ij = s <I_i, T_j> over the global batch and G(i) = {j : g_j = g_i} (i is in
G(i)), the per-row terms of ``clip_loss`` become, by ``duplicates``:

* ``"off"``: row_i = LSE_j x_ij - x_ii (the plain CLIP loss; group ids are not used).
* ``"mask"``: pairs i != j of one group are not negatives; they leave both softmaxes:
      row_i = LSE_{j not in G(i) \\ {i}} x_ij - x_ii,   col_j = LSE_{i not in G(j) \\ {j}} x_ij - x_jj.
* ``"positive"``: multi-positive InfoNCE, the log of the summed positives over the whole
  softmax, in both directions:
      row_i = LSE_j x_ij - LSE_{j in G(i)} x_ij,      col_j = LSE_i x_ij - LSE_{i in G(j)} x_ij.

The loss is mean_i (row_i + col_i) / 2 in every mode (local rows on a ring rank). A group
of size 1 gives exactly the plain terms, in both modes.

Where it is computed:

* ``mask`` changes the LSEs themselves, so it lives in the tiles: ``TorchTileOps`` and the
  Triton kernels take ``groups = (g_row (m,), g_col (n,))`` and drop same-group entries
  (except a positive pair's own i == j on the diagonal block) from both directions, in the
  forward and in dX of the backward. On one process the ids become int32 ranks: dense ranks
  on the PyTorch tiles (``dense_ids``, ``prepare``), each sorted pair's group's first sorted
  position with the Triton kernels (``sort_groups``): one integer compare per tile entry.
  With the Triton kernels on one process the compare is confined to a band (``sort_groups``,
  ``infclip.loss.function._SortedMask``): the loss is a mean over pairs, so the pairs are
  permuted (image and text rows together) to make every group contiguous (a stable sort of
  the ids); then every same-group pair (p, q) has |p - q| <= w, w = the largest group's size
  less one, and only the tiles within w of the diagonal can hold one. The kernels read w from
  a (1,) int32 device tensor (no host sync) and compare ids only in those tiles (``groups =
  (ids, ids, band)``; ``infclip.kernels.clip.kernels``, BAND); the gradients are un-permuted
  by a gather with the inverse permutation. Cost argument: of a BM-row block's columns only
  [row0 - w, row0 + BM + w), rounded out to BN-column tiles, compare: a fraction of about
  (BM + 2w + BN) / b of all tiles (about 1 % at b = 32k, BM = 256, BN = 128, w of a few),
  plus a sort of b ids and gathers of the (b, c) features (two in the forward, four in the
  backward; the sorted copies live only within each pass: 2 b c elements more at the peak).
  One group of size ~b makes w ~ b: every tile compares, the cost of comparing everywhere.
  The ring keeps the compare on every tile (its ids are global; other ranks' rows are not
  in the local order), and so does ``TorchTileOps`` (the reference).
* ``positive`` keeps the denominators of the plain loss (the tiles run unchanged); its
  numerators LSE_{G(i)} need only the same-group pairs, which are few: they are gathered
  here (on one process once per call, ``find_pairs`` in ``prepare``, one host sync, the list
  reused by the backward; else ``group_pairs``), their logits computed from fp32 dot products, and their
  log-sum-exp taken relative to x_ii (whose relative logit is exactly 0). The backward
  is the plain one with the positives' weight g_diag_i = g_row_i w_ii + g_col_i w'_ii
  (w = the within-group softmax; 1 for a singleton, so singletons are bit-identical to
  "off") plus the same-group pairs' -g w terms, added sparsely (``positive_backward``).
  Cost: O(pairs * c); a group of size k costs k^2 dot products (one batch of identical
  captions, k = b, costs one more b^2 c pass, chunked to bounded memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

MODES = ("off", "mask", "positive")
PAIR_CHUNK = 1 << 20  # (pairs x c) elements per chunk of gathered features (<= ~8 MB fp32 x 2)


def check_duplicates(duplicates: str, group_ids: Tensor | None, m: int, device: torch.device) -> None:
    """Raises ValueError unless ``duplicates`` is a mode and group_ids fit it: (m,) int64 on
    ``device`` when the mode is on, None when it is off."""
    if duplicates not in MODES:
        raise ValueError(f"duplicates={duplicates!r} is not valid; choose one of {list(MODES)}")
    if duplicates == "off":
        if group_ids is not None:
            raise ValueError("group_ids were given with duplicates='off', which ignores them: pass "
                             "duplicates='mask' or 'positive' (or drop group_ids)")
        return
    if group_ids is None:
        raise ValueError(f"duplicates={duplicates!r} needs group_ids: an int64 tensor (b,), one id per pair")
    if not isinstance(group_ids, Tensor) or group_ids.dtype != torch.int64 or group_ids.shape != (m,):
        got = tuple(group_ids.shape) if isinstance(group_ids, Tensor) else type(group_ids).__name__
        raise ValueError(f"group_ids must be an int64 tensor of shape ({m},), got "
                         f"{getattr(group_ids, 'dtype', '')} {got}")
    if group_ids.device != device:
        raise ValueError(f"group_ids are on {group_ids.device} but the features are on {device}")


@dataclass(frozen=True)
class Duplicates:
    """What the loss nodes need: the mode ("mask" | "positive"), the local group ids (m,) and,
    for "positive" on one process, the same-group pairs found once per call (``prepare``).

    ids: int64 as given (the ring: ids stay global across ranks; the fused Triton "mask",
    which sorts them itself: ``sort_groups``), or int32 dense ranks (``dense_ids``; the
    PyTorch tiles on one process). pairs: None (found by ``group_pairs`` where needed) or the
    chunks (ia, jb) of every ordered pair i != j of one group, computed once in the forward's
    preparation and reused by the backward."""

    mode: str
    ids: Tensor
    pairs: list | None = None


# Pairs kept as one precomputed list (16 B each: two int64 indices) up to this many per
# sample, plus a fixed part: ~1 % duplicates is ~0.01 b; one caption filling the batch is
# b^2 and goes through the chunked ``group_pairs`` in both passes instead.
PAIRS_PER_ROW = 8
PAIRS_FIXED = 1 << 16


def dense_ids(ids: Tensor) -> Tensor:
    """(m,) int32 ranks with dense_i == dense_j iff ids_i == ids_j: each id's position of first
    occurrence in the sorted ids (a sort and a binary search on the device, O(m log m), no host
    sync). The kernels compare int32 in one instruction and hold half the registers of int64."""
    srt = torch.sort(ids).values
    return torch.searchsorted(srt, ids).to(torch.int32)


@dataclass(frozen=True)
class GroupSort:
    """The one-process batch sorted by group ("mask" on the Triton kernels): order (m,) int64,
    the stable argsort of the ids (pair p of the sorted batch is pair order[p]); inverse (m,)
    int64, its inverse permutation (sorted position of pair i), to un-permute the gradients by
    a gather; ids (m,) int32, for each sorted pair its group's first sorted position (equal
    within a group and only there, groups contiguous; not dense: gaps between groups); band (1,) int32, w = the largest group's size less one: every same-group pair
    (p, q) of the sorted batch has |p - q| <= w."""

    order: Tensor
    inverse: Tensor
    ids: Tensor
    band: Tensor


def sort_groups(ids: Tensor) -> GroupSort:
    """``GroupSort`` of ``ids`` (any integer ids, (m,), m >= 1): a stable sort, two binary
    searches and a scatter for the inverse, on the device, no host sync (w stays a device
    tensor, read by the kernels)."""
    if ids.numel() == 0:
        raise ValueError("sort_groups needs at least one id")
    order = torch.argsort(ids, stable=True)
    srt = ids[order]
    lo = torch.searchsorted(srt, srt)  # each sorted pair's group's first sorted position
    size = torch.searchsorted(srt, srt, right=True) - lo
    band = (size.max() - 1).to(torch.int32).reshape(1)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)  # a permutation: no duplicate index
    return GroupSort(order, inverse, lo.to(torch.int32), band)


def find_pairs(ids: Tensor, cap: int | None = None) -> list | None:
    """[(ia, jb)]: every ordered pair i != j with ids_i == ids_j, as one chunk of int64 index
    vectors ([] when there is none), or None when there are more than ``cap`` (callers then
    use the chunked ``group_pairs``). One host sync (the number of pairs, to size the
    vectors); everything else stays on the device. ``cap`` defaults to PAIRS_PER_ROW x m +
    PAIRS_FIXED."""
    m = ids.numel()
    cap = PAIRS_PER_ROW * m + PAIRS_FIXED if cap is None else cap
    order = torch.argsort(ids)
    srt = ids[order]
    lo = torch.searchsorted(srt, srt)
    partners = torch.searchsorted(srt, srt, right=True) - lo - 1  # of sorted position p: its group less itself
    ends = torch.cumsum(partners, 0)
    total = int(ends[-1]) if m else 0  # the one host sync
    if total == 0:
        return []
    if total > cap:
        return None
    p = torch.repeat_interleave(torch.arange(m, device=ids.device), partners, output_size=total)
    q = lo[p] + torch.arange(total, device=ids.device) - (ends - partners)[p]  # lo .. hi - 2
    q = q + (q >= p)  # skip p itself: the partners are lo .. hi - 1 less p
    return [(order[p], order[q])]


def prepare(mode: str, ids: Tensor) -> Duplicates:
    """The one-process ``Duplicates`` of a loss call: int32 dense ids for "mask" (no host
    sync); the pair list for "positive" (one host sync, before any of the loss's kernels is
    queued, so the GPU waits only for these few small ops)."""
    if mode == "mask":
        return Duplicates(mode, dense_ids(ids))
    return Duplicates(mode, ids, find_pairs(ids))


def group_pairs(g_a: Tensor, g_b: Tensor, exclude_self: bool, max_pairs: int = PAIR_CHUNK):
    """Yields chunks (ia, jb) of int64 indices of every pair g_a[ia] == g_b[jb] (ia over rows of
    a, jb over rows of b), without i == j when ``exclude_self`` (the square block pair of the
    positives). A chunk holds at most ``max_pairs`` pairs, or one row's pairs if more."""
    order = torch.argsort(g_b)
    sorted_b = g_b[order]
    lo = torch.searchsorted(sorted_b, g_a, right=False)
    counts = torch.searchsorted(sorted_b, g_a, right=True) - lo
    counts_x = counts - 1 if exclude_self else counts  # a square pair's rows each match themselves once
    if not bool((counts_x > 0).any()):
        return
    rows = torch.nonzero(counts_x > 0).flatten()
    per = counts[rows]
    cum = torch.cumsum(per, 0).cpu()  # one host sync: the chunk boundaries
    cuts = torch.searchsorted(cum, torch.arange(max_pairs, max(int(cum[-1]), max_pairs), max_pairs), right=True)
    edges = [0] + sorted({int(e) for e in cuts if 0 < int(e) < rows.numel()}) + [rows.numel()]
    for start, end in zip(edges[:-1], edges[1:]):
        yield _expand(rows[start:end], lo[rows[start:end]], per[start:end], order, exclude_self)


def _expand(rows: Tensor, lo: Tensor, per: Tensor, order: Tensor, exclude_self: bool) -> tuple[Tensor, Tensor]:
    """(ia, jb) of the rows' matches: row r matches sorted positions lo_r .. lo_r + per_r - 1."""
    ia = torch.repeat_interleave(rows, per)
    first = torch.repeat_interleave(torch.cumsum(per, 0) - per, per)
    jb = order[torch.repeat_interleave(lo, per) + torch.arange(ia.numel(), device=ia.device) - first]
    if exclude_self:
        keep = ia != jb
        ia, jb = ia[keep], jb[keep]
    return ia, jb


def pair_logits(img: Tensor, txt: Tensor, s: Tensor, o_a: Tensor, o_b: Tensor, ia: Tensor, jb: Tensor
                ) -> tuple[Tensor, Tensor, Tensor]:
    """(u_row, u_col, dot) of the pairs: dot = <img_ia, txt_jb> in the accumulation dtype (fp32,
    fp64 for fp64), u_row = s (dot - o_a[ia]) and u_col = s (dot - o_b[jb]) (logits relative
    to the offsets, as the tiles compute them)."""
    acc = o_a.dtype
    dot = torch.empty(ia.numel(), dtype=acc, device=img.device)
    step = max(1, PAIR_CHUNK // max(1, img.shape[1]))
    for lo in range(0, ia.numel(), step):
        i, j = ia[lo:lo + step], jb[lo:lo + step]
        dot[lo:lo + step] = (img[i].to(acc) * txt[j].to(acc)).sum(-1)
    s = s.to(acc)
    return s * (dot - o_a[ia]), s * (dot - o_b[jb]), dot


def scatter_lse(values: Tensor, index: Tensor, size: int) -> Tensor:
    """(size,) log sum_{k: index_k = r} exp(values_k); -inf where no value lands."""
    peak = torch.full((size,), float("-inf"), dtype=values.dtype, device=values.device)
    peak.scatter_reduce_(0, index, values, reduce="amax")
    safe = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    total = torch.zeros(size, dtype=values.dtype, device=values.device)
    total.index_add_(0, index, torch.exp(values - safe[index]))
    return safe + torch.log(total)


def _chunks(g_a: Tensor, g_b: Tensor, diag: bool, pairs: list | None):
    """The given pair chunks, or ``group_pairs``' (found now)."""
    return pairs if pairs is not None else group_pairs(g_a, g_b, diag)


def positive_forward(img: Tensor, txt: Tensor, scale: Tensor, o_a: Tensor, o_b: Tensor, g_a: Tensor, g_b: Tensor,
                     diag: bool, pairs: list | None = None) -> tuple[Tensor, Tensor]:
    """(row_part (m,), col_part (n,)): LSE over the block pair's same-group pairs (not i == j
    when ``diag``) of the logits relative to the offsets; -inf where a row/column has none.
    The full within-group LSE of a row is logaddexp(0, its parts merged over all blocks).
    pairs: those pairs' chunks when already found (``find_pairs``), else None."""
    acc = o_a.dtype
    row = torch.full((img.shape[0],), float("-inf"), dtype=acc, device=img.device)
    col = torch.full((txt.shape[0],), float("-inf"), dtype=acc, device=img.device)
    for ia, jb in _chunks(g_a, g_b, diag, pairs):
        u_row, u_col, _ = pair_logits(img, txt, scale, o_a, o_b, ia, jb)
        row = torch.logaddexp(row, scatter_lse(u_row, ia, row.numel()))
        col = torch.logaddexp(col, scatter_lse(u_col, jb, col.numel()))
    return row, col


def with_self(part: Tensor) -> Tensor:
    """The within-group LSE (relative to x_ii) from the off-diagonal parts: logaddexp(0, part)."""
    return torch.logaddexp(torch.zeros_like(part), part)


def positive_weight(pos_lse: Tensor) -> Tensor:
    """w_ii = exp(-pos_lse): the positive's own share of its group's softmax (1 when alone)."""
    return torch.exp(-pos_lse)


def positive_backward(img: Tensor, txt: Tensor, scale: Tensor, o_a: Tensor, o_b: Tensor, g_a: Tensor,
                      g_b: Tensor, diag: bool, pos_row: Tensor, pos_col: Tensor, g_row: Tensor, g_col: Tensor,
                      dimg: Tensor, dtxt: Tensor, pairs: list | None = None) -> Tensor:
    """Adds the same-group pairs' dX_ij = -(g_row_i w_ij + g_col_j w'_ij) (w: the within-group
    softmaxes, pos_row / pos_col their final LSEs relative to the offsets) to dimg += s dX T
    and dtxt += s dX^T I (in place, their dtype); returns their share of d scale (0-d).
    pairs: as ``positive_forward``."""
    acc = o_a.dtype
    s = scale.to(acc)
    ds = torch.zeros((), dtype=acc, device=img.device)
    for ia, jb in _chunks(g_a, g_b, diag, pairs):
        u_row, u_col, dot = pair_logits(img, txt, scale, o_a, o_b, ia, jb)
        dx = -(g_row[ia].to(acc) * torch.exp(u_row - pos_row[ia]) + g_col[jb].to(acc) * torch.exp(u_col - pos_col[jb]))
        ds += (dx * dot).sum()
        dimg.index_add_(0, ia, (s * dx[:, None] * txt[jb].to(acc)).to(dimg.dtype))
        dtxt.index_add_(0, jb, (s * dx[:, None] * img[ia].to(acc)).to(dtxt.dtype))
    return ds


def duplicate_pairs_device(group_ids: Tensor) -> Tensor:
    """0-d int64 tensor: the number of unordered pairs i < j with equal ids, on the device (a
    sort and two binary searches; no host sync)."""
    srt = torch.sort(group_ids).values
    size = torch.searchsorted(srt, srt, right=True) - torch.searchsorted(srt, srt)  # each one's group size
    return (size - 1).sum() // 2  # sum over groups of k (k - 1), halved


def duplicate_pairs(group_ids: Tensor) -> int:
    """Number of unordered pairs i < j with group_ids[i] == group_ids[j] (one host sync)."""
    return int(duplicate_pairs_device(group_ids))


def reference_terms(img: Tensor, txt: Tensor, scale: Tensor, group_ids: Tensor | None, duplicates: str) -> Tensor:
    """(b,) per-pair terms (row_i + col_i) / 2 of every mode from the full b x b matrix in
    float64, masked as the module docs state (tests only: O(b^2) memory)."""
    x = scale.double() * img.double() @ txt.double().T
    eye = torch.eye(x.shape[0], dtype=torch.bool, device=x.device)
    same = eye if duplicates == "off" else group_ids[:, None] == group_ids[None, :]
    if duplicates == "positive":
        grp = x.masked_fill(~same, float("-inf"))
        row = torch.logsumexp(x, 1) - torch.logsumexp(grp, 1)
        col = torch.logsumexp(x, 0) - torch.logsumexp(grp, 0)
    else:
        xm = x.masked_fill(same & ~eye, float("-inf"))
        row, col = torch.logsumexp(xm, 1) - x.diagonal(), torch.logsumexp(xm, 0) - x.diagonal()
    return 0.5 * (row + col)


def reference_loss(img: Tensor, txt: Tensor, scale: Tensor, group_ids: Tensor | None, duplicates: str) -> Tensor:
    """The CLIP loss of every mode from the full b x b matrix in float64 (tests only)."""
    return reference_terms(img, txt, scale, group_ids, duplicates).mean()
