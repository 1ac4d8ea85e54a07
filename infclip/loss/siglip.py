"""Tiled SigLIP (sigmoid) loss: O(b) memory on one process, a ring across ranks.

With x_ij = s * <I_i, T_j> + t (s: logit scale, t: logit bias) and z_ij = +1 if i == j
(the positive pair) else -1, the loss of the m local images is

    L = (1/m) * sum_i sum_j -log sigmoid(z_ij x_ij),   j over all b texts of the global batch,

which is open_clip's ``SigLipLoss`` on one rank and on W ranks (its per-rank value). The
gradient of one tile is dX_ij = dL/dx_ij = -z_ij sigmoid(-z_ij x_ij) (= sigmoid(x_ij) - [i == j]),
then dI = s dX T, dT = s dX^T I, ds = sum dX_ij <I_i, T_j>, dt = sum dX_ij.

Tile-operation protocol (``TorchSigmoidOps``; ``infclip.kernels.siglip.TritonSigmoidOps``):
    forward(img (m,c), txt (n,c), scale, bias, diag) -> row_loss (m,) fp32: sum over this
        block pair of -log sigmoid(z x); ``diag``: the positives lie on the block's diagonal
        (the block pair is (own images, own texts)); otherwise every pair is a negative.
    backward(img, txt, scale, bias, g_row (m,), diag, dimg=None, dtxt=None)
        -> (dimg (m,c), dtxt (n,c), dscale 0-d, dbias 0-d) fp32, for upstream g_row of
        row_loss; accumulates into dimg/dtxt when given.
Only O(m) vectors are saved for backward; tiles are recomputed there. Across ranks the
texts travel around the ring (``infclip.loss.sweep``); images, the row sums and dI stay
put, and dT travels home behind its block. Unlike open_clip's ring, which keeps every
block's (m, m) logits for autograd (memory grows with W), nothing here grows with W.

Gradient semantics across ranks (as ``clip_loss``): feature gradients are
d(sum over ranks of the losses)/d(local features); scale and bias gradients are this
rank's part, not all-reduced (DDP's averaging then gives the single-process gradient of the
global mean loss). open_clip's distributed ``SigLipLoss`` produces the same gradients.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor

from infclip.loss.tiled import RowTiledOps, _acc_dtype, lazy, pick_backend, row_blocks

IMPLS = ("auto", "vanilla", "torch", "triton")
class TorchSigmoidOps(RowTiledOps):
    """SigLIP tile operations in plain PyTorch, one (tile, n) row block at a time; the backward
    is one pass (each block's s dX feeds dimg[block] and the dtxt accumulator, ``addmm_``)."""

    def _signed(self, img: Tensor, txt32: Tensor, lo: int, hi: int, s: Tensor, t: Tensor, diag: bool):
        """(dot, zx) of rows lo:hi: dot_ij = <I_i, T_j>, zx_ij = z_ij * (s dot_ij + t)."""
        dot = img[lo:hi].to(txt32.dtype) @ txt32.T
        zx = -(s * dot + t)
        if diag and lo < txt32.shape[0]:
            d = zx[:, lo:hi].diagonal()  # positives (i, i) of this row block
            d.neg_()
        return dot, zx

    def forward(self, img: Tensor, txt: Tensor, scale: Tensor, bias: Tensor, diag: bool) -> Tensor:
        """row_loss (m,): sum_j -log sigmoid(z_ij x_ij) over this block pair."""
        acc = _acc_dtype(img)
        txt32, s, t = txt.to(acc), scale.to(acc), bias.to(acc)
        row = torch.empty(img.shape[0], dtype=acc, device=img.device)
        for lo, hi in row_blocks(img.shape[0], txt.shape[0], self.tile):
            # -- compute tile --
            _, zx = self._signed(img, txt32, lo, hi, s, t, diag)
            row[lo:hi] = -F.logsigmoid(zx).sum(1)
        return row

    def backward(self, img: Tensor, txt: Tensor, scale: Tensor, bias: Tensor, g_row: Tensor, diag: bool,
                 dimg: Tensor | None = None, dtxt: Tensor | None = None):
        """(dimg (m,c), dtxt (n,c), dscale, dbias) for upstream g_row (m,) of row_loss."""
        acc = _acc_dtype(img)
        txt32, s, t, g = txt.to(acc), scale.to(acc), bias.to(acc), g_row.to(acc)
        dimg = torch.zeros(img.shape, dtype=acc, device=img.device) if dimg is None else dimg
        dtxt = torch.zeros(txt.shape, dtype=acc, device=img.device) if dtxt is None else dtxt
        dscale = torch.zeros((), dtype=acc, device=img.device)
        dbias = torch.zeros((), dtype=acc, device=img.device)
        for lo, hi in row_blocks(img.shape[0], txt.shape[0], self.tile):
            dot, zx = self._signed(img, txt32, lo, hi, s, t, diag)
            # -- compute tile --: dX = -z sigmoid(-z x); z = -1 off the diagonal.
            dx = torch.sigmoid(-zx)
            if diag and lo < txt.shape[0]:
                dx[:, lo:hi].diagonal().neg_()
            dx *= g[lo:hi, None]
            dscale += (dx * dot).sum()
            dbias += dx.sum()
            # One pass: s dX of the block feeds both products, accumulated in place (no (n, c)
            # temporaries: dtxt is the fp32 accumulator the memory rule allows), as ``TorchTileOps``.
            dx.mul_(s)
            _addmm_into(dimg[lo:hi], dx, txt32)
            _addmm_into(dtxt, dx.T, img[lo:hi].to(acc))
        return dimg, dtxt, dscale, dbias


def _addmm_into(out: Tensor, a: Tensor, b: Tensor) -> None:
    """out += a @ b: in place (``addmm_``) when out has the product's dtype, else (a caller's
    buffer of another dtype) through one rounded temporary."""
    if out.dtype == a.dtype:
        out.addmm_(a, b)
    else:
        out += a @ b


class _SigmoidRows(torch.autograd.Function):
    """row_loss (m,) over all texts (global with a group), saving O(m) beyond the inputs."""

    @staticmethod
    def forward(ctx, img, txt, scale, bias, ops, group):
        if group is None:
            rows = ops.forward(img, txt, scale, bias, True)
        else:
            rows = _ring_forward(img, txt, scale, bias, ops, group)
        ctx.save_for_backward(img, txt, scale, bias)
        ctx.ops, ctx.group = ops, group
        return rows

    @staticmethod
    def backward(ctx, g_row):
        img, txt, scale, bias = ctx.saved_tensors
        g_row = g_row.contiguous()
        wants = ctx.needs_input_grad
        if ctx.group is None:  # a locked tower's features (LiT): no gradient formed for them
            need = {"need": (wants[0], wants[1])} if getattr(ctx.ops, "takes_need", False) else {}
            grads = ctx.ops.backward(img, txt, scale, bias, g_row, True, **need)
        else:
            grads = _ring_backward(img, txt, scale, bias, g_row, ctx.ops, ctx.group)
        outs = [g.to(x.dtype) if w else None for g, x, w in zip(grads, (img, txt, scale, bias), wants)]
        return (*outs, None, None)


def _ring_forward(img, txt, scale, bias, ops, group) -> Tensor:
    from infclip.loss.ring import Ring, check_equal_shapes
    from infclip.loss.sweep import ring_sweep

    ring = Ring.of(group)
    check_equal_shapes(img, txt, scale, ring.group)
    rows = torch.zeros(img.shape[0], dtype=_acc_dtype(img), device=img.device)

    def tile(k, blocks, _):
        rows.add_(ops.forward(img, blocks[0], scale, bias, k == 0))

    ring_sweep(ring, [txt], tile)
    return rows


def _ring_backward(img, txt, scale, bias, g_row, ops, group):
    from infclip.loss.ring import Ring
    from infclip.loss.sweep import ring_sweep

    acc = _acc_dtype(img)
    dimg = torch.zeros(img.shape, dtype=acc, device=img.device)
    d = torch.zeros(2, dtype=acc, device=img.device)  # (dscale, dbias) of this rank's tiles

    def tile(k, blocks, part):
        _, _, ds, db = ops.backward(img, blocks[0], scale, bias, g_row, k == 0, dimg=dimg, dtxt=part)
        d[0] += ds
        d[1] += db

    dtxt = ring_sweep(Ring.of(group), [txt], tile, acc_like=txt, acc_dtype=acc, home_dtype=txt.dtype)
    return dimg, dtxt, d[0], d[1]


def siglip_reference(img: Tensor, txt: Tensor, scale: Tensor, bias: Tensor) -> Tensor:
    """Full b x b matrix in the input dtype: open_clip ``SigLipLoss`` on one rank."""
    logits = scale.to(img.dtype) * img @ txt.T + bias.to(img.dtype)
    labels = 2 * torch.eye(img.shape[0], dtype=img.dtype, device=img.device) - 1
    loss = -F.logsigmoid(labels * logits).sum() / img.shape[0]
    return loss if loss.dtype == torch.float64 else loss.float()


def _as_scalar(x, like: Tensor, name: str) -> Tensor:
    if not isinstance(x, Tensor):
        return torch.tensor(float(x), dtype=torch.float32, device=like.device)
    if x.numel() != 1:
        raise ValueError(f"{name} must be a scalar (0-d tensor or float), got shape {tuple(x.shape)}")
    if x.device != like.device:
        raise ValueError(f"{name} is on {x.device} but the features are on {like.device}")
    return x.reshape(())


def siglip_loss(image_features: Tensor, text_features: Tensor, logit_scale, logit_bias, *,
                impl: str = "auto", group=None) -> Tensor:
    """SigLIP loss of the local images against all texts, without the b x b matrix.

    Args:
        image_features, text_features: (m, c) local batch, same dtype/device; row i of each
            is a positive pair. Used as given (not normalized here), as open_clip does.
        logit_scale: s > 0, 0-d tensor or float (e.g. ``model.logit_scale.exp()``).
        logit_bias: t, 0-d tensor or float (``model.logit_bias``); may require grad.
        impl: "auto" (Triton on CUDA, else torch), "torch" (tiled, plain PyTorch), "triton" (fused
            kernels; CUDA, or CPU under TRITON_INTERPRET=1) or "vanilla" (full matrix).
        group: process group for the ring across ranks, or None.
    Returns:
        float32 scalar (float64 for float64 inputs): sum over the local images and all b
        texts of -log sigmoid(z x), divided by the number of local images.
    """
    from infclip.loss import _check_inputs, _world

    scale = _as_scalar(logit_scale, image_features, "logit_scale")
    bias = _as_scalar(logit_bias, image_features, "logit_bias")
    _check_inputs(image_features, text_features, scale)
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r} for siglip_loss; choose one of {IMPLS}")
    distributed = group is not None and _world(group) > 1
    if impl == "vanilla":
        if distributed:
            return _distributed_reference(image_features, text_features, scale, bias, group)
        return siglip_reference(image_features, text_features, scale, bias)
    rows = _SigmoidRows.apply(image_features, text_features, scale, bias, sigmoid_ops(impl, image_features),
                              group if distributed else None)
    loss = rows.sum() / image_features.shape[0]
    return loss if loss.dtype == torch.float64 else loss.float()


