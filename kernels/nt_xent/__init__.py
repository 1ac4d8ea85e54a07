"""Fused Triton kernels of the tiled NT-Xent (SimCLR) loss: masked self-similarity LSEs.

- ``kernels``: the ``@triton.jit`` kernels (forward masked row LSE; backward dA / dB, ds).
- ``ops.TritonMaskedLSEOps``: the tile-operation protocol used by ``infclip.loss.nt_xent``.
The plain-PyTorch statement of the same math is ``infclip.loss.nt_xent.TorchMaskedLSEOps``'s
docstring; the tests compare against float64 full matrices.
"""

from .ops import TritonMaskedLSEOps

__all__ = ["TritonMaskedLSEOps"]
