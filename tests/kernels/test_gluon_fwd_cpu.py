"""The Gluon forward (``infclip.kernels.clip.gluon_fwd``): what a CPU can check.

The module imports without a GPU (and without Gluon), refuses CPU tensors, and its host
arithmetic is right: ring depth within shared memory, column chunks as ``lse_forward``
cuts them (col_part <= 32 MB, each chunk a multiple of BN but the last). On a CUDA machine
(the H200) one test compares it with the Triton forward at small shapes, or checks that it
refuses where it does not apply (not sm_90, no Gluon). The full grid and timings:
``scripts/tools/check_gluon_fwd.py``.
"""

import pytest
import torch

from infclip.kernels.clip import gluon_fwd
from infclip.kernels.clip.launch import PART_BUDGET_BYTES, SMEM_BYTES
from infclip.kernels.launching import cdiv


def test_module_imports_and_refuses_cpu_tensors():
    a = torch.zeros(256, 512, dtype=torch.bfloat16)
    assert not gluon_fwd.gluon_available(a, a)
    with pytest.raises(ValueError, match="does not apply"):
        gluon_fwd.lse_forward_gluon(a, a, torch.tensor(1.0), torch.zeros(256), torch.zeros(256), True)


def test_budgets_match_the_triton_launcher():
    assert gluon_fwd.PART_BUDGET_BYTES == PART_BUDGET_BYTES
    assert gluon_fwd.SMEM_BYTES == SMEM_BYTES


@pytest.mark.parametrize("k", [64, 512, 768, 1024, 1088, 2048])
@pytest.mark.parametrize("bm, bn", [(64, 128), (128, 64)])
def test_ring_depth_fits_shared_memory(k, bm, bn):
    cfg = gluon_fwd.GluonFwdConfig(BM=bm, BN=bn)
    stages = gluon_fwd.pick_stages(cfg, k)
    if stages == 0:  # not even 2 chunks beside the resident block
        assert gluon_fwd.smem_bytes(cfg, k, 2) > SMEM_BYTES
        return
    assert 2 <= stages <= gluon_fwd.MAX_STAGES
    assert gluon_fwd.smem_bytes(cfg, k, stages) <= SMEM_BYTES
    assert stages == gluon_fwd.MAX_STAGES or gluon_fwd.smem_bytes(cfg, k, stages + 1) > SMEM_BYTES


def test_the_default_tile_serves_the_feature_dims_that_matter():
    for k, stages in [(512, 9), (768, 7), (1024, 5)]:  # the kernel compiled for sm_90 at these (triton 3.6)
        assert gluon_fwd.pick_stages(gluon_fwd.default_config(k), k) == stages
    assert gluon_fwd.pick_stages(gluon_fwd.default_config(1536), 1536) == 0  # A block too big: Triton path
    fixed = gluon_fwd.GluonFwdConfig(stages=4)
    assert gluon_fwd.pick_stages(fixed, 512) == 4
    assert gluon_fwd.pick_stages(gluon_fwd.GluonFwdConfig(BM=128, stages=12), 1024) == 0


@pytest.mark.parametrize("m, n", [(1, 1), (1000, 1000), (8192, 8192), (65536, 65536), (65536, 1000), (3, 70000)])
@pytest.mark.parametrize("bm, bn", [(64, 128), (128, 64)])
def test_column_chunks_cover_the_columns_within_the_budget(m, n, bm, bn):
    chunks = gluon_fwd.column_chunks(m, n, bm, bn)
    assert chunks[0][0] == 0 and chunks[-1][1] == n
    for (c0, c1), (d0, _) in zip(chunks, chunks[1:]):
        assert c1 == d0 and (c1 - c0) % bn == 0
    for c0, c1 in chunks:
        assert c1 > c0
        assert 4 * cdiv(m, bm) * (c1 - c0) <= max(PART_BUDGET_BYTES, 4 * cdiv(m, bm) * bn)


def test_tune_candidates_keep_a_deep_ring():
    assert [(c.BM, c.BN) for c in gluon_fwd.tune_candidates(512)] == [(128, 64), (64, 128)]
    for k in (768, 1024):  # BM 128 keeps < 3 stages there (0.70x the Triton forward at K = 768)
        assert [(c.BM, c.BN) for c in gluon_fwd.tune_candidates(k)] == [(64, 128)]
    assert gluon_fwd.tune_candidates(1536) == []


