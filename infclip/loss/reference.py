"""Full-matrix baselines: ``vanilla`` (open_clip's ClipLoss on one rank) and ``local``.

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
