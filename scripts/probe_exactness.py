"""Where the CLIP loss loses accuracy: relative errors against float64, per seed, as a table.

For each (case, b, c, seed) it prints the relative error of (loss, d image, d text,
d scale) for vanilla fp32 (the bar), the PyTorch tiles and the Triton kernels, plus two
Triton rows that split the error between the passes:
  triton_lse64: the Triton backward fed the float64 LSEs (its own error only);
  triton_fwd:   the Triton forward's LSEs against float64 (max abs error, natural units,
                and the error of the loss they give).
Cases as in tests/loss/test_exact_positives.py (peaked / flat / unnormalized).

    python scripts/probe_exactness.py --shapes 37x40,777x640 --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infclip.kernels.clip.ops import TritonTileOps  # noqa: E402
from infclip.loss import clip_loss  # noqa: E402
from infclip.loss.reference import vanilla_loss  # noqa: E402
from tests.loss.test_exact_positives import DEV, _errs, _grads, _inputs, _truth  # noqa: E402

NAMES = ("loss", "dimg", "dtxt", "ds")


def _true_lse(img, txt, s, pos):
    """float64 (row, col) LSEs relative to s * pos, the positives' logits set to s * pos."""
    x = s * (img @ txt.T)
    x.diagonal().copy_(s * pos)
    return torch.logsumexp(x, 1) - s * pos, torch.logsumexp(x, 0) - s * pos


def _split(img, txt, s, ref, ops):
    """(errors of the Triton backward fed float64 LSEs, max |LSE error| of the Triton forward)."""
    i32, t32 = img.float(), txt.float()
    pos = (i32 * t32).sum(-1)  # fp32, as row_dot
    s32 = s.float()
    row64, col64 = _true_lse(img, txt, s, pos.double())
    b = img.shape[0]
    g = torch.full((b,), 0.5 / b, device=img.device)
    di, dt, ds = ops.backward(i32, t32, s32, row64.float(), col64.float(), g, g, out_dtype=torch.float32,
                              g_diag=2 * g, offsets=(pos, pos))
    loss64 = 0.5 * (row64.mean() + col64.mean())
    bwd = _errs([loss64, di.double(), dt.double(), ds.double()], ref)
    row, col = ops.forward(i32, t32, s32, offsets=(pos, pos), diag=True)
    fwd_err = max((row.double() - row64).abs().max().item(), (col.double() - col64).abs().max().item())
    loss_err = abs(0.5 * (row.double().mean() + col.double().mean()).item() - ref[0].item()) / ref[0].item()
    return bwd, fwd_err, loss_err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="37x40,70x200", help="b x c pairs")
    ap.add_argument("--cases", default="peaked,flat,unnormalized")
    ap.add_argument("--seeds", default="0,1,2")
    args = ap.parse_args()
    ops = TritonTileOps()
    print(f"device {DEV}; relative errors vs float64 of (loss, dimg, dtxt, ds)")
    print(f"{'case':13s} {'b':>6s} {'c':>5s} {'seed':>4s} {'impl':13s} " + " ".join(f"{n:>9s}" for n in NAMES))
    for shape in args.shapes.split(","):
        b, c = (int(v) for v in shape.split("x"))
        for case in args.cases.split(","):
            for seed in (int(v) for v in args.seeds.split(",")):
                img, txt, s = _inputs(case, b, c, seed)
                ref = _truth(img, txt, s)
                rows = {"vanilla_fp32": _errs(_grads(vanilla_loss, img, txt, s, torch.float32), ref)}
                for impl in ("torch", "triton"):
                    fn = (lambda i, t, sc, impl=impl: clip_loss(i, t, sc, impl=impl))
                    rows[impl] = _errs(_grads(fn, img, txt, s, torch.float32), ref)
                bwd, fwd_err, loss_err = _split(img, txt, s, ref, ops)
                rows["triton_lse64"] = bwd
                for name, errs in rows.items():
                    print(f"{case:13s} {b:6d} {c:5d} {seed:4d} {name:13s} " + " ".join(f"{e:9.2e}" for e in errs))
                print(f"{case:13s} {b:6d} {c:5d} {seed:4d} {'triton_fwd':13s} max|dLSE| {fwd_err:.2e}, "
                      f"loss from it {loss_err:.2e}  (loss {ref[0].item():.4f})")


if __name__ == "__main__":
    main()
