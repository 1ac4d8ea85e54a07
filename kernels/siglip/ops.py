"""``TritonSigmoidOps``: the SigLIP tile-operation protocol of ``infclip.loss.siglip`` on Triton.

    forward(img (m,c), txt (n,c), scale, bias, diag) -> row_loss (m,) fp32
    backward(img, txt, scale, bias, g_row (m,), diag, dimg=None, dtxt=None)
        -> (dimg (m,c), dtxt (n,c), dscale 0-d, dbias 0-d) fp32; accumulates when given.
``diag``: the block pair holds the positives on its diagonal (own images x own texts).
Scale and bias stay on the device (read by the kernels through pointers: no host sync).

Paths and block configs as ``infclip.kernels.objective.ObjectiveTiles`` (strip backward for
16-bit CUDA inputs, the fused kernel otherwise; configs timed once). ``backward="onepass"``
one strip fill of P = s dX per strip of image rows feeds both gradients, dimg[strip]
= P @ txt and dtxt (fp32) += P^T @ img[strip] (``launching.addmm_f32_``), as the CLIP tiles'
``launch.grad_onepass_strips``; ds and dt summed once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..launching import addmm_f32_, cdiv, finish_accumulator, fp32_accumulator, strip_backward
from ..objective import ObjectiveTiles
from .kernels import _sigmoid_fwd_kernel, _sigmoid_grad_kernel, _sigmoid_strip_kernel


# What backward="auto" takes on the strip path (16-bit CUDA inputs): one-pass measured 1.19-1.34x
# faster for forward + backward at b = 16k-64k, c = 512-1024 (H200, scripts/bench/bench_objective_backward.py);
# elsewhere (the fused kernel) "auto" is two-pass.
AUTO_BACKWARD = "onepass"


class TritonSigmoidOps(ObjectiveTiles):
    """Fused Triton SigLIP tiles: one forward pass (row sums), one backward pass per direction
    ("twopass") or one for both ("onepass", a strip path).

    Args as ``ObjectiveTiles`` (fp32_precision, strips, poison), and backward: "twopass",
    "onepass" (not with strips="never") or "auto" (``AUTO_BACKWARD`` where the strip path
    runs, i.e. 16-bit CUDA inputs; "twopass" elsewhere: see :meth:`path_for`).
    """

    name = "triton"
    family = "sigmoid"
    takes_need = True  # backward(need=): an unwanted feature gradient costs no product (a locked tower)

    def __init__(self, fp32_precision: str = "ieee", *, strips: str = "auto", poison: bool = False,
                 backward: str = "auto"):
        super().__init__(fp32_precision, strips=strips, poison=poison)
        if backward not in ("auto", "onepass", "twopass"):
            raise ValueError(f"backward must be 'auto', 'onepass' or 'twopass', got {backward!r}")
        if backward == "onepass" and strips == "never":
            raise ValueError("backward='onepass' is a strip path: it needs strips 'auto' or 'always'")
        self.backward_path = backward

    def path_for(self, img: Tensor) -> str:
        """The backward path ("onepass" / "twopass") this ops takes for ``img``."""
        if self.backward_path != "auto":
            return self.backward_path
        return AUTO_BACKWARD if self._use_strips(img) else "twopass"

    def forward(self, img: Tensor, txt: Tensor, scale: Tensor, bias: Tensor, diag: bool) -> Tensor:
        img, txt, scale, bias = _prep(img, txt, scale, bias)
        m, n = img.shape[0], txt.shape[0]
        if not (m and n):
            return torch.zeros(m, device=img.device)
        return self._row_forward(_sigmoid_fwd_kernel, img, txt, (scale, bias), 0 if diag else m + n,
                                 lambda part: part.sum(0))

    def backward(self, img: Tensor, txt: Tensor, scale: Tensor, bias: Tensor, g_row: Tensor, diag: bool,
                 dimg: Tensor | None = None, dtxt: Tensor | None = None, need: tuple[bool, bool] = (True, True)):
        """need: which of (dimg, dtxt) are wanted; an unwanted one is None and costs no product
        (the one-pass backward fills each strip once either way; the two-pass path runs only the
        wanted passes). What is computed is bit-identical to a call that wants both (ds, dt:
        equal up to summation order when only dtxt is wanted on the two-pass path)."""
        img, txt, scale, bias = _prep(img, txt, scale, bias)
        g = g_row.float().contiguous()
        acc_i, acc_t = dimg is not None and need[0], dtxt is not None and need[1]
        dimg = self._out(dimg, img) if need[0] else None
        dtxt = self._out(dtxt, txt) if need[1] else None
        off = 0 if diag else img.shape[0] + txt.shape[0]
        vecs, rows_flags = (scale, bias, g), dict(diag=off, G_ON_A=True)
        if self.path_for(img) == "onepass" and img.shape[0] and txt.shape[0]:
            part = self._grad_onepass(img, txt, vecs, dimg, dtxt, acc_i, acc_t, rows_flags)
            return dimg, dtxt, part[0], part[1]
        part = None
        if need[0] or not need[1]:  # (ds and dt alone: the image pass, its gradient dropped)
            part = self._grad(img, txt, vecs, dimg if need[0] else self._out(None, img), acc_i, rows_flags)
        if need[1]:
            part_t = self._grad(txt, img, vecs, dtxt, acc_t, dict(diag=off, G_ON_A=False))
            part = part_t if part is None else part
        return dimg, dtxt, part[0], part[1]

    # -- the family's pieces used by ObjectiveTiles._grad --

    @staticmethod
    def _sub_vecs(vecs, flags, ms: int, ns: int):
        """The backward's vectors for a (ms, ns) corner of the problem (config timing)."""
        scale, bias, g = vecs
        return scale, bias, g[:ms] if flags["G_ON_A"] else g[:ns]

    def _grad_onepass(self, a, b, vecs, out_a, out_b, acc_a, acc_b, flags) -> Tensor:
        """out_a (+)= s dX @ b and out_b (+)= s dX^T @ a from one fill per strip of a's rows;
        returns (ds, dt). out_b is summed in fp32: in itself when fp32, else in a fresh fp32
        accumulator rounded into it once. out_a / out_b None: not wanted, no product for it."""
        rows = self._strip_rows(a, b)
        tune_dtype = a.dtype if out_a is None else out_a.dtype

        def run_strips(cfg, a_sub, b_sub):
            sub = self._sub_vecs(vecs, flags, a_sub.shape[0], b_sub.shape[0])
            self._strips(a_sub, b_sub, sub, torch.empty(a_sub.shape, device=a.device, dtype=tune_dtype), False,
                         rows, cfg, flags)

        cfg = self._pick("strip", a, b, self._strip_candidates(a.shape[1], a.element_size()), run_strips)
        if out_b is None:  # the same fills and P @ b, without the second product
            return self._strips(a, b, vecs, out_a, acc_a, rows, cfg, flags)
        acc = fp32_accumulator(out_b, acc_b)

        def second(r0: int, r: int, scratch: Tensor) -> None:
            addmm_f32_(acc, scratch[:r].T, a[r0:r0 + r])

        part = self._strips(a, b, vecs, out_a, acc_a, rows, cfg, flags, then=second)
        finish_accumulator(out_b, acc, acc_b)
        return part

    def _strips(self, a, b, vecs, out, accumulate, rows, cfg, flags, then=None) -> Tensor:
        scale, bias, g = vecs
        k, n = a.shape[1], b.shape[0]

        def fill(r0: int, r: int, scratch: Tensor) -> Tensor:
            grid = cdiv(r, cfg.BM) * cdiv(n, cfg.BN)
            part = torch.empty(2 * grid, device=a.device, dtype=torch.float32)
            _sigmoid_strip_kernel[(grid,)](
                a, b, scale, bias, g, scratch, part, r, r0, n, k, a.stride(0), b.stride(0), scratch.stride(0),
                flags["diag"], GROUP=cfg.GROUP, G_ON_A=flags["G_ON_A"], **self._meta(cfg, a))
            return part.view(-1, 2).sum(0)

        return strip_backward(a, b, out, rows, accumulate, fill, self._alloc, then=then)

    def _fused(self, a, b, vecs, out, accumulate, cfg, flags) -> Tensor:
        scale, bias, g = vecs
        m, n, k = a.shape[0], b.shape[0], a.shape[1]
        grid = (cdiv(m, cfg.BM), cdiv(k, cfg.DC))
        part = torch.empty(2 * grid[0] * grid[1], device=a.device, dtype=torch.float32)
        _sigmoid_grad_kernel[grid](a, b, scale, bias, g, out, part, m, n, k, a.stride(0), b.stride(0),
                                   out.stride(0), flags["diag"], DC=cfg.DC, G_ON_A=flags["G_ON_A"],
                                   ACCUM=accumulate, COMPUTE_DS=True, **self._meta(cfg, a))
        return part.view(-1, 2).sum(0)


def _prep(img: Tensor, txt: Tensor, scale: Tensor, bias: Tensor):
    if img.dtype != txt.dtype:
        raise ValueError(f"dtype mismatch: {img.dtype} vs {txt.dtype}")
    if img.shape[1] != txt.shape[1]:
        raise ValueError(f"feature dims differ: {img.shape[1]} vs {txt.shape[1]}")
    to32 = (lambda x: x.detach().reshape(1).float())
    return img.contiguous(), txt.contiguous(), to32(scale), to32(bias)

