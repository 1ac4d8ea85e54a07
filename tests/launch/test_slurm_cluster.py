"""The Slurm path on a real one-node cluster (``scripts/slurm/local_cluster.sh``: Debian's
slurmctld, slurmd and munge, two placeholder GPUs), not a dry run: a two-size sweep of 2-rank
CPU jobs through ``scripts/slurm/sweep.py``, gathered by ``gather.py``; one job preempted with
USR1 as Slurm's warning would (``scancel --signal=USR1 --batch``): checkpoint, requeue by the
batch script, exact resume, every step logged once, and a log without tracebacks or srun
errors. Skipped, with the reason, where the cluster cannot start (not root, no apt, ...)."""

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch_testutils import MICRO, child_env, losses_by_step

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 40
SHARED = [o for o in MICRO if not o.startswith("batch.global_size=")] + [
    f"steps={STEPS}", "checkpoint.every_n_steps=10", "checkpoint.keep_last=2"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm")
    script = ROOT / "scripts" / "slurm" / "local_cluster.sh"
    proc = subprocess.run([str(script), "start", str(state)], capture_output=True, text=True, timeout=420)
    if proc.returncode != 0:
        pytest.skip(f"no local Slurm cluster here: {proc.stderr.strip()[-300:]}")
    env = child_env(SLURM_CONF=str(state / "slurm.conf"))
    yield env
    subprocess.run(["scancel", "--user=root"], env=env, capture_output=True)
    subprocess.run([str(script), "stop", str(state)], capture_output=True, timeout=60)


def _squeue(env, job: str) -> str:
    """The job's state (PENDING, RUNNING, ...), or '' once it left the queue."""
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True)
    return out.stdout.strip()


def _wait(what: str, ready, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout} s")


def test_sweep_gather_and_a_preempted_job_requeues_and_resumes_exactly(cluster, tmp_path):
    data_root, sweep = tmp_path / "synthetic", tmp_path / "sweep"
    cmd = [sys.executable, str(ROOT / "scripts" / "slurm" / "sweep.py"), "--name", "t", "--sweep-dir", str(sweep),
           "--batches", "32,64", "--lr-rule", "sqrt", "--ref-batch", "32", "--ref-lr", "1e-3", "--nodes", "1",
           "--gpus-per-node", "2", "--sbatch-arg=--cpus-per-task=2", "--", f"data.synthetic_root={data_root}", *SHARED]
    proc = subprocess.run(cmd, cwd=ROOT, env=cluster, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    runs = json.loads((sweep / "sweep.json").read_text())["runs"]
    jobs = {r["batch"]: r["job_id"] for r in runs}
    assert sorted(jobs) == [32, 64] and all(j.isdigit() for j in jobs.values())

    # preempt the first job once it has trained a few steps (--exclusive: one job at a time)
    preempted, run_dir = jobs[32], sweep / "b32"
    _wait("b32 reaches step 3", lambda: max(losses_by_step(run_dir), default=0) >= 3)
    subprocess.run(["scancel", "--signal=USR1", "--batch", preempted], env=cluster, check=True)
    log = sweep / "logs" / f"t_b32-{preempted}.out"
    _wait("b32 requeued", lambda: log.exists() and "requeueing job" in log.read_text())
    # a requeued job may be missing from squeue between its end and its pending state: wait
    # for its second start before waiting for the queue to empty
    _wait("b32 restarted", lambda: "restart 1" in log.read_text())
    _wait("both jobs done", lambda: not _squeue(cluster, jobs[32]) and not _squeue(cluster, jobs[64]), timeout=900)

    text = log.read_text()
    assert "restart 1" in text and "resumed from" in text, text[-3000:]
    assert "Traceback" not in text and "srun: error" not in text, text[-3000:]
    got = losses_by_step(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1)) and all(len(v) == 1 for v in got.values()), got

    # the same run, uninterrupted, on 2 local ranks: identical losses
    ref_dir = tmp_path / "reference"
    ref = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(ROOT / "train.py"), f"data.synthetic_root={data_root}", *SHARED,
                          "batch.global_size=32", "optim.lr=0.001", f"run_dir={ref_dir}"],
                         cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = losses_by_step(ref_dir)
    assert {s: v[0] for s, v in got.items()} == {s: v[0] for s, v in want.items()}

    gathered = subprocess.run([sys.executable, str(ROOT / "scripts" / "slurm" / "gather.py"), str(sweep)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    assert gathered.returncode == 0, gathered.stderr
    with open(sweep / "sweep.csv") as f:
        rows = {int(r["batch"]): r for r in csv.DictReader(f)}
    assert sorted(rows) == [32, 64] and all(int(r["steps_done"]) == STEPS and int(r["world_size"]) == 2
                                            for r in rows.values())
