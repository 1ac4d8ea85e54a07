"""scripts/bench/bench_towers.py on the CPU: a tiny model through the trainer's engine, the table and
JSON it writes, a failing variant reported in its row, and the kernel classification."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))
import bench_towers  # noqa: E402


def test_smoke_run_on_a_tiny_model_writes_rows_and_goes_on_after_a_failing_variant(tmp_path, capsys):
    rows = bench_towers.main(["--models", "infclip-micro", "--micro", "4", "--fp8", "tensorwise,off",
                              "--steps", "1", "--warmup", "1", "--amp", "fp32", "--device", "cpu",
                              "--out", str(tmp_path)])
    ok, native, failed = rows  # bf16 rows first whatever --fp8's order: a budget cuts FP8 rows first
    assert native["fp8"] == "off" and native["sdpa_attention"] is False and native["step_s"] > 0
    assert failed["fp8"] == "tensorwise" and "precision.fp8=tensorwise" in failed["error"]  # refused on the CPU
    assert ok["fp8"] == "off" and "error" not in ok
    assert ok["micro"] == 4 and ok["global"] == 8
    for key in ("cache_pass_s", "loss_s", "replay_fwd_s", "replay_bwd_s", "step_s", "samples_per_s", "mfu_pct"):
        assert ok[key] > 0, key
    assert ok["step_s"] >= ok["cache_pass_s"] + ok["replay_fwd_s"]
    assert set(ok["sdpa"]) == {"image", "text"} and ok["sdpa"]["text"]["replay"] != "none"
    assert set(ok["profile"]) >= {"cache_pass", "loss", "replay"}
    kernels = {(k["tower"], k["backend"]): k for k in ok["attention_kernels"]}
    assert kernels[("image", "math")]["shape"] == [4, 2, 17, 16]  # 4 x 4 patches + class token, 2 heads of 16
    assert kernels[("text", "math")]["causal"] and kernels[("text", "math")]["fwd_bwd_ms"] > 0
    assert ("text", "efficient, float mask") in kernels and "attention_kernels" not in native
    assert (tmp_path / "infclip-micro_fp8-off" / "profile" / "step_1_rank_0.md").is_file()  # the trainer's summary
    assert not (tmp_path / "infclip-micro_fp8-off" / "profile" / "step_1_rank_0.json.gz").exists()  # --keep-traces
    saved = json.loads((tmp_path / "towers.json").read_text())
    assert [(r["fp8"], r["sdpa_attention"]) for r in saved["rows"]] == [("off", True), ("off", False),
                                                                       ("tensorwise", True)]
    table = (tmp_path / "towers.md").read_text()
    assert "| infclip-micro | off | 4 x 2 |" in table and "ConfigError" in table
    assert "| infclip-micro | off, nn.MHA attention | 4 x 2 |" in table
    assert table in capsys.readouterr().out


def test_variant_order_and_compile_modes():
    """bf16 rows first (SDPA, nn.MHA, then each other compile mode), FP8 recipes last; modes
    without 'default' leave the baseline out; a mode without --compile is refused by the parser."""
    a = bench_towers.parse_args(["--compile", "--compile-modes", "default,max-autotune-no-cudagraphs",
                                 "--fp8", "tensorwise,off"])
    assert bench_towers.variants(a) == [("off", True, "default"), ("off", False, "default"),
                                        ("off", True, "max-autotune-no-cudagraphs"), ("tensorwise", True, "default")]
    alone = bench_towers.parse_args(["--compile", "--compile-modes", "max-autotune-no-cudagraphs", "--fp8", "off"])
    assert bench_towers.variants(alone) == [("off", True, "max-autotune-no-cudagraphs")]  # no default-mode rows
    row = {"fp8": "off", "sdpa_attention": True, "compile_mode": "max-autotune-no-cudagraphs"}
    assert bench_towers.label(row) == "off, compile mode=max-autotune-no-cudagraphs"
    with pytest.raises(SystemExit):
        bench_towers.parse_args(["--compile-modes", "max-autotune-no-cudagraphs"])


def test_a_variant_past_the_budget_is_skipped_and_says_so(tmp_path):
    rows = bench_towers.main(["--models", "infclip-micro", "--fp8", "off", "--budget-s", "-1", "--device", "cpu",
                              "--out", str(tmp_path)])
    assert len(rows) == 2 and all(r["error"].startswith("skipped: --budget-s") for r in rows)
    assert json.loads((tmp_path / "towers.json").read_text())["rows"] == rows


@pytest.mark.parametrize("name, want", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNN", "gemm"),
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90>>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>", "norm_elementwise"),
    ("triton_per_fused_native_layer_norm_0", "norm_elementwise"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "other"),
])
def test_kernel_classes(name, want):
    assert bench_towers.kernel_class(name) == want


def test_phase_split_of_a_trace():
    """Kernels are cut at the engine's phase marks; gaps = wall - busy."""
    ev = [
        {"name": "start", "ph": "X", "ts": 0, "dur": 1},
        {"name": "gemm_a", "cat": "kernel", "ph": "X", "ts": 10, "dur": 40},
        {"name": "flash_fwd", "cat": "kernel", "ph": "X", "ts": 60, "dur": 20},
        {"name": "infclip.phase_end.cache_pass", "ph": "X", "ts": 100, "dur": 0},
        {"name": "layer_norm", "cat": "kernel", "ph": "X", "ts": 90, "dur": 30},
        {"name": "infclip.phase_end.replay", "ph": "X", "ts": 200, "dur": 0},
    ]
    p = bench_towers.phase_classes(ev)
    assert p["cache_pass"]["gemm"] == pytest.approx(40e-6) and p["cache_pass"]["attention"] == pytest.approx(20e-6)
    assert p["cache_pass"]["norm_elementwise"] == pytest.approx(10e-6)
    assert p["cache_pass"]["gaps"] == pytest.approx(30e-6)
    assert p["replay"]["norm_elementwise"] == pytest.approx(20e-6) and p["replay"]["gaps"] == pytest.approx(80e-6)


def test_an_fp8_variant_can_ask_for_the_large_layers_only():
    cfg = bench_towers.train_config("ViT-B-16", 8, 2, "tensorwise:large", False, "bf16", "cpu")
    assert (cfg.precision.fp8, cfg.precision.fp8_layers) == ("tensorwise", "large")
    cfg = bench_towers.train_config("ViT-B-16", 8, 2, "rowwise", False, "bf16", "cpu")
    assert (cfg.precision.fp8, cfg.precision.fp8_layers) == ("rowwise", "all")
    a = bench_towers.parse_args(["--fp8", "off,tensorwise,tensorwise:large"])
    assert [v[0] for v in bench_towers.variants(a)] == ["off", "off", "tensorwise", "tensorwise:large"]


def test_a_compiled_variant_compiles_as_the_trainer_does_in_its_mode(monkeypatch, capsys):
    from infclip.train import build

    seen = []
    monkeypatch.setattr(build, "compile_towers", lambda model, **kw: seen.append(kw) or ["visual"])
    cfg = bench_towers.train_config("infclip-micro", 4, 2, "off", True, "fp32", "cpu", True,
                                    "max-autotune-no-cudagraphs")
    bench_towers.build_variant(cfg, torch.device("cpu"))
    assert seen == [{"mode": "max-autotune-no-cudagraphs"}]
    assert "compile mode=max-autotune-no-cudagraphs" in capsys.readouterr().out
