"""scripts/bench/bench_ring.py on the CPU (gloo, 2 ranks): the ring against its loopback, the
table and JSON (with the opt-in ``loopback_plain``), and ``--home-chunk-rows`` reaching the ring (recorded in the JSON's env; its fp32
check, 3,000 rows a rank, then runs the last tile in chunks of 1,500, 750, 375 and 375 against
the full-matrix loss)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_run_writes_rows_and_the_chunking_it_ran_with(tmp_path):
    out = tmp_path / "ring.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "scripts/bench/bench_ring.py"), "--device", "cpu", "--dtype", "fp32", "--sizes", "512",
           "--methods", "ring", "loopback", "loopback_plain", "--home-chunk-rows", "64", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    saved = json.loads(out.read_text())
    assert saved["env"]["home_chunk_min_rows"] == 64 and saved["env"]["world"] == 2
    assert saved["env"]["verify_home_chunk_min_rows"] == [64]  # chunked as configured: one check
    rows = {r["method"]: r for r in saved["rows"]}
    assert set(rows) == {"ring", "loopback", "loopback_plain"} and all(r["ms"] > 0 for r in rows.values())
    assert rows["ring"]["loss"] > 0
    assert max(saved["verify"].values()) < 1e-4, saved["verify"]  # chunked ring == full matrix, fp32
    assert "| 512 |" in saved["table"]


def test_the_fp32_check_runs_the_chunked_last_tile_also_where_the_timed_sizes_keep_it_whole(tmp_path):
    """At the default HOME_CHUNK_MIN_ROWS (8,192) a 3,000-row check keeps the last tile whole;
    the check then runs the ring a second time with chunks of 1,500, 750, 375 and 375 rows."""
    out = tmp_path / "ring.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "scripts/bench/bench_ring.py"), "--device", "cpu", "--dtype", "fp32", "--sizes", "256",
           "--methods", "ring", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    saved = json.loads(out.read_text())
    assert saved["env"]["home_chunk_min_rows"] == 8192
    assert saved["env"]["verify_home_chunk_min_rows"] == [8192, 375]
    assert max(saved["verify"].values()) < 1e-4, saved["verify"]