def test_forward_kernel_option(monkeypatch):
    from infclip.kernels.clip.ops import GLUON_MIN_ROWS, TritonTileOps

    with pytest.raises(ValueError, match="forward_kernel"):
        TritonTileOps(forward_kernel="cutlass")
    monkeypatch.setenv("INFCLIP_FORWARD_KERNEL", "triton")
    assert TritonTileOps().forward_kernel == "triton"
    assert TritonTileOps(forward_kernel="gluon").forward_kernel == "gluon"
    monkeypatch.delenv("INFCLIP_FORWARD_KERNEL")
    ops = TritonTileOps()
    assert ops.forward_kernel == "auto"
    plain = dict(has_gid=False, positives=True, offsets=True)
    big = torch.zeros(GLUON_MIN_ROWS, 512, dtype=torch.bfloat16)
    assert ops._forward_candidates(big, big, **plain)[0] == "fwd"  # CPU tensors: no Gluon candidates
    monkeypatch.setattr(gluon_fwd, "gluon_available", lambda a, b, cfg=None: True)
    kind, cands = ops._forward_candidates(big, big, **plain)
    assert kind == "fwd_gluon" and isinstance(cands[-1], gluon_fwd.GluonFwdConfig)
    assert not isinstance(cands[0], gluon_fwd.GluonFwdConfig)  # untuned default stays Triton
    assert ops._forward_candidates(big, big, **{**plain, "has_gid": True})[0] == "fwd"  # group ids: the Triton kernel only
    assert ops._forward_candidates(big[:100], big[:100], **plain)[0] == "fwd"  # small b: graph regime
    assert ops._forward_candidates(big, big, **{**plain, "positives": False})[0] == "fwd"  # a ring's other blocks
    forced = TritonTileOps(forward_kernel="gluon")
    kind, cands = forced._forward_candidates(big[:100], big[:100], **plain)
    assert kind == "fwd_gluon_first" and isinstance(cands[0], gluon_fwd.GluonFwdConfig)
    assert TritonTileOps(forward_kernel="triton")._forward_candidates(big, big, **plain)[0] == "fwd"
    no_off = {**plain, "offsets": False}  # positives without offsets: the Triton forward refuses them, Gluon too
    assert forced._forward_candidates(big, big, **no_off)[0] == "fwd"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares with the Triton forward on the GPU")
@pytest.mark.parametrize("b, c", [(1000, 512), (4096, 768), (777, 1024)])
def test_gluon_matches_triton_on_the_gpu(b, c):
    from infclip.kernels.clip.ops import TritonTileOps
    from infclip.loss.function import positive_dots

    torch.manual_seed(b)
    img = torch.nn.functional.normalize(torch.randn(b, c, device="cuda"), dim=1).bfloat16()
    txt = torch.nn.functional.normalize(img.float() + 0.7 * torch.randn_like(img.float()), dim=1).bfloat16()
    s = torch.tensor(1 / 0.07, device="cuda")
    pos = positive_dots(img, txt)
    if not gluon_fwd.gluon_available(img, txt):  # not sm_90 / no Gluon here: it must refuse, not run
        with pytest.raises(ValueError):
            gluon_fwd.lse_forward_gluon(img, txt, s, pos, pos, True)
        return
    want = TritonTileOps(forward_kernel="triton").forward(img, txt, s, offsets=(pos, pos), diag=True)
    got = gluon_fwd.lse_forward_gluon(img, txt, s, pos, pos, True,
                                      alloc=lambda *sh, device, dtype: torch.full(sh, float("nan"), device=device,
                                                                                  dtype=dtype))
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, atol=2e-3, rtol=0)


