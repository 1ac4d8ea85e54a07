"""Child side of tests/multigpu/test_nccl_ranks.py: one case on every rank of a torchrun launch
(NCCL, one GPU per rank). A failed check raises, so the rank exits non-zero."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "loss"))


def init() -> tuple[int, int]:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    return dist.get_rank(), dist.get_world_size()


def features(b: int, c: int, seed: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded global (b, c) pairs, unit rows, related (a non-trivial softmax), on this GPU."""
    g = torch.Generator().manual_seed(seed)
    img = torch.nn.functional.normalize(torch.randn(b, c, generator=g, dtype=torch.float64), dim=-1)
    txt = torch.nn.functional.normalize(img + 0.8 * torch.randn(b, c, generator=g, dtype=torch.float64), dim=-1)
    return img.to("cuda", dtype), txt.to("cuda", dtype)


def loss_and_grads(img, txt, scale, **kw):
    from infclip.loss import clip_loss

    img, txt = img.detach().requires_grad_(), txt.detach().requires_grad_()
    s = scale.detach().clone().requires_grad_()
    loss = clip_loss(img, txt, s, **kw)
    loss.backward()
    return loss.detach(), img.grad, txt.grad, s.grad


def case_ring():
    """The ring (Triton tiles, bf16 and fp32) against the one-GPU loss of the global batch and
    a float64 reference: the ring's error is no worse than the one-GPU loss's own (x2 + eps);
    bf16 also with the backward's last tile in column chunks (``ring.HOME_CHUNK_MIN_ROWS`` 256:
    chunks of 768, 384 and 384 texts, each sent home while the next computes)."""
    from infclip.loss import ring as ring_mod

    rank, world = init()
    m, c, scale = 1536, 256, torch.tensor(30.0, device="cuda", dtype=torch.float64)
    rows = slice(rank * m, (rank + 1) * m)
    whole = ring_mod.HOME_CHUNK_MIN_ROWS  # > m / 2: the last tile whole
    for dtype, chunk_rows in ((torch.bfloat16, whole), (torch.float32, whole), (torch.bfloat16, 256)):
        ring_mod.HOME_CHUNK_MIN_ROWS = chunk_rows
        img, txt = features(world * m, c, seed=world, dtype=dtype)
        ref = loss_and_grads(img.double(), txt.double(), scale, impl="vanilla")
        one = loss_and_grads(img, txt, scale.float(), impl="triton")
        ring = loss_and_grads(img[rows], txt[rows], scale.float(), impl="triton", group=dist.group.WORLD)
        # each rank's loss is its rows' mean, and its gradients are those of the sum over ranks
        # (DDP averages them): the global mean's are 1 / W of them, the scale's summed over ranks
        total = torch.stack([ring[0] * m, ring[3]]).double()
        dist.all_reduce(total)
        got = (total[0] / (world * m), ring[1].double() / world, ring[2].double() / world, total[1] / world)
        want = (ref[0], ref[1][rows], ref[2][rows], ref[3])
        base = (one[0], one[1][rows], one[2][rows], one[3])
        for name, g, w, b in zip(("loss", "d img", "d txt", "d scale"), got, want, base):
            err = float((g.double() - w).abs().max() / w.abs().max())
            err_one = float((b.double() - w).abs().max() / w.abs().max())
            assert err <= 2 * err_one + 1e-6, (f"{dtype} {name} (chunks from {chunk_rows} rows): ring error "
                                               f"{err:.2e}, one GPU {err_one:.2e}")
    dist.destroy_process_group()


def case_ddp():
    """A tiny CLIP in DDP over NCCL takes the single-process float64 steps (ring, Triton fp32)."""
    from test_ddp_ring_step import M, batches, check, ddp_grads_on, single_process_grads

    rank, world = init()
    data = batches(world, seed=world)
    want = single_process_grads(data)
    got = ddp_grads_on(data, dist.group.WORLD, "triton", torch.device("cuda", torch.cuda.current_device()))
    check(got, want, f"nccl, {world} ranks of {M} rows", tol=1e-4)
    dist.destroy_process_group()


if __name__ == "__main__":
    {"ring": case_ring, "ddp": case_ddp}[sys.argv[1]]()
