"""``ObjectiveTiles``: what the SigLIP and NT-Xent Triton tile backends share.

A family (``TritonSigmoidOps``, ``TritonMaskedLSEOps``) supplies its kernels through
``_strips`` (the strip backward: s * dX into a scratch, then cuBLAS), ``_fused`` (the fused
backward, fp32 accumulator in registers) and ``_sub_vecs`` (its vectors cut to a corner of
the problem, for timing configs). This base picks the path and the block configs (timed
once per problem class with ``clip.launch.pick_config``), allocates (optionally NaN-poisoned)
buffers and builds the common launch arguments.

Paths, per gradient direction: "auto" takes the strip path for 16-bit CUDA inputs, the
fused kernel otherwise; "always" / "never" force one (tests). The strip scratch holds
48 MB + 768 B per column of s * dX (``launch.strip_rows``, as the CLIP loss: at least
``launch.STRIP_MIN_ROWS`` rows in 16-bit at every b; 240 MB at b = 256k, 816 MB at 1M):
the fused kernels run at 22-25 % of peak at 256k on an H200, the strips at ~33 %.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .clip import launch
from .clip.launch import BwdConfig, FwdConfig, StripConfig
from .launching import cdiv, column_splits

PRECISIONS = ("ieee", "tf32")


def fwd_candidates(esize: int) -> list[FwdConfig]:
    """Forward configs to time; the first (used untimed) compiles for sm_90 without spills
    (checked in tests/kernels). The row-sum epilogue (softplus / masked online LSE) holds
    more live registers than CLIP's forward: 256x128 tiles (CLIP's best) and 128x64 with 4
    warps spill, 128x128 with 8 warps does not."""
    if launch.interpreting():
        return [FwdConfig(16, 16, 16, 1, 1)]
    if esize == 4:
        return [FwdConfig(64, 64, 32, 8, 3), FwdConfig(128, 64, 32, 8, 3), FwdConfig(128, 128, 32, 8, 2)]
    return [FwdConfig(128, 128, 64, 8, 3), FwdConfig(128, 128, 64, 8, 4), FwdConfig(256, 128, 64, 8, 3),
            FwdConfig(64, 64, 32, 8, 3)]


def fused_candidates(k: int, esize: int) -> list[BwdConfig]:
    """Fused-backward configs (streamed logits; DC feature columns of the accumulator per
    program, the logits recomputed per feature chunk). Only 64x64 with DC <= 128 compiles
    without spills (sm_90, bf16 and fp32); the wider DC ones spill a little (DC = 256: ~50
    bytes) or a lot (DC = 512: ~3 KB) but recompute the logits fewer times: timing decides."""
    if launch.interpreting():
        return [BwdConfig(16, 16, 16, 16, False, 1, 1)]
    kp = 1 << max(5, math.ceil(math.log2(max(k, 1))))
    cands = [BwdConfig(64, 64, 32, min(kp, 128), False, 8, 3)]
    if esize == 2:
        cands += [BwdConfig(64, 64, 64, min(kp, 256), False, 8, 3), BwdConfig(64, 64, 32, min(kp, 256), False, 8, 2),
                  BwdConfig(64, 128, 64, min(kp, 512), False, 8, 3)]
    else:
        cands += [BwdConfig(64, 64, 32, min(kp, 256), False, 8, 2)]
    return [c for c in cands if launch._bwd_smem(c, k, esize) <= launch.SMEM_BYTES]


def strip_candidates(k: int, esize: int) -> list[StripConfig]:
    """Strip-kernel configs: 128x128 tiles (no spills on sm_90); CLIP's 128x256 spills here
    (the sigmoid / mask epilogue) but is timed too."""
    if launch.interpreting():
        return [StripConfig(16, 16, 16, 2, 1, 1)]
    if esize == 4:
        return [StripConfig(64, 64, 32, 8, 8, 3), StripConfig(128, 128, 32, 8, 8, 3)]
    return [StripConfig(128, 128, 64, 8, 8, 4), StripConfig(128, 128, 64, 8, 8, 3), StripConfig(128, 256, 64, 8, 8, 3)]


class ObjectiveTiles:
    """Config choice, path choice and buffers of a Triton objective backend (see module doc).

    Args:
        fp32_precision: dot precision for float32 inputs: "ieee" (default) or "tf32".
        strips: backward path: "auto", "always" or "never".
        poison: fill every buffer the kernels must write with NaN first (tests).
    """

    family = "objective"  # prefix of the tuning cache keys

    def __init__(self, fp32_precision: str = "ieee", *, strips: str = "auto", poison: bool = False):
        if fp32_precision not in PRECISIONS:
            raise ValueError(f"fp32_precision must be one of {PRECISIONS}, got {fp32_precision!r}")
        if strips not in ("auto", "always", "never"):
            raise ValueError(f"strips must be 'auto', 'always' or 'never', got {strips!r}")
        self.fp32_precision, self.strips, self.poison = fp32_precision, strips, poison

    def _alloc(self, *shape, device, dtype):
        if self.poison:
            return torch.full(shape, float("nan"), device=device, dtype=dtype)
        return torch.empty(*shape, device=device, dtype=dtype)

    def _out(self, buf: Tensor | None, like: Tensor) -> Tensor:
        """A fresh fp32 gradient buffer, or the caller's (checked) to accumulate into."""
        if buf is None:
            return self._alloc(*like.shape, device=like.device, dtype=torch.float32)
        if buf.shape != like.shape or buf.stride(-1) != 1:
            raise ValueError(f"gradient buffer must be {tuple(like.shape)} with unit last stride, "
                             f"got {tuple(buf.shape)} strides {buf.stride()}")
        return buf

    def _meta(self, cfg, a: Tensor) -> dict:
        """Launch arguments every kernel of the families takes."""
        return dict(BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, EVEN_K=a.shape[1] % cfg.BK == 0,
                    PREC=self.fp32_precision if a.dtype == torch.float32 else "tf32",
                    DOT_F32=launch._dot_f32(a), num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    def _pick(self, kind: str, a: Tensor, b: Tensor, cands: list, run):
        prec = self.fp32_precision if a.dtype == torch.float32 else "tf32"
        return launch.pick_config(f"{self.family}_{kind}", a, b, prec, cands, run)

    def _row_forward(self, kernel, a: Tensor, b: Tensor, args: tuple, diag: int, merge, tail: tuple = (),
                     flags: dict | None = None) -> Tensor:
        """merge(part) where part (splits, m) fp32 holds the forward kernel's per-row partials
        over column splits: kernel[(row blocks, splits)](a, b, *args, part, m, n, k,
        stride_a, stride_b, diag, columns per split, *tail, **flags)."""
        def run(cfg, a_: Tensor, b_: Tensor) -> Tensor:
            m_, n_ = a_.shape[0], b_.shape[0]
            nrb = cdiv(m_, cfg.BM)
            splits, per = column_splits(nrb, n_, cfg.BN, a_.device)
            part = self._alloc(splits, m_, device=a_.device, dtype=torch.float32)
            kernel[(nrb, splits)](a_, b_, *args, part, m_, n_, a_.shape[1], a_.stride(0), b_.stride(0), diag, per,
                                  *tail, **(flags or {}), **self._meta(cfg, a_))
            return merge(part)

        return run(self._pick("fwd", a, b, fwd_candidates(a.element_size()), run), a, b)

    def _use_strips(self, a: Tensor) -> bool:
        if self.strips == "never":
            return False
        return self.strips == "always" or (a.is_cuda and a.element_size() == 2)

    # -- family hooks of the strip path (defaults: SigLIP's) --

    def _strip_rows(self, a: Tensor, b: Tensor) -> int:
        """Rows per strip: the scratch budget with the fp32 fixup temporary's room kept."""
        return max(launch.strip_rows(b.shape[0], a.element_size()), launch.STRIP_MIN_ROWS)

    @staticmethod
    def _strip_candidates(k: int, esize: int) -> list[StripConfig]:
        return strip_candidates(k, esize)

    def _grad(self, a: Tensor, b: Tensor, vecs: tuple, out: Tensor, accumulate: bool, flags: dict,
              kind: str = "strip") -> Tensor:
        """out (+)= s dX @ b for the rows of ``a``; returns the family's partial sums. ``kind``:
        the tuning cache's name of the strip problem (a family's variants of it tune apart)."""
        rows = self._strip_rows(a, b)

        def scratch_out(a_sub: Tensor) -> Tensor:
            return torch.empty(a_sub.shape, device=a.device, dtype=out.dtype)

        if self._use_strips(a):
            def run_strips(cfg, a_sub, b_sub):
                sub = self._sub_vecs(vecs, flags, a_sub.shape[0], b_sub.shape[0])
                self._strips(a_sub, b_sub, sub, scratch_out(a_sub), False, rows, cfg, flags)

            cfg = self._pick(kind, a, b, self._strip_candidates(a.shape[1], a.element_size()), run_strips)
            return self._strips(a, b, vecs, out, accumulate, rows, cfg, flags)

        def run_fused(cfg, a_sub, b_sub):
            sub = self._sub_vecs(vecs, flags, a_sub.shape[0], b_sub.shape[0])
            self._fused(a_sub, b_sub, sub, scratch_out(a_sub), False, cfg, flags)

        cfg = self._pick("fused", a, b, fused_candidates(a.shape[1], a.element_size()), run_fused)
        return self._fused(a, b, vecs, out, accumulate, cfg, flags)
