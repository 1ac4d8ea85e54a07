"""logging.profile_step: one step under the PyTorch profiler, trace and GPU summary written."""

import gzip
import json

from infclip.spans import covered
from infclip.train.profiling import PHASE_MARK, summarize_trace
from tests.train.test_train_cli import losses, run_train


def test_busy_time_is_the_union_of_spans():
    assert covered([]) == 0
    assert covered([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert covered([(3, 4), (0, 10)]) == 10


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
    text = summary.read_text()
    assert text.startswith("step wall time ")
    # the engine's phase marks split the step (the phases add up to about its wall time)
    phases = [line.split(" | ") for line in text.splitlines() if line.startswith(("| cache_pass", "| replay"))]
    assert [p[0] for p in phases] == ["| cache_pass", "| replay"] and all(float(p[1]) > 0 for p in phases)
    with gzip.open(run_dir / "profile" / "step_2_rank_0.json.gz", "rt") as f:
        trace = json.load(f)
    assert any(e.get("cat") == "cpu_op" for e in trace["traceEvents"])  # the step's ops were recorded
    assert sorted(losses(run_dir)) == [1, 2]
    assert [p.name for p in (run_dir / "profile").iterdir()] and not list((run_dir / "profile").glob("*.part"))


def test_summary_splits_the_step_at_the_phase_marks_and_lists_idle_gaps():
    k = lambda name, ts, dur: {"cat": "kernel", "ph": "X", "name": name, "ts": ts, "dur": dur,  # noqa: E731
                               "args": {"stream": 7}}
    mark = lambda name, ts: {"cat": "user_annotation", "ph": "X", "name": PHASE_MARK + name,  # noqa: E731
                             "ts": ts, "dur": 1}
    events = [{"cat": "cpu_op", "ph": "X", "name": "start", "ts": 0, "dur": 1},
              k("fwd", 0, 1000), k("fwd", 3000, 1000), mark("cache_pass", 4000),
              k("loss", 4000, 500), mark("loss", 5000),
              k("bwd", 5000, 2000), mark("replay", 7000), k("adam", 7000, 500), mark("optimizer", 8000)]
    text = summarize_trace(events, wall_s=0.008)
    assert "| cache_pass | 0.004 | 0.002 | 50.0 |" in text
    assert "| loss | 0.001 | 0.001 | 50.0 |" in text and "| replay | 0.002 | 0.002 | 100.0 |" in text
    assert "| optimizer | 0.001 | 0.001 | 50.0 |" in text
    gaps = text.split("GPU idle at")[1]
    # longest idle stretch first: 2 ms between the two forward kernels, 1 ms into the step
    assert gaps.splitlines()[2] == "| 1.0 | 2.00 | fwd | fwd |"
    assert "| 4.5 | 0.50 | loss | bwd |" in gaps


def test_a_profile_step_past_the_run_is_named_at_the_start(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(tmp_path, f"run_dir={run_dir}", "steps=1", "eval.tasks=[]", "logging.profile_step=5")
    assert "warning: logging.profile_step=5 is outside the steps this run trains (1..1)" in proc.stdout
    assert not (run_dir / "profile").exists()


def test_a_decode_trace_step_past_the_run_or_without_a_device_decoder_is_named_at_the_start(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(tmp_path, f"run_dir={run_dir}", "steps=1", "eval.tasks=[]", "data.decode=cpu",
                     "logging.decode_trace_step=5")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "warning: logging.decode_trace_step=5 is outside the steps this run trains (1..1): no step is traced" \
        in proc.stdout
    assert "this run decodes in the loader workers (data.decode=cpu): nothing is traced" in proc.stdout
    assert not (run_dir / "decode_trace").exists()
