"""GPU check of the Gluon strip fill (``infclip.kernels.clip.gluon_strip``) against the Triton one.

For c in {512, 768, 1024}, strips of R in {1000, 4096} rows against N in {1000, 32768, 65536}
columns: random L2-normalized bf16 pairs, s = 1 / 0.07, offsets = the pairs' fp32 dot products
(``infclip.loss.function.positive_dots``), LSEs from ``TritonTileOps(forward_kernel="triton")``
-- the square block pair with its diagonal (HAS_DIAG, positives folded into P) where N >= R,
the strip starting at an odd row that makes it cross the diagonal; a non-square pair without
the diagonal otherwise (and for c = 512 also a square one without it) -- and CLIP's gradient
vectors g_a = g_b = 1 / (2 b), g_d = g_a + g_b. Compares P and the d scale partials of
``fill_strip_gluon`` with ``launch._fill_tma`` (the persistent TMA Triton kernel it would
replace: P's largest difference in bf16 ulps of the Triton value and the count of differing
entries, ds's relative difference), checks that every P entry was written (NaN-poisoned
scratch) and no ds slot past the strip's tiles was touched, and times both (CUDA events,
median of 5 after warm-up; TFLOP/s = 2 R N c / time). Every case runs in its own try/except:
one call reports as much as it can. Then the compiled kernels' registers, spills, shared
memory and wgmma / HGMMA counts.

    python scripts/tools/check_gluon_strip.py            # the full grid (< 2 minutes on an H200)
    python scripts/tools/check_gluon_strip.py --quick    # c = 512, (R, N) in {(1000, 1000), (1000, 32768)}
    python scripts/tools/check_gluon_strip.py --band     # duplicates "mask": the BAND variants (below)

--band: the square (diagonal) cases with group ids, sorted by group as duplicates "mask" on one
process sorts them (``check_gluon_fwd.band_ids``: 1 % duplicates as ``bench_loss.py
--duplicates`` draws them, groups of 2-3; and the same plus one group of 300, whose band spans
several tiles), the LSEs from the Triton band forward; compares the Gluon fill's BAND variant
with the Triton TMA fill's (HAS_GID + BAND) as above and times both.
"""

from __future__ import annotations

import math
import os
import traceback

import torch

from check_gluon_fwd import band_ids, check_parser, print_compiled, print_versions  # puts scripts/bench on sys.path
from bench_loss import time_ms  # noqa: I001  (scripts/bench, after the line above)
from infclip.kernels.clip import gluon_strip, launch
from infclip.kernels.clip.kernels import _dx_strip_tma_kernel
from infclip.kernels.clip.ops import TritonTileOps
from infclip.loss.function import positive_dots

# The LSEs come from the first forward config, untuned (the tuner would compile and time four
# forward configs per case: a minute of the budget, for LSEs that do not depend on the config).
os.environ.setdefault("INFCLIP_TRITON_TUNE", "0")
REPS = 5  # timed calls per case (median), after one warm-up
SENTINEL = 16  # NaN ds slots past the strip's tiles: a fill must leave them alone


