"""GPU check of the Gluon forward (``infclip.kernels.clip.gluon_fwd``) against the Triton path.

For c in {512, 768, 1024} and b in {1000, 8192, 32768, 65536}: random L2-normalized bf16
features, s = 1 / 0.07, offsets = the positives' fp32 dot products as the loss computes them
(``infclip.loss.function.positive_dots``), the square block pair with its diagonal (HAS_DIAG).
Compares (row_lse, col_lse) of ``lse_forward_gluon`` with ``TritonTileOps.forward`` (the
tuned ``launch.lse_forward`` it would replace) and, at b <= 8192, with a float64 reference;
times both (CUDA events, median of 5 after warm-up) and prints ms, TFLOP/s (2 b^2 c) and the
speed ratio. Every case runs in its own try/except: one call reports as much as it can.
Then the compiled kernels' registers, spills, shared memory and wgmma counts.

    python scripts/tools/check_gluon_fwd.py            # the full grid (< 3 minutes on an H200)
    python scripts/tools/check_gluon_fwd.py --quick    # c = 512, b in {1000, 8192}
    python scripts/tools/check_gluon_fwd.py --band     # duplicates "mask": the BAND variants (below)

--band: the same grid with group ids (duplicates "mask" on one process): ids as
``scripts/bench/bench_loss.py --duplicates`` draws them (1 % of the samples take another's id:
groups of 2-3, small w), and the same plus one group of 300 (w = 299: the band spans several
tiles), sorted by group (``infclip.loss.duplicates.sort_groups``: int32 ids and the band w).
Compares the Gluon forward's BAND variant with the Triton forward's (HAS_GID + BAND) and, at
b <= 8192, with a float64 masked reference; times both.
"""

from __future__ import annotations

import argparse
import math
import sys
import traceback
from pathlib import Path

import torch

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # bench_loss's timer
from bench_loss import time_ms  # noqa: E402
from infclip.kernels.clip import gluon_fwd  # noqa: E402
from infclip.kernels.clip.ops import TritonTileOps  # noqa: E402
from infclip.loss.function import positive_dots  # noqa: E402

REPS = 5  # timed calls per case (median), after one warm-up
FIXED_MODES = ("auto", "off")  # the fixed-reference epilogue where its flag holds, and the running max
SCALE = 1 / 0.07  # --scale
FLIP = 0  # --flip: that many pairs made anti-aligned (txt_i = -img_i): the flag off at s = 100
REF_MAX_B = 8192  # float64 reference up to this batch (a b x b fp64 matrix: 512 MB at 8k)


def parse_list(text: str) -> list[int]:
    """argparse type: comma-separated positive integers (else argparse's one-line error, exit 2)."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(x <= 0 for x in out):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return out


def count(text: str) -> int:
    """argparse type: a count >= 0."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return n


