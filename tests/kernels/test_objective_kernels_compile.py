"""The SigLIP / NT-Xent Triton kernels compile for sm_90 (H100/H200) with the launch configs,
ahead of time and without a GPU, and ptxas reports no register spills: catches what Triton's
interpreter accepts but the compiler does not (dtypes, dot shapes, shared memory, registers).
The CLIP kernels compile too, with every flag on (offsets, positives, filtering; their
spills are reported, not asserted: the fused backward is known to spill a little), once
with the duplicate groups off (None id pointers, as launched) and on (HAS_GID) with int32 ids
(one process: dense ranks) and int64 ids (the ring), and with int32 ids and the band (BAND:
the one-process batch sorted by group); the strip fill both as the persistent TMA kernel (the
first bf16 candidate, the one-pass path's) and as the pointer kernel.
Runs in a subprocess without TRITON_INTERPRET."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

K = 520  # not a multiple of BK: the masked-K loads


def _ptxas_path() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not _ptxas_path().exists(), reason="this triton wheel ships no ptxas (non-Linux)")
def test_kernels_compile_for_sm90_without_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PTX_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("compiled")]
    assert len(lines) == 6 + 2 + 4 * 4, proc.stdout  # CLIP: fwd, fused bwd, TMA strip, pointer strip; 4 flag sets
    lines = lines[:8]  # SigLIP / NT-Xent (the CLIP kernels come last)
    assert all("0 bytes spill stores" in line for line in lines), "register spills:\n" + "\n".join(lines)


def _compile(fn, dtype: str, consts: dict, cfg, tag: str = "", gid: str = "i32") -> None:
    """Compile ``fn`` for sm_90: feature pointers ``dtype``, group ids ``gid``, other pointers
    fp32, ints i32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def kind(name: str) -> str:
        if name in consts:
            return "constexpr"
        if name in ("a_ptr", "b_ptr", "p_ptr", "out_ptr"):  # features, strip scratch, gradient
            return f"*{dtype}"
        if name == "kept_ptr":
            return "*i32"
        if name.startswith("gid_"):  # duplicate group ids
            return f"*{gid}"
        if name == "band_ptr":  # the band's half-width w
            return "*i32"
        if name == "log2_thr":
            return "fp32"
        return "*fp32" if name.endswith("_ptr") else "i32"

    names = fn.arg_names
    src = ASTSource(fn=fn, signature={n: kind(n) for n in names},
                    constexprs={(names.index(k),): v for k, v in consts.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    ptx = Path(os.environ["PTX_DIR"]) / f"{fn.__name__}_{dtype}{tag}.ptx"
    ptx.write_text(kernel.asm["ptx"])
    info = subprocess.run([str(_ptxas_path()), "-arch=sm_90a", "-v", str(ptx), "-o", str(ptx.with_suffix(".cubin"))],
                          capture_output=True, text=True, check=True).stderr
    spills = [line.strip() for line in info.splitlines() if "spill" in line]
    print("compiled", fn.__name__, dtype + tag, *spills, flush=True)


def _compile_clip() -> None:
    """The CLIP kernels with the first (untimed) configs, bf16 (the training path; the fp32
    ones share the code), every flag on."""
    from infclip.kernels.clip import launch
    from infclip.kernels.clip.kernels import _dx_strip_kernel, _dx_strip_tma_kernel, _grad_kernel, _lse_fwd_kernel

    for (dtype, esize, prec), gid, band in ((("bf16", 2, "tf32"), None, False), (("bf16", 2, "tf32"), "i32", False),
                                            (("bf16", 2, "tf32"), "i64", False), (("bf16", 2, "tf32"), "i32", True)):
        fwd, bwd = launch.fwd_candidates(K, esize)[0], launch.bwd_candidates(K, esize)[0]
        strip = launch.strip_candidates(K, esize)[0]
        groups = {"HAS_GID": True} if gid else {"HAS_GID": False, "gid_a_ptr": None, "gid_b_ptr": None}
        groups.update({"BAND": True} if band else {"BAND": False, "band_ptr": None})
        tag = (f"_groups_{gid}" if gid else "") + ("_band" if band else "")

        def tile(cfg):
            return dict(BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, EVEN_K=K % cfg.BK == 0, DOT_F32=False, PREC=prec,
                        HAS_OFF=True, HAS_DIAG=True, **groups)

        _compile(_lse_fwd_kernel, dtype, tile(fwd), fwd, tag, gid or "i32")
        _compile(_grad_kernel, dtype, {**tile(bwd), "DC": bwd.DC, "RESIDENT": bwd.resident, "ACCUM": False,
                                       "COMPUTE_DS": True, "FILTER": True}, bwd, tag, gid or "i32")
        strip_ptr = {k: v for k, v in tile(strip).items() if k != "EVEN_K"}  # the TMA kernel: K by descriptors
        if strip.tma:  # the first bf16 candidate: the persistent TMA kernel (the one-pass path's default)
            _compile(_dx_strip_tma_kernel, dtype, {**strip_ptr, "GROUP": strip.GROUP, "NUM_PROGS": 132 * strip.per_sm,
                                                   "WS": strip.ws, "FOLD": True}, strip, tag, gid or "i32")
        ptr = next(c for c in launch.strip_candidates(K, esize) if not c.tma)
        _compile(_dx_strip_kernel, dtype, {**tile(ptr), "GROUP": ptr.GROUP}, ptr, tag, gid or "i32")


def _main() -> None:
    from infclip.kernels.nt_xent.kernels import _masked_grad_kernel, _masked_lse_fwd_kernel, _masked_strip_kernel
    from infclip.kernels.objective import fused_candidates, fwd_candidates, strip_candidates
    from infclip.kernels.siglip.kernels import _sigmoid_fwd_kernel, _sigmoid_grad_kernel, _sigmoid_strip_kernel

    # The configs used untimed (the first candidates). SigLIP in bf16 (tensor cores), NT-Xent
    # in fp32 (ieee dots): both dtype paths.
    for dtype, esize, prec, fwd_k, grad_k, strip_k, flag in (
            ("bf16", 2, "tf32", _sigmoid_fwd_kernel, _sigmoid_grad_kernel, _sigmoid_strip_kernel, "G_ON_A"),
            ("fp32", 4, "ieee", _masked_lse_fwd_kernel, _masked_grad_kernel, _masked_strip_kernel, "LSE_ON_A")):
        fwd, bwd, strip = fwd_candidates(esize)[0], fused_candidates(K, esize)[0], strip_candidates(K, esize)[0]

        def tile(cfg):
            return dict(BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, EVEN_K=K % cfg.BK == 0, DOT_F32=False, PREC=prec)

        pos = {"HAS_OFF": True, "HAS_POS": True} if flag == "LSE_ON_A" else {}  # NT-Xent's positives
        _compile(fwd_k, dtype, {**tile(fwd), **pos}, fwd)
        _compile(grad_k, dtype, {**tile(bwd), "DC": bwd.DC, "ACCUM": True, "COMPUTE_DS": True, flag: False, **pos}, bwd)
        fixup = {"SYM": False, "FOLD": False} if pos else {}  # NT-Xent's two-direction strips, fp32 fixup
        _compile(strip_k, dtype, {**tile(strip), "GROUP": strip.GROUP, flag: True, **pos, **fixup}, strip)
    _compile_nt_xent_own()
    _compile_clip()


def _compile_nt_xent_own() -> None:
    """NT-Xent's one-process backward in bf16 (the training path): the symmetric strip pass,
    persistent TMA kernel (the first candidate) and pointer kernel (the second), positives
    folded. (The two-direction TMA variant spills: the tuner times it against the pointer
    kernel; it serves only the ring's remote blocks.)"""
    from infclip.kernels.nt_xent.kernels import _masked_strip_kernel, _masked_strip_tma_kernel
    from infclip.kernels.nt_xent.ops import strip_candidates

    tma, ptr = strip_candidates(K, 2)[:2]
    flags = dict(DOT_F32=False, PREC="tf32", LSE_ON_A=True, SYM=True, HAS_OFF=True, HAS_POS=True, FOLD=True)
    _compile(_masked_strip_tma_kernel, "bf16", dict(BM=tma.BM, BN=tma.BN, BK=tma.BK, GROUP=tma.GROUP,
                                                    NUM_PROGS=132 * tma.per_sm, WS=tma.ws, **flags), tma)
    _compile(_masked_strip_kernel, "bf16", dict(BM=ptr.BM, BN=ptr.BN, BK=ptr.BK, GROUP=ptr.GROUP,
                                                EVEN_K=K % ptr.BK == 0, **flags), ptr)


if __name__ == "__main__":
    _main()
