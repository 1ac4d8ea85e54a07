"""Duplicate-aware negatives across ranks: the ring (group ids travelling with their blocks)
equals one process on the concatenated global batch, against the float64 masked reference.

``LoopbackRing`` cases run in this process (the ring's schedule on W copies of the batch);
the gloo case launches 2 ranks running this file as a script (``_gloo_launch``), with the
PyTorch tiles and the Triton kernels (interpreted), both modes, duplicates across ranks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _gloo_launch import init_triton_rank, launch  # noqa: E402

C = 19


def batch(b: int, seed: int, scale: float):
    """Seeded (b, C) float32 features, group ids of sizes 1..many spread over the whole batch
    (so over ranks), near-duplicate texts within a group; the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, max(1, b // 3), (b,), generator=g) * 1_000_003 + 7
    img = torch.nn.functional.normalize(torch.randn(b, C, generator=g), dim=-1)
    cap = torch.randn(b, C, generator=g)[torch.unique(ids, return_inverse=True)[1]]
    txt = torch.nn.functional.normalize(img + 0.5 * cap + 0.1 * torch.randn(b, C, generator=g), dim=-1)
    return img, txt, torch.tensor(scale), ids


def reference(img, txt, scale, ids, mode: str, world: int):
    """Per-rank losses and the gradients of their sum (the DDP-summed objective), float64."""
    from infclip.loss.duplicates import reference_terms

    i, t, s = (x.double().requires_grad_() for x in (img, txt, scale))
    losses = reference_terms(i, t, s, ids, mode).view(world, -1).mean(1)
    losses.sum().backward()
    return losses.detach(), i.grad, t.grad, s.grad


@pytest.mark.parametrize("mode", ["mask", "positive"])
@pytest.mark.parametrize("world, m, tile", [(2, 7, 3), (3, 5, 2)])
def test_loopback_ring_matches_reference(mode, world, m, tile):
    """One process, W copies of the batch: every sample has W - 1 copies in the other blocks,
    all of its group, so every block pair has same-group pairs (float64, torch tiles)."""
    from infclip.loss import _tiled_loss
    from infclip.loss.duplicates import Duplicates
    from infclip.loss.ring import LoopbackRing
    from infclip.loss.tiled import TorchTileOps

    img, txt, scale, ids = batch(m, seed=world * 10 + m, scale=30.0)
    ref_loss, ref_di, ref_dt, ref_ds = reference(img.repeat(world, 1), txt.repeat(world, 1), scale,
                                                 ids.repeat(world), mode, world)
    i, t, s = (x.double().requires_grad_() for x in (img, txt, scale))
    loss = _tiled_loss(i, t, s, TorchTileOps(tile=tile), LoopbackRing(world), Duplicates(mode, ids))
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(i.grad, ref_di[:m], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(t.grad, ref_dt[:m], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s.grad * world, ref_ds, rtol=1e-10, atol=1e-12)


def test_gloo_ring_two_ranks_matches_one_process(tmp_path):
    launch(__file__, "ring", 2, tmp_path)


def _rank_case(name, loss_fn, mode, rank, world, b, scale, tol):
    import torch.distributed as dist

    img, txt, sc, ids = batch(b, seed=b, scale=scale)
    m = b // world
    ref_loss, ref_di, ref_dt, ref_ds = reference(img, txt, sc, ids, mode, world)
    rows = slice(rank * m, (rank + 1) * m)
    i, t = (x[rows].clone().requires_grad_() for x in (img, txt))
    s = sc.clone().requires_grad_()
    loss = loss_fn(i, t, s, ids[rows].clone())
    loss.backward()
    ds = s.grad.clone()
    dist.all_reduce(ds)  # what DDP's average gives, times W
    for what, got, want in (("loss", loss.detach(), ref_loss[rank]), ("dimg", i.grad, ref_di[rows]),
                            ("dtxt", t.grad, ref_dt[rows]), ("dscale", ds, ref_ds)):
        err = float((got.double() - want).abs().max() / want.abs().max().clamp_min(1.0 if what == "loss" else 1e-3))
        assert err <= tol, f"{name} {mode} rank {rank}: {what} rel err {err:.2e} > {tol}"


def case_ring():
    import torch.distributed as dist

    from infclip.kernels.clip import TritonTileOps
    from infclip.loss import _tiled_loss, clip_loss
    from infclip.loss.duplicates import Duplicates
    from infclip.loss.tiled import TorchTileOps

    rank, world = init_triton_rank()
    group = dist.group.WORLD
    for mode in ("mask", "positive"):
        impls = {
            "torch": lambda i, t, s, g: clip_loss(i, t, s, impl="torch", group=group, group_ids=g, duplicates=mode),
            "torch_tile3": lambda i, t, s, g: _tiled_loss(i, t, s, TorchTileOps(tile=3), group, Duplicates(mode, g)),
            "triton": lambda i, t, s, g: clip_loss(i, t, s, impl="triton", group=group, group_ids=g,
                                                   duplicates=mode),
            "triton_strips": lambda i, t, s, g: _tiled_loss(i, t, s, TritonTileOps(strips="always"), group,
                                                            Duplicates(mode, g)),
            # one-pass tiles summing into the ring's fp32 buffers, the ids travelling with the blocks
            "triton_onepass": lambda i, t, s, g: _tiled_loss(i, t, s, TritonTileOps(backward="onepass"), group,
                                                             Duplicates(mode, g)),
        }
        for name, fn in impls.items():
            for b, scale in ((22, 20.0), (34, 100.0)):
                _rank_case(name, fn, mode, rank, world, b, scale, 1e-4)
    dist.barrier()


if __name__ == "__main__":
    torch.manual_seed(0)
    {"ring": case_ring}[sys.argv[1]]()
    import torch.distributed as dist

    dist.destroy_process_group()
