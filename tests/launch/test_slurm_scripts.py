"""Slurm launch scripts without Slurm: syntax, --dry-run wiring, and the real code path of
train.sbatch against fake scontrol/srun/scancel/torchrun executables."""

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "scripts" / "slurm"
sys.path.insert(0, str(SLURM))
import sweep  # noqa: E402


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "RDZV_", "GPUS_"))}
    env.update(extra)
    return env


@pytest.mark.parametrize("script", ["train.sbatch", "torchrun_node.sh"])
def test_shell_scripts_parse(script):
    subprocess.run(["bash", "-n", str(SLURM / script)], check=True)
    assert os.access(SLURM / script, os.X_OK)


def _torchrun_lines(stdout):
    """{node index: (host, argv of torchrun)} from train.sbatch --dry-run output."""
    nodes = {}
    for line in stdout.splitlines():
        if line.startswith("[node "):
            head, cmd = line.split("] ", 1)
            _, idx, host = head.split()
            nodes[int(idx)] = (host, shlex.split(cmd))
    return nodes


def _opts(argv):
    return dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)


def test_sbatch_dry_run_static_rendezvous_wiring(tmp_path):
    shards = "/data/laion/{00000..00099}.tar"
    proc = subprocess.run(
        [str(SLURM / "train.sbatch"), "--dry-run", "--nodes", "3", "experiment=vit_b32_laion",
         f"data.shards={shards}", "batch.global_size=262144"],
        capture_output=True, text=True, check=True, cwd=tmp_path,
        env=_clean_env(GPUS_PER_NODE="4", SLURM_JOB_ID="555", OMP_NUM_THREADS=""),
    )
    nodes = _torchrun_lines(proc.stdout)
    assert sorted(nodes) == [0, 1, 2]
    first_host = nodes[0][0]
    for i, (host, argv) in nodes.items():
        assert argv[:3] == ["python", "-m", "infclip.launch"] and argv[-4:] == [
            str(ROOT / "train.py"), "experiment=vit_b32_laion", f"data.shards={shards}", "batch.global_size=262144"]
        o = _opts(argv)
        assert o["nnodes"] == "3" and o["nproc_per_node"] == "4" and o["node_rank"] == str(i)
        assert o["master_addr"] == first_host and o["master_port"] == str(20000 + 555 % 20000)
    assert "--ntasks=3 --ntasks-per-node=1" in proc.stdout  # one torchrun per node
    assert "OMP_NUM_THREADS=16" in proc.stdout  # 64 CPUs / 4 GPUs
    assert "NCCL sockets 4 thread(s) x 4" in proc.stdout  # the socket transport's parallelism, unless set


def test_sbatch_keeps_the_user_s_nccl_socket_settings(tmp_path):
    proc = subprocess.run(
        [str(SLURM / "train.sbatch"), "--dry-run", "--nodes", "2", "experiment=vit_b32_laion"],
        capture_output=True, text=True, check=True, cwd=tmp_path,
        env=_clean_env(GPUS_PER_NODE="4", SLURM_JOB_ID="7", NCCL_SOCKET_NTHREADS="2", NCCL_NSOCKS_PERTHREAD="8"),
    )
    assert "NCCL sockets 2 thread(s) x 8" in proc.stdout


def test_sbatch_dry_run_c10d_rendezvous_and_given_hosts(tmp_path):
    proc = subprocess.run(
        [str(SLURM / "train.sbatch"), "--dry-run", "steps=5"], capture_output=True, text=True, check=True,
        env=_clean_env(DRY_RUN_HOSTS="gpu-a gpu-b", RDZV_BACKEND="c10d", SLURM_JOB_ID="42", MAX_RESTARTS="3"),
    )
    nodes = _torchrun_lines(proc.stdout)
    assert [nodes[i][0] for i in (0, 1)] == ["gpu-a", "gpu-b"]
    for _, argv in nodes.values():
        o = _opts(argv)
        assert o["rdzv_backend"] == "c10d" and o["rdzv_endpoint"] == "gpu-a:20042" and o["rdzv_id"] == "42"
        assert o["nnodes"] == "2" and o["max_restarts"] == "3" and "node_rank" not in o