def features(n: int, c: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n image / text pairs (correlated: a peaked softmax), L2-normalized, bf16."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    img = torch.randn(n, c, device="cuda", generator=g)
    txt = img + 0.7 * torch.randn(n, c, device="cuda", generator=g)
    return (torch.nn.functional.normalize(img, dim=1).bfloat16(),
            torch.nn.functional.normalize(txt, dim=1).bfloat16())


def problem(r: int, n: int, c: int, diag: bool, big: int | None = None) -> dict:
    """A (m, c), B (n, c), their vectors and the strip's first row (module docs); big not None:
    sorted group ids and their band (``band_ids``, with one group of ``big``; diag only)."""
    if diag and n < r:
        raise ValueError("a diagonal case needs N >= R (the strip lies in the square pair)")
    if big is not None and not diag:
        raise ValueError("a band case needs the square pair with its diagonal")
    m = n if diag else max(n, r) + 517  # without the diagonal: a non-square pair
    rows = max(m, n)  # (not ``big``: that is the band case's group size)
    img, txt = features(rows, c, seed=r + n + c)
    pos = positive_dots(img, txt)
    a, b = img[:m], txt[:n]
    o_a, o_b = pos[:m].contiguous(), pos[:n].contiguous()
    s = torch.tensor(1 / 0.07, device="cuda")
    ids = band = None
    kw = {}
    if big is not None:
        ids, band, _ = band_ids(n, big, seed=c)
        kw = dict(groups=(ids, ids, band))
    lse_a, lse_b = TritonTileOps(forward_kernel="triton").forward(a, b, s, offsets=(o_a, o_b), diag=diag, **kw)
    g_a = torch.full((m,), 1 / (2 * rows), device="cuda")
    g_b = torch.full((n,), 1 / (2 * rows), device="cuda")
    g_d = (g_a + g_b) if diag else None
    # A strip that crosses the diagonal (odd first row: no tile alignment), within the m rows.
    row_start = min(max(0, n // 3) | 1, m - r) if m > r else 0
    return dict(a=a, b=b, s=s, lse_a=lse_a.float().contiguous(), lse_b=lse_b.float().contiguous(), o_a=o_a,
                o_b=o_b, g_a=g_a, g_b=g_b, g_d=g_d, r=r, r0=row_start, diag=diag, ids=ids, band=band)


def fill(kind: str, pb: dict, cfg, scratch: torch.Tensor, ds_buf: torch.Tensor) -> None:
    """One strip fill of P = s dX[r0:r0 + r] into scratch, its ds partials into ds_buf."""
    a, b, r = pb["a"], pb["b"], pb["r"]
    o_a, o_b, gd, flags = launch._vecs(a, pb["o_a"], pb["o_b"], pb["g_d"], True)
    ids, band = pb.get("ids"), pb.get("band")
    flags["HAS_GID"] = ids is not None
    tiles = launch.cdiv(r, cfg.BM) * launch.cdiv(b.shape[0], cfg.BN)
    args = (a, b, pb["s"], pb["lse_a"], pb["lse_b"], o_a, o_b, pb["g_a"], pb["g_b"], gd, scratch, ds_buf, pb["s"],
            r, pb["r0"], cfg, "tf32", True, flags, tiles, ids, ids)
    if kind == "gluon":
        gluon_strip.fill_strip_gluon(*args, band=band)
    else:
        launch._fill_tma(*args, launch._band(band, ids, a.shape[0], b.shape[0]))



def ulp_diff(got: torch.Tensor, want: torch.Tensor) -> tuple[float, int]:
    """(largest |got - want| in bf16 ulps of want, entries that differ)."""
    g, w = got.float(), want.float()
    _, e = torch.frexp(w)
    ulp = torch.ldexp(torch.ones_like(w), (e - 8).clamp_min(-133))  # bf16: 8 significant bits
    diff = (g - w).abs()
    return (diff / ulp).max().item(), int((diff > 0).sum().item())


def run_case(c: int, r: int, n: int, diag: bool, cfgs: list, time_it: bool, big: int | None = None) -> None:
    pb = problem(r, n, c, diag, big)
    fl = gluon_strip.flops(r, n, c)
    tri_cfgs = [t for t in launch.strip_candidates(c, 2) if t.tma]
    head = f"c={c:5d} R={r:5d} N={n:6d} m={pb['a'].shape[0]:6d} row0={pb['r0']:6d} diag={int(diag)}"
    if big is not None:
        head = f"band w={int(pb['band'].item()):4d} {head}"
    want = torch.full((r, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    t0 = tri_cfgs[0]
    want_ds_buf = torch.zeros(launch.cdiv(r, t0.BM) * launch.cdiv(n, t0.BN), device="cuda")
    fill("triton", pb, t0, want, want_ds_buf)
    want_ds = want_ds_buf.sum().item()
    line = f"{head} | triton ds {want_ds:+.6e}"
    best = math.inf
    if time_it:
        for t in tri_cfgs:
            scratch, ds_t = torch.empty_like(want), torch.zeros(launch.cdiv(r, t.BM) * launch.cdiv(n, t.BN),
                                                                 device="cuda")
            ms = time_ms(lambda: fill("triton", pb, t, scratch, ds_t), REPS)
            best = min(best, ms)
            line += f" | triton {t.BM}x{t.BN}/{t.per_sm} {ms:7.3f} ms {fl / ms / 1e9:6.1f} TF/s"
    print(line, flush=True)
    for cfg in cfgs:
        tag = f"    gluon {cfg.BM:3d}x{cfg.BN:3d} G{cfg.GROUP:2d} stages={gluon_strip.pick_stages(cfg):2d}"
        try:
            if not gluon_strip.gluon_strip_available(pb["a"], pb["b"], cfg):
                print(f"{tag}: not available here")
                continue
            tiles = gluon_strip.strip_tiles(r, n, cfg)
            got = torch.full((r, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            ds_buf = torch.zeros(tiles + SENTINEL, device="cuda")
            ds_buf[tiles:] = float("nan")
            fill("gluon", pb, cfg, got, ds_buf[:tiles])
            torch.cuda.synchronize()
            ulps, ndiff = ulp_diff(got, want)
            ds = ds_buf[:tiles].sum().item()
            progs = gluon_strip.strip_programs(tiles, torch.cuda.get_device_properties(0).multi_processor_count)
            slots = gluon_strip.ds_slots(tiles, progs)
            msg = (f"{tag}: P max {ulps:.1f} ulp, {ndiff} of {r * n} differ, nan {int(got.isnan().sum())}"
                   f" | ds {ds:+.6e} rel {abs(ds - want_ds) / max(abs(want_ds), 1e-30):.1e}"
                   f" | slots {int((ds_buf[:tiles] != 0).sum())}/{slots} sentinel ok "
                   f"{bool(ds_buf[tiles:].isnan().all())}")
            if time_it:
                scratch, ds_g = torch.empty_like(got), torch.zeros(tiles, device="cuda")
                ms = time_ms(lambda: fill("gluon", pb, cfg, scratch, ds_g), REPS)
                msg += f" | {ms:7.3f} ms {fl / ms / 1e9:6.1f} TF/s  x{best / ms:.2f} vs best triton"
            print(msg, flush=True)
        except Exception:  # noqa: BLE001 -- report and go on: one call, all the information
            print(f"{tag}: FAILED")
            traceback.print_exc()


def main() -> None:
    ap = check_parser(__doc__, "c = 512, R = 1000, N in {1000, 32768}")
    ap.add_argument("--default-only", action="store_true", help="only the default Gluon config (64 x 128)")
    args = ap.parse_args()
    print_versions()
    cs = [512] if args.quick else [512, 768, 1024]
    shapes = [(1000, 1000), (1000, 32768)] if args.quick else [
        (1000, 1000), (1000, 32768), (1000, 65536), (4096, 1000), (4096, 32768), (4096, 65536)]
    for c in cs:
        cfgs = [gluon_strip.default_config(c)] if args.default_only else gluon_strip.tune_candidates(c)
        cases = [(r, n, n >= r, None) for r, n in shapes]
        if c == 512 and not args.quick:
            cases.append((1000, 32768, False, None))  # offsets without the diagonal on a wide pair
        if args.band:  # the square cases, groups of 2-3 (w small) and one of 300 (w spans tiles)
            cases = [(r, n, True, big) for r, n, diag, _ in cases if diag for big in (0, 300)]
        for r, n, diag, big in cases:
            try:
                run_case(c, r, n, diag, cfgs, not args.no_time, big)
            except Exception:  # noqa: BLE001
                print(f"c={c} R={r} N={n} diag={diag}: FAILED")
                traceback.print_exc()
            torch.cuda.empty_cache()
    print("compiled kernels:")
    print_compiled({"gluon strip": gluon_strip._dx_strip_ws_kernel, "triton strip": _dx_strip_tma_kernel})


if __name__ == "__main__":
    main()
