"""Fused Triton kernels of the tiled CLIP (Inf-CL) loss.

- ``kernels``: the ``@triton.jit`` kernels (forward: both LSEs in one pass; backward).
- ``launch``: launch wrappers, block configs and tuning.
- ``ops.TritonTileOps``: the tile-operation protocol used by ``infclip.loss``.
- ``function``: a standalone autograd Function and ``clip_loss_triton``.
- ``reference``: the math in plain PyTorch (float64).
"""

from .function import TritonCLIPLoss, TritonLSEPair, clip_loss_triton, lse_pair_triton
from .ops import TritonTileOps
from .reference import clip_loss_reference, lse_grad_reference, lse_pair_reference

__all__ = [
    "TritonTileOps",
    "TritonCLIPLoss",
    "TritonLSEPair",
    "clip_loss_triton",
    "lse_pair_triton",
    "clip_loss_reference",
    "lse_grad_reference",
    "lse_pair_reference",
]