def _fake_bin(tmp_path):
    """scontrol/srun/scancel/torchrun stand-ins that record what they were asked to do."""
    d = tmp_path / "bin"
    d.mkdir()
    scripts = {
        "scontrol": 'if [ "$1 $2" = "show hostnames" ]; then printf "n1\\nn2\\n"; fi\n',
        # srun: run the command once per node (as Slurm's tasks would), with SLURM_NODEID
        "srun": 'while [ "${1#--}" != "$1" ]; do shift; done\n'
                'for i in 0 1; do SLURM_NODEID=$i "$@" & done\nwait\n',
        "scancel": 'echo "$@" >> "$FAKE_DIR/scancel.txt"\ntouch "$FAKE_DIR/signalled"\n',
        "torchrun": f'exec {sys.executable} "$FAKE_DIR/torchrun.py" "$@"\n',
    }
    for name, body in scripts.items():
        (d / name).write_text("#!/bin/bash\n" + body)
        (d / name).chmod(0o755)
    (d / "torchrun.py").write_text(
        "import os, signal, sys, time\n"
        "d = os.environ['FAKE_DIR']\n"
        "ign = signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN\n"
        "open(f\"{d}/node{os.environ['SLURM_NODEID']}.txt\", 'w').write(f'{ign}\\n' + '\\n'.join(sys.argv[1:]))\n"
        "for _ in range(1200):\n"
        "    if os.path.exists(f'{d}/signalled'): break\n"
        "    time.sleep(0.05)\n"
    )
    return d


def test_sbatch_real_path_launches_every_node_and_forwards_usr1_once(tmp_path):
    fake = _fake_bin(tmp_path)
    env = _clean_env(PATH=f"{fake}:{os.environ['PATH']}", FAKE_DIR=str(fake), SLURM_JOB_ID="777",
                     INFCLIP_LAUNCHER="torchrun",
                     SLURM_JOB_NODELIST="n[1-2]", SLURM_SUBMIT_DIR=str(ROOT), GPUS_PER_NODE="2")
    proc = subprocess.Popen(["bash", str(SLURM / "train.sbatch"), "steps=3"], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not all((fake / f"node{i}.txt").exists() for i in (0, 1)):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)  # Slurm's --signal=B:USR1 warning to the batch shell
    time.sleep(0.3)
    proc.send_signal(signal.SIGUSR1)  # a second warning is not forwarded again
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert (fake / "scancel.txt").read_text().split() == ["--signal=USR1", "777"]
    for i in (0, 1):
        ignored, *argv = (fake / f"node{i}.txt").read_text().splitlines()
        assert ignored == "True"  # torchrun survives USR1; its workers handle it
        o = _opts(argv)
        assert (o["node_rank"], o["master_addr"], o["nnodes"], o["nproc_per_node"]) == (str(i), "n1", "2", "2")
        assert argv[-2:] == [str(ROOT / "train.py"), "steps=3"]


