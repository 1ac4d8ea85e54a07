"""logging.profile_step: one step under the PyTorch profiler, trace and GPU summary written."""

import gzip
import json

from infclip.train.profiling import busy_us, summarize_trace
from tests.train.test_train_cli import losses, run_train


def test_busy_time_is_the_union_of_spans():
    assert busy_us([]) == 0
    assert busy_us([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert busy_us([(3, 4), (0, 10)]) == 10


def test_summary_counts_kernels_per_stream_and_name():
    events = [{"cat": "kernel", "name": "gemm", "ts": 0, "dur": 400, "args": {"stream": 7}},
              {"cat": "kernel", "name": "gemm", "ts": 500, "dur": 400, "args": {"stream": 7}},
              {"cat": "kernel", "name": "resize", "ts": 300, "dur": 300, "args": {"stream": 38}},
              {"cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 950, "dur": 50, "args": {"stream": 40}},
              {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000}]
    text = summarize_trace(events, wall_s=0.002)
    assert "GPU busy (any kernel or copy, union over streams) 0.001 s = 47.5 %; 4 GPU events" in text
    assert "| 7 | 0.001 | 2 | gemm |" in text and "| 38 | 0.000 | 1 | resize |" in text
    assert "| gemm | 0.001 | 2 | 400.0 |" in text and "aten::mm" not in text


def test_train_writes_the_profiled_steps_trace_and_summary(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(tmp_path, f"run_dir={run_dir}", "steps=2", "eval.tasks=[]", "logging.profile_step=2")
    summary = run_dir / "profile" / "step_2_rank_0.md"
    assert f"profile: step 2 in {summary}" in proc.stdout
    assert summary.read_text().startswith("step wall time ")
    with gzip.open(run_dir / "profile" / "step_2_rank_0.json.gz", "rt") as f:
        trace = json.load(f)
    assert any(e.get("cat") == "cpu_op" for e in trace["traceEvents"])  # the step's ops were recorded
    assert sorted(losses(run_dir)) == [1, 2]
    assert [p.name for p in (run_dir / "profile").iterdir()] and not list((run_dir / "profile").glob("*.part"))
