"""Duplicate-aware negatives (``clip_loss(..., group_ids=, duplicates=)``) against the float64
reference that builds the full masked matrix (``infclip.loss.duplicates.reference_loss``).

Fresh random inputs every draw; odd b (not a multiple of any tile), tiny tiles so every
block boundary is crossed, a peaked softmax (scale 100 on near-duplicate rows), groups of
size 1 to many. The Triton kernels run under the interpreter on CPU (tiny shapes).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from _same_sums import assert_same_sums  # noqa: E402

from infclip.loss import _tiled_loss, clip_loss  # noqa: E402
from infclip.loss.duplicates import Duplicates, duplicate_pairs, group_pairs, reference_loss  # noqa: E402
from infclip.loss.tiled import TorchTileOps  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
MODES = ["mask", "positive"]


def _batch(b: int, c: int, scale: float, groups: str, seed: int, dtype=torch.float64):
    """(img, txt, scale, group ids): L2-normalized features; duplicates get near-identical
    texts (as duplicated captions do), so their logits are among the largest of a row."""
    g = torch.Generator().manual_seed(seed)
    ids = {
        "unique": torch.arange(b),
        "pairs": torch.arange(b) // 2,
        "mixed": torch.randint(0, max(1, b // 3), (b,), generator=g),  # sizes 1..many
        "one": torch.zeros(b, dtype=torch.int64),  # the whole batch is one caption
    }[groups].to(torch.int64)
    ids = ids[torch.randperm(b, generator=g)] * 7919 + 12345  # scattered, not sorted, large ids
    img = torch.nn.functional.normalize(torch.randn(b, c, generator=g, dtype=torch.float64), dim=-1)
    base = torch.randn(b, c, generator=g, dtype=torch.float64)
    cap = base[torch.unique(ids, return_inverse=True)[1]]  # one "caption" per group
    txt = torch.nn.functional.normalize(img + 0.5 * cap + 0.1 * torch.randn(b, c, generator=g, dtype=torch.float64),
                                        dim=-1)
    s = torch.tensor(scale, dtype=torch.float64)
    return img.to(dtype).to(DEV), txt.to(dtype).to(DEV), s.to(DEV), ids.to(DEV)


def _grads(fn, img, txt, s):
    i, t, sc = (x.detach().clone().requires_grad_() for x in (img, txt, s))
    loss = fn(i, t, sc)
    loss.backward()
    return loss.detach(), i.grad, t.grad, sc.grad


def _reference(img, txt, s, ids, mode):
    return _grads(lambda i, t, sc: reference_loss(i, t, sc, ids, mode), img.double(), txt.double(), s.double())


def _close(got, want, rtol, atol):
    for name, a, b in zip(("loss", "d image", "d text", "d scale"), got, want):
        torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("b, tile, scale, groups", [(13, 4, 10.0, "mixed"), (23, 5, 100.0, "mixed"),
                                                    (9, 2, 100.0, "pairs"), (11, 3, 30.0, "one"),
                                                    (1, 1, 10.0, "unique")])
def test_torch_tiles_match_float64_masked_reference(mode, b, tile, scale, groups):
    img, txt, s, ids = _batch(b, 19, scale, groups, seed=b * 31 + tile)
    got = _grads(lambda i, t, sc: _tiled_loss(i, t, sc, TorchTileOps(tile=tile), None, Duplicates(mode, ids)),
                 img, txt, s)
    _close(got, _reference(img, txt, s, ids, mode), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_torch_tiles_fp32_match_reference(mode):
    img, txt, s, ids = _batch(37, 24, 100.0, "mixed", seed=5, dtype=torch.float32)
    got = _grads(lambda i, t, sc: clip_loss(i, t, sc, impl="torch", group_ids=ids, duplicates=mode), img, txt,
                 s.float())
    _close(got, _reference(img, txt, s, ids, mode), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("b, c, scale, groups", [(37, 24, 100.0, "mixed"), (21, 16, 10.0, "pairs"),
                                                 (9, 8, 50.0, "one")])
def test_triton_kernels_match_float64_masked_reference(mode, b, c, scale, groups):
    """The Triton path (interpreter on CPU): forward LSEs and all gradients; b is not a
    multiple of the 32-row tiles, so masked rows and columns are crossed too."""
    img, txt, s, ids = _batch(b, c, scale, groups, seed=b + c, dtype=torch.float32)
    got = _grads(lambda i, t, sc: clip_loss(i, t, sc, impl="triton", group_ids=ids, duplicates=mode), img, txt,
                 s.float())
    _close(got, _reference(img, txt, s, ids, mode), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("mode", MODES)
def test_unique_groups_equal_duplicates_off(impl, mode):
    """All groups of size one: the same loss and gradients as duplicates="off" (torch tiles:
    bit for bit; Triton: "mask" sorts the pairs by group id, here a permutation of the batch,
    so the same sums in another order: to fp32 rounding; "positive": the generic sparse terms
    against none, to fp32 rounding)."""
    img, txt, s, ids = _batch(29, 16, 50.0, "unique", seed=3, dtype=torch.float32)
    off = _grads(lambda i, t, sc: clip_loss(i, t, sc, impl=impl), img, txt, s.float())
    on = _grads(lambda i, t, sc: clip_loss(i, t, sc, impl=impl, group_ids=ids, duplicates=mode), img, txt, s.float())
    if impl == "torch":
        for a, b in zip(on, off):
            assert torch.equal(a, b)
    else:
        _close(on, off, rtol=1e-5, atol=1e-5)  # off's own error against float64 here: up to 3e-6


def test_triton_mask_of_sorted_unique_ids_is_off_bit_for_bit():
    """Ids already sorted and unique: the sort is the identity and the band w = 0 holds only
    the diagonal tiles, so "mask" runs the very sums of "off" (the compare drops only i == j,
    which the diagonal handling restores): equal bit for bit (on the GPU, separately compiled
    variants: within a few fp32 roundings, ``_same_sums``)."""
    img, txt, s, _ = _batch(45, 16, 50.0, "unique", seed=6, dtype=torch.float32)
    ids = torch.arange(45, device=DEV) * 3 + 7
    off = _grads(lambda i, t, sc: clip_loss(i, t, sc, impl="triton"), img, txt, s.float())
    on = _grads(lambda i, t, sc: clip_loss(i, t, sc, impl="triton", group_ids=ids, duplicates="mask"), img, txt,
                s.float())
    for name, a, b in zip(("loss", "d image", "d text", "d scale"), on, off):
        assert_same_sums(a, b, name)


def test_off_is_the_default_and_unchanged():
    img, txt, s, _ = _batch(17, 8, 20.0, "unique", seed=9, dtype=torch.float32)
    a = clip_loss(img, txt, s.float(), impl="torch")
    b = clip_loss(img, txt, s.float(), impl="torch", duplicates="off")
    assert torch.equal(a, b)


def test_bad_arguments_are_refused():
    img, txt, s, ids = _batch(6, 4, 10.0, "pairs", seed=1, dtype=torch.float32)
    s = s.float()
    with pytest.raises(ValueError, match="duplicates='sometimes' is not valid"):
        clip_loss(img, txt, s, duplicates="sometimes", group_ids=ids)
    with pytest.raises(ValueError, match="needs group_ids"):
        clip_loss(img, txt, s, duplicates="mask")
    with pytest.raises(ValueError, match="group_ids were given with duplicates='off'"):
        clip_loss(img, txt, s, group_ids=ids)
    with pytest.raises(ValueError, match=r"int64 tensor of shape \(6,\)"):
        clip_loss(img, txt, s, duplicates="mask", group_ids=ids[:5])
    with pytest.raises(ValueError, match="needs a tiled impl"):
        clip_loss(img, txt, s, impl="vanilla", duplicates="mask", group_ids=ids)


def test_group_pairs_and_duplicate_count():
    ids = torch.tensor([5, 1, 5, 2, 5, 1])
    assert duplicate_pairs(ids) == 3 + 1
    pairs = torch.cat([torch.stack(p) for p in group_pairs(ids, ids, exclude_self=True, max_pairs=3)], 1)
    want = {(i, j) for i in range(6) for j in range(6) if i != j and ids[i] == ids[j]}
    assert {tuple(p) for p in pairs.T.tolist()} == want and pairs.shape[1] == len(want)
    assert list(group_pairs(torch.arange(4), torch.arange(4), exclude_self=True)) == []


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("positives", ["fold", "fixup"])
def test_triton_strip_backward_matches_reference(mode, positives):
    """The strip backward (scratch s * dX, then a product) with the group mask in its epilogue."""
    from infclip.kernels.clip import TritonTileOps

    img, txt, s, ids = _batch(45, 16, 100.0, "mixed", seed=11, dtype=torch.float32)
    ops = TritonTileOps(strips="always", strip_positives=positives)
    got = _grads(lambda i, t, sc: _tiled_loss(i, t, sc, ops, None, Duplicates(mode, ids)), img, txt, s.float())
    _close(got, _reference(img, txt, s, ids, mode), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("mode", MODES)
def test_only_some_inputs_require_grad(mode):
    """Every combination of which inputs require grad gives the reference's gradients for them."""
    img, txt, s, ids = _batch(15, 8, 40.0, "mixed", seed=2, dtype=torch.float32)
    ref = _reference(img, txt, s, ids, mode)
    for need in ((True, False, False), (False, True, True), (False, False, True)):
        xs = [x.detach().clone().float().requires_grad_(n) for x, n in zip((img, txt, s), need)]
        clip_loss(*xs, impl="torch", group_ids=ids, duplicates=mode).backward()
        for x, n, want in zip(xs, need, ref[1:]):
            assert (x.grad is None) != n
            if n:
                torch.testing.assert_close(x.grad.double(), want, rtol=2e-4, atol=2e-5)