def test_sweep_dry_run_prints_one_sbatch_per_batch_with_lr_rule(tmp_path, capsys):
    assert sweep.main(["--dry-run", "--batches", "32k,128k,1M", "--lr-rule", "sqrt", "--ref-batch", "32k",
                       "--ref-lr", "1e-3", "--nodes", "4", "--sweep-dir", str(tmp_path / "sw"),
                       "--", "experiment=vit_b32_laion", "data.shards='/data/laion/{00000..00099}.tar'",
                       "steps=100"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and not (tmp_path / "sw").exists()  # dry run: nothing written, nothing submitted
    expected = {32768: 1e-3, 131072: 2e-3, 1048576: 1e-3 * 32**0.5}
    for line in lines:
        argv = shlex.split(line)
        assert argv[0] == "sbatch" and "--nodes=4" in argv and str(SLURM / "train.sbatch") in argv
        kv = dict(a.split("=", 1) for a in argv[argv.index(str(SLURM / "train.sbatch")) + 1:])
        b = int(kv["batch.global_size"])
        assert float(kv["optim.lr"]) == pytest.approx(expected[b], rel=1e-5)
        assert kv["run_dir"] == str(tmp_path / "sw" / f"b{b}") and kv["experiment"] == "vit_b32_laion"


@pytest.mark.parametrize("rule,expected", [("constant", 1e-3), ("linear", 8e-3), ("sqrt", 1e-3 * 8**0.5)])
def test_lr_rules(rule, expected):
    assert sweep.scaled_lr(rule, 262144, 32768, 1e-3) == pytest.approx(expected)
    assert sweep.parse_size("1M") == 2**20 and sweep.parse_size("32k") == 32768 and sweep.parse_size("500") == 500


def test_sweep_submits_and_writes_manifest(tmp_path):
    fake = tmp_path / "sbatch"
    fake.write_text('#!/bin/bash\necho "$@" >> "$(dirname "$0")/calls.txt"\necho "Submitted batch job 9$RANDOM"\n')
    fake.chmod(0o755)
    sw = tmp_path / "sw"
    assert sweep.main(["--batches", "32k,64k", "--lr-rule", "linear", "--sbatch", str(fake),
                       "--sweep-dir", str(sw), "--", "steps=10"]) == 0
    manifest = OmegaConf.to_container(OmegaConf.load(sw / "sweep.json"))
    assert [r["batch"] for r in manifest["runs"]] == [32768, 65536]
    assert [r["lr"] for r in manifest["runs"]] == [1e-3, 2e-3]
    assert all(r["job_id"].startswith("9") for r in manifest["runs"])
    assert (sw / "logs").is_dir() and len((tmp_path / "calls.txt").read_text().splitlines()) == 2


def test_sweep_validates_every_member_and_submits_none_when_one_cannot_run(tmp_path, capsys):
    """global 128 on 2 ranks with micro 128: that member is named (and why), nothing submitted."""
    fake = tmp_path / "sbatch"
    fake.write_text("#!/bin/sh\necho submitted >> " + str(tmp_path / "calls") + "\necho Submitted batch job 1\n")
    fake.chmod(0o755)
    argv = ["--batches", "128,512", "--gpus-per-node", "2", "--sbatch", str(fake), "--sweep-dir", str(tmp_path / "sw"),
            "--", "steps=10", "batch.micro_size=128"]
    assert sweep.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 1 of 2 sweep members cannot run, so none was submitted:")
    assert "sweep_b128 (batch.global_size=128 on 2 ranks): batch.micro_size=128 must divide the per-rank" in err
    assert "sweep_b512" not in err and not (tmp_path / "calls").exists() and not (tmp_path / "sw" / "sweep.json").exists()
    assert sweep.main(["--dry-run", "--", "experiment=vit_b32_laion"]) == 2
    assert "data.kind=wds needs data.shards=" in capsys.readouterr().err


def test_sweep_rejects_overrides_it_sets_itself(capsys):
    with pytest.raises(SystemExit):
        sweep.main(["--dry-run", "--", "optim.lr=0.1"])
    assert "set per run by the sweep" in capsys.readouterr().err


def test_hydra_launcher_config_fields_belong_to_the_plugin():
    """configs/hydra/launcher/slurm.yaml extends submitit_slurm with its real fields only
    (hydra-submitit-launcher 1.2 SlurmQueueConf; the plugin is an optional extra)."""
    plugin_fields = {
        "submitit_folder", "timeout_min", "cpus_per_task", "gpus_per_node", "tasks_per_node", "mem_gb",
        "nodes", "name", "stderr_to_stdout", "partition", "qos", "comment", "constraint", "exclude", "gres",
        "cpus_per_gpu", "gpus_per_task", "mem_per_gpu", "mem_per_cpu", "account", "signal_delay_s",
        "max_num_timeout", "additional_parameters", "array_parallelism", "setup",
    }
    cfg = OmegaConf.load(ROOT / "configs" / "hydra" / "launcher" / "slurm.yaml")
    assert list(cfg.defaults) == ["submitit_slurm"]
    assert set(cfg.keys()) - {"defaults"} <= plugin_fields
    assert cfg.tasks_per_node == cfg.gpus_per_node  # one process per GPU: the trainer reads Slurm's ranks
    assert cfg.additional_parameters.requeue is True and cfg.signal_delay_s > 0


def test_node_script_forwards_usr1_to_workers_in_their_own_session(tmp_path):
    """torchrun starts workers with start_new_session=True: a signal to the step's process
    group may miss them, so torchrun_node.sh forwards USR1 to torchrun's children itself,
    while torchrun (USR1 ignored) survives and exits with its workers' status."""
    d = tmp_path / "bin"
    d.mkdir()
    worker = ("import signal, sys, time, pathlib\n"
              "d = pathlib.Path(sys.argv[1])\n"
              "signal.signal(signal.SIGUSR1, lambda *a: ((d / 'got_usr1').write_text('yes'), sys.exit(0)))\n"
              "(d / 'ready').write_text('1')\n"
              "time.sleep(30)\n"
              "sys.exit(3)\n")
    (d / "worker.py").write_text(worker)
    (d / "torchrun").write_text(
        f"#!{sys.executable}\n"
        "import subprocess, sys\n"
        f"p = subprocess.Popen([sys.executable, '{d / 'worker.py'}', '{d}'], start_new_session=True)\n"
        "sys.exit(p.wait())\n")
    (d / "torchrun").chmod(0o755)
    env = _clean_env(PATH=f"{d}:{os.environ['PATH']}", NNODES="1", GPUS_PER_NODE="1", MASTER_ADDR="h",
                     MASTER_PORT="1", SLURM_NODEID="0", INFCLIP_REPO=str(ROOT), INFCLIP_LAUNCHER="torchrun")
    proc = subprocess.Popen(["bash", str(SLURM / "torchrun_node.sh"), "steps=1"], env=env, start_new_session=True)
    deadline = time.monotonic() + 30
    while not (d / "ready").exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGUSR1)  # what Slurm does: the step's process group, not the workers
    assert proc.wait(timeout=30) == 0  # torchrun survived and returned the worker's clean exit
    assert (d / "got_usr1").read_text() == "yes"
