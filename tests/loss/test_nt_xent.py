"""Tiled NT-Xent equals the naive full-matrix SimCLR loss: one process and W gloo ranks.

The report's grid (batch 4..128, dims 64..2048) at representative points: fp32 loss within
1e-5 and gradients within 1e-4 of the naive fp32 reference, and both against float64 truth.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _gloo_launch import init_triton_rank, launch, rel_err, subgroups  # noqa: E402

from infclip.loss import nt_xent_loss  # noqa: E402
from infclip.loss.nt_xent import TorchMaskedLSEOps, _NTXentRows, nt_xent_reference  # noqa: E402


def views(rows: int, dim: int, seed: int, *, peaked: bool = False, dtype=torch.float32) -> torch.Tensor:
    """(rows, dim) L2-normalized [view 1; view 2]. peaked: samples are near-duplicates of 3
    cluster centres and the views nearly coincide, so each softmax row has a few large,
    competing entries (hard negatives), as late in training."""
    g = torch.Generator().manual_seed(seed)
    n = rows // 2
    base = torch.randn(n, dim, generator=g, dtype=torch.float64)
    if peaked:
        base = torch.randn(3, dim, generator=g, dtype=torch.float64)[torch.arange(n) % 3] + 0.2 * base
    noise = (0.05 if peaked else 1.0) * torch.randn(rows, dim, generator=g, dtype=torch.float64)
    return F.normalize(torch.cat([base, base]) + noise, dim=-1).to(dtype)


def grads(fn, f, temperature):
    f = f.detach().clone().requires_grad_()
    t = torch.tensor(temperature, dtype=f.dtype, requires_grad=True)
    loss = fn(f, t)
    return loss.detach(), torch.autograd.grad(loss, (f, t))


def abs_err(got, want) -> float:
    return float((got.double() - want.double()).abs().max())


def naive(f, t):
    return nt_xent_reference(f, 1 / t)


@pytest.mark.parametrize("rows,dim", [(4, 64), (4, 2048), (34, 257), (128, 64), (128, 2048)])
@pytest.mark.parametrize("peaked", [False, True])
def test_matches_naive_reference_grid(rows, dim, peaked):
    f = views(rows, dim, seed=rows + dim, peaked=peaked)
    temperature = 0.05 if peaked else 0.5
    truth = grads(naive, f.double(), temperature)
    ref, ours = grads(naive, f, temperature), grads(nt_xent_loss, f, temperature)
    assert abs(float(ours[0] - ref[0])) <= 1e-5 * max(1.0, abs(float(ref[0])))
    for a, b in zip(ours[1], ref[1]):
        assert float((a - b).abs().max()) <= 1e-4
    # vs float64 truth: loss and feature gradients no worse than the naive fp32 matrix
    # (cut-cross-entropy's rule), up to fp32 rounding of logits of size 1/T. The temperature
    # gradient (-ds/T^2) amplifies the rounding of LSE - x_pos, which the tiled loss forms
    # from two separately rounded terms: 1e-5 relative plus eps(fp32)/T^2.
    for got, naive32, want in zip((ours[0], ours[1][0]), (ref[0], ref[1][0]), (truth[0], truth[1][0])):
        err, err_naive = abs_err(got, want), abs_err(naive32, want)
        assert err <= 2 * err_naive + 1e-6 / temperature, (err, err_naive)
    err, err_naive = abs_err(ours[1][1], truth[1][1]), abs_err(ref[1][1], truth[1][1])
    assert err <= 2 * err_naive + 1e-5 * float(truth[1][1].abs()) + 1.2e-7 / temperature**2
    assert ours[0].dtype == torch.float32


def test_small_tiles_float_temperature_and_no_temperature_grad():
    f = views(22, 13, seed=1)
    want = grads(naive, f.double(), 0.2)
    for tile in (1, 3, 7):
        x = f.clone().requires_grad_()
        t = torch.tensor(0.2, requires_grad=True)
        loss = _NTXentRows.apply(x, 1 / t, TorchMaskedLSEOps(tile=tile), None).mean()
        loss.backward()
        assert rel_err(loss.detach(), want[0]) < 1e-6 and rel_err(x.grad, want[1][0]) < 1e-5
        assert rel_err(t.grad, want[1][1]) < 1e-5
    x = f.clone().requires_grad_()
    nt_xent_loss(x, 0.2).backward()  # python float temperature: features still get gradients
    assert rel_err(x.grad, want[1][0]) < 1e-5


def test_bf16_within_fp32_accumulation_bound():
    f = views(64, 96, seed=4, dtype=torch.bfloat16)
    truth = grads(naive, f.double(), 0.1)
    ours = grads(nt_xent_loss, f, 0.1)
    assert ours[0].dtype == torch.float32 and ours[1][0].dtype == torch.bfloat16
    assert rel_err(ours[0], truth[0]) < 1e-5  # fp32 accumulation: only the inputs are bf16
    assert rel_err(ours[1][0], truth[1][0]) <= 2 ** -8  # fp32 gradient, one final rounding to bf16


def test_saves_only_features_and_vectors_not_the_matrix():
    rows, dim = 128, 8
    f = views(rows, dim, seed=2).requires_grad_()
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        nt_xent_loss(f, 0.1)
    assert max(sizes) <= rows * dim and sum(sizes) <= rows * dim + 4 * rows, sizes


def test_validation_messages():
    f = views(6, 8, seed=0)
    with pytest.raises(ValueError, match="even number of rows"):
        nt_xent_loss(f[:5], 0.1)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        nt_xent_loss(f, 0.0)
    with pytest.raises(ValueError, match="unknown impl"):
        nt_xent_loss(f, 0.1, impl="nope")
    assert torch.allclose(nt_xent_loss(f, 0.1, impl="vanilla"), nt_xent_loss(f, 0.1))


def test_ring_matches_global_batch_on_gloo(tmp_path):
    launch(__file__, "ring", 4, tmp_path)


# -- ranks (child side) ---------------------------------------------------------------------


def per_rank_reference(blocks: torch.Tensor, temperature: float, world: int):
    """float64 per-rank losses of W local [v1; v2] blocks and grads of their sum."""
    f = blocks.double().requires_grad_()
    t = torch.tensor(temperature, dtype=torch.float64, requires_grad=True)
    rows = f.shape[0] // world
    local = torch.arange(f.shape[0]) % rows
    pos = torch.arange(f.shape[0]) - local + (local + rows // 2) % rows
    x = (f @ f.T / t).masked_fill(torch.eye(f.shape[0], dtype=torch.bool), float("-inf"))
    losses = F.cross_entropy(x, pos, reduction="none").view(world, rows).mean(1)
    return losses.detach(), torch.autograd.grad(losses.sum(), (f, t))


def check_rank(blocks, temperature, group, tag, tol=1e-5, impl="auto"):
    import torch.distributed as dist

    world, r = dist.get_world_size(group), dist.get_rank(group)
    rows = blocks.shape[0] // world
    ref_l, (ref_df, ref_dt) = per_rank_reference(blocks, temperature, world)
    sl = slice(r * rows, (r + 1) * rows)
    loss, (df, dt) = grads(lambda f, t: nt_xent_loss(f, t, group=group, impl=impl), blocks[sl], temperature)
    dt = dt.double()
    dist.all_reduce(dt, group=group)
    mean = loss.double()
    dist.all_reduce(mean, group=group)
    # The mean of the per-rank losses is the single-process loss on [all views 1; all views 2].
    v = blocks.view(world, 2, rows // 2, -1).transpose(0, 1).reshape(blocks.shape)  # [views 1; views 2]
    single = nt_xent_reference(v.double(), torch.tensor(1 / temperature, dtype=torch.float64))
    errs = {"loss": rel_err(loss, ref_l[r]), "df": rel_err(df, ref_df[sl]), "dT(sum)": rel_err(dt, ref_dt),
            "mean vs single process": rel_err(mean / world, single)}
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"{tag} W={world} rank {r}: rel errors {bad} > {tol}"


def case_ring():
    import torch.distributed as dist

    rank, world = init_triton_rank()  # CPU tensors: Triton interpreted, on any machine
    for members, group in subgroups(rank, world):
        for rows, peaked in ((6, False), (2, False), (10, True)):
            # W local [v1; v2] blocks (positives within each block, hard negatives across them).
            w = len(members)
            v = views(w * rows, 37, seed=rows + w, peaked=peaked)  # [all views 1; all views 2]
            blocks = v.view(2, w, rows // 2, -1).transpose(0, 1).reshape(v.shape)
            for impl in ("torch", "triton") if rows == 6 else ("torch",):
                check_rank(blocks, 0.07 if peaked else 0.5, group, f"{impl} members={members} peaked={peaked}",
                           impl=impl)
    x = views(4 + 2 * (rank == 1), 37, seed=0)  # rank 1 has one more pair: every rank raises
    with pytest.raises(ValueError, match="same local batch shape"):
        nt_xent_loss(x, 0.1, group=dist.group.WORLD)
    dist.barrier()


if __name__ == "__main__":
    {"ring": case_ring}[sys.argv[1]]()
    import torch.distributed as dist

    dist.destroy_process_group()
