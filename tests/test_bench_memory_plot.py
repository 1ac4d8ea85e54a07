"""scripts/bench/bench_memory.py --plot: one figure from the CSVs of earlier runs, no GPU."""

import csv
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))

import bench_memory  # noqa: E402


def _csv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=bench_memory.FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow(r)
    return path


def _row(batch: int, gb: float, status: str = "ok", device: str = "NVIDIA H200") -> dict:
    return dict(model="ViT-B-16", gpus=1, global_batch=batch, loss="ours", offload="on", status=status,
                peak_gb=gb, device=device)


def test_rows_of_several_csvs_are_drawn_in_one_figure(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    a = _csv(tmp_path / "a.csv", [_row(32768, 25.0), _row(131072, 25.4), _row(262144, 0, status="oom")])
    b = _csv(tmp_path / "b.csv", [_row(1048576, 26.3, device="NVIDIA H100 80GB HBM3")])
    png = tmp_path / "memory.png"
    bench_memory.main(["--plot", str(png), str(a), str(b)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in capsys.readouterr().out


def test_a_plot_without_a_finished_row_or_without_a_csv_is_refused(tmp_path):
    pytest.importorskip("matplotlib")
    only_failed = _csv(tmp_path / "a.csv", [_row(262144, 0, status="oom")])
    with pytest.raises(ValueError, match="no finished row"):
        bench_memory.main(["--plot", str(tmp_path / "m.png"), str(only_failed)])
    with pytest.raises(SystemExit, match="at least one CSV"):
        bench_memory.main(["--plot", str(tmp_path / "m.png")])
