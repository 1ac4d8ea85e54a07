"""scripts/bench/bench_trainer.py's pieces that run without a GPU: the checks before any run (open_clip's
webdataset loader against the installed webdataset), which step records count towards a run's
medians, how a --runs entry is read, the logs' names and how a run's output reaches its log."""

import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))

import bench_trainer  # noqa: E402


def test_an_end_of_shard_marker_refuses_open_clip_runs_before_anything_runs(monkeypatch, tmp_path, capsys):
    import webdataset.tariterators as t

    def expander(data, handler=None, select_files=None, rename_files=None, eof_value={}):  # noqa: B006
        return iter(())

    monkeypatch.setattr(t, "tar_file_expander", expander)
    shards = tmp_path / "never_written"
    with pytest.raises(SystemExit) as e:
        bench_trainer.main(["--runs", "openclip_compile:32768", "--shards", str(shards), "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "KeyError: 'fname'" in err and "webdataset==0.2.86" in err
    assert not shards.exists()  # refused before the shards were written or anything ran


def test_no_end_of_shard_marker_is_no_problem(monkeypatch):
    import webdataset.tariterators as t

    monkeypatch.setattr(t, "tar_file_expander", lambda data, handler=None: iter(()))
    assert bench_trainer.openclip_wds_problem() is None
    monkeypatch.setattr(t, "tar_file_expander", lambda data, handler=None, eof_value=None: iter(()))
    assert bench_trainer.openclip_wds_problem() is None


def test_the_profiled_step_is_left_out_of_the_records():
    recs = [{"event": "start"}, *({"step": k, "samples_per_s": 100.0 * k} for k in (1, 2, 3, 4))]
    assert [r["step"] for r in bench_trainer.step_records(recs)] == [1, 2, 3, 4]
    assert [r["step"] for r in bench_trainer.step_records(recs, profile_step=3)] == [1, 2, 4]


def test_a_run_entry_keeps_colons_inside_its_overrides():
    assert bench_trainer.parse_run("lit_compile:65536", 4) == ("lit_compile", 65536, 4, [])
    assert bench_trainer.parse_run("ours:32768:3", 4) == ("ours", 32768, 3, [])
    entry = "ours_compile:32768::data.decoder_options='nvjpeg_hw_decoder:force_batch_single=1';data.workers=8"
    assert bench_trainer.parse_run(entry, 4) == (
        "ours_compile", 32768, 4, ["data.decoder_options='nvjpeg_hw_decoder:force_batch_single=1'", "data.workers=8"])


def test_a_run_streams_its_output_into_its_log_and_a_timeout_keeps_what_ran(tmp_path):
    log = tmp_path / "run.log"
    code = "import sys, time; print('step 1', flush=True); print('warn', file=sys.stderr, flush=True); time.sleep(30)"
    out = bench_trainer._run([sys.executable, "-c", code], timeout=3, log=log)
    assert out == log.read_text()
    assert "step 1" in out and "warn" in out and out.rstrip().endswith("TIMEOUT")


def test_runs_that_differ_past_the_cut_get_logs_of_their_own():
    long = "data.decoder_options='nvjpeg_hw_decoder:force_batch_single=1 :fancy_upsampling=1 "
    a, b = bench_trainer._tag([long + "x'"]), bench_trainer._tag([long + "y'"])
    assert a != b and a.startswith("_data.decoder_options") and len(a) <= 1 + 60 + 1 + 8
    assert "/" not in a and " " not in a and bench_trainer._tag([]) == ""
    out = bench_trainer._out_name(f"decode_trace_lit_compile_65536{a}_step_3_rank_0.json")
    assert re.fullmatch(r"[A-Za-z0-9._-]+", out) and out.endswith("_step_3_rank_0.json")


def test_the_table_shows_the_decoder_s_busy_share_and_a_dash_where_a_run_has_none():
    runs = [{"kind": "lit_compile", "global_batch": 65536, "samples_per_s": 4705.0, "decode_busy_pct": 93.6,
             "decode_busy_first_pct": 99.2},
            {"kind": "ours", "global_batch": 32768, "samples_per_s": 5000.0, "decode_busy_pct": float("nan")}]
    head, _, lit, ours = bench_trainer._table(runs).splitlines()
    col = head.split(" | ").index("decoder busy %")
    assert lit.split(" | ")[col] == "94" and ours.split(" | ")[col] == "—"
    first = head.split(" | ").index("decoder busy % of cache pass")
    assert lit.split(" | ")[first] == "99" and ours.split(" | ")[first] == "—"


def test_a_run_kind_names_its_gpu_count_and_more_than_one_runs_under_torchrun(tmp_path):
    assert bench_trainer.split_gpus("ours_compile") == ("ours_compile", 1)
    assert bench_trainer.split_gpus("openclip_compile@4") == ("openclip_compile", 4)
    for bad in ("ours@0", "ours@two"):
        with pytest.raises(SystemExit):
            bench_trainer.split_gpus(bad)
    one = bench_trainer.launcher(1, tmp_path, "print(1)")
    assert one[1:] == ["-c", "print(1)"]
    two = bench_trainer.launcher(2, tmp_path, "print(2)")
    assert two[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert Path(two[-1]).read_text() == "print(2)"


def test_open_clip_main_runs_need_its_folder_and_are_refused_before_anything_runs(tmp_path, capsys):
    shards = tmp_path / "never_written"
    with pytest.raises(SystemExit) as e:
        bench_trainer.main(["--runs", "openclipmain_compile@2:65536", "--shards", str(shards), "--out", str(tmp_path),
                            "--openclip-data", "synthetic"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--openclip-main" in err and "not given" in err and "pip install --no-deps --target" in err
    assert not shards.exists()
    a = bench_trainer.parse_args(["--runs", "openclipmain:1024", "--openclip-main", str(tmp_path)])
    assert "holds no open_clip" in bench_trainer.openclip_main_problem(a)
    (tmp_path / "open_clip").mkdir()
    (tmp_path / "open_clip_train").mkdir()
    assert bench_trainer.openclip_main_problem(a) is None
    assert bench_trainer.openclip_main_problem(bench_trainer.parse_args(["--runs", "ours:1024"])) is None


def test_a_child_s_pythonpath_can_put_a_folder_first(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    code = "import os; print('PP', os.environ['PYTHONPATH'])"
    out = bench_trainer._run([sys.executable, "-c", code], timeout=30, log=tmp_path / "a.log", path_first="/first")
    assert f"PP /first{__import__('os').pathsep}/somewhere" in out
    out = bench_trainer._run([sys.executable, "-c", code], timeout=30, log=tmp_path / "b.log")
    assert "PP /somewhere" in out


def test_a_run_past_its_time_is_killed_with_the_processes_it_started(tmp_path):
    """Also a process in a session of its own, as torchrun starts its ranks."""
    pidfile = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
            f"open({str(pidfile)!r}, 'w').write(str(c.pid)); print('started', flush=True); time.sleep(60)")
    out = bench_trainer._run([sys.executable, "-c", code], timeout=5, log=tmp_path / "run.log")
    assert "started" in out and out.rstrip().endswith("TIMEOUT")
    child = int(pidfile.read_text())
    deadline = __import__("time").monotonic() + 10
    while Path(f"/proc/{child}").exists() and "Z" not in _state(child) and __import__("time").monotonic() < deadline:
        __import__("time").sleep(0.1)
    assert not Path(f"/proc/{child}").exists() or "Z" in _state(child)  # gone (or a zombie awaiting its reaper)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_open_clip_s_arguments_travel_inside_the_launched_script(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(bench_trainer, "_run", lambda cmd, timeout, log, path_first=None: seen.update(cmd=cmd, pf=path_first) or "")
    a = bench_trainer.parse_args(["--logs", str(tmp_path), "--openclip-main", "/oc", "--micro", "256"])
    bench_trainer.run_openclip(a, 65536, 3, True, "/s/{0..1}.tar", [], gpus=2, main_branch=True)
    script = Path(seen["cmd"][-1]).read_text()
    assert seen["cmd"][-2:-1] == ["--nproc_per_node=2"] and seen["pf"] == "/oc"
    for arg in ("'--logs'", "'--accum-freq', '128'", "'--local-loss'", "'--gather-with-grad'", "'--torchcompile'"):
        assert arg in script


def test_mfu_counts_the_peak_of_every_gpu_of_the_run():
    """16,436 samples/s of ViT-B/32 on 4 GPUs is about 31 % of four GPUs' peak, not 123 % of one."""
    one = bench_trainer.mfu_pct(4_109.0, 8.818, 5.960, lit=False, peak_tflops=790.0, gpus=1)
    four = bench_trainer.mfu_pct(4 * 4_109.0, 8.818, 5.960, lit=False, peak_tflops=790.0, gpus=4)
    assert four == pytest.approx(one) and 25 < four < 40
    locked = bench_trainer.mfu_pct(1_000.0, 10.0, 2.0, lit=True, peak_tflops=100.0, gpus=2)
    assert locked == pytest.approx(100 * 1_000 * (10 + 8) * 1e9 / (2 * 100e12))  # the locked image tower: 1 forward


def test_a_run_kind_can_ask_for_simulated_nodes_of_one_gpu_each():
    assert bench_trainer.split_gpus("ours_compile@2n") == ("ours_compile", 2)
    assert bench_trainer.sim_nodes("ours_compile@2n") and not bench_trainer.sim_nodes("ours_compile@2")
    assert not bench_trainer.sim_nodes("ours_compile")
    for bad in ("ours@n", "ours@0n", "ours@", "ours@2nn"):
        with pytest.raises(SystemExit):
            bench_trainer.split_gpus(bad)


def test_simulated_nodes_split_the_gpus_and_cores_and_take_the_socket_transport(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    monkeypatch.delenv("NCCL_SOCKET_NTHREADS", raising=False)
    monkeypatch.setenv("NCCL_NSOCKS_PERTHREAD", "2")  # the user's setting is kept
    monkeypatch.setattr(bench_trainer.os, "sched_getaffinity", lambda pid: set(range(8)))
    nodes = bench_trainer.node_launchers(2, tmp_path, "print(1)")
    assert [n.env["CUDA_VISIBLE_DEVICES"] for n in nodes] == ["5", "7"]
    assert [n.cpus for n in nodes] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for n in nodes:
        assert n.cmd == nodes[0].cmd and "--nnodes=2" in n.cmd and "--nproc_per_node=1" in n.cmd
        assert n.env["NCCL_P2P_DISABLE"] == n.env["NCCL_SHM_DISABLE"] == "1"
        assert n.env["NCCL_SOCKET_NTHREADS"] == "4" and "NCCL_NSOCKS_PERTHREAD" not in n.env
    assert Path(nodes[0].cmd[-1]).read_text() == "print(1)"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(SystemExit, match="2 simulated nodes need 2 GPUs"):
        bench_trainer.node_launchers(2, tmp_path, "print(1)")


def test_simulated_nodes_rendezvous_into_one_job_on_their_own_cores(tmp_path, monkeypatch):
    """Two torchrun agents as two nodes (gloo on CPU here): one job of world size 2, each rank
    pinned to its node's share of the cores, both logs kept and joined."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    body = ("import os, torch.distributed as dist; dist.init_process_group('gloo'); "
            "print('RANK', dist.get_rank(), 'OF', dist.get_world_size(), 'CORES', len(os.sched_getaffinity(0)), "
            "'P2P', os.environ['NCCL_P2P_DISABLE'], flush=True); dist.destroy_process_group()")
    nodes = bench_trainer.node_launchers(2, tmp_path, body)
    out = bench_trainer._run_nodes(nodes, timeout=120, log=tmp_path / "job.log")
    ranks = sorted(re.findall(r"RANK (\d) OF (\d) CORES (\d+) P2P 1", out))
    assert [r[:2] for r in ranks] == [("0", "2"), ("1", "2")], out[-2000:]
    assert all(int(r[2]) == len(n.cpus) for r, n in zip(ranks, nodes))
    assert (tmp_path / "job.node0.log").exists() and (tmp_path / "job.node1.log").exists()
    assert (tmp_path / "job.log").read_text() == out


def test_a_simulated_node_s_printed_command_runs_in_a_shell_as_printed(tmp_path, capsys):
    import shutil
    import subprocess

    node = bench_trainer.Node([sys.executable, "-c", "import os; print('ENV', os.environ['NCCL_SHM_DISABLE'], "
                               "sorted(os.sched_getaffinity(0)))"], {"NCCL_SHM_DISABLE": "1"}, [0])
    bench_trainer._run_nodes([node], timeout=60, log=tmp_path / "one.log")
    line = next(x for x in capsys.readouterr().out.splitlines() if x.endswith(" &"))
    if shutil.which("taskset") is None:
        pytest.skip("no taskset on this machine")
    out = subprocess.run(["bash", "-c", line + " wait"], capture_output=True, text=True, timeout=60).stdout
    assert "ENV 1 [0]" in out


def test_simulated_nodes_past_their_time_are_all_killed(tmp_path):
    node = bench_trainer.Node([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                              {}, sorted(os.sched_getaffinity(0)))
    out = bench_trainer._run_nodes([node, node], timeout=3, log=tmp_path / "slow.log")
    assert out.count("up") == 2 and out.rstrip().endswith("TIMEOUT")


def test_the_peak_of_a_multi_rank_run_is_the_largest_rank_s():
    assert bench_trainer._peak("PEAK_RSS_GB 12.0\nPEAK_RSS_GB 11.5\n", "PEAK_RSS_GB") == 12.0
    assert bench_trainer._peak("nothing", "PEAK_RSS_GB") != bench_trainer._peak("nothing", "PEAK_RSS_GB")  # NaN


def test_a_run_ended_before_its_exit_lines_takes_its_gpu_peak_from_rank_0_s_steps_and_says_so():
    steps = [{"gpu_mem_gb": 43.1}, {"gpu_mem_gb": 43.6}]
    ended = bench_trainer._gpu_peak("step lines only", steps)
    assert ended["gpu_gb"] == 43.6 and ended["gpu_gb_source"].startswith("rank 0")
    printed = bench_trainer._gpu_peak("PEAK_GPU_GB 44.0\nPEAK_GPU_GB 43.9\n", steps)
    assert printed == {"gpu_gb": 44.0, "gpu_gb_source": "exit lines, largest rank"}
    runs = [{"kind": "ours_compile", "global_batch": 65536, "samples_per_s": 10989.0, **ended},
            {"kind": "ours_compile", "global_batch": 65536, "samples_per_s": 10787.0, **printed}]
    lines = bench_trainer._table(runs).splitlines()
    col = lines[0].split(" | ").index("peak GPU GB")
    assert lines[2].split(" | ")[col] == "43.6 *" and lines[3].split(" | ")[col] == "44.0"
    assert lines[-1].startswith("\\* rank 0's peak")


def test_ours_on_simulated_nodes_gives_each_node_the_trainer_s_arguments(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(bench_trainer, "_run_nodes",
                        lambda nodes, timeout, log: seen.update(nodes=nodes, log=log) or "PEAK_GPU_GB 3.0\n")
    monkeypatch.setattr(bench_trainer, "_run", lambda *a, **k: pytest.fail("one node's launcher used"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    a = bench_trainer.parse_args(["--logs", str(tmp_path), "--out", str(tmp_path), "--micro", "256"])
    res = bench_trainer.run_ours(a, "ours_compile", 65536, 3, "/s/{0..1}.tar", ["model.name=ViT-B-16"], gpus=2,
                                 nodes=True)
    assert res["steps_seen"] == 0  # nothing ran
    first, second = seen["nodes"]
    assert first.cmd == second.cmd and "--nnodes=2" in first.cmd
    script = next(i for i, c in enumerate(first.cmd) if c.endswith(".py"))
    args = first.cmd[script + 1:]
    assert args[0] == "experiment=vit_b32_laion" and "batch.global_size=65536" in args
    assert "model.compile=true" in args and args[-1] == "model.name=ViT-B-16"
    assert "2node" in seen["log"].name and "train.py" in Path(first.cmd[script]).read_text()
    assert "sys.argv[1:]" in Path(first.cmd[script]).read_text()  # a torchrun script's argv: the overrides
    bench_trainer.run_ours(a, "ours", 1024, 2, "/s/{0..1}.tar", [], gpus=1, nodes=True)  # one simulated node too
    (only,) = seen["nodes"]
    script = next(i for i, c in enumerate(only.cmd) if c.endswith(".py"))
    assert "sys.argv[1:]" in Path(only.cmd[script]).read_text() and only.cmd[script + 1] == "experiment=vit_b32_laion"


def test_a_failing_node_ends_the_others_at_once(tmp_path):
    """A node that exits with an error (e.g. a refused start) takes the others down with it,
    instead of leaving them in the rendezvous until the run's timeout."""
    pidfile = tmp_path / "waiting.pid"
    waiting = bench_trainer.Node([sys.executable, "-c", f"import os, time; open({str(pidfile)!r}, 'w').write("
                                  "str(os.getpid())); time.sleep(600)"], {}, sorted(os.sched_getaffinity(0)))
    failing = bench_trainer.Node([sys.executable, "-c", "import time, sys; time.sleep(1); sys.exit(3)"], {},
                                 sorted(os.sched_getaffinity(0)))
    out = bench_trainer._run_nodes([waiting, failing], timeout=600, log=tmp_path / "fail.log")
    assert out.rstrip().endswith("NODE 1 FAILED (exit status 3)")
    pid = int(pidfile.read_text())
    assert not Path(f"/proc/{pid}").exists() or "Z" in _state(pid)


def test_a_signal_ends_the_run_in_flight_and_keeps_what_it_printed(tmp_path):
    """SIGTERM (an outer ``timeout``, a scheduler) reaches the script while a run waits: the
    run's process is killed at once, not at its own timeout, and its output says why."""
    import signal
    import threading

    before = signal.signal(signal.SIGTERM, bench_trainer.Stop.handle)
    bench_trainer.Stop.signum = 0
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        timer.start()
        code = "import time; print('step 1', flush=True); time.sleep(120)"
        t0 = __import__("time").monotonic()
        out = bench_trainer._run([sys.executable, "-c", code], timeout=600, log=tmp_path / "run.log")
        assert __import__("time").monotonic() - t0 < 90
        assert "step 1" in out and out.rstrip().endswith("STOPPED (SIGTERM)")
        assert not bench_trainer.Stop.pids
    finally:
        timer.cancel()  # a late signal after the handler's removal would end pytest
        signal.signal(signal.SIGTERM, before)
        bench_trainer.Stop.signum = 0


def test_a_signal_between_runs_writes_the_finished_ones_and_starts_no_more(tmp_path, monkeypatch, capsys):
    import json
    import signal

    calls = []

    def fake_run(a, kind, g, steps, spec, overrides, gpus, nodes=0):
        calls.append(g)
        if len(calls) == 2:  # the signal comes while the second run is in flight
            bench_trainer.Stop.handle(signal.SIGTERM, None)
        return {"samples_per_s": 1000.0 * len(calls), "step_s": 1.0}

    monkeypatch.setattr(bench_trainer, "run_ours", fake_run)
    monkeypatch.setattr(bench_trainer, "ensure_shards", lambda a: "shards")
    monkeypatch.setattr(bench_trainer, "fwd_gflops", lambda *m: (1.0, 1.0))
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        bench_trainer.main(["--runs", "ours:1024,ours:2048,ours:4096", "--out", str(tmp_path / "out"),
                            "--logs", str(tmp_path / "logs")])
    assert e.value.code == 128 + signal.SIGTERM
    assert calls == [1024, 2048]
    runs = json.loads((tmp_path / "out" / "trainer.json").read_text())["runs"]
    assert [r["global_batch"] for r in runs] == [1024, 2048]
    assert "stopped" not in runs[0] and runs[1]["stopped"] == "SIGTERM"
    md = (tmp_path / "out" / "trainer.md").read_text()
    assert "1,024" in md and "2,048" in md and "4,096" not in md and "stopped by SIGTERM" in md
    assert "stopped by SIGTERM after 2 of 3" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == before
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_a_signal_ends_simulated_nodes_at_once(tmp_path):
    import signal
    import threading

    before = signal.signal(signal.SIGTERM, bench_trainer.Stop.handle)
    bench_trainer.Stop.signum = 0
    timer = None
    try:
        node = bench_trainer.Node([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"],
                                  {}, sorted(os.sched_getaffinity(0)))
        timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        out = bench_trainer._run_nodes([node, node], timeout=600, log=tmp_path / "nodes.log")
        assert out.rstrip().endswith("STOPPED (SIGTERM)") and "FAILED" not in out
        assert not bench_trainer.Stop.pids
    finally:
        if timer is not None:
            timer.cancel()
        signal.signal(signal.SIGTERM, before)
        bench_trainer.Stop.signum = 0


def test_an_ignored_signal_stays_ignored_and_a_cut_metrics_line_is_left_out(tmp_path, monkeypatch):
    """Under nohup SIGHUP is ignored: the script must not start handling it. A run killed while
    writing its metrics leaves a cut last line, which the parse skips."""
    import signal

    seen = {}

    def fake_run(a, kind, g, steps, spec, overrides, gpus, nodes=0):
        seen["hup"] = signal.getsignal(signal.SIGHUP)
        seen["term"] = signal.getsignal(signal.SIGTERM)
        return {"samples_per_s": 1.0, "step_s": 1.0}

    monkeypatch.setattr(bench_trainer, "run_ours", fake_run)
    monkeypatch.setattr(bench_trainer, "ensure_shards", lambda a: "shards")
    monkeypatch.setattr(bench_trainer, "fwd_gflops", lambda *m: (1.0, 1.0))
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        bench_trainer.main(["--runs", "ours:1024", "--out", str(tmp_path / "out"), "--logs", str(tmp_path / "logs")])
        assert seen["hup"] is signal.SIG_IGN
        assert seen["term"] == bench_trainer.Stop.handle
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n{"step": 3, "a"')
    assert [r["step"] for r in bench_trainer.read_records(metrics)] == [1, 2]
    assert bench_trainer.read_records(tmp_path / "absent.jsonl") == []


def test_a_run_keeps_every_step_s_rate_in_its_own_run_dir(tmp_path, monkeypatch):
    """A run's result keeps each step's samples/s (the compile step included, the profiled one
    left out) beside the median of the steady ones; runs of other overrides or another --micro get
    run_dirs and logs of their own, the run_dirs passing as a Hydra value (no '=' in them)."""
    import json
    import subprocess

    dirs, logs = [], []

    def fake_run(cmd, timeout, log, path_first=None):
        run_dir = Path(next(c for c in cmd if c.startswith("run_dir=")).split("=", 1)[1])
        dirs.append(run_dir)
        logs.append(log)
        run_dir.mkdir(parents=True, exist_ok=True)
        rates = {1: 400.0, 2: 5000.0, 3: 3000.0, 4: 5200.0}
        (run_dir / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": s, "samples_per_s": r, "step_time": 1.0}) + "\n" for s, r in rates.items()))
        return "PEAK_GPU_GB 3.0\n"

    monkeypatch.setattr(bench_trainer, "_run", fake_run)
    monkeypatch.setattr(bench_trainer, "launcher", lambda gpus, logs, body: [])
    a = bench_trainer.parse_args(["--logs", str(tmp_path), "--out", str(tmp_path), "--profile-step", "3"])
    try:
        res = bench_trainer.run_ours(a, "ours", 1024, 4, "/s/{0..1}.tar", ["model.name=ViT-L-14"])
        assert res["step_samples_per_s"] == [400.0, 5000.0, 5200.0]  # step 3 was profiled
        assert res["samples_per_s"] == 5100.0 and res["steps_seen"] == 3
        bench_trainer.run_ours(a, "ours", 1024, 4, "/s/{0..1}.tar", ["model.name=ViT-B-16"])
        bench_trainer.run_ours(a, "ours", 1024, 4, "/s/{0..1}.tar", [])
        a2048 = bench_trainer.parse_args(["--logs", str(tmp_path), "--out", str(tmp_path), "--micro", "2048"])
        bench_trainer.run_ours(a2048, "ours", 1024, 4, "/s/{0..1}.tar", [])  # only --micro differs
        assert len(set(dirs)) == 4 and not any("=" in d.name for d in dirs)
        assert len({p.name for p in logs}) == 4  # and each its own log
        table = bench_trainer._table([{**res, "kind": "ours", "global_batch": 1024}])
        assert "| 5,100 (5,000 / 5,200) |" in table  # the steady steps beside their median
    finally:
        for d in dirs:
            subprocess.run(["rm", "-rf", str(d)])
