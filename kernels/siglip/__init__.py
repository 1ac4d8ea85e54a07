"""Fused Triton kernels of the tiled SigLIP (sigmoid) loss.

- ``kernels``: the ``@triton.jit`` kernels (forward row sums; backward dA / dB, ds, dt: fused or strips).
- ``ops.TritonSigmoidOps``: the SigLIP tile-operation protocol used by ``infclip.loss.siglip``.
- ``reference``: the tile math in plain PyTorch (float64).
"""

from .ops import TritonSigmoidOps
from .reference import sigmoid_grad_reference, sigmoid_rows_reference

__all__ = ["TritonSigmoidOps", "sigmoid_grad_reference", "sigmoid_rows_reference"]
