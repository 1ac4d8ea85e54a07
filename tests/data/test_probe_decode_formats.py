"""scripts/probe_decode_formats.py on the CPU backend (libjpeg-turbo through nvImageCodec): the
same table the GPU run prints, with the formats the host decoder takes and refuses."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_probe_prints_a_row_per_format_and_counts_refusals(shards):
    pytest.importorskip("nvidia.nvimgcodec")
    paths = shards([40, 40])
    spec = str(Path(paths[0]).parent / "{00000..00001}.tar")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "probe_decode_formats.py"), "--shards", spec,
                           "--backend", "cpu", "--micro", "32", "--repeats", "1",
                           "--options", "nvjpeg_hw_decoder:force_batch_single=1"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, NVIMGCODEC_LOG_LEVEL="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "backend cpu; options 'nvjpeg_hw_decoder:force_batch_single=1'" in proc.stdout  # passed to the decoders
    table = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("| ")]
    rows = {r[0].lstrip("| "): r for r in table[-3:]}
    assert set(rows) == {"rgb", "rgb_nofancy", "yuv"}
    for fmt in ("rgb", "rgb_nofancy"):  # decoded, every image, at some positive rate
        assert rows[fmt][1] == "0" and float(rows[fmt][2].replace(",", "")) > 0
    # planar YCbCr of 4:2:0 JPEGs: libjpeg-turbo's decoder refuses every one (the engines may not)
    assert rows["yuv"][1] == "32" and rows["yuv"][2] == "— (all refused)"


def test_probe_refuses_a_gpu_backend_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "probe_decode_formats.py"), "--shards", "x"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "needs a CUDA device; use --backend cpu" in proc.stderr


def test_trace_summary_counts_device_operations_and_lists_the_control_beside():
    sys.path.insert(0, str(ROOT / "scripts"))
    from probe_decode_formats import op_kind, trace_summary

    assert op_kind("Memcpy DtoD (Device -> Device)") == "copy DtoD"
    assert op_kind("Memset (Device)") == "memset"
    assert op_kind("void nvjpeg::ycbcr_to_format_kernel_roi<...>") == "kernel"
    ops = ["Memcpy HtoD (Pinned -> Device)"] * 4 + ["Memset (Device)"] * 2 + ["k"] * 8
    api = [("cudaFree", 900.0), ("cudaFree", 100.0), ("cudaMemcpyAsync", 50.0), ("cudaStreamSynchronize", 5000.0)]
    control = [("cudaStreamSynchronize", 4000.0), ("cudaLaunchKernel", 10.0)]
    assert trace_summary(ops, api, n=4, control_calls=control) == [
        "  device operations per image: copy HtoD 1.00, kernel 2.00, memset 0.50",
        "  CUDA calls meanwhile (every thread):",
        "    cudaStreamSynchronize x1, 5.0 ms", "    cudaFree x2, 1.0 ms", "    cudaMemcpyAsync x1, 0.1 ms",
        "  CUDA calls of the matmul load alone, as long:",
        "    cudaStreamSynchronize x1, 4.0 ms", "    cudaLaunchKernel x1, 0.0 ms"]


def test_trace_is_refused_on_the_cpu_backend():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "probe_decode_formats.py"), "--shards", "x",
                           "--backend", "cpu", "--trace"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "--trace profiles GPU decoding" in proc.stderr
