"""SigLIP and NT-Xent Triton kernels: the two-pass backward against the one-pass one, one GPU run.

For each objective and (c, b) of ``--shapes`` (bf16, L2-normalized random features): the
forward + backward through its Triton ops with ``backward="twopass"`` and ``backward="onepass"``,
median (and min-max) of ``--reps`` CUDA-event timings after a warm-up (which also tunes), the
one-pass gradients checked against the two-pass ones (relative Frobenius difference), and the
ratio. ``AUTO_BACKWARD`` of ``kernels/siglip/ops.py`` and ``kernels/nt_xent/ops.py`` is what
``backward="auto"`` takes: flip it where one-pass wins.

- ``siglip``: the whole one-process loss (one block pair: own images x own texts).
- ``nt_xent``: one process's loss is its own block, F x F^T, which the strip path already runs
  as one symmetric pass whatever ``backward`` says (``backward_own``): identical kernels. So
  this row times what the choice changes, a ring's off-diagonal block pair (b rows of view
  features against b rows of another rank's): ``forward`` + ``backward(..., mask_diag=False)``.

    python3 -u scripts/bench/bench_objective_backward.py --out $OUT
    python3 -u scripts/bench/bench_objective_backward.py --shapes 512x32768,1024x65536 --reps 5

Without CUDA it runs the same code on tiny shapes under TRITON_INTERPRET (a dry run of the
script: wall-clock timings, not a benchmark).
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_loss import times_ms  # noqa: E402  (this folder is on sys.path when run as a script)

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _features(objective: str, b: int, c: int, device: str, seed: int):
    """(leaves, closure of an ops object): SigLIP's leaf inputs and its loss (backward through
    autograd), or for NT-Xent a dict the closure fills with the block's gradients."""
    from infclip.loss.siglip import _SigmoidRows

    g = torch.Generator(device=device).manual_seed(seed)
    dtype = torch.bfloat16 if CUDA else torch.float32
    x = F.normalize(torch.randn(b, c, device=device, generator=g), dim=-1)
    y = F.normalize(0.5 * x + torch.randn(b, c, device=device, generator=g), dim=-1)
    if objective == "siglip":
        img, txt = x.to(dtype).requires_grad_(), y.to(dtype).requires_grad_()
        scale = torch.tensor(10.0, device=device, requires_grad=True)
        bias = torch.tensor(-10.0, device=device, requires_grad=True)
        leaves = (img, txt, scale, bias)
        return leaves, lambda ops: _SigmoidRows.apply(img, txt, scale, bias, ops, None).sum() / b
    a, other = x.to(dtype), y.to(dtype)  # this rank's rows and another rank's (a ring block pair)
    scale = torch.tensor(10.0, device=device)  # 1 / temperature 0.1
    g = torch.full((b,), 1.0 / b, device=device)
    out = {}

    def block(ops):
        lse = ops.forward(a, other, scale, False)
        da, db, ds = ops.backward(a, other, scale, lse, g, False)
        out["grads"] = (da, db, ds.reshape(1))
        return None

    return out, block


def _ops(objective: str, backward: str):
    if objective == "siglip":
        from infclip.kernels.siglip import TritonSigmoidOps

        return TritonSigmoidOps(backward=backward)
    from infclip.kernels.nt_xent import TritonMaskedLSEOps

    return TritonMaskedLSEOps(backward=backward)


def measure(objective: str, c: int, b: int, reps: int) -> dict:
    device = "cuda" if CUDA else "cpu"
    leaves, loss_of = _features(objective, b, c, device, seed=b + c)
    row = {"objective": objective, "c": c, "b": b}
    grads = {}
    for path in ("twopass", "onepass"):
        ops = _ops(objective, path)

        def step():
            if isinstance(leaves, dict):  # nt_xent: the ring block's forward + backward
                loss_of(ops)
                return
            for t in leaves:
                t.grad = None
            loss_of(ops).backward()

        ms = times_ms(step, reps)
        row[path] = (statistics.median(ms), min(ms), max(ms))
        got = leaves["grads"] if isinstance(leaves, dict) else [t.grad for t in leaves]
        grads[path] = [t.float().clone() for t in got]
    diff = max(float((o - t).norm() / t.norm().clamp_min(1e-30)) for o, t in zip(grads["onepass"], grads["twopass"]))
    row["grad_rel_diff"] = diff
    row["speedup"] = row["twopass"][0] / row["onepass"][0]
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="512x16384,512x32768,512x65536,1024x32768,1024x65536" if CUDA else "16x48,32x40",
                   help="c x b pairs (b even: NT-Xent's two views)")
    p.add_argument("--objectives", default="siglip,nt_xent")
    p.add_argument("--reps", type=int, default=5 if CUDA else 1)
    p.add_argument("--out", default=None, help="folder for the table (bench_objective_backward.md)")
    a = p.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    dev = torch.cuda.get_device_name() if CUDA else "CPU (TRITON_INTERPRET: a dry run)"
    lines = [f"device: {dev}  torch {torch.__version__}",
             "| objective | c | b | two-pass ms (min-max) | one-pass ms (min-max) | one-pass speed-up | grad rel. diff |",
             "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for objective in a.objectives.split(","):
        for c, b in shapes:
            r = measure(objective, c, b, a.reps)
            (t, t0, t1), (o, o0, o1) = r["twopass"], r["onepass"]
            line = (f"| {objective} | {c} | {b:,} | {t:.2f} ({t0:.2f}-{t1:.2f}) | {o:.2f} ({o0:.2f}-{o1:.2f}) "
                    f"| {r['speedup']:.2f}x | {r['grad_rel_diff']:.1e} |")
            lines.append(line)
            print(line, flush=True)
            if CUDA:
                torch.cuda.empty_cache()
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "bench_objective_backward.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
