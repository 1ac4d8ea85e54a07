"""``TritonMaskedLSEOps``: the NT-Xent tile-operation protocol of ``infclip.loss.nt_xent``.

    forward(a (m,c), b (n,c), scale, mask_diag, offsets=None) -> row_lse (m,) fp32,
        excluding (i, i) when ``mask_diag`` (a and b are the same block)
    backward(a, b, scale, row_lse, g_row, mask_diag, da=None, db=None, offsets=None)
        -> (da (m,c), db (n,c), dscale 0-d) fp32; accumulates when given.
    offsets (m,): the rows' positives' dot products <a_i, a_pos(i)>: the LSEs are relative
    to s * offsets and, on the own block (mask_diag), the positives pos(i) = (i + m/2) mod m
    are part of the tile (``infclip.loss.nt_xent``): their gradient -g_i is folded into dX.
Paths and block configs as ``infclip.kernels.objective.ObjectiveTiles`` (strip backward for
16-bit CUDA inputs, the fused kernel otherwise; configs timed once).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..launching import cdiv, strip_backward
from ..objective import ObjectiveTiles
from .kernels import _masked_grad_kernel, _masked_lse_fwd_kernel, _masked_strip_kernel


class TritonMaskedLSEOps(ObjectiveTiles):
    """Fused Triton NT-Xent tiles: one forward pass (masked row LSE), one backward pass per
    direction. Args as ``ObjectiveTiles`` (fp32_precision, strips, poison)."""

    name = "triton"
    family = "masked_lse"

    def forward(self, a: Tensor, b: Tensor, scale: Tensor, mask_diag: bool, offsets: Tensor | None = None
                ) -> Tensor:
        a, b, scale = _prep(a, b, scale)
        m, n = a.shape[0], b.shape[0]
        if not (m and n):
            return torch.full((m,), float("-inf"), device=a.device)
        off, flags = _offsets(offsets, a, mask_diag)
        return self._row_forward(_masked_lse_fwd_kernel, a, b, (scale, off), 0 if mask_diag else m + n,
                                 lambda part: torch.logsumexp(part, 0), tail=(m // 2,), flags=flags)

    def backward(self, a: Tensor, b: Tensor, scale: Tensor, row_lse: Tensor, g_row: Tensor, mask_diag: bool,
                 da: Tensor | None = None, db: Tensor | None = None, offsets: Tensor | None = None):
        a, b, scale = _prep(a, b, scale)
        off, flags = _offsets(offsets, a, mask_diag)
        vecs = (scale, row_lse.float().contiguous(), g_row.float().contiguous(), off)
        acc_a, acc_b = da is not None, db is not None
        da, db = self._out(da, a), self._out(db, b)
        diag = 0 if mask_diag else a.shape[0] + b.shape[0]
        half = a.shape[0] // 2
        ds = self._grad(a, b, vecs, da, acc_a, dict(diag=diag, half=half, LSE_ON_A=True, **flags))
        self._grad(b, a, vecs, db, acc_b, dict(diag=diag, half=half, LSE_ON_A=False, **flags))
        return da, db, ds

    # -- the family's pieces used by ObjectiveTiles._grad --

    @staticmethod
    def _sub_vecs(vecs, flags, ms: int, ns: int):
        """The backward's vectors for a (ms, ns) corner of the problem (config timing)."""
        scale, lse, g, off = vecs
        keep = ms if flags["LSE_ON_A"] else ns
        return scale, lse[:keep], g[:keep], off[:keep] if flags["HAS_OFF"] else off

    def _strips(self, a, b, vecs, out, accumulate, rows, cfg, flags) -> Tensor:
        scale, lse, g, off = vecs
        k, n = a.shape[1], b.shape[0]
        pos = flags["HAS_POS"]
        d_vec = self._alloc(min(rows, a.shape[0]), device=a.device, dtype=torch.float32) if pos else scale
        consts = dict(LSE_ON_A=flags["LSE_ON_A"], HAS_OFF=flags["HAS_OFF"], HAS_POS=pos)

        def fill(r0: int, r: int, scratch: Tensor) -> Tensor:
            grid = cdiv(r, cfg.BM) * cdiv(n, cfg.BN)
            part = torch.empty(grid, device=a.device, dtype=torch.float32)
            _masked_strip_kernel[(grid,)](
                a, b, scale, lse, g, off, scratch, part, d_vec, r, r0, n, k, a.stride(0), b.stride(0),
                scratch.stride(0), flags["diag"], flags["half"], GROUP=cfg.GROUP, **consts, **self._meta(cfg, a))
            return part.sum()

        def positives(r0: int, r: int, prod: Tensor) -> None:  # + s dX_i,pos(i) b_pos(i), fp32
            idx = (torch.arange(r0, r0 + r, device=a.device) + flags["half"]) % (2 * flags["half"])
            prod.addcmul_(d_vec[:r, None], b[idx])

        return strip_backward(a, b, out, rows, accumulate, fill, self._alloc, positives if pos else None)

    def _fused(self, a, b, vecs, out, accumulate, cfg, flags) -> Tensor:
        scale, lse, g, off = vecs
        m, n, k = a.shape[0], b.shape[0], a.shape[1]
        grid = (cdiv(m, cfg.BM), cdiv(k, cfg.DC))
        part = torch.empty(grid[0] * grid[1], device=a.device, dtype=torch.float32)
        _masked_grad_kernel[grid](a, b, scale, lse, g, off, out, part, m, n, k, a.stride(0), b.stride(0),
                                  out.stride(0), flags["diag"], flags["half"], DC=cfg.DC,
                                  LSE_ON_A=flags["LSE_ON_A"], HAS_OFF=flags["HAS_OFF"], HAS_POS=flags["HAS_POS"],
                                  ACCUM=accumulate, COMPUTE_DS=True, **self._meta(cfg, a))
        return part.sum()


def _offsets(offsets: Tensor | None, a: Tensor, mask_diag: bool) -> tuple[Tensor, dict]:
    """(offsets as contiguous fp32, or a dummy pointer; HAS_OFF / HAS_POS flags)."""
    if offsets is None:
        return a, dict(HAS_OFF=False, HAS_POS=False)
    if offsets.shape != (a.shape[0],):
        raise ValueError(f"offsets must be ({a.shape[0]},), got {tuple(offsets.shape)}")
    if mask_diag and a.shape[0] % 2:
        raise ValueError(f"the own block holds the positives i <-> i + m/2: m must be even, got {a.shape[0]}")
    return offsets.detach().float().contiguous(), dict(HAS_OFF=True, HAS_POS=mask_diag)


def _prep(a: Tensor, b: Tensor, scale: Tensor):
    if a.dtype != b.dtype or a.shape[1] != b.shape[1]:
        raise ValueError(f"blocks must share dtype and feature dim, got {a.dtype} {tuple(a.shape)} "
                         f"and {b.dtype} {tuple(b.shape)}")
    return a.contiguous(), b.contiguous(), scale.detach().reshape(1).float()
