"""``TritonMaskedLSEOps``: the NT-Xent tile-operation protocol of ``infclip.loss.nt_xent``.

    forward(a (m,c), b (n,c), scale, mask_diag) -> row_lse (m,) fp32, excluding (i, i)
        when ``mask_diag`` (a and b are the same block)
    backward(a, b, scale, row_lse, g_row, mask_diag, da=None, db=None)
        -> (da (m,c), db (n,c), dscale 0-d) fp32; accumulates when given.
Block configs are those of ``infclip.kernels.siglip`` (fixed; small under the interpreter).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..siglip.ops import Config, default_config, interpreting, triton_cdiv
from .kernels import _masked_grad_kernel, _masked_lse_fwd_kernel


class TritonMaskedLSEOps:
    """Fused Triton NT-Xent tiles: one forward pass (masked row LSE), two backward passes."""

    name = "triton"

    def __init__(self, fp32_precision: str = "ieee", config: Config | None = None):
        if fp32_precision not in ("ieee", "tf32"):
            raise ValueError(f"fp32_precision must be 'ieee' or 'tf32', got {fp32_precision!r}")
        self.fp32_precision, self.config = fp32_precision, config

    def _meta(self, a: Tensor):
        cfg = self.config or default_config(a.shape[1])
        prec = self.fp32_precision if a.dtype == torch.float32 else "tf32"
        return dict(BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, EVEN_K=a.shape[1] % cfg.BK == 0, PREC=prec,
                    DOT_F32=interpreting() and a.element_size() == 2, num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages), cfg

    def forward(self, a: Tensor, b: Tensor, scale: Tensor, mask_diag: bool) -> Tensor:
        a, b, scale = _prep(a, b, scale)
        m, n, k = a.shape[0], b.shape[0], a.shape[1]
        meta, cfg = self._meta(a)
        lse = torch.empty(m, device=a.device, dtype=torch.float32)
        _masked_lse_fwd_kernel[(triton_cdiv(m, cfg.BM),)](
            a, b, scale, lse, m, n, k, a.stride(0), b.stride(0), 0 if mask_diag else m + n, **meta)
        return lse

    def backward(self, a: Tensor, b: Tensor, scale: Tensor, row_lse: Tensor, g_row: Tensor, mask_diag: bool,
                 da: Tensor | None = None, db: Tensor | None = None):
        a, b, scale = _prep(a, b, scale)
        lse, g = row_lse.float().contiguous(), g_row.float().contiguous()
        acc_a, acc_b = da is not None, db is not None
        da = torch.empty(a.shape, device=a.device, dtype=torch.float32) if da is None else da
        db = torch.empty(b.shape, device=a.device, dtype=torch.float32) if db is None else db
        off = 0 if mask_diag else a.shape[0] + b.shape[0]
        ds = self._grad(a, b, scale, lse, g, da, acc_a, True, off)
        self._grad(b, a, scale, lse, g, db, acc_b, False, off)
        return da, db, ds

    def _grad(self, a, b, scale, lse, g, out, accumulate, lse_on_a, diag_off):
        m, n, k = a.shape[0], b.shape[0], a.shape[1]
        meta, cfg = self._meta(a)
        grid = (triton_cdiv(m, cfg.BM), triton_cdiv(k, cfg.DC))
        part = torch.empty(grid[0] * grid[1] if lse_on_a else 1, device=a.device, dtype=torch.float32)
        _masked_grad_kernel[grid](a, b, scale, lse, g, out, part, m, n, k, a.stride(0), b.stride(0),
                                  out.stride(0), diag_off, DC=cfg.DC, LSE_ON_A=lse_on_a, ACCUM=accumulate,
                                  COMPUTE_DS=lse_on_a, **meta)
        return part.sum()


def _prep(a: Tensor, b: Tensor, scale: Tensor):
    if a.dtype != b.dtype or a.shape[1] != b.shape[1]:
        raise ValueError(f"blocks must share dtype and feature dim, got {a.dtype} {tuple(a.shape)} "
                         f"and {b.dtype} {tuple(b.shape)}")
    return a.contiguous(), b.contiguous(), scale.detach().reshape(1).float()
