"""``TritonMaskedLSEOps``: the NT-Xent tile-operation protocol of ``infclip.loss.nt_xent``.

    forward(a (m,c), b (n,c), scale, mask_diag, offsets=None) -> row_lse (m,) fp32,
        excluding (i, i) when ``mask_diag`` (a and b are the same block)
    backward(a, b, scale, row_lse, g_row, mask_diag, da=None, db=None, offsets=None)
        -> (da (m,c), db (n,c), dscale 0-d) fp32; accumulates when given.
    backward_own(f, scale, row_lse, g_row, offsets=None, out_dtype=fp32) -> (df, dscale):
        the own block's whole gradient da + db of ``backward(f, f, ..., True)`` in one pass
        (the block is symmetric: P = s (dX + dX^T), one product P @ f), df in ``out_dtype``.
    offsets (m,): the rows' positives' dot products <a_i, a_pos(i)>: the LSEs are relative
    to s * offsets and, on the own block (mask_diag), the positives pos(i) = (i + m/2) mod m
    are part of the tile (``infclip.loss.nt_xent``): their gradient -g_i is folded into dX.
Paths and block configs as ``infclip.kernels.objective.ObjectiveTiles`` (strip backward for
16-bit CUDA inputs, the fused kernel otherwise; configs timed once); the strip configs and
the persistent TMA strip kernel are CLIP's (``strip_candidates``).

One pass: the own block's gradient already is (``backward_own``, P = s (dX + dX^T), one
product). A block pair (a, b) of the ring has one softmax, that of a's rows, so both of its
gradients come from the same dX: ``backward="onepass"`` fills each strip's P = s dX once
(the da strip fill, LSE_ON_A) and forms da[strip] = P @ b and an fp32 db accumulator +=
P^T @ a[strip] (``launching.addmm_f32_``), as CLIP's ``launch.grad_onepass_strips``: the
logits recomputed once instead of once per direction. "auto" stays two-pass (``AUTO_BACKWARD``:
not measured on the GPU yet).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from ..clip import launch
from ..clip.launch import StripConfig
from ..launching import addmm_f32_, cdiv, finish_accumulator, fp32_accumulator, strip_backward, tma_ok, tma_programs
from ..objective import ObjectiveTiles
from ..objective import strip_candidates as objective_strip_candidates
from .kernels import _masked_grad_kernel, _masked_lse_fwd_kernel, _masked_strip_kernel, _masked_strip_tma_kernel


AUTO_BACKWARD = "twopass"  # what backward="auto" takes: flip once the GPU measures "onepass" faster


def strip_candidates(k: int, esize: int) -> list[StripConfig]:
    """Strip configs: CLIP's H200 choices (``clip.launch.strip_candidates``: persistent TMA
    128x128, BK 64, 8 warps, 4 stages first, 22.7 ms vs 25.2 for the pointer kernel at
    c = 512, b = 64k, one direction), whose tiles and epilogue are the same shape here
    (the masked epilogue adds two compares per entry). The interpreter runs the TMA kernel
    (16-bit inputs; fp32 falls back to pointer loads). Before triton 3.8 the TMA kernel's
    masked epilogue does not fit 128x128 tiles in registers (``_tma_wide_tiles_fit``):
    the first candidate (the one used untimed) is the TMA kernel at 128x64, and the
    128x128 one comes last, timed like the rest."""
    if launch.interpreting():
        return [StripConfig(16, 16, 16, 2, 1, 1, tma=True)]
    if esize == 4:
        return objective_strip_candidates(k, esize)
    rest = [StripConfig(128, 128, 64, 8, 8, 4), StripConfig(128, 256, 64, 8, 8, 3),
            StripConfig(64, 128, 64, 8, 4, 3, tma=True, per_sm=2)]
    wide = StripConfig(128, 128, 64, 8, 8, 4, tma=True)
    if _tma_wide_tiles_fit():
        return [wide, *rest]
    return [StripConfig(128, 64, 64, 8, 8, 4, tma=True), *rest, wide]


def _tma_wide_tiles_fit() -> bool:
    """Whether this triton compiles ``_masked_strip_tma_kernel`` at 128x128, 8 warps without
    register spills (ptxas, sm_90, the own block's flags: SYM, offsets, positives): 3.8 does
    (226 registers a thread); 3.6 and 3.7 spill 340 and 156 bytes a thread (255 registers),
    where 128x64 takes 203 and 172 registers and spills nothing."""
    parts = triton.__version__.split(".")
    try:
        return (int(parts[0]), int(parts[1])) >= (3, 8)
    except (ValueError, IndexError):
        return True


class TritonMaskedLSEOps(ObjectiveTiles):
    """Fused Triton NT-Xent tiles: one forward pass (masked row LSE), one backward pass per
    direction, or one for the own block (``backward_own``).

    Args as ``ObjectiveTiles`` (fp32_precision, strips, poison), and
        strip_positives: how the strip path applies the positives' folded fp32 s dX (as
            CLIP's option): "fold" (default) leaves it in the scratch P, rounded once to
            the input dtype with the rest of the tile (exact for fp32; in 16-bit the one
            rounding vanilla applies to its dX), so the product goes straight into the
            gradient; "fixup" keeps it out of P and adds s dX b_pos in fp32 to an fp32
            product per strip (an (R, c) fp32 temporary, a gather and two elementwise passes
            per strip).
        backward: the block-pair backward (``backward``): "twopass" (one fill per direction),
            "onepass" (one strip fill for both, see the module docs; not with strips="never")
            or "auto" (``AUTO_BACKWARD``, "twopass" until the GPU measures "onepass" faster).
    """

    name = "triton"
    family = "masked_lse"

    def __init__(self, fp32_precision: str = "ieee", *, strips: str = "auto", poison: bool = False,
                 strip_positives: str = "fold", backward: str = "auto"):
        super().__init__(fp32_precision, strips=strips, poison=poison)
        if strip_positives not in ("fixup", "fold"):
            raise ValueError(f"strip_positives must be 'fixup' or 'fold', got {strip_positives!r}")
        if backward not in ("auto", "onepass", "twopass"):
            raise ValueError(f"backward must be 'auto', 'onepass' or 'twopass', got {backward!r}")
        if backward == "onepass" and strips == "never":
            raise ValueError("backward='onepass' is a strip path: it needs strips 'auto' or 'always'")
        self.fold = strip_positives == "fold"
        self.backward_path = AUTO_BACKWARD if backward == "auto" else backward

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
        if self.backward_path == "onepass" and a.shape[0] and b.shape[0]:
            ds = self._grad_onepass(a, b, vecs, da, db, acc_a, acc_b, dict(diag=diag, half=half, LSE_ON_A=True,
                                                                           **flags))
            return da, db, ds
        ds = self._grad(a, b, vecs, da, acc_a, dict(diag=diag, half=half, LSE_ON_A=True, **flags))
        self._grad(b, a, vecs, db, acc_b, dict(diag=diag, half=half, LSE_ON_A=False, **flags))
        return da, db, ds

    def _grad_onepass(self, a, b, vecs, out_a, out_b, acc_a, acc_b, flags) -> Tensor:
        """out_a (+)= s dX @ b and out_b (+)= s dX^T @ a from one fill per strip of a's rows;
        returns ds. out_b is summed in fp32: in itself when fp32, else in a fresh fp32
        accumulator rounded into it once. The positives' fixup (own block, not folded): the
        fp32 s dX_i,pos(i) go to out_a's fp32 product (``_strips``) and to acc[pos(i)] here."""
        rows = self._strip_rows(a, b)

        def run_strips(cfg, a_sub, b_sub):
            sub = self._sub_vecs(vecs, flags, a_sub.shape[0], b_sub.shape[0])
            self._strips(a_sub, b_sub, sub, torch.empty(a_sub.shape, device=a.device, dtype=out_a.dtype), False,
                         rows, cfg, flags)

        cfg = self._pick("strip", a, b, self._strip_candidates(a.shape[1], a.element_size()), run_strips)
        acc = fp32_accumulator(out_b, acc_b)

        def second(r0: int, r: int, scratch: Tensor, dv: Tensor | None) -> None:
            a_s = a[r0:r0 + r]
            addmm_f32_(acc, scratch[:r].T, a_s)  # (n, r) @ (r, k): fp32 accumulate
            if dv is not None:  # the own block: P's column pos(i) is row pos(i) of b = a
                idx = (torch.arange(r0, r0 + r, device=a.device) + flags["half"]) % (2 * flags["half"])
                acc.index_add_(0, idx, dv[:r, None] * a_s.float())

        ds = self._strips(a, b, vecs, out_a, acc_a, rows, cfg, flags, then=second)
        finish_accumulator(out_b, acc, acc_b)
        return ds

    def backward_own(self, f: Tensor, scale: Tensor, row_lse: Tensor, g_row: Tensor,
                     offsets: Tensor | None = None, out_dtype: torch.dtype = torch.float32
                     ) -> tuple[Tensor, Tensor]:
        """(df (m,c) ``out_dtype``, ds 0-d fp32) of the own block f: df = s (dX + dX^T) f, the
        sum of ``backward(f, f, ..., mask_diag=True)``'s da and db. On the strip path one
        pass (``_sym_dx``: P = s (dX + dX^T) strip by strip, then P @ f); otherwise the two
        directions, added."""
        f, _, scale = _prep(f, f, scale)
        if not self._use_strips(f):
            da, db, ds = self.backward(f, f, scale, row_lse, g_row, True, offsets=offsets)
            return da.add_(db).to(out_dtype), ds
        off, flags = _offsets(offsets, f, True)
        vecs = (scale, row_lse.float().contiguous(), g_row.float().contiguous(), off)
        df = self._alloc(*f.shape, device=f.device, dtype=out_dtype)
        flags = dict(diag=0, half=f.shape[0] // 2, LSE_ON_A=True, SYM=True, **flags)
        return df, self._grad(f, f, vecs, df, False, flags, kind="strip_sym")

    # -- the family's pieces used by ObjectiveTiles._grad --

    @staticmethod
    def _sub_vecs(vecs, flags, ms: int, ns: int):
        """The backward's vectors for a (ms, ns) corner of the problem (config timing)."""
        scale, lse, g, off = vecs
        keep = ms if flags["LSE_ON_A"] else ns  # SYM: rows and columns index them, ms = ns
        return scale, lse[:keep], g[:keep], off[:keep] if flags["HAS_OFF"] else off

    def _strip_rows(self, a: Tensor, b: Tensor) -> int:
        """CLIP's rule (``clip.launch.strip_rows``): with the positives folded into P there is
        no fp32 (R, c) temporary, and the scratch takes its room (64 MB + 768 B x n)."""
        rows = launch.strip_rows(b.shape[0], a.element_size(), k=a.shape[1], temp=not self.fold)
        return max(rows, launch.STRIP_MIN_ROWS)

    _strip_candidates = staticmethod(strip_candidates)

    def _strips(self, a, b, vecs, out, accumulate, rows, cfg, flags, then=None) -> Tensor:
        """out (+)= P @ b strip by strip; returns ds. One buffer of ds partials for all strips,
        summed once at the end (zeros: a short last strip leaves some slots unwritten).
        then(r0, r, scratch, dv): after each strip's product (``_grad_onepass``), dv the
        strip's fp32 s dX_i,pos(i) of the fixup (None when folded or without positives)."""
        m, n = a.shape[0], b.shape[0]
        pos, fixup = flags["HAS_POS"], flags["HAS_POS"] and not self.fold
        rows = max(1, min(rows, m))
        d_vec = self._alloc(rows, device=a.device, dtype=torch.float32) if fixup else vecs[0]
        per = cdiv(rows, cfg.BM) * cdiv(n, cfg.BN)
        ds_all = torch.zeros(cdiv(m, rows) * per, device=a.device, dtype=torch.float32)
        # else (fp32, a row not 16-byte aligned, or c = 0: the TMA kernel assumes K > 0) pointer loads
        use_tma = cfg.tma and a.shape[1] > 0 and tma_ok(a, b)
        consts = dict(LSE_ON_A=flags["LSE_ON_A"], SYM=flags.get("SYM", False), HAS_OFF=flags["HAS_OFF"],
                      HAS_POS=pos, FOLD=self.fold)

        def fill(r0: int, r: int, scratch: Tensor) -> None:
            self._fill((a, b, *vecs, scratch, ds_all[r0 // rows * per:], d_vec), r, r0, cfg, flags, consts,
                       use_tma)

        def positives(r0: int, r: int, prod: Tensor) -> None:  # + s dX_i,pos(i) b_pos(i), fp32
            idx = (torch.arange(r0, r0 + r, device=a.device) + flags["half"]) % (2 * flags["half"])
            prod.addcmul_(d_vec[:r, None], b[idx])

        after = None if then is None else (lambda r0, r, scratch: then(r0, r, scratch, d_vec if fixup else None))
        strip_backward(a, b, out, rows, accumulate, fill, self._alloc, positives if fixup else None, after)
        return ds_all.sum()

    def _fill(self, args: tuple, r: int, r0: int, cfg: StripConfig, flags: dict, consts: dict, use_tma: bool):
        """One strip's P (and ds partials, dv) through the TMA or the pointer kernel;
        args = (a, b, scale, lse, g, off, scratch, ds_part, dv)."""
        a, b, scratch = args[0], args[1], args[6]
        m, n, k = a.shape[0], b.shape[0], a.shape[1]
        tiles = cdiv(r, cfg.BM) * cdiv(n, cfg.BN)
        strides = (a.stride(0), b.stride(0), scratch.stride(0), flags["diag"], flags["half"])
        meta = self._meta(cfg, a)
        if use_tma:
            progs = tma_programs(a.device, tiles, cfg.per_sm)
            meta.pop("EVEN_K")
            _masked_strip_tma_kernel[(progs,)](*args, r, r0, m, n, k, *strides, GROUP=cfg.GROUP, NUM_PROGS=progs,
                                               WS=cfg.ws, **consts, **meta)
            return
        _masked_strip_kernel[(tiles,)](*args, r, r0, n, k, *strides, GROUP=cfg.GROUP, **consts, **meta)

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
