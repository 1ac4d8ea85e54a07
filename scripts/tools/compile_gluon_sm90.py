"""Compile the Gluon kernels for sm_90a on a machine without a GPU, and report what they hold.

The H200 machine runs triton 3.6; the Gluon kernels (``kernels/clip/gluon_fwd.py``,
``kernels/clip/gluon_strip.py``) are written against it. This script loads a triton 3.6
installed into a folder of its own (not the environment's triton), stands a stub driver in
for the GPU (target ``cuda:90``), compiles every shipped variant through the wheel's own
``ptxas`` and prints, per variant: registers, spilled bytes, shared memory, wgmma in the PTX
and HGMMA in the SASS (and setmaxnreg in the PTX), the BAND variants (group ids of a batch
sorted by group) beside the plain ones. It runs nothing: correctness and speed need the GPU
(``scripts/tools/check_gluon_fwd.py``, ``scripts/tools/check_gluon_strip.py``). What it catches first: API
names a triton version lacks, layouts that do not lower, spills and shared memory over budget.

    pip install --no-deps --target /tmp/triton36 triton==3.6.0
    python scripts/tools/compile_gluon_sm90.py --triton /tmp/triton36
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load_triton(site: str) -> None:
    """Import triton from ``site`` (before anything else imports one) with a stub sm_90 driver."""
    sys.path.insert(0, site)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    if not triton.__version__.startswith("3.6"):
        _refuse(f"--triton {site}: the triton found there is {triton.__version__} (from {triton.__file__}), but the "
                f"Gluon kernels are written against 3.6, the GPU machine's. Install it into a folder of its own "
                f"and point --triton at it: pip install --no-deps --target {site} triton==3.6.0")

    class Sm90:  # what the JIT asks a driver while compiling (nothing is launched)
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            import torch
            return torch.device("cpu")

        def is_active(self):
            return True

    driver.set_active(Sm90())


def _refuse(msg: str) -> None:
    """Bad input: one paragraph on stderr, exit status 2."""
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _kernels():
    """gluon_fwd and gluon_strip loaded from this checkout as infclip.kernels.clip.* (without
    importing the installed infclip, whose import would bring the environment's triton)."""
    for name, path in (("infclip", ROOT / "infclip"), ("infclip.kernels", ROOT / "kernels"),
                       ("infclip.kernels.clip", ROOT / "kernels" / "clip")):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(path)]
        sys.modules[name] = pkg
    _module("infclip.kernels.launching", ROOT / "kernels" / "launching.py")
    fwd = _module("infclip.kernels.clip.gluon_fwd", ROOT / "kernels" / "clip" / "gluon_fwd.py")
    strip = _module("infclip.kernels.clip.gluon_strip", ROOT / "kernels" / "clip" / "gluon_strip.py")
    for mod in (fwd, strip):
        if mod.gluon is None:
            _refuse(f"triton 3.6's Gluon did not import ({mod.GLUON_ERROR}); reinstall it with "
                    f"pip install --no-deps --target <folder> triton==3.6.0")
    return fwd, strip


