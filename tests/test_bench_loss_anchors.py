"""scripts/bench/bench_loss.py's anchors without a GPU: a published package that is not installed
(inf-cl, memeff) is reported with what installs it instead of failing the run, and the rows of
memeff, which learns no scale, say so."""

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))

import bench_loss  # noqa: E402


@pytest.mark.parametrize("impl, requirement", [("memeff", "memeff==0.3.1"), ("inf_cl", "inf-cl==1.2.1")])
def test_a_missing_anchor_is_reported_with_its_requirement(impl, requirement, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == bench_loss.ANCHOR_PACKAGES[impl][0] else real(name, *a))
    assert bench_loss.missing_anchor(impl) == requirement
    reason = bench_loss._skip_reason(impl, 32768, 512, {}, 90.0, 3)
    assert reason == f"not installed (pip install {requirement})"
    assert bench_loss._fmt(bench_loss.Row(impl, 512, 32768, reason)).endswith(reason)


def test_an_installed_anchor_and_our_impls_are_not_refused(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert bench_loss.missing_anchor("memeff") is None
    assert bench_loss.missing_anchor("triton_bf16") is None  # not a package: never "missing"


def test_fixed_scale_rows_say_so():
    row = bench_loss.Row("memeff", 512, 32768, "ok", ms=10.0, extra_gb=0.1, tflops=400.0, pct_peak=50.0, loss=9.7)
    assert bench_loss._fmt(row).endswith("(fixed scale: no d scale)")
    ours = bench_loss.Row("triton_bf16", 512, 32768, "ok", ms=10.0, extra_gb=0.1, tflops=400.0, pct_peak=50.0, loss=9.7)
    assert "fixed scale" not in bench_loss._fmt(ours)
    assert "memeff" in bench_loss.IMPLS and "memeff" in bench_loss.FIXED_SCALE_IMPLS


def test_an_unknown_impl_is_refused_before_any_gpu_work(tmp_path):
    """A typo in --impls: argparse's one line naming it and the valid names, exit 2 (no KeyError
    traceback after the peak matmul)."""
    import subprocess

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "bench_loss.py"
    proc = subprocess.run([sys.executable, str(script), "--impls", "triton_bf16,memef", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--impls: unknown memef; choose from" in proc.stderr and "memeff" in proc.stderr
    assert "Traceback" not in proc.stderr
