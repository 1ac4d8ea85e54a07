"""Nsight Compute driver for the Gluon forward (``_lse_fwd_ws_kernel``): plain vs BAND.

Issue 27: the BAND variant (duplicates "mask") runs 7-10 % slower than the plain Gluon
forward although only band tiles do extra work; the hypothesis to test is L2 traffic (a
64-row consumer tile reads 64 FLOP per byte of B from L2) and register or spill changes.
This script warms each case up (compile, autotune-free: the default config of c unless
``--config BMxBN``), then runs it once more inside an NVTX range named ``prof`` so that

    ncu --clock-control none --nvtx --nvtx-include "prof/" -k regex:_lse_fwd_ws_kernel \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \\
        python3 scripts/profile_gluon_fwd.py --dims 512,1024 --batch 32768

profiles exactly one forward per (c, variant), in the order printed. Without ncu it prints
each case's time (CUDA events, median of 5), so the two can be told apart by the printed
order. Inputs as ``check_gluon_fwd.py`` draws them (``--band``: 1 % duplicates, sorted).
On a machine without a CUDA device: one paragraph, exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

import torch

from bench_loss import time_ms  # this folder's sibling scripts
from check_gluon_fwd import band_ids, features, parse_list, print_versions
from infclip.kernels.clip import gluon_fwd
from infclip.loss.function import positive_dots

WARMUP = 2  # untimed calls per case before the profiled one (the first compiles)


def parse_config(text: str) -> tuple[int, int]:
    try:
        bm, bn = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BMxBN such as 128x64, got {text!r}") from None
    return bm, bn


def fail(message: str) -> NoReturn:
    """One paragraph on stderr, exit status 2 (bad input or a machine the profile cannot use)."""
    print(message, file=sys.stderr)
    raise SystemExit(2)


def config_for(c: int, tile: tuple[int, int] | None) -> gluon_fwd.GluonFwdConfig:
    """The default config of ``c``, or the tuning candidate with tile ``tile`` (BM, BN)."""
    if tile is None:
        return gluon_fwd.default_config(c)
    for cfg in gluon_fwd.tune_candidates(c):
        if (cfg.BM, cfg.BN) == tile:
            return cfg
    fail(f"error: no Gluon forward candidate has the tile {tile[0]}x{tile[1]} at c = {c}; pick one of "
         f"{', '.join(f'{k.BM}x{k.BN}' for k in gluon_fwd.tune_candidates(c))} (--config), or leave --config out "
         f"for the default config of c.")


def profile_case(c: int, b: int, band: bool, tile: tuple[int, int] | None) -> None:
    img, txt = features(b, c, torch.bfloat16, seed=b + c)
    s = torch.tensor(1 / 0.07, device="cuda")
    pos = positive_dots(img, txt)
    groups = {}
    if band:
        ids, bnd, _ = band_ids(b, 0, seed=c)
        groups = {"gid_a": ids, "gid_b": ids, "band": bnd}
    cfg = config_for(c, tile)
    if not gluon_fwd.gluon_available(img, txt, cfg):
        fail(f"error: the Gluon forward does not run here ({gluon_fwd.GLUON_ERROR or 'see gluon_available'}): it "
             f"needs an sm_90 GPU and triton 3.6 with Gluon; check_gluon_fwd.py prints what is missing.")

    def run():
        return gluon_fwd.lse_forward_gluon(img, txt, s, pos, pos, True, cfg=cfg, **groups)

    for _ in range(WARMUP):
        run()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("prof")
    run()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    t = time_ms(run, 5)
    fl = gluon_fwd.flops(b, b, c)
    print(f"{'band ' if band else 'plain'} c={c:5d} b={b:6d} BM={cfg.BM} BN={cfg.BN}: {t:.3f} ms "
          f"{fl / t / 1e9:.1f} TF/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", type=parse_list, default=[512, 1024], help="feature widths c (default 512,1024)")
    ap.add_argument("--batch", type=int, default=32768, help="b (default 32768)")
    ap.add_argument("--config", type=parse_config, default=None, help="tile BMxBN (default: the default config of c)")
    args = ap.parse_args()
    if args.batch <= 0:
        ap.error(f"--batch must be positive, got {args.batch}")
    print_versions()
    for c in args.dims:
        for band in (False, True):
            profile_case(c, args.batch, band, args.config)


if __name__ == "__main__":
    main()