def sigmoid_ops(impl: str, like: Tensor):
    """Tile backend: "auto" is Triton on CUDA (as ``clip_loss``), PyTorch elsewhere; "triton"
    runs the fused kernels on CUDA, or on CPU under TRITON_INTERPRET=1 (the tests)."""
    triton_ops = lazy("infclip.kernels.siglip", "TritonSigmoidOps")
    return pick_backend(impl, like.device, TorchSigmoidOps, triton_ops)


def _distributed_reference(img: Tensor, txt: Tensor, scale: Tensor, bias: Tensor, group) -> Tensor:
    """All-gather-with-grad baseline: (m, b) logits; positives at this rank's columns."""
    import torch.distributed as dist

    from infclip.loss.ring import check_equal_shapes

    check_equal_shapes(img, txt, scale, group)
    m = img.shape[0]
    logits = scale.to(img.dtype) * img @ gather_rows(txt, group).T + bias.to(img.dtype)
    labels = -torch.ones_like(logits)
    off = dist.get_rank(group) * m
    labels[:, off:off + m] += 2 * torch.eye(m, dtype=img.dtype, device=img.device)
    loss = -F.logsigmoid(labels * logits).sum() / m
    return loss if loss.dtype == torch.float64 else loss.float()


class _GatherRows(torch.autograd.Function):
    """(W*m, c) all-gather whose backward sums every rank's gradient into the owner's rows.

    (``torch.distributed.nn.all_gather`` fails in backward on non-contiguous subgroups.)
    """

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group, ctx.rank, ctx.m = group, dist.get_rank(group), x.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, g):
        import torch.distributed as dist

        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g[ctx.rank * ctx.m:(ctx.rank + 1) * ctx.m], None


def gather_rows(x: Tensor, group) -> Tensor:
    return _GatherRows.apply(x, group)