def test_bench_duplicates_dry_run_prints_the_table(tmp_path):
    """scripts/bench/bench_loss.py --duplicates: its CPU-side handling (arguments, group ids, the
    three modes, the table and CSV) on the PyTorch tiles, tiny shapes."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "bench_loss.py"
    cmd = [sys.executable, str(script), "--duplicates", "--dry-run", "--dup-batches", "40", "--dup-dims", "8",
           "--dup-frac", "0.1", "--reps", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mask +%" in proc.stdout and "pos +%" in proc.stdout
    assert (tmp_path / "bench_duplicates.csv").read_text().startswith("b,c,pairs,off,mask,positive")
    split = subprocess.run(cmd + ["--breakdown"], capture_output=True, text=True, timeout=300)
    assert split.returncode == 0, split.stderr[-3000:]
    assert "bwd +%" in split.stdout and "prep ms" in split.stdout and split.stdout.count(" positive ") >= 1
    header = (tmp_path / "bench_duplicates.csv").read_text().splitlines()[0]
    assert header.startswith("b,c,pairs,off,mask,positive,off_fwd,off_bwd") and header.endswith("positive_prep")
    bad = subprocess.run(cmd[:2] + ["--dry-run", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--dry-run applies to --duplicates only" in bad.stderr


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("mode", MODES)
def test_bf16_inputs_within_bf16_rounding_of_reference(impl, mode):
    """bf16 features (the training dtype): loss and gradients within bf16's rounding of the
    float64 reference on the same (rounded) inputs; the gradients are written in bf16."""
    img, txt, s, ids = _batch(33, 16, 100.0, "mixed", seed=13, dtype=torch.bfloat16)
    got = _grads(lambda i, t, sc: clip_loss(i, t, sc, impl=impl, group_ids=ids, duplicates=mode), img, txt,
                 s.float())
    want = _reference(img, txt, s, ids, mode)
    assert got[1].dtype == torch.bfloat16
    for name, a, b in zip(("loss", "d image", "d text", "d scale"), got, want):
        err = float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-3))
        assert err < 2e-2, f"{name}: relative error {err:.2e}"


def test_dense_ids_find_pairs_and_device_count():
    """dense_ids: int32, equal exactly where the ids are; find_pairs: every ordered same-group
    pair i != j once ([] when none, None past the cap); the device count equals the host's."""
    from infclip.loss.duplicates import dense_ids, duplicate_pairs_device, find_pairs

    _, _, _, ids = _batch(40, 4, 10.0, "mixed", seed=21)
    dense = dense_ids(ids)
    assert dense.dtype == torch.int32
    assert torch.equal(dense[:, None] == dense[None, :], ids[:, None] == ids[None, :])
    (ia, jb), = find_pairs(ids)
    want = {(i, j) for i in range(40) for j in range(40) if i != j and ids[i] == ids[j]}
    assert {tuple(p) for p in torch.stack([ia, jb]).T.tolist()} == want and ia.numel() == len(want)
    assert find_pairs(torch.arange(7)) == [] and find_pairs(ids, cap=len(want) - 1) is None
    assert int(duplicate_pairs_device(ids)) == duplicate_pairs(ids) == len(want) // 2


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backward", ["onepass", "twopass"])
def test_triton_fused_node_equals_generic_node_and_reference(mode, backward, monkeypatch):
    """clip_loss(impl="triton") with group ids takes the fused node of duplicates="off"
    (_SortedMask: TritonCLIPLoss's passes on the batch sorted by group, for "mask"; _FusedPositive
    for "positive"), under
    both backwards; it equals the generic tiled node on the raw int64 ids and the float64
    reference."""
    from infclip.kernels.clip import TritonTileOps
    from infclip.kernels.clip import ops as ops_mod

    img, txt, s, ids = _batch(45, 16, 100.0, "mixed", seed=17, dtype=torch.float32)
    node = {"mask": "_SortedMaskBackward", "positive": "_FusedPositiveBackward"}[mode]
    # the ops clip_loss builds take backward="auto": make it resolve to `backward` on CPU too
    monkeypatch.setattr(ops_mod.TritonTileOps, "path_for", lambda self, t: backward)
    loss = clip_loss(img.clone().requires_grad_(), txt, s.float(), impl="triton", group_ids=ids,
                     duplicates=mode)
    assert type(loss.grad_fn).__name__ == node
    fused = _grads(lambda i, t, sc: clip_loss(i, t, sc, impl="triton", group_ids=ids, duplicates=mode),
                   img, txt, s.float())
    monkeypatch.undo()
    ops = TritonTileOps(backward=backward)
    generic = _grads(lambda i, t, sc: _tiled_loss(i, t, sc, ops, None, Duplicates(mode, ids)), img, txt, s.float())
    if mode == "mask":  # the fused node sorts the pairs by group: the same sums in another order
        _close(fused, generic, rtol=1e-4, atol=1e-5)
    else:
        _close(fused, generic, rtol=1e-5, atol=1e-6)
    _close(fused, _reference(img, txt, s, ids, mode), rtol=2e-4, atol=2e-5)


