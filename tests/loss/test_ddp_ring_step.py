"""A tiny CLIP model in DDP on W gloo ranks takes the same steps as one process on the
global batch, with the ring loss and with the all-gather baselines.

Each rank's loss is the mean over its local rows and DDP averages gradients, so every
parameter, the logit scale included, must get the single-process gradient of the global
mean: a scale gradient all-reduced inside the loss (as the published inf_cl does) would be
W times too large here. Ranks run this file as a script, like tests/loss/test_ring.py.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _gloo_launch import init_rank, launch  # noqa: E402

D_IMG, D_TXT, C, M = 11, 7, 13, 5  # input dims, embedding dim (not a power of 2), rows per rank
STEPS, LR = 2, 0.5


def test_ddp_step_matches_single_process_w4_w3_and_subgroup(tmp_path):
    launch(__file__, "ddp", 4, tmp_path)


# -- ranks (child side) ---------------------------------------------------------------------


class TinyClip(nn.Module):
    """Two linear encoders and open_clip's learnable log logit scale."""

    def __init__(self):
        super().__init__()
        self.img = nn.Linear(D_IMG, C)
        self.txt = nn.Linear(D_TXT, C)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, x_img, x_txt):
        f_img = nn.functional.normalize(self.img(x_img), dim=-1)
        f_txt = nn.functional.normalize(self.txt(x_txt), dim=-1)
        return f_img, f_txt, self.logit_scale.exp()


def batches(world: int, seed: int):
    """STEPS seeded global batches (x_img (b, D_IMG), x_txt (b, D_TXT)), b = world * M."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        x_img = torch.randn(world * M, D_IMG, generator=g)
        x_txt = x_img[:, :D_TXT] + 0.5 * torch.randn(world * M, D_TXT, generator=g)  # related pairs
        out.append((x_img, x_txt))
    return out


def single_process_grads(data) -> list[dict[str, torch.Tensor]]:
    """float64 ground truth: per step, the gradients of the global-batch mean loss."""
    from infclip.loss import clip_loss

    torch.manual_seed(0)
    model = TinyClip().double()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    for x_img, x_txt in data:
        opt.zero_grad()
        clip_loss(*model(x_img.double(), x_txt.double()), impl="vanilla").backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return grads


def ddp_grads(data, group, impl: str) -> list[dict[str, torch.Tensor]]:
    """The same steps with DDP on ``group``: each rank feeds its M rows, loss = local mean."""
    return ddp_grads_on(data, group, impl, torch.device("cpu"))


def ddp_grads_on(data, group, impl: str, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """``ddp_grads`` with the model and rows on ``device`` (a GPU per rank under NCCL);
    gradients come back on the CPU."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from infclip.loss import clip_loss

    torch.manual_seed(0)
    model = DDP(TinyClip().to(device), process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    rows = slice(dist.get_rank(group) * M, (dist.get_rank(group) + 1) * M)
    grads = []
    for x_img, x_txt in data:
        opt.zero_grad()
        clip_loss(*model(x_img[rows].to(device), x_txt[rows].to(device)), impl=impl, group=group).backward()
        grads.append({n.removeprefix("module."): p.grad.cpu().clone() for n, p in model.named_parameters()})
        opt.step()
    return grads


def check(got, want, tag: str, tol: float = 1e-5) -> None:
    for step, (g, w) in enumerate(zip(got, want)):
        for name in w:
            err = float((g[name].double() - w[name]).abs().max() / w[name].abs().max())
            assert err <= tol, f"{tag}, step {step}, grad of {name}: rel error {err:.2e} > {tol}"


def case_ddp():
    """DDP on all 4 ranks, on ranks {0, 1, 2} and on the non-contiguous subgroup {1, 3}."""
    import torch.distributed as dist

    rank, _ = init_rank()
    groups = [(members, dist.new_group(members)) for members in ([0, 1, 2, 3], [0, 1, 2], [1, 3])]
    for members, group in groups:
        if rank not in members:
            continue
        data = batches(len(members), seed=len(members))
        want = single_process_grads(data)
        for impl in ("torch", "local", "vanilla"):
            check(ddp_grads(data, group, impl), want, f"impl={impl}, members={members}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    {"ddp": case_ddp}[sys.argv[1]]()