def test_tuner_skips_a_candidate_that_cannot_run_but_not_a_cuda_fault(monkeypatch):
    """A compile error or out-of-resources rules one candidate out; a CUDA fault is sticky and
    must surface (every later launch would fail with an unrelated error)."""
    from infclip.kernels.clip import launch

    class Features:  # what pick_config reads of a CUDA tensor (this machine has none)
        shape, dtype, device = (8, 64), torch.bfloat16, torch.device("cuda", 0)

        def __getitem__(self, rows):
            return self

    monkeypatch.setenv("INFCLIP_TRITON_TUNE", "1")
    monkeypatch.setattr(launch, "_time", lambda fn, reps=3: fn())
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    a = Features()
    launch._TUNED.clear()

    def run(cfg, a_sub, b_sub):
        if cfg == "bad":
            raise RuntimeError("out of resource: shared memory, Required: 300000")
        return 1.0 if cfg == "slow" else 0.5

    assert launch.pick_config("probe", a, a, "tf32", ["bad", "slow", "fast"], run) == "fast"
    launch._TUNED.clear()

    def fault(cfg, a_sub, b_sub):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        launch.pick_config("probe", a, a, "tf32", ["x", "y"], fault)
    launch._TUNED.clear()
    assert launch._skippable(ValueError("the Gluon forward does not apply here"))
    assert not launch._skippable(RuntimeError("CUDA error: misaligned address"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares with the Triton forward on the GPU")
def test_gluon_without_offsets_matches_triton_on_the_gpu():
    """A block pair without offsets (and so without the diagonal): zero offsets, the same LSEs
    as the Triton forward's plain path; the diagonal without offsets is refused."""
    from infclip.kernels.clip.ops import TritonTileOps

    torch.manual_seed(3)
    img = torch.nn.functional.normalize(torch.randn(1000, 512, device="cuda"), dim=1).bfloat16()
    txt = torch.nn.functional.normalize(torch.randn(1200, 512, device="cuda"), dim=1).bfloat16()
    s = torch.tensor(1 / 0.07, device="cuda")
    if not gluon_fwd.gluon_available(img, txt):
        pytest.skip("not sm_90 / no Gluon: refusal covered by the test above")
    want = TritonTileOps(forward_kernel="triton").forward(img, txt, s)
    got = gluon_fwd.lse_forward_gluon(img, txt, s, None, None, False)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-3, rtol=0)
    with pytest.raises(ValueError, match="offsets"):
        gluon_fwd.lse_forward_gluon(img[:1000], txt[:1000], s, None, None, True)


# -- the fixed-reference epilogue ----------------------------------------------------------------

def _unit_pairs(b: int, c: int, noise: float, seed: int, device: str = "cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    raw = torch.randn(b, c, generator=g, device=device)
    txt = torch.nn.functional.normalize(raw + noise * torch.randn(b, c, generator=g, device=device), dim=1)
    return torch.nn.functional.normalize(raw, dim=1).bfloat16(), txt.bfloat16()


def _flag(img, txt, s: float) -> int:
    from infclip.loss.function import positive_dots

    pos = positive_dots(img, txt).float()
    return int(gluon_fwd.fixed_flag(img, txt, torch.tensor(s), pos, pos).item())


def test_fixed_flag_where_every_entry_is_bounded():
    """Unit features: on at s = 1/0.07 and up to s ~ 59 whatever the positives; at s = 100 while
    every positive's cosine stays above about -0.17; off for one anti-aligned pair there, for
    s <= 0, and for a NaN scale (never a NaN bound taken as small)."""
    img, txt = _unit_pairs(256, 64, 0.7, seed=0)
    assert _flag(img, txt, 1 / 0.07) == 1
    assert _flag(img, txt, 100.0) == 1  # the positives' cosines are ~0.8 here
    flipped = txt.clone()
    flipped[7] = -img[7]
    assert _flag(img, flipped, 50.0) == 1  # s (1 - (-1)) log2 e = 144 <= 172
    assert _flag(img, flipped, 100.0) == 0  # 289 > 172
    assert _flag(img, txt, 0.0) == 0 and _flag(img, txt, -3.0) == 0
    assert _flag(img, txt, float("nan")) == 0
    assert gluon_fwd.FIXED_LIMIT - gluon_fwd.FIXED_REF_BITS <= 104  # 2^104 x 2^22 entries < fp32's max


def _fixed_lse(x2: torch.Tensor, ref: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed-reference epilogue in fp32 with the MUFU's flush to zero: x2 (b, b) base-2
    entries relative to the rows' (dim 1) or the columns' (dim 0) offsets; natural LSEs."""
    def side(x):
        e = torch.exp2(x.float() - ref)
        e = torch.where(e < 2.0 ** -126, torch.zeros_like(e), e)  # ex2.approx.ftz
        return (ref + torch.log2(e.sum(1))) * 0.6931471805599453
    return side(x2), side(x2.T)


@pytest.mark.parametrize("s", [1 / 0.07, 50.0, 100.0])
def test_fixed_reference_is_exact_where_the_flag_holds(s):
    """The epilogue's arithmetic (emulated in fp32, entries below 2^-126 flushed) against a
    float64 logsumexp at b = 640, c = 200 (not tile multiples): with the flag on the LSEs match
    to fp32 rounding, peaked rows included (s = 100, cosines 0.8 against ~0); the bound
    FIXED_LIMIT - FIXED_REF leaves no entry able to overflow a sum."""
    from infclip.loss.function import positive_dots

    img, txt = _unit_pairs(640, 200, 0.7, seed=int(s))
    pos = positive_dots(img, txt).double()
    assert _flag(img, txt, s) == 1
    dot = img.double() @ txt.double().T
    dot.diagonal().copy_(pos)
    s2 = s * 1.4426950408889634
    xr, xc = s2 * (dot - pos[:, None]), s2 * (dot - pos[None, :])
    assert max(xr.max().item(), xc.max().item()) <= gluon_fwd.FIXED_LIMIT
    want_r, want_c = torch.logsumexp(s * (dot - pos[:, None]), 1), torch.logsumexp(s * (dot - pos[None, :]), 0)
    got_r, _ = _fixed_lse(xr, gluon_fwd.FIXED_REF_BITS)
    _, got_c = _fixed_lse(xc, gluon_fwd.FIXED_REF_BITS)
    for got, want in ((got_r, want_r), (got_c, want_c)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, atol=2e-5 * max(1.0, want.abs().max().item()), rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares with the Triton forward on the GPU")
@pytest.mark.parametrize("s, flip", [(1 / 0.07, False), (100.0, False), (100.0, True)])
@pytest.mark.parametrize("fixed", ["auto", "off"])
def test_fixed_and_running_max_epilogues_match_on_the_gpu(s, flip, fixed):
    """Both epilogues against the Triton forward at b = 1000, c = 512: the fixed reference
    where the flag holds (s = 1/0.07, s = 100 with cosines ~0.8) and the running max where it
    does not (s = 100, one anti-aligned pair: the flag is off and the kernel must notice)."""
    from infclip.kernels.clip.ops import TritonTileOps
    from infclip.loss.function import positive_dots

    img, txt = _unit_pairs(1000, 512, 0.7, seed=11, device="cuda")
    if flip:
        txt[3] = -img[3]
    st = torch.tensor(s, device="cuda")
    pos = positive_dots(img, txt)
    if not gluon_fwd.gluon_available(img, txt):
        pytest.skip("not sm_90 / no Gluon: refusal covered above")
    assert int(gluon_fwd.fixed_flag(img, txt, st, pos.float(), pos.float()).item()) == (0 if flip else 1)
    want = TritonTileOps(forward_kernel="triton").forward(img, txt, st, offsets=(pos, pos), diag=True)
    got = gluon_fwd.lse_forward_gluon(img, txt, st, pos, pos, True, fixed=fixed,
                                      alloc=lambda *sh, device, dtype: torch.full(sh, float("nan"), device=device,
                                                                                  dtype=dtype))
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, atol=2e-3 * max(1.0, s / 14.0), rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares with the Triton forward on the GPU")
def test_fixed_epilogue_across_column_chunks_on_the_gpu(monkeypatch):
    """The fixed reference where a row's partials come from several launches (column chunks
    of 256 columns: most hold no diagonal, so their row partials may flush to -inf) and the
    host merges them: the same LSEs as the running max and the Triton forward (b = 1,000)."""
    from infclip.kernels.clip.ops import TritonTileOps
    from infclip.loss.function import positive_dots

    img, txt = _unit_pairs(1000, 512, 0.7, seed=12, device="cuda")
    st = torch.tensor(100.0, device="cuda")
    pos = positive_dots(img, txt)
    if not gluon_fwd.gluon_available(img, txt):
        pytest.skip("not sm_90 / no Gluon: refusal covered above")
    real = gluon_fwd.column_chunks
    monkeypatch.setattr(gluon_fwd, "column_chunks", lambda m, n, bm, bn: real(m, n, bm, bn, budget=4 * 256 * cdiv(m, bm)))
    assert len(gluon_fwd.column_chunks(1000, 1000, 64, 128)) == 4
    want = TritonTileOps(forward_kernel="triton").forward(img, txt, st, offsets=(pos, pos), diag=True)
    for fixed in ("auto", "off"):
        got = gluon_fwd.lse_forward_gluon(img, txt, st, pos, pos, True, fixed=fixed)
        for g, w in zip(got, want):
            assert torch.isfinite(g).all()
            torch.testing.assert_close(g, w, atol=1e-2, rtol=0)