def test_positive_past_the_pair_cap_uses_chunked_pairs(monkeypatch):
    """More same-group pairs than the precomputed list holds (one caption fills the batch):
    both passes go through the chunked group_pairs, still exact (Triton fused node)."""
    from infclip.loss import duplicates

    monkeypatch.setattr(duplicates, "PAIRS_PER_ROW", 0)
    monkeypatch.setattr(duplicates, "PAIRS_FIXED", 4)
    img, txt, s, ids = _batch(11, 8, 30.0, "one", seed=4, dtype=torch.float32)
    assert duplicates.prepare("positive", ids).pairs is None
    got = _grads(lambda i, t, sc: clip_loss(i, t, sc, impl="triton", group_ids=ids, duplicates="positive"),
                 img, txt, s.float())
    _close(got, _reference(img, txt, s, ids, "positive"), rtol=2e-4, atol=2e-5)


def test_triton_mask_kernels_take_int32_and_int64_ids():
    """The tile ops accept int32 dense ranks and int64 ids (the ring's) alike: same LSEs and
    gradients; other dtypes are refused."""
    from infclip.kernels.clip import TritonTileOps
    from infclip.loss.duplicates import dense_ids

    img, txt, s, ids = _batch(37, 16, 50.0, "mixed", seed=8, dtype=torch.float32)
    ops = TritonTileOps(backward="onepass")
    runs = [_grads(lambda i, t, sc: _tiled_loss(i, t, sc, ops, None, Duplicates("mask", g)), img, txt, s.float())
            for g in (ids, dense_ids(ids))]
    _close(runs[0], runs[1], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="int32 or int64"):
        ops.forward(img, txt, s.float(), groups=(ids.to(torch.int16), ids.to(torch.int16)))
