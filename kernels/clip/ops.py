"""``TritonTileOps``: the tile-operation protocol of ``infclip.loss.tiled`` on Triton kernels.

Protocol (same as ``TorchTileOps``), with x_ij = s * <img_i, txt_j>:
    forward(img (m, c), txt (n, c), scale 0-d) -> (row_lse (m,), col_lse (n,)) fp32, LSE
        over this block pair only (callers merge partial LSEs with logaddexp).
    backward(img, txt, scale, row_lse, col_lse, g_row, g_col, dimg=None, dtxt=None)
        -> (dimg (m, c), dtxt (n, c), dscale 0-d) fp32; row_lse/col_lse are the final
        (global) LSEs; accumulates into dimg/dtxt when given.
    Extensions: ``out_dtype`` (fresh gradients written directly in, e.g., the input
    dtype; ``writes_out_dtype`` advertises it); ``offsets = (o_row (m,), o_col (n,))``
    (dot products: the LSEs are taken and returned relative to s * o) with ``diag`` /
    ``g_diag`` (the square block pair holding the CLIP positives, whose dot products are
    the offsets; g_diag: the gradient of -sum_i g_diag_i x_ii, folded into dX in fp32) --
    as ``infclip.loss.tiled.TorchTileOps``.
``scale`` stays on the device (read by the kernels through a pointer: no host sync).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from . import gluon_fwd, gluon_strip, launch
from ..launching import addmm_f32_in_place, finish_accumulator, fp32_accumulator

PRECISIONS = {"ieee": "ieee", "tf32": "tf32", "tf32x3": "tf32x3"}
BACKWARDS = ("auto", "onepass", "twopass")
# backward="auto" takes the one-pass path where the two-pass one would take strips (fresh bf16
# gradients on CUDA): H200, bf16, b = 16k-128k, c = 512-1024, forward + backward 1.14-1.33x
# faster (commit de83b53; docs/changelog.md). Elsewhere (fp32/fp16, the CUDA-graph path
# of small b, the interpreter) it stays two-pass: not measured faster there.
AUTO_BACKWARD = "onepass"
KERNEL_CHOICES = ("auto", "triton", "gluon")  # forward_kernel, strip_kernel
# forward_kernel="auto": the Gluon forward (``gluon_fwd``: warp-specialized, two consumer
# warpgroups ping-ponging wgmma and the exp2 epilogue) joins the tuner's candidates for 16-bit
# inputs on sm_90 without group ids, on the positives' square block pair, from this many rows
# on: the smallest b measured in the loss step (b <= graphs.MAX_ROWS = 16k runs on CUDA graphs
# with the Triton kernels; 16k-32k was not measured). H200, bf16, forward alone
# (scripts/tools/check_gluon_fwd.py): c = 512, b = 32k-64k 1.24-1.28x the Triton kernel (BM 128 x
# BN 64); c = 768 1.03-1.05x, c = 1024 1.11-1.12x (BM 64 x BN 128); the tuner keeps the faster.
GLUON_MIN_ROWS = 32768
# The Gluon strip fill (``gluon_strip``: the backward's P = s dX tiles, same ping-pong) joins
# the tuner's candidates as the forward's does ("auto", the default; "gluon" puts it first,
# "triton" leaves it out). Checked on an H200 (commit 4221a99, ``scripts/tools/check_gluon_strip.py``):
# P within 1 bf16 ulp of the Triton fill, d scale within 1e-7; a 4,096-row strip at b = 32k-64k
# 1.04-1.18x the Triton fill at c = 512-768, 0.97-1.04x at 1024, slower on 1,000-row strips
# (the tuner keeps the faster per size class). CLIP loss step, bf16, b = 32k-64k: 1.04-1.12x.
STRIP_KERNEL_DEFAULT = "auto"
# duplicates="mask" on one process (the batch sorted by group: int32 ids and a band w, the
# kernels' BAND): the Gluon forward and strip fill take it (``gluon_common.band_args``) when
# forced and, since both agreed with the Triton band kernels on an H200 and ran faster
# (scripts/tools/check_gluon_fwd.py --band: row / column LSE within 1.4e-6, 1.02-1.27x at b >= 32k;
# scripts/tools/check_gluon_strip.py --band: P within 1 bf16 ulp, d scale within 1e-7; commit
# 640e884), under "auto" too, where the tuner times them beside the Triton band kernels.
# Ids without a band (the ring) keep the Triton kernels.
GLUON_BAND_AUTO = True


def _kernel_choice(name: str, value: str | None, env: str, default: str) -> str:
    """A kernel option's value: as given, else the environment's ``env``, else ``default``;
    one of "auto", "triton", "gluon"."""
    value = value or os.environ.get(env, default)
    if value not in KERNEL_CHOICES:
        raise ValueError(f"{name} must be one of {KERNEL_CHOICES} (or {env} set to one), got {value!r}")
    return value


class TritonTileOps:
    """Triton tile operations: one forward pass for both LSEs; in the backward, per gradient
    direction either the strip path (bf16) or the fused kernel (accumulator in registers)
    ("twopass"), or one strip pass for both directions ("onepass", see ``backward``).

    Args:
        fp32_precision: dot precision for float32 inputs: "ieee" (default, full fp32),
            "tf32x3" (near-fp32 on tensor cores) or "tf32". 16-bit inputs always use
            tensor cores with fp32 accumulation.
        poison: fill every buffer the kernels must write with NaN first (tests).
        strips: backward path. "auto" takes the strip path (scratch s * dX for a strip of
            rows, then cuBLAS) for fresh bf16 gradients on CUDA: its scratch of 48 MB + 768 B
            x b (``launch.strip_rows``) holds at least ``launch.STRIP_MIN_ROWS`` rows at
            every b, so the extra memory stays within the rule (the two feature gradients
            + 1 KB x b + 64 MB). Otherwise (fp32/fp16, accumulating into a buffer) the
            fused kernel (fp32 accumulator in registers). "always"/"never" force one.
        strip_positives: how the strip path (16-bit inputs) applies the positives' folded
            fp32 dX_ii: "fold" (default) writes it into the scratch with the rest of the
            tile, rounded once to the input dtype (as vanilla rounds its softmax - one-hot,
            but after the fold: the small p_ii - 1 is rounded, not p_ii ~ 1), and the product
            goes straight into the gradient; "fixup" adds s dX_ii b_i to an fp32 product
            before its one rounding (more exact than vanilla; an fp32 (R, c) temporary and
            two elementwise passes per strip: H200, bf16, c = 1024, b = 16k: 7.40 ms vs
            6.97, c = 512, b = 64k: 63.0 vs 62.7).
        strip_budget: bytes of the strip scratch (default: ``launch.strip_rows``' 64 MB +
            768 B x b, and in a one-pass backward of fresh gradients (or ``spare_room``) without group ids, on
            CUDA with an in-place fp32 addmm, the unused second fp32 accumulator's room, 4 c
            bytes a sample: ``launch.onepass_spare_bytes``); the CUDA-graph path passes what its static
            buffers leave of the rule. An explicit budget is taken as it is.
        cuda_graphs: "auto" (default) runs ``fused_loss`` of small CUDA problems (b <= 16k where
            the memory rule leaves room: there the host, not the GPU, bounds the step) through
            captured CUDA graphs (``graphs``);
            "never" launches every kernel from Python.
        backward: "twopass" recomputes the logits once per gradient direction (the strip
            path or the fused kernel for dimg, then the same with the roles swapped for dtxt:
            10 b^2 c FLOPs for forward + backward). "onepass" fills each strip's P = s dX
            once and forms both gradients from it (``launch.grad_onepass_strips``: dimg[strip]
            = P @ txt, and dtxt's fp32 accumulator += P^T @ img[strip], two cuBLAS products:
            8 b^2 c FLOPs); its extra memory is that of the strip path plus one fp32 (n, c)
            accumulator for dtxt (none when dtxt is fp32: it is the accumulator), within issue
            27's rule (the two feature gradients + their fp32 accumulators + 1 KB x b + 64 MB).
            Any dtype and output (fresh or accumulated); not with ``grad_filter`` or
            ``strips="never"``. "auto" (default): ``AUTO_BACKWARD`` ("onepass") where the
            two-pass path would take strips (fresh bf16 gradients on CUDA, without
            ``grad_filter`` or ``strips="never"``), else "twopass" (measured:
            ``scripts/bench/bench_loss_kernels.py --parts onepass``).
        forward_kernel: "auto" (default; the environment's ``INFCLIP_FORWARD_KERNEL`` when
            set) lets the tuner time the Gluon forward (``gluon_fwd``) beside the Triton one
            for 16-bit inputs on sm_90 without group ids, from ``GLUON_MIN_ROWS`` rows, on
            the positives' square block pair (the case checked on the GPU; a ring's other
            blocks keep the Triton forward);
            "triton" never uses it; "gluon" puts it first wherever it applies, any b (also
            the default when tuning is off: ``INFCLIP_TRITON_TUNE=0``; the GPU tests), and
            also for duplicates "mask" on one process (int32 ids with a band: the sorted
            batch), which "auto" tunes too while ``GLUON_BAND_AUTO``.
        strip_kernel: the same choice for the backward's strip fill (``gluon_strip``; the
            environment's ``INFCLIP_STRIP_KERNEL``); default ``STRIP_KERNEL_DEFAULT``
            ("auto", from ``GLUON_MIN_ROWS`` columns). It applies with offsets,
            with the positives folded (``strip_positives="fold"``), without group ids or,
            forced ("gluon"), with the sorted batch's int32 ids and band (as forward_kernel).
    """

    name = "triton"
    writes_out_dtype = True  # backward(..., out_dtype=img.dtype) writes fresh grads directly
    takes_need = True  # backward(need=): an unwanted feature gradient costs no product (a locked tower)
    takes_spare_room = True  # backward(spare_room=): a summing caller gives its strips the spare accumulator room

    def __init__(self, fp32_precision: str = "ieee", *, poison: bool = False, strips: str = "auto",
                 grad_filter: tuple[float, int] | None = None, strip_positives: str = "fold",
                 strip_budget: int | None = None, cuda_graphs: str = "auto", backward: str = "auto",
                 forward_kernel: str | None = None, strip_kernel: str | None = None):
        if grad_filter is not None and (grad_filter[0] < 0 or grad_filter[1] < 1):
            raise ValueError(f"grad_filter must be (eps >= 0, columns >= 1), got {grad_filter}")
        self.threshold = None if grad_filter is None else grad_filter[0] / grad_filter[1]
        self.kept: list = [0, 0]  # [kept tiles (0-d tensor), all tiles], summed over filtered backwards
        if fp32_precision not in PRECISIONS:
            raise ValueError(f"fp32_precision must be one of {sorted(PRECISIONS)}, got {fp32_precision!r}")
        if strips not in ("auto", "always", "never"):
            raise ValueError(f"strips must be 'auto', 'always' or 'never', got {strips!r}")
        if strip_positives not in ("fixup", "fold"):
            raise ValueError(f"strip_positives must be 'fixup' or 'fold', got {strip_positives!r}")
        if strip_budget is not None and strip_budget <= 0:
            raise ValueError(f"strip_budget must be a positive number of bytes (or None: the default), "
                             f"got {strip_budget}")
        if cuda_graphs not in ("auto", "never"):
            raise ValueError(f"cuda_graphs must be 'auto' or 'never', got {cuda_graphs!r}")
        if backward not in BACKWARDS:
            raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
        if backward == "onepass" and (grad_filter is not None or strips == "never"):
            raise ValueError("backward='onepass' is a strip path without gradient filtering: it needs "
                             "grad_filter=None and strips 'auto' or 'always'; use backward='twopass'")
        self.forward_kernel = _kernel_choice("forward_kernel", forward_kernel, "INFCLIP_FORWARD_KERNEL", "auto")
        self.strip_kernel = _kernel_choice("strip_kernel", strip_kernel, "INFCLIP_STRIP_KERNEL", STRIP_KERNEL_DEFAULT)
        self.backward_path = backward
        self.fold = strip_positives == "fold"
        self.strip_budget = strip_budget
        self.cuda_graphs = cuda_graphs
        self.fp32_precision = fp32_precision
        self.poison = poison
        self.strips = strips

    def _prec(self, t: Tensor) -> str:
        return PRECISIONS[self.fp32_precision] if t.dtype == torch.float32 else "tf32"

    def _alloc(self, *shape, device, dtype):
        if self.poison:
            return torch.full(shape, float("nan"), device=device, dtype=dtype)
        return torch.empty(*shape, device=device, dtype=dtype)

    def forward(self, img: Tensor, txt: Tensor, scale: Tensor, offsets=None, diag: bool = False,
                groups=None) -> tuple[Tensor, Tensor]:
        """(row_lse (m,), col_lse (n,)) fp32 over the block pair (img, txt), relative to
        s * offsets when given; ``diag``: the positives' dot products are the offsets.
        groups: (g_row (m,), g_col (n,)) int32 or int64 group ids (``_groups``): same-group
        entries are dropped (duplicates, as ``infclip.loss.tiled.TorchTileOps``); or
        (g_row, g_col, band) on the square pair of a batch sorted by group (``_groups``)."""
        img, txt, scale = _prep(img, txt, scale)
        prec = self._prec(img)
        o_row, o_col = _offsets(offsets, img.shape[0], txt.shape[0])
        gid_row, gid_col, band = _groups(groups, img.shape[0], txt.shape[0])

        def run(cfg, a, b):
            sub = (o_row[:a.shape[0]], o_col[:b.shape[0]]) if o_row is not None else (None, None)
            gid = (gid_row[:a.shape[0]], gid_col[:b.shape[0]]) if gid_row is not None else (None, None)
            square = diag and a.shape[0] == b.shape[0]
            if isinstance(cfg, gluon_fwd.GluonFwdConfig):  # ids only in the band case (_forward_candidates)
                return gluon_fwd.lse_forward_gluon(a, b, scale, *sub, square, cfg=cfg, alloc=self._alloc,
                                                   gid_a=gid[0], gid_b=gid[1], band=band)
            return launch.lse_forward(a, b, scale, cfg, prec, alloc=self._alloc, off_a=sub[0], off_b=sub[1],
                                      diag=square, gid_a=gid[0], gid_b=gid[1], band=band)

        kind, cands = self._forward_candidates(img, txt, has_gid=gid_row is not None,
                                               positives=diag and img.shape[0] == txt.shape[0],
                                               offsets=o_row is not None, band=_sorted_band(gid_row, band))
        return run(launch.pick_config(kind, img, txt, prec, cands, run), img, txt)

    def _forward_candidates(self, img: Tensor, txt: Tensor, *, has_gid: bool, positives: bool,
                            offsets: bool, band: bool = False) -> tuple[str, list]:
        """(tuner key kind, configs): the Triton forward's, with the Gluon forward's joined
        (``forward_kernel`` "auto": from ``GLUON_MIN_ROWS`` rows, on the positives' square
        block pair with its offsets, the one-GPU loss's only call and the case checked on the
        GPU) or first ("gluon": any block pair; also the untuned default) where
        ``gluon_fwd.gluon_available``, and never for positives without offsets (the Triton
        forward refuses those). Group ids: only the sorted-band case (``band``: int32 ids with
        a band, ``_sorted_band``) on the positives' pair: forced ("gluon"), or "auto" while
        ``GLUON_BAND_AUTO``, kind "fwd_band_gluon(_first)"; the ring's ids never.
        The kind tells the orders and the cases apart, so that no two share a cached choice."""
        cands = launch.fwd_candidates(img.shape[1], img.element_size())
        banded = has_gid and band and positives
        if (self.forward_kernel == "triton" or (has_gid and not banded) or (positives and not offsets)
                or not gluon_fwd.gluon_available(img, txt)):
            return "fwd", cands
        if banded and not _gluon_takes_band(self.forward_kernel):
            return "fwd", cands
        if self.forward_kernel == "auto" and (not positives or min(img.shape[0], txt.shape[0]) < GLUON_MIN_ROWS):
            return "fwd", cands
        glu = gluon_fwd.tune_candidates(img.shape[1])
        tag = "fwd_band_gluon" if banded else "fwd_gluon"
        if self.forward_kernel == "gluon":
            return f"{tag}_first", glu + cands
        return tag, cands + glu

    def backward(self, img: Tensor, txt: Tensor, scale: Tensor, row_lse: Tensor, col_lse: Tensor,
                 g_row: Tensor, g_col: Tensor, dimg: Tensor | None = None,
                 dtxt: Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                 g_diag: Tensor | None = None, offsets=None, overwrite: bool = False, groups=None,
                 need: tuple[bool, bool] = (True, True),
                 spare_room: bool = False) -> tuple[Tensor | None, Tensor | None, Tensor]:
        """(dimg, dtxt, dscale); fresh outputs are ``out_dtype`` (fp32 by the protocol).

        offsets: row_lse / col_lse are relative to s * offsets (as ``forward``). g_diag (m,)
        (square block pair, offsets = the positives' dot products): the gradient of
        -sum_i g_diag_i x_ii, folded into dX_ii in fp32 before any rounding (ds too).
        overwrite: the given dimg / dtxt are written, not accumulated into (as fresh outputs
        of their dtype: the CUDA graphs' static gradients). groups: as ``forward``.
        need: which of (dimg, dtxt) are wanted; an unwanted one is returned as None and costs
        no product (LiT's locked image tower: the one-pass backward forms dX once and skips
        dX @ txt, 6 b^2 c instead of 8 for forward + backward; the two-pass path runs one of
        its passes). What is computed is bit-identical to the same gradient of a call that
        wants both (ds: equal up to summation order when only dtxt is wanted).
        spare_room: a caller summing into given fp32 buffers whose memory rule holds the room of
        the second fp32 accumulator the one-pass backward never allocates (the ring's tiles:
        ``ring.backward_extra_bytes``) lets the strips take it, as fresh gradients do
        (``launch.onepass_spare_bytes``). Taller strips sum dtxt over fewer strips: equal up to
        the fp32 summation order."""
        img, txt, scale = _prep(img, txt, scale)
        o_row, o_col = _offsets(offsets, img.shape[0], txt.shape[0])
        gid_row, gid_col, band = _groups(groups, img.shape[0], txt.shape[0])
        vecs = [v.float().contiguous() for v in (row_lse, col_lse, g_row, g_col)]
        row_lse, col_lse, g_row, g_col = vecs
        prec = self._prec(img)
        acc_i = dimg is not None and not overwrite and need[0]
        acc_t = dtxt is not None and not overwrite and need[1]
        dimg = self._out(dimg, img, out_dtype) if need[0] else None
        dtxt = self._out(dtxt, txt, out_dtype) if need[1] else None
        if g_diag is not None:
            if img.shape[0] != txt.shape[0] or o_row is None:
                raise ValueError(f"g_diag needs a square block pair ({img.shape[0]} x {txt.shape[0]}) and "
                                 "the offsets (the positives' dot products)")
            g_diag = g_diag.float().contiguous()
        if self._one_pass(img, txt):
            return dimg, dtxt, self._grad_onepass(img, txt, scale, row_lse, col_lse, g_row, g_col, dimg, dtxt, acc_i,
                                                  acc_t, prec, g_diag, o_row, o_col, gid_row, gid_col, band,
                                                  spare_room)
        ds = None
        if need[0] or not need[1]:  # (d scale alone: the image pass, its gradient dropped)
            out = dimg if need[0] else self._out(None, img, out_dtype)
            ds = self._grad(img, txt, scale, row_lse, col_lse, g_row, g_col, out, acc_i, True, prec, g_diag,
                            o_row, o_col, gid_row, gid_col, band)
        if need[1]:  # (the band is symmetric: |i - j| <= w either way round)
            # d scale is formed in the text pass whether or not it is wanted from there: the
            # kernel variant without it is compiled differently (its q is dead code), and its
            # fp32 dtxt came out other in the last bits on the GPU than a text-only call's.
            ds_t = self._grad(txt, img, scale, col_lse, row_lse, g_col, g_row, dtxt, acc_t, True, prec, g_diag,
                              o_col, o_row, gid_col, gid_row, band)
            ds = ds_t if ds is None else ds
        return dimg, dtxt, ds

    def fused_loss(self, img: Tensor, txt: Tensor, scale: Tensor, groups: Tensor | None = None) -> Tensor:
        """The symmetric CLIP loss of a square batch as one autograd node (see function.py),
        replayed from CUDA graphs where ``graphs.eligible``.

        groups: (b,) int32 (or int64) group ids, or None: same-group pairs i != j are not
        negatives (duplicates "mask"), in the same kernels and passes as without (HAS_GID:
        one compare per tile entry). Such calls run eagerly, never from the graphs: the ids
        are a new tensor every step (a graph would need a static id buffer, a copy and a
        second captured variant per problem), and graphs serve only b <= ``graphs.MAX_ROWS``,
        where the host bounds the step, below the b >= 32k the Gluon kernels serve. An eager call drops a
        resident graph pool first (the memory rule: no eager call beside one)."""
        from . import graphs
        from .function import TritonCLIPLoss

        if graphs.eligible(self, img, txt):
            if groups is None:
                return graphs.graphed_loss(self, img, txt, scale)
            graphs.release()
        return TritonCLIPLoss.apply(img, txt, scale, self, groups)

    def _grad(self, a, b, scale, lse_a, lse_b, g_a, g_b, out, accumulate, compute_ds, prec, g_d=None,
              off_a=None, off_b=None, gid_a=None, gid_b=None, band=None):
        """out (+)= s * dX @ b for the rows of a; returns ds when ``compute_ds``."""
        rows = launch.strip_rows(b.shape[0], a.element_size(), budget=self.strip_budget, k=a.shape[1],
                                 temp=not self.fold)
        vecs = dict(g_d=g_d, off_a=off_a, off_b=off_b, gid_a=gid_a, gid_b=gid_b, band=band)
        if self.threshold is not None:
            cfg = self._bwd_cfg(a, b, prec, scale)
            return launch.grad_rows(a, b, scale, lse_a, lse_b, g_a, g_b, out, accumulate, compute_ds, cfg, prec,
                                    threshold=self.threshold, kept=self.kept, **vecs)
        if self._use_strips(a, out, accumulate, rows):
            cfg = self._strip_cfg(a, b, prec, scale, rows, self._gluon_strip_ok(g_d, off_a, gid_a, band),
                                  banded=gid_a is not None)
            ds = launch.grad_rows_strips(a, b, scale, lse_a, lse_b, g_a, g_b, out, rows, cfg, prec,
                                         alloc=self._alloc, fold=self.fold, **vecs)
            return ds if compute_ds else None
        cfg = self._bwd_cfg(a, b, prec, scale)
        return launch.grad_rows(a, b, scale, lse_a, lse_b, g_a, g_b, out, accumulate, compute_ds, cfg, prec,
                                **vecs)

    def path_for(self, img: Tensor) -> str:
        """The backward path ("onepass" / "twopass") this ops takes for fresh gradients of ``img``."""
        if self.backward_path != "auto":
            return self.backward_path
        auto_ok = self.threshold is None and self.strips != "never"
        strips = img.is_cuda and img.dtype == torch.bfloat16
        return AUTO_BACKWARD if auto_ok and strips else "twopass"

    def _one_pass(self, img: Tensor, txt: Tensor) -> bool:
        return self.path_for(img) == "onepass" and img.shape[0] > 0 and txt.shape[0] > 0

    def _grad_onepass(self, img, txt, scale, row_lse, col_lse, g_row, g_col, dimg, dtxt, acc_i, acc_t, prec,
                      g_d, o_row, o_col, gid_row=None, gid_col=None, band=None, spare_room=False) -> Tensor:
        """dimg (+)= s dX @ txt and dtxt (+)= s dX^T @ img from one fill per strip of image
        rows (``launch.grad_onepass_strips``); returns ds. dtxt is summed over the strips in
        fp32: in dtxt itself when it is fp32, else in a fresh fp32 (n, c) accumulator that
        is rounded into dtxt once at the end. dimg / dtxt None: not wanted (no product for
        it; both None: the fills alone, for ds), the other one bit for bit as with both."""
        # (the sorted mask's feature copies hold the spare room already: no spare with group ids)
        roomy = (spare_room or not (acc_i or acc_t)) and gid_row is None
        spare = launch.onepass_spare_bytes(img.shape[0], txt.shape[0], img.shape[1], roomy,
                                           addmm_f32_in_place(img, txt))
        rows = launch.strip_rows(txt.shape[0], img.element_size(), budget=self.strip_budget, k=img.shape[1],
                                 temp=not self.fold, spare=spare)
        cfg = self._strip_cfg(img, txt, prec, scale, rows, self._gluon_strip_ok(g_d, o_row, gid_row, band),
                              banded=gid_row is not None)
        if dtxt is None:  # the same fills and P @ txt, without the second product
            return launch.grad_rows_strips(img, txt, scale, row_lse, col_lse, g_row, g_col, dimg, rows, cfg, prec,
                                           alloc=self._alloc, g_d=g_d, off_a=o_row, off_b=o_col, fold=self.fold,
                                           accumulate=acc_i, gid_a=gid_row, gid_b=gid_col, band=band)
        acc = fp32_accumulator(dtxt, acc_t)  # (dimg may be None: not wanted, no product)
        ds = launch.grad_onepass_strips(img, txt, scale, row_lse, col_lse, g_row, g_col, dimg, acc, rows, cfg, prec,
                                        alloc=self._alloc, g_d=g_d, off_a=o_row, off_b=o_col, fold=self.fold,
                                        accumulate=acc_i, gid_a=gid_row, gid_b=gid_col, band=band)
        finish_accumulator(dtxt, acc, acc_t)
        return ds

    def _use_strips(self, a: Tensor, out: Tensor, accumulate: bool, rows: int) -> bool:
        fits = not accumulate and out.dtype == a.dtype and out.is_contiguous() and rows >= 1
        if self.strips == "always":
            return fits
        auto = a.is_cuda and a.dtype == torch.bfloat16 and rows >= launch.STRIP_MIN_ROWS
        return self.strips == "auto" and fits and auto

    def _gluon_strip_ok(self, g_d: Tensor | None, off: Tensor | None, gid: Tensor | None,
                        band: Tensor | None = None) -> bool:
        """Whether this backward's fills are of the kind the Gluon strip fill computes
        (offsets given, positives absent or folded; group ids only in the sorted-band case,
        ``_sorted_band``, with the positives: ``gluon_common.band_args``)."""
        if off is None or (g_d is not None and not self.fold):
            return False
        if gid is None:
            return True
        # (where the Gluon fill may not take the band, the Triton fills run as before the band
        # variant; where it may, the fills run in the Gluon fill's form, zero offsets included,
        # also when the tuner then picks a Triton config: the same results)
        return _gluon_takes_band(self.strip_kernel) and _sorted_band(gid, band) and g_d is not None

    def _strip_cfg(self, a: Tensor, b: Tensor, prec: str, scale: Tensor, rows: int, gluon_ok: bool = False,
                   banded: bool = False):
        """The strip config (tuned per ``_strip_candidates``' kind). banded: the fills carry
        group ids with a band; the tuner's fills then do too (w = 0: the diagonal's tiles)."""
        def run(cfg, a_sub, b_sub):
            ms, ns = a_sub.shape[0], b_sub.shape[0]
            lse_a = torch.full((ms,), 30.0, device=a.device)
            lse_b = torch.full((ns,), 30.0, device=a.device)
            g_a, g_b = torch.ones(ms, device=a.device), torch.ones(ns, device=a.device)
            out = torch.empty_like(a_sub)
            # zero offsets: the fast-offset path every real call with offsets takes (the Gluon
            # fill's only one), at the cost of the same tiles
            off = (torch.zeros(ms, device=a.device), torch.zeros(ns, device=a.device)) if gluon_ok else (None, None)
            ids = {}
            if banded and gluon_ok:  # the band case: square, with the positives (band_args)
                arange = torch.arange(max(ms, ns), device=a.device, dtype=torch.int32)
                ids = dict(g_d=2 * g_a, gid_a=arange[:ms], gid_b=arange[:ns],
                           band=torch.zeros(1, device=a.device, dtype=torch.int32), fold=True)
            launch.grad_rows_strips(a_sub, b_sub, scale, lse_a, lse_b, g_a, g_b, out, rows, cfg, prec,
                                    off_a=off[0], off_b=off[1], **ids)

        kind, cands = self._strip_candidates(a, b, gluon_ok, banded)
        return launch.pick_config(kind, a, b, prec, cands, run)

    def _strip_candidates(self, a: Tensor, b: Tensor, gluon_ok: bool, banded: bool = False) -> tuple[str, list]:
        """(tuner key kind, configs): the Triton strip configs, with the Gluon fill's joined
        ("auto": from ``GLUON_MIN_ROWS`` columns) or first ("gluon") where it applies. banded
        (group ids, which ``gluon_ok`` admits in the sorted-band case only): forced ("gluon"),
        or "auto" while ``GLUON_BAND_AUTO``, kind "strip_band_gluon(_first)"."""
        cands = launch.strip_candidates(a.shape[1], a.element_size())
        if self.strip_kernel == "triton" or not gluon_ok or not gluon_strip.gluon_strip_available(a, b):
            return "strip", cands
        if banded and not _gluon_takes_band(self.strip_kernel):
            return "strip", cands
        if self.strip_kernel == "auto" and b.shape[0] < GLUON_MIN_ROWS:
            return "strip", cands
        glu = gluon_strip.tune_candidates(a.shape[1], a.element_size())
        tag = "strip_band_gluon" if banded else "strip_gluon"
        if self.strip_kernel == "gluon":
            return f"{tag}_first", glu + cands
        return tag, cands + glu

    def _out(self, buf: Tensor | None, like: Tensor, dtype: torch.dtype) -> Tensor:
        if buf is None:
            return self._alloc(*like.shape, device=like.device, dtype=dtype)
        if buf.shape != like.shape or buf.stride(-1) != 1:
            raise ValueError(f"gradient buffer must be {tuple(like.shape)} with unit last stride, "
                             f"got {tuple(buf.shape)} strides {buf.stride()}")
        return buf

    def _bwd_cfg(self, a: Tensor, b: Tensor, prec: str, scale: Tensor):
        m, n = a.shape[0], b.shape[0]

        def run(cfg, a_sub, b_sub):
            ms, ns = a_sub.shape[0], b_sub.shape[0]
            lse_a = torch.full((ms,), 30.0, device=a.device)  # keeps exp() of tuning data finite
            lse_b = torch.full((ns,), 30.0, device=a.device)
            g_a, g_b = torch.ones(ms, device=a.device), torch.ones(ns, device=a.device)
            out = torch.empty(a_sub.shape, device=a.device, dtype=torch.float32)
            launch.grad_rows(a_sub, b_sub, scale, lse_a, lse_b, g_a, g_b, out, False, True, cfg, prec)

        cands = launch.bwd_candidates(a.shape[1], a.element_size())
        return launch.pick_config("bwd", a, b, prec, cands, run) if m and n else cands[0]


def _offsets(offsets, m: int, n: int) -> tuple[Tensor | None, Tensor | None]:
    """(o_row (m,), o_col (n,)) contiguous fp32, or (None, None)."""
    if offsets is None:
        return None, None
    o_row, o_col = offsets
    if o_row.shape != (m,) or o_col.shape != (n,):
        raise ValueError(f"offsets must be ({m},) and ({n},), got {tuple(o_row.shape)} and {tuple(o_col.shape)}")
    return o_row.detach().float().contiguous(), o_col.detach().float().contiguous()


def _groups(groups, m: int, n: int) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(g_row (m,), g_col (n,), band) contiguous group ids of one integer dtype, or Nones:
    int32 (dense ranks, ``infclip.loss.duplicates.dense_ids``: one compare instruction and
    half the registers of int64 in the kernels) or int64 (ids that must stay global: the ring).
    band: a third element, a (1,) int32 device tensor w, when the batch is sorted by group
    (every same-group pair (i, j) has |i - j| <= w: ``infclip.loss.duplicates.sort_groups``);
    the square block pair's kernels then compare ids only in tiles within w of the diagonal
    (``launch._band``). Absent (two elements): every tile compares."""
    if groups is None:
        return None, None, None
    g_row, g_col, band = (*groups, None) if len(groups) == 2 else groups
    if band is not None and m != n:
        raise ValueError(f"a band (groups' third element) needs the square block pair of a sorted batch, got {m} x {n}")
    ok = g_row.dtype == g_col.dtype and g_row.dtype in (torch.int32, torch.int64)
    if g_row.shape != (m,) or g_col.shape != (n,) or not ok:
        raise ValueError(f"groups must be int32 or int64 (one dtype) ({m},) and ({n},), got {g_row.dtype} "
                         f"{tuple(g_row.shape)} and {g_col.dtype} {tuple(g_col.shape)}")
    return g_row.contiguous(), g_col.contiguous(), band


def _gluon_takes_band(choice: str) -> bool:
    """Whether a Gluon kernel under ``choice`` (forward_kernel / strip_kernel) may take the
    sorted band: forced ("gluon"), or "auto" while ``GLUON_BAND_AUTO``."""
    return choice == "gluon" or (choice == "auto" and GLUON_BAND_AUTO)


def _sorted_band(gid: Tensor | None, band: Tensor | None) -> bool:
    """Whether group ids come in the case the Gluon kernels take: int32 with a band (the
    one-process batch sorted by group, ``infclip.loss.duplicates.sort_groups``)."""
    return gid is not None and band is not None and gid.dtype == torch.int32


def _prep(img: Tensor, txt: Tensor, scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Unit last stride for the kernels' pointer math; scale as a 0-d fp32 device tensor."""
    if img.shape[1] != txt.shape[1] or img.dtype != txt.dtype:
        raise ValueError(f"img {tuple(img.shape)} {img.dtype} and txt {tuple(txt.shape)} {txt.dtype} "
                         "must share feature dim and dtype")
    if img.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"Triton tile ops support float32/bfloat16/float16, got {img.dtype}")
    img = img if img.stride(-1) == 1 else img.contiguous()
    txt = txt if txt.stride(-1) == 1 else txt.contiguous()
    return img, txt, scale.detach().float().reshape(())