def features(b: int, c: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Image / text features with correlated pairs (a peaked softmax), L2-normalized; the
    first FLIP pairs anti-aligned."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    img = torch.randn(b, c, device="cuda", generator=g)
    txt = img + 0.7 * torch.randn(b, c, device="cuda", generator=g)
    txt[:FLIP] = -img[:FLIP]
    return (torch.nn.functional.normalize(img, dim=1).to(dtype),
            torch.nn.functional.normalize(txt, dim=1).to(dtype))


def reference(img: torch.Tensor, txt: torch.Tensor, s: torch.Tensor, pos: torch.Tensor):
    """float64 (row_lse, col_lse) relative to s * pos, the diagonal's dot products being pos."""
    dot = img.double() @ txt.double().T
    dot.diagonal().copy_(pos.double())
    o = pos.double()
    sd = s.double()
    return torch.logsumexp(sd * (dot - o[:, None]), 1), torch.logsumexp(sd * (dot - o[None, :]), 0)


def band_ids(b: int, big: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(ids (b,) int32, band (1,) int32, w) of a batch sorted by group: ``bench_loss.duplicate_ids``'
    1 % duplicates, plus one group of ``big`` members (0: none), through ``sort_groups``."""
    from bench_loss import duplicate_ids
    from infclip.loss.duplicates import sort_groups

    ids = duplicate_ids(b, 0.01, "cuda", seed=seed)
    if big:
        ids[torch.randperm(b, device="cuda")[:big]] = -1
    srt = sort_groups(ids)
    return srt.ids, srt.band, int(srt.band.item())


def masked_reference(img: torch.Tensor, txt: torch.Tensor, s: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor):
    """``reference`` with the same-group pairs i != j dropped from both directions."""
    dot = img.double() @ txt.double().T
    dot.diagonal().copy_(pos.double())
    o = pos.double()
    sd = s.double()
    same = ids[:, None] == ids[None, :]
    same.fill_diagonal_(False)
    inf = torch.tensor(float("-inf"), device=dot.device, dtype=dot.dtype)
    return (torch.logsumexp(torch.where(same, inf, sd * (dot - o[:, None])), 1),
            torch.logsumexp(torch.where(same, inf, sd * (dot - o[None, :])), 0))


def run_band_case(c: int, b: int, big: int, cfgs: list, time_it: bool) -> None:
    """The BAND variant of the Gluon forward against the Triton forward's, on sorted ids."""
    img, txt = features(b, c, torch.bfloat16, seed=b + c)
    s = torch.tensor(SCALE, device="cuda")
    pos = positive_dots(img, txt)
    ids, band, w = band_ids(b, big, seed=c)
    ref = masked_reference(img, txt, s, pos, ids) if b <= REF_MAX_B else None
    compare(f"band c={c:5d} b={b:6d} w={w:4d}", "band", cfgs, img, txt, s, pos, ref, time_it,
            gid_a=ids, gid_b=ids, band=band)


def compare(line: str, label: str, cfgs: list, img, txt, s, pos, ref, time_it: bool, **groups) -> None:
    """Print the Triton forward's line (its time, its distance from ``ref`` when given), then
    one line per Gluon config: its distance from the Triton forward and ``ref``, NaNs left in
    NaN-filled buffers, its time. ``groups`` (gid_a, gid_b, band): the BAND variants."""
    ops = TritonTileOps(forward_kernel="triton")  # the baseline: never the Gluon forward itself
    kw = {} if not groups else {"groups": (groups["gid_a"], groups["gid_b"], groups["band"])}
    call = lambda: ops.forward(img, txt, s, offsets=(pos, pos), diag=True, **kw)  # noqa: E731
    tri = call()
    fl = gluon_fwd.flops(img.shape[0], txt.shape[0], img.shape[1])
    t_tri = time_ms(call, REPS) if time_it else math.nan
    if ref is not None:
        line += f" | triton-ref {maxdiff(tri[0], ref[0]):.2e} {maxdiff(tri[1], ref[1]):.2e}"
    print(f"{line} | triton {t_tri:8.3f} ms {fl / t_tri / 1e9:6.1f} TF/s", flush=True)
    name = f"gluon {label} " if label else "gluon "
    flag = int(gluon_fwd.fixed_flag(img, txt, s, pos.float(), pos.float()).item())
    for cfg, fixed in ((cfg, fixed) for cfg in cfgs for fixed in FIXED_MODES):
        tag = (f"    {name}BM={cfg.BM:3d} BN={cfg.BN:3d} stages={gluon_fwd.pick_stages(cfg, img.shape[1]):2d} "
               f"fixed={fixed}{f'(flag {flag})' if fixed == 'auto' else ''}")
        try:
            if not gluon_fwd.gluon_available(img, txt, cfg):
                print(f"{tag}: not available here")
                continue
            def run(cfg=cfg, fixed=fixed, **alloc):
                return gluon_fwd.lse_forward_gluon(img, txt, s, pos, pos, True, cfg=cfg, fixed=fixed, **groups,
                                                   **alloc)

            got = run(alloc=poison)
            torch.cuda.synchronize()
            msg = f"{tag}: vs triton row {maxdiff(got[0], tri[0]):.2e} col {maxdiff(got[1], tri[1]):.2e}"
            if ref is not None:
                msg += f" | vs ref row {maxdiff(got[0], ref[0]):.2e} col {maxdiff(got[1], ref[1]):.2e}"
            msg += f" | nan {int(got[0].isnan().sum() + got[1].isnan().sum())}"
            if time_it:
                t = time_ms(run, REPS)
                msg += f" | {t:8.3f} ms {fl / t / 1e9:6.1f} TF/s  x{t_tri / t:.2f} vs triton{' ' + label if label else ''}"
            print(msg, flush=True)
        except Exception:  # noqa: BLE001 -- report and go on: one call, all the information
            print(f"{tag}: FAILED")
            traceback.print_exc()


def poison(*shape, device, dtype):
    return torch.full(shape, float("nan"), device=device, dtype=dtype)


def maxdiff(x: torch.Tensor, y: torch.Tensor) -> float:
    return (x.double() - y.double()).abs().max().item()


def run_case(c: int, b: int, dtype: torch.dtype, cfgs: list, time_it: bool) -> None:
    img, txt = features(b, c, dtype, seed=b + c)
    s = torch.tensor(SCALE, device="cuda")
    pos = positive_dots(img, txt)
    ref = reference(img, txt, s, pos) if b <= REF_MAX_B else None
    compare(f"c={c:5d} b={b:6d} {str(dtype)[6:]:8s}", "", cfgs, img, txt, s, pos, ref, time_it)


def print_versions() -> None:
    """The device, triton and torch, and whether Gluon imported (also check_gluon_strip.py);
    without a CUDA device: one paragraph and exit status 2."""
    from infclip.kernels.clip import gluon_common

    if not torch.cuda.is_available():
        print("error: this check runs the Gluon kernels against the Triton ones on an sm_90 GPU (H100 / H200), "
              "and no CUDA device is visible here. Run it on a machine with a Hopper GPU; "
              "on a CPU machine scripts/tools/compile_gluon_sm90.py compiles the kernels without running them.",
              file=sys.stderr)
        raise SystemExit(2)

    print(f"device: {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))}), "
          f"triton {triton.__version__}, torch {torch.__version__}")
    print(f"gluon imported: {gluon_common.gluon is not None} ({gluon_common.GLUON_ERROR})")


def print_compiled(kernels: dict) -> None:
    """Registers, spills, shared memory and wgmma / HGMMA counts of every variant each jit
    kernel in ``kernels`` ({name: kernel}) compiled in this process (also used by
    check_gluon_strip.py)."""
    for name, kern in kernels.items():
        for dev, cache in getattr(kern, "device_caches", {}).items():
            for compiled in cache[0].values():
                try:
                    if hasattr(compiled, "result"):
                        compiled = compiled.result()
                    info = gluon_fwd.compile_info(compiled)
                    try:
                        info["sass_hgmma"] = compiled.asm["sass"].count("HGMMA")
                    except Exception as err:  # noqa: BLE001 -- cuobjdump missing: PTX counts only
                        info["sass_hgmma"] = f"n/a ({type(err).__name__})"
                    consts = getattr(getattr(compiled, "src", None), "constants", None)
                    print(f"  {name} device {dev}: {info} {consts if consts is not None else ''}")
                except Exception:  # noqa: BLE001
                    traceback.print_exc()


def check_parser(doc: str, quick: str) -> argparse.ArgumentParser:
    """The options both Gluon checks take (also check_gluon_strip.py): --quick, --no-time, --band."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--no-time", action="store_true", help="correctness only")
    ap.add_argument("--band", action="store_true", help="the BAND variants (duplicates 'mask', sorted ids)")
    return ap


def main() -> None:
    ap = check_parser(__doc__, "c = 512, b in {1000, 8192} only")
    ap.add_argument("--scale", type=float, default=1 / 0.07, help="the logit scale s (default 1/0.07)")
    ap.add_argument("--flip", type=count, default=0, help="anti-align that many pairs (the fixed flag off at s = 100)")
    ap.add_argument("--sizes", type=parse_list, default=None, help="comma-separated b list (default by --quick)")
    ap.add_argument("--dims", type=parse_list, default=None, help="comma-separated c list (default by --quick)")
    args = ap.parse_args()
    global SCALE, FLIP
    SCALE, FLIP = args.scale, args.flip
    print_versions()
    cs = [512] if args.quick else [512, 768, 1024]
    bs = [1000, 8192] if args.quick else [1000, 8192, 32768, 65536]
    cs = args.dims or cs
    bs = args.sizes or bs
    if args.band:
        for c in cs:
            cfgs = gluon_fwd.tune_candidates(c) or [gluon_fwd.default_config(c)]
            for b in bs:
                for big in (0, 300):  # groups of 2-3 (w small), and one of 300 (w spans tiles)
                    try:
                        run_band_case(c, b, big, cfgs, not args.no_time)
                    except Exception:  # noqa: BLE001
                        print(f"band c={c} b={b} big={big}: FAILED")
                        traceback.print_exc()
                    torch.cuda.empty_cache()
        print("compiled Gluon kernels:")
        print_compiled({"gluon forward": gluon_fwd._lse_fwd_ws_kernel})
        return
    for c in cs:
        # the default (BM 64 x BN 128, A resident up to c = 1024) and, where A's 128 rows fit, 128 x 64
        cfgs = [gluon_fwd.default_config(c)]
        alt = gluon_fwd.GluonFwdConfig(BM=128, BN=64)
        if gluon_fwd.pick_stages(alt, c):
            cfgs.append(alt)
        for b in bs:
            try:
                run_case(c, b, torch.bfloat16, cfgs, not args.no_time)
            except Exception:  # noqa: BLE001
                print(f"c={c} b={b}: FAILED")
                traceback.print_exc()
            torch.cuda.empty_cache()
    try:  # one fp16 case (same kernel, the other 16-bit dtype)
        run_case(512, 8192, torch.float16, [gluon_fwd.default_config(512)], False)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    print("compiled Gluon kernels:")
    print_compiled({"gluon forward": gluon_fwd._lse_fwd_ws_kernel})


if __name__ == "__main__":
    main()
