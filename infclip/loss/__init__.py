"""Contrastive losses. The public entry point is :func:`clip_loss`.

With x_ij = s * <I_i, T_j> over the global batch, each rank's loss is the mean over its
local rows i of 1/2 [(LSE_j x_ij - x_ii) + (LSE_j x_ji - x_ii)]; on one process that is
exactly open_clip's ``ClipLoss`` value.

Across ranks (``group`` with world size > 1, equal local batch sizes): impl "auto" /
"torch" / "triton" run the overlapped ring of ``infclip.loss.ring`` (no rank ever holds
more than its own (b/W, c) features plus two travelling blocks); "vanilla" / "local" are
open_clip's all-gather-with-grad baselines. Each rank gets d(sum of all ranks' losses)/d
(its features) and its own share of the logit-scale gradient (no all-reduce), so DDP's
gradient average is exactly the single-process step on the global batch.
``global_mean_loss(loss, group)`` returns the detached global-batch loss for logging
(one scalar all-reduce).

Duplicate-aware negatives (``duplicates="mask"`` / ``"positive"`` with ``group_ids``): pairs of
one group are not negatives, or are extra positives; ``infclip.loss.duplicates`` states the
loss. Off (the default) runs exactly the code of before.
"""

from __future__ import annotations


import torch
from torch import Tensor

from infclip.loss.duplicates import Duplicates, check_duplicates, prepare
from infclip.loss.function import fused_duplicates_loss, lse_pair
from infclip.loss.reference import vanilla_loss
from infclip.loss.ring import global_mean_loss
from infclip.loss.tiled import TorchTileOps, lazy, pick_backend

IMPLS = ("auto", "vanilla", "local", "torch", "triton")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_inputs(img: Tensor, txt: Tensor, scale: Tensor) -> None:
    for name, t in (("image_features", img), ("text_features", txt)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D (batch, dim), got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} unsupported: use float32, bfloat16 or float16")
    if img.shape != txt.shape:
        raise ValueError(
            f"image_features {tuple(img.shape)} and text_features {tuple(txt.shape)} must have "
            "the same shape: row i of each is a positive pair"
        )
    if img.shape[0] == 0:
        raise ValueError("empty batch: image_features has 0 rows (b must be >= 1)")
    if img.dtype != txt.dtype:
        raise ValueError(f"dtype mismatch: image_features {img.dtype}, text_features {txt.dtype}")
    if img.device != txt.device:
        raise ValueError(f"device mismatch: image_features on {img.device}, text_features on {txt.device}")
    if not isinstance(scale, Tensor) or scale.dim() != 0:
        raise ValueError(
            "logit_scale must be a 0-dim tensor (e.g. model.logit_scale.exp()), got "
            f"{type(scale).__name__}{'' if not isinstance(scale, Tensor) else tuple(scale.shape)}"
        )
    if not scale.is_floating_point():
        raise ValueError(f"logit_scale must be a floating tensor, got {scale.dtype}")
    if scale.device != img.device:
        raise ValueError(f"logit_scale is on {scale.device} but the features are on {img.device}")
    if not bool(scale.detach() > 0):  # one host sync per call; the check is worth it
        raise ValueError(f"logit_scale must be positive (it multiplies the logits), got {float(scale)}")


def tile_ops(impl: str, device: torch.device, *, fp32_precision: str = "ieee"):
    """The CLIP tile-operation backend for ``impl`` ("torch" or "triton"; "auto" picks by device)."""
    triton_ops = lazy("infclip.kernels.clip", "TritonTileOps", fp32_precision=fp32_precision)
    return pick_backend(impl, device, TorchTileOps, triton_ops)