def sass_report(kernel, site: str) -> dict:
    """Registers and spill stores from the wheel's ``ptxas -v`` on the kernel's PTX, and the
    SASS's HGMMA / local-memory (STL, LDL) / MUFU.EX2 counts from its ``cuobjdump`` (the
    compiled kernel's own figures exist only once it is loaded on a GPU)."""
    import re
    import subprocess
    import tempfile

    bin_ = Path(site) / "triton" / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        ptx.write_text(kernel.asm["ptx"])
        log = subprocess.run([str(bin_ / "ptxas"), "-arch=sm_90a", "-v", str(ptx), "-o", str(cubin)],
                             capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([str(bin_ / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    return dict(regs=int(regs[-1]) if regs else None, spill_stores=int(spills[-1]) if spills else None,
                hgmma=sass.count("HGMMA"), stl=sass.count("STL"), ldl=sass.count("LDL"),
                ex2=sass.count("MUFU.EX2"))


def _band(m: int, n: int, band: bool) -> dict:
    """The kernels' group-id arguments: None / False, or int32 ids and w (``gluon_common.band_args``)."""
    import torch

    if not band:
        return dict(gid_a_ptr=None, gid_b_ptr=None, band_ptr=None, BAND=False)
    i32 = torch.int32
    return dict(gid_a_ptr=torch.empty(m, dtype=i32), gid_b_ptr=torch.empty(n, dtype=i32),
                band_ptr=torch.empty(1, dtype=i32), BAND=True)


def compile_fwd(gf, k: int, cfg, diag: bool, dtype, band: bool = False):
    import torch

    m = n = 4096
    a, b = torch.empty(m, k, dtype=dtype), torch.empty(n, k, dtype=dtype)
    a_desc, b_desc = gf._descriptors(a, b, cfg)
    kern = gf._lse_fwd_ws_kernel.warmup(
        a_desc, b_desc, torch.empty(()), torch.empty(m), torch.empty(n), torch.empty(2, m),
        torch.empty(m // cfg.BM, n), m, 0, n, n, n, fixed_ptr=torch.empty(1, dtype=torch.int32) if diag else None,
        K=k, STAGES=gf.pick_stages(cfg, k), HAS_DIAG=diag, FIXED=diag,  # (as shipped: the fixed epilogue with the diagonal)
        REGS=cfg.regs, num_warps=4, maxnreg=cfg.maxnreg, grid=(1,), **_band(m, n, band))
    return kern


def compile_strip(gs, k: int, cfg, diag: bool, dtype, band: bool = False):
    import torch

    m = n = 4096
    r = 1000
    a, b = torch.empty(m, k, dtype=dtype), torch.empty(n, k, dtype=dtype)
    a_desc, b_desc, p_desc = gs._descriptors(a, b, torch.empty(r, n, dtype=dtype), cfg)
    va, vb = [torch.empty(m) for _ in range(3)], [torch.empty(n) for _ in range(3)]
    kern = gs._dx_strip_ws_kernel.warmup(
        a_desc, b_desc, p_desc, torch.empty(()), va[0], vb[0], va[1], vb[1], va[2], vb[2], va[0],
        torch.empty(1024), r, 0, n, K=k, STAGES=gs.pick_stages(cfg), GROUP=cfg.GROUP, HAS_DIAG=diag,
        REGS=cfg.regs, num_warps=4, maxnreg=cfg.maxnreg, grid=(1,), **_band(m, n, band))
    return kern


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--triton", required=True, help="folder holding triton 3.6 (pip install --target)")
    p.add_argument("--dims", default="512,768,1024")
    p.add_argument("--save", metavar="DIR", help="also write each variant's PTX there (to diff two versions)")
    p.add_argument("--only", choices=("forward", "strip"), help="compile one kernel's variants only")
    args = p.parse_args()
    _load_triton(args.triton)
    import torch

    gf, gs = _kernels()
    print("| kernel | K | tile | diag | band | registers | spill stores (bytes) | shared KB | HGMMA | STL / LDL | "
          "MUFU.EX2 | setmaxnreg |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    # (diag, band): the plain variants, and the band's (duplicates "mask" on a batch sorted by
    # group: the positives' square pair, so with the diagonal only)
    variants = ((True, False), (False, False), (True, True))
    for k in (int(x) for x in args.dims.split(",")):
        for name, cands, build in (("forward", gf.tune_candidates(k), compile_fwd),
                                   ("strip", gs.tune_candidates(k), compile_strip)):
            if args.only and name != args.only:
                continue
            for cfg in cands:
                for diag, band in variants:
                    try:
                        kern = build(gf if name == "forward" else gs, k, cfg, diag, torch.bfloat16, band)
                        rep = sass_report(kern, args.triton)
                        if args.save:
                            Path(args.save).mkdir(parents=True, exist_ok=True)
                            tag = f"{name}_{k}_{cfg.BM}x{cfg.BN}_{'diag' if diag else 'off'}{'_band' if band else ''}"
                            (Path(args.save) / f"{tag}.ptx").write_text(kern.asm["ptx"])
                    except Exception as err:  # noqa: BLE001 -- report and go on: one table for all
                        msg = (str(err).splitlines() or [""])[0][:120]
                        print(f"| {name} | {k} | {cfg.BM}x{cfg.BN} | {diag} | {band} | failed: {type(err).__name__}: "
                              f"{msg} | | | | | | |")
                        continue
                    print(f"| {name} | {k} | {cfg.BM}x{cfg.BN} | {diag} | {band} | {rep['regs']} | "
                          f"{rep['spill_stores']} | {kern.metadata.shared / 1024:.0f} | {rep['hgmma']} | "
                          f"{rep['stl']} / {rep['ldl']} | {rep['ex2']} | {kern.asm['ptx'].count('setmaxnreg')} |")


if __name__ == "__main__":
    main()
