"""``build_loss(loss_cfg, group)``: the trainer's loss callable for ``loss.kind``.

Every callable has the engine's signature ``loss_fn(image_emb, text_emb, logit_scale,
logit_bias=None) -> scalar`` (the engine passes ``logit_bias`` when the model has one):

* ``clip``: ``clip_loss``; with ``loss.grad_filter > 0`` the filtered backward
  (``infclip.loss.filtering``; PyTorch tiles or the Triton kernels, by ``loss.impl``). With
  ``loss.duplicates`` mask / positive it takes ``group_ids=`` (the engine passes them:
  ``infclip.data.dedup.group_ids`` of the step's captions) and refuses to run without.
* ``siglip``: ``siglip_loss``; needs the model's ``logit_bias`` (``model.init_logit_bias``).
* ``nt_xent``: SimCLR's loss on ``cat([image_emb, text_emb])``, i.e. the two slots carry
  view 1 and view 2 of the same images; fixed ``loss.temperature``, ``logit_scale`` unused
  (it gets a zero gradient so the engine can differentiate with respect to it).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from torch import Tensor

LossFn = Callable[..., Tensor]
_TILED_ONLY = {"siglip": ("auto", "torch", "triton", "vanilla"), "nt_xent": ("auto", "torch", "triton", "vanilla")}


def build_loss(loss_cfg: Any, group=None) -> LossFn:
    """The loss callable for ``loss_cfg`` (a ``LossConfig``); ``group``: process group or None."""
    kind, impl = loss_cfg.kind, loss_cfg.impl
    if kind in _TILED_ONLY and impl not in _TILED_ONLY[kind]:
        raise ValueError(f"loss.impl={impl!r} is not available for loss.kind={kind}; "
                         f"choose one of {list(_TILED_ONLY[kind])}")
    if kind == "clip":
        return _clip(loss_cfg, group)
    if kind == "siglip":
        return functools.partial(_siglip, impl=impl, group=group)
    if kind == "nt_xent":
        return functools.partial(_nt_xent, temperature=float(loss_cfg.temperature), impl=impl, group=group)
    raise ValueError(f"unknown loss.kind={kind!r}; choose one of ['clip', 'siglip', 'nt_xent']")


def _clip(loss_cfg: Any, group) -> LossFn:
    from infclip.loss import clip_loss
    from infclip.loss.filtering import filtered_clip_loss

    eps = float(getattr(loss_cfg, "grad_filter", 0.0) or 0.0)
    dup = getattr(loss_cfg, "duplicates", "off") or "off"
    if eps > 0 and dup != "off":
        raise ValueError(f"loss.grad_filter and loss.duplicates={dup} do not combine; set one of them off")
    if eps > 0:
        if loss_cfg.impl not in ("auto", "torch", "triton"):
            raise ValueError(f"loss.grad_filter needs loss.impl=auto, torch or triton, got {loss_cfg.impl!r}")
        fn = functools.partial(filtered_clip_loss, eps=eps, group=group, impl=loss_cfg.impl)
    else:
        fn = functools.partial(clip_loss, impl=loss_cfg.impl, group=group, fp32_precision=loss_cfg.fp32_precision)
        if dup != "off":
            fn = functools.partial(fn, duplicates=dup)

    def clip(img: Tensor, txt: Tensor, logit_scale: Tensor, logit_bias: Optional[Tensor] = None,
             group_ids: Optional[Tensor] = None) -> Tensor:
        if logit_bias is not None:
            raise ValueError("loss.kind=clip got a logit_bias: the model has a SigLIP bias; use "
                             "loss=siglip or leave model.init_logit_bias unset")
        if group_ids is None:  # (with duplicates on, clip_loss refuses: group ids are never optional)
            return fn(img, txt, logit_scale)
        return fn(img, txt, logit_scale, group_ids=group_ids)

    return clip


def _siglip(img: Tensor, txt: Tensor, logit_scale: Tensor, logit_bias: Optional[Tensor] = None, *,
            impl: str, group) -> Tensor:
    from infclip.loss import siglip_loss

    if logit_bias is None:
        raise ValueError("loss.kind=siglip needs the model's logit bias: set model.init_logit_bias "
                         "(SigLIP uses -10; configs/loss/siglip.yaml does)")
    return siglip_loss(img, txt, logit_scale, logit_bias, impl=impl, group=group)


def _nt_xent(img: Tensor, txt: Tensor, logit_scale: Optional[Tensor] = None,
             logit_bias: Optional[Tensor] = None, *, temperature: float, impl: str, group) -> Tensor:
    from infclip.loss import nt_xent_loss

    loss = nt_xent_loss(torch.cat([img, txt]), temperature, impl=impl, group=group)
    if isinstance(logit_scale, Tensor) and logit_scale.requires_grad:
        loss = loss + 0.0 * logit_scale.sum()  # fixed temperature: a zero, not a missing, gradient
    return loss
