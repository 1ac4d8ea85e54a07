"""Full-matrix baselines: ``vanilla`` (open_clip's ClipLoss) and ``local``, on one rank or many.

These materialize b x b (or b/W x b) logits on purpose: they are what the tiled loss is
measured against, and the ground truth of the tests (run them in float64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _ce_pair(logits_img: Tensor, logits_txt: Tensor, labels: Tensor) -> Tensor:
    loss = 0.5 * (F.cross_entropy(logits_img, labels) + F.cross_entropy(logits_txt, labels))
    return loss.float() if loss.dtype != torch.float64 else loss


def vanilla_loss(img: Tensor, txt: Tensor, scale: Tensor) -> Tensor:
    """open_clip ``ClipLoss`` on one rank: logits in the input dtype, symmetric CE."""
    logits = scale.to(img.dtype) * img @ txt.T
    labels = torch.arange(img.shape[0], device=img.device)
    return _ce_pair(logits, logits.T, labels)


# -- across ranks: all-gather with grad (open_clip's ``gather_with_grad=True``) -------------
# Both return this rank's local-rows loss (the convention of ``clip_loss``) and need equal
# local batch sizes (``infclip.loss.ring.check_equal_shapes`` is called before them). The
# gather's backward sums every rank's gradient into the owner, so each rank's feature
# gradient is d(sum over ranks of the losses)/d(local features), as in the ring.


class _GatherWithGrad(torch.autograd.Function):
    """all_gather forward; backward sums every rank's gradient of the gathered tensor and
    keeps this rank's slice (reduce-scatter on NCCL, all-reduce + slice where unsupported)."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        ctx.group, world = group, dist.get_world_size(group)
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.14
        gather(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        world, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        m, grad = grad.shape[0] // world, grad.contiguous()
        if dist.get_backend(ctx.group) == "nccl":
            out = grad.new_empty((m, *grad.shape[1:]))
            scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            scatter(out, grad, group=ctx.group)
            return out, None
        grad = grad.clone()  # all_reduce is in place; autograd may still hold grad
        dist.all_reduce(grad, group=ctx.group)
        return grad[rank * m:(rank + 1) * m], None


def _gather(x: Tensor, group) -> Tensor:
    """(W * m, c) concatenation of every rank's x, differentiable (grads summed at owners)."""
    return _GatherWithGrad.apply(x, group)


def _local_labels(x: Tensor, group) -> Tensor:
    import torch.distributed as dist

    m = x.shape[0]
    return torch.arange(m, device=x.device) + dist.get_rank(group) * m


def distributed_vanilla_loss(img: Tensor, txt: Tensor, scale: Tensor, group) -> Tensor:
    """Full b x b logits on every rank (open_clip ``ClipLoss(local_loss=False)``), local rows.

    open_clip returns the global mean on every rank; we return the mean over this rank's
    rows and columns. After DDP averages parameter gradients the two give the same step.
    """
    labels = _local_labels(img, group)
    logits = scale.to(img.dtype) * _gather(img, group) @ _gather(txt, group).T  # (b, b)
    return _ce_pair(logits[labels], logits.T[labels], labels)


def distributed_local_loss(img: Tensor, txt: Tensor, scale: Tensor, group) -> Tensor:
    """open_clip ``ClipLoss(local_loss=True, gather_with_grad=True)``: (m, b) logits twice."""
    labels = _local_labels(img, group)
    s = scale.to(img.dtype)
    logits_img = s * img @ _gather(txt, group).T
    logits_txt = s * txt @ _gather(img, group).T
    return _ce_pair(logits_img, logits_txt, labels)
