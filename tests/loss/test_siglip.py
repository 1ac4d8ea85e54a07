"""Tiled SigLIP equals open_clip's ``SigLipLoss``: one process and W gloo ranks (its ring).

Ground truth is float64; in float32 the tiled loss must match to 1e-5 relative, in bf16 its
error must be no worse than open_clip's own (which rounds the logits to bf16).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _gloo_launch import init_triton_rank, launch, rel_err, subgroups  # noqa: E402

from infclip.loss import siglip_loss  # noqa: E402
from infclip.loss.siglip import TorchSigmoidOps, _SigmoidRows  # noqa: E402


def batch(b: int, c: int, seed: int, *, peaked: bool = False, dtype=torch.float32):
    """(img, txt, scale, bias); peaked: near-duplicate pairs, large scale (late training)."""
    g = torch.Generator().manual_seed(seed)
    img = F.normalize(torch.randn(b, c, generator=g, dtype=torch.float64), dim=-1)
    txt = F.normalize(img + (0.05 if peaked else 1.0) * torch.randn(b, c, generator=g, dtype=torch.float64), dim=-1)
    scale, bias = (torch.tensor(40.0), torch.tensor(-15.0)) if peaked else (torch.tensor(10.0), torch.tensor(-10.0))
    return img.to(dtype), txt.to(dtype), scale.to(dtype), bias.to(dtype)


def open_clip_loss_module():
    """open_clip/loss.py loaded on its own: it needs only torch, and importing the whole
    open_clip package (timm, transformers) costs each gloo rank many seconds."""
    import importlib.util

    if "_open_clip_loss" not in sys.modules:
        root = importlib.util.find_spec("open_clip").submodule_search_locations[0]
        spec = importlib.util.spec_from_file_location("_open_clip_loss", Path(root) / "loss.py")
        sys.modules["_open_clip_loss"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["_open_clip_loss"]


def open_clip_grads(img, txt, scale, bias, rank=0, world=1, dist_impl=None, dtype=None):
    """open_clip SigLipLoss value and gradients w.r.t. (img, txt, scale, bias)."""
    SigLipLoss = open_clip_loss_module().SigLipLoss
    dtype = dtype or img.dtype
    xs = [x.detach().to(dtype).requires_grad_() for x in (img, txt, scale, bias)]
    loss = SigLipLoss(rank=rank, world_size=world, dist_impl=dist_impl)(*xs)
    return loss.detach(), torch.autograd.grad(loss, xs)


def ours_grads(img, txt, scale, bias, **kw):
    xs = [x.detach().clone().requires_grad_() for x in (img, txt, scale, bias)]
    loss = siglip_loss(*xs, **kw)
    return loss.detach(), torch.autograd.grad(loss, xs)


def assert_close(got, want, tol: float, tag: str):
    (l1, g1), (l2, g2) = got, want
    errs = {"loss": rel_err(l1, l2), **{n: rel_err(a, b) for n, a, b in zip(("dimg", "dtxt", "ds", "db"), g1, g2)}}
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"{tag}: rel errors {bad} > {tol}"


@pytest.mark.parametrize("b,c", [(1, 8), (7, 37), (130, 64)])
@pytest.mark.parametrize("peaked", [False, True])
def test_matches_open_clip_fp32_fp64(b, c, peaked):
    img, txt, s, t = batch(b, c, seed=b + c, peaked=peaked, dtype=torch.float64)
    truth = open_clip_grads(img, txt, s, t)
    assert_close(ours_grads(img, txt, s, t), truth, 1e-12, "float64")
    f32 = [x.float() for x in (img, txt, s, t)]
    assert_close(ours_grads(*f32), truth, 1e-5, f"float32 peaked={peaked}")


def test_small_tiles_and_odd_shapes_equal_one_tile():
    img, txt, s, t = batch(11, 5, seed=3)
    for tile in (1, 3, 4):
        xs = [x.clone().requires_grad_() for x in (img, txt, s, t)]
        rows = _SigmoidRows.apply(*xs, TorchSigmoidOps(tile=tile), None)
        got = (rows.sum() / 11).detach(), torch.autograd.grad(rows.sum() / 11, xs)
        assert_close(got, open_clip_grads(img, txt, s, t), 1e-5, f"tile={tile}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_torch_backward_accumulates_in_place(dtype):
    """``TorchSigmoidOps.backward`` (one pass, ``addmm_`` of s dX into the gradients) equals the
    two products formed per block and added, s (dX @ T) and s (dX^T @ I), to fp32 rounding,
    with fresh buffers and accumulating into given ones (the ring's), which it returns."""
    img, txt, s, t = batch(9, 13, seed=4, dtype=dtype)
    g = torch.linspace(0.5, 1.5, 9, dtype=torch.float64).to(dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    i32, t32 = img.to(acc), txt.to(acc)
    zx = -(s.to(acc) * i32 @ t32.T + t.to(acc))
    zx.diagonal().neg_()
    dx = torch.sigmoid(-zx)
    dx.diagonal().neg_()
    dx *= g.to(acc)[:, None]
    want_i, want_t = s.to(acc) * (dx @ t32), s.to(acc) * (dx.T @ i32)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    ops = TorchSigmoidOps(tile=4)
    di, dt, _, _ = ops.backward(img, txt, s, t, g, True)
    assert di.dtype == dt.dtype == acc
    assert rel_err(di, want_i) < tol and rel_err(dt, want_t) < tol
    base_i, base_t = torch.randn(9, 13, dtype=acc), torch.randn(9, 13, dtype=acc)
    bi, bt = base_i.clone(), base_t.clone()
    di, dt, _, _ = ops.backward(img, txt, s, t, g, True, dimg=bi, dtxt=bt)
    assert di is bi and dt is bt
    assert rel_err(di - base_i, want_i) < tol and rel_err(dt - base_t, want_t) < tol


def test_row_blocks_capped_by_tile_elements(monkeypatch):
    """Rows per tile shrink as n grows (fixed working set); the result is unchanged."""
    import infclip.loss.tiled as tiled

    assert [hi - lo for lo, hi in tiled.row_blocks(10, 2**23, 1024)] == [2] * 5
    monkeypatch.setattr(tiled, "TILE_ELEMENTS", 40)  # n = 13 -> 3 rows per tile
    img, txt, s, t = batch(13, 6, seed=8)
    assert_close(ours_grads(img, txt, s, t), open_clip_grads(img, txt, s, t), 1e-5, "capped tiles")


def vanilla_bf16_loss(img, txt, s, t):
    """open_clip's SigLipLoss in bf16: logits rounded to bf16 (fp32-accumulated GEMM), bf16 math.

    Emulated with an fp32 matmul: bf16 GEMMs crash some CI CPUs (illegal instruction).
    """
    logits = (s.float() * img.float() @ txt.float().T).bfloat16() + t
    labels = 2 * torch.eye(img.shape[0], dtype=torch.bfloat16) - 1
    return -F.logsigmoid(labels * logits).sum() / img.shape[0]


def test_bf16_no_worse_than_vanilla():
    img, txt, s, t = batch(96, 64, seed=5, dtype=torch.bfloat16)
    truth = open_clip_grads(img, txt, s, t, dtype=torch.float64)
    ours = ours_grads(img, txt, s, t)
    assert ours[0].dtype == torch.float32 and ours[1][0].dtype == torch.bfloat16
    assert rel_err(ours[0], truth[0]) <= max(rel_err(vanilla_bf16_loss(img, txt, s, t), truth[0]), 1e-6)
    assert rel_err(ours[0], truth[0]) < 1e-5  # fp32 accumulation: only the inputs are bf16
    for got, want in zip(ours[1], truth[1]):
        assert rel_err(got, want) <= 2 ** -8  # fp32 gradients, one final rounding to bf16


def test_requires_grad_combinations_and_validation():
    img, txt, s, t = batch(6, 9, seed=2)
    want = open_clip_grads(img, txt, s, t)[1]
    for mask in range(16):
        xs = [x.clone().requires_grad_(bool(mask >> k & 1)) for k, x in enumerate((img, txt, s, t))]
        loss = siglip_loss(*xs)
        if mask:
            loss.backward()
        for x, w, k in zip(xs, want, range(4)):
            assert (x.grad is None) == (not mask >> k & 1)
            if x.grad is not None:
                assert rel_err(x.grad, w) < 1e-5
    assert torch.allclose(siglip_loss(img, txt, 10.0, -10.0), siglip_loss(img, txt, s, t))
    with pytest.raises(ValueError, match="same shape"):
        siglip_loss(img, txt[:5], s, t)
    with pytest.raises(ValueError, match="logit_bias must be a scalar"):
        siglip_loss(img, txt, s, torch.zeros(2))
    with pytest.raises(ValueError, match="unknown impl"):
        siglip_loss(img, txt, s, t, impl="bogus")


def saved_numel(fn) -> tuple[int, int]:
    """(largest, total) numel of the tensors autograd saves while ``fn()`` runs forward."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return max(sizes), sum(sizes)


def test_saves_only_inputs_and_vectors_not_the_logits():
    b, c = 96, 8  # b > c: a saved (b, b) logits matrix would stand out
    img, txt, s, t = (x.requires_grad_() for x in batch(b, c, seed=1))
    largest, total = saved_numel(lambda: siglip_loss(img, txt, s, t))
    assert largest <= b * c and total <= 2 * b * c + 8 * b
    largest_oc, _ = saved_numel(lambda: open_clip_loss_module().SigLipLoss()(img, txt, s, t))
    assert largest_oc >= b * b  # the reference keeps the full matrix


def test_ring_matches_open_clip_ring_on_gloo(tmp_path):
    launch(__file__, "ring", 4, tmp_path)


# -- ranks (child side) ---------------------------------------------------------------------


def per_rank_reference(img, txt, s, t, world: int):
    """float64 per-rank losses L_q and gradients of sum_q L_q over the global batch."""
    xs = [x.double().requires_grad_() for x in (img, txt, s, t)]
    i, tt, sc, bi = xs
    logits = sc * i @ tt.T + bi
    labels = 2 * torch.eye(i.shape[0], dtype=torch.float64) - 1
    losses = -F.logsigmoid(labels * logits).view(world, -1, i.shape[0]).sum((1, 2)) / (i.shape[0] // world)
    return losses.detach(), torch.autograd.grad(losses.sum(), xs)


def check_rank(img, txt, s, t, group, tag, tol=1e-5, **kw):
    """This rank's loss and gradients vs the float64 global reference (s, t grads summed)."""
    import torch.distributed as dist

    world, r = dist.get_world_size(group), dist.get_rank(group)
    m = img.shape[0] // world
    ref_l, (ref_di, ref_dt, ref_ds, ref_db) = per_rank_reference(img, txt, s, t, world)
    sl = slice(r * m, (r + 1) * m)
    loss, (di, dt, ds, db) = ours_grads(img[sl], txt[sl], s, t, group=group, **kw)
    dsb = torch.stack([ds, db]).double()
    dist.all_reduce(dsb, group=group)  # what DDP's average gives, times W
    got = (loss, (di, dt, dsb[0], dsb[1]))
    assert_close(got, (ref_l[r], (ref_di[sl], ref_dt[sl], ref_ds, ref_db)), tol, f"{tag} W={world} rank {r}")


def case_ring():
    import torch.distributed as dist

    rank, world = init_triton_rank()  # CPU tensors: Triton interpreted, on any machine
    for members, group in subgroups(rank, world):
        for m, peaked in ((5, False), (3, True), (1, False)):
            data = batch(len(members) * m, 37, seed=m + len(members), peaked=peaked)
            for impl in ("torch", "vanilla") + (("triton",) if m == 3 else ()):
                check_rank(*data, group, f"{impl} members={members} peaked={peaked}", impl=impl)
    # Autograd saves the same O(m c) per rank whatever W is (open_clip's ring saves W blocks of logits).
    img, txt, s, t = (x.requires_grad_() for x in batch(8 * world, 4, seed=2))
    sl = slice(8 * rank, 8 * rank + 8)
    largest, total = saved_numel(lambda: siglip_loss(img[sl], txt[sl], s, t, group=dist.group.WORLD))
    assert largest <= 8 * 4 and total <= 2 * 8 * 4 + 8 * 8, (largest, total)
    _, total_oc = saved_numel(lambda: open_clip_loss_module().SigLipLoss(rank=rank, world_size=world)(
        img[sl], txt[sl], s, t))
    assert total_oc >= world * 8 * 8, total_oc
    # open_clip's own ring (global ranks, world group): equal value and gradients per rank.
    for dist_impl in ("shift", "bidir"):
        img, txt, s, t = batch(4 * world, 24, seed=9, dtype=torch.float64)
        sl = slice(4 * rank, 4 * rank + 4)
        want = open_clip_grads(img[sl], txt[sl], s, t, rank=rank, world=world, dist_impl=dist_impl)
        got = ours_grads(img[sl], txt[sl], s, t, group=dist.group.WORLD)
        assert_close(got, want, 1e-12, f"vs open_clip {dist_impl} rank {rank}")
    img, txt, s, t = batch(5 + (rank == 1), 37, seed=0)  # rank 1 has one more pair: every rank raises
    for impl in ("torch", "vanilla"):
        with pytest.raises(ValueError, match="same local batch shape"):
            siglip_loss(img, txt, s, t, impl=impl, group=dist.group.WORLD)
    dist.barrier()


if __name__ == "__main__":
    {"ring": case_ring}[sys.argv[1]]()
    import torch.distributed as dist

    dist.destroy_process_group()