def clip_loss(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor,
    *,
    impl: str = "auto",
    group=None,
    fp32_precision: str = "ieee",
    group_ids: Tensor | None = None,
    duplicates: str = "off",
) -> Tensor:
    """Symmetric CLIP (InfoNCE) loss without materializing the b x b similarity matrix.

    Args:
        image_features, text_features: (b, c), same dtype/device; row i is a positive pair.
            Not assumed normalized.
        logit_scale: positive 0-d tensor s (e.g. ``model.logit_scale.exp()``); may require grad.
        impl: "auto" | "vanilla" | "local" | "torch" | "triton" (see module docs).
        group: a ``torch.distributed`` process group for the ring across ranks, or None.
        fp32_precision: "ieee" (default, full fp32) or "tf32" for fp32 inputs on CUDA.
        group_ids: (b,) int64, one id per pair (local rows; ids are global across ranks: equal
            ids mean duplicates wherever they are), or None. Needed unless duplicates is "off".
        duplicates: "off" (default: every j != i is a negative) | "mask" (same-group pairs
            i != j are neither negatives nor positives) | "positive" (they are extra
            positives: multi-positive InfoNCE, -log of the summed group softmax, both
            directions). Exact definitions in ``infclip.loss.duplicates``. Not with impl
            "vanilla" / "local". On one process with Triton, both modes take the fused node
            of "off" (same kernels and passes; "mask" sorts the pairs by group and adds one
            int32 compare per entry of the tiles within w of the diagonal, w = the largest
            group's size less one; "positive" sparse terms over the same-group pairs), run
            eagerly (not from the CUDA graphs of b <= 16k).
    Returns:
        float32 scalar: mean over local rows (global mean on one process).
    """
    _check_inputs(image_features, text_features, logit_scale)
    check_duplicates(duplicates, group_ids, image_features.shape[0], image_features.device)
    dup = None if duplicates == "off" else Duplicates(duplicates, group_ids)
    if dup is not None and impl in ("vanilla", "local"):
        raise ValueError(f"duplicates={duplicates!r} needs a tiled impl (auto, torch or triton), got impl={impl!r}")
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; choose one of {IMPLS}")
    if fp32_precision not in ("ieee", "tf32"):
        raise ValueError(f"fp32_precision must be 'ieee' or 'tf32', got {fp32_precision!r}")
    if group is not None and _world(group) > 1:
        from infclip.loss import ring

        return ring.distributed_clip_loss(
            image_features, text_features, logit_scale, impl=impl, group=group,
            fp32_precision=fp32_precision, dup=dup,
        )
    if impl in ("vanilla", "local"):
        return vanilla_loss(image_features, text_features, logit_scale)
    ops = tile_ops(impl, image_features.device, fp32_precision=fp32_precision)
    fused = hasattr(ops, "fused_loss")  # Triton: one autograd node, positive pairs in the kernels
    if dup is not None and not (fused and duplicates == "mask"):
        # one process: int32 dense ids ("mask" on the tiles), the pair list ("positive", one
        # host sync); the fused "mask" sorts the ids as given (sort_groups), one sort, not two
        dup = prepare(duplicates, group_ids)
    if fused:
        if dup is None:
            return ops.fused_loss(image_features, text_features, logit_scale)
        return fused_duplicates_loss(image_features, text_features, logit_scale, ops, dup)
    return _tiled_loss(image_features, text_features, logit_scale, ops, None, dup)


def _world(group) -> int:
    import torch.distributed as dist

    return dist.get_world_size(group) if dist.is_initialized() else 1


def _tiled_loss(img: Tensor, txt: Tensor, scale: Tensor, ops, group, dup=None) -> Tensor:
    """Local-rows loss from the per-row terms LSE - x_ii of both directions, one autograd node
    (``dup``: a ``Duplicates``, the terms of its mode)."""
    row_loss, col_loss = lse_pair(img, txt, scale, ops, group, dup)
    loss = 0.5 * (row_loss.mean() + col_loss.mean())
    return loss if loss.dtype == torch.float64 else loss.float()


# Other objectives on the same tiled engine (SigLIP, NT-Xent). Imported last: they use the helpers above.
from infclip.loss.siglip import siglip_loss  # noqa: E402
from infclip.loss.nt_xent import nt_xent_loss  # noqa: E402
from infclip.loss.build import build_loss  # noqa: E402
