"""Two torchrun "nodes" on this host (--nnodes 2, c10d rendezvous on localhost, one gloo process
each) train a couple of steps: the multi-node launch of docs/launch.md, without a cluster."""

import socket
import subprocess
import sys
import time

from launch_testutils import MICRO, ROOT, child_env, records


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_by_c10d_rendezvous_on_localhost_train_steps(tmp_path):
    run_dir, port = tmp_path / "run", _free_port()
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
            "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=infclip-test",
            str(ROOT / "train.py"), f"data.synthetic_root={tmp_path / 'synthetic'}", f"run_dir={run_dir}",
            *MICRO, "steps=2"]
    env = child_env(GLOO_SOCKET_IFNAME="lo")  # the loopback is the "network" between the nodes
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    nodes = []
    for log in logs:
        nodes.append(subprocess.Popen(node, cwd=tmp_path, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT))
        time.sleep(1)  # one after the other, as nodes start on a cluster
    try:
        codes = [p.wait(timeout=300) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    tails = "\n".join(f"--- {log.name} ---\n{log.read_text()[-3000:]}" for log in logs)
    assert codes == [0, 0], tails
    recs = records(run_dir)
    assert sorted(r["step"] for r in recs if "loss" in r) == [1, 2], tails
    assert {r["world_size"] for r in recs if r.get("event") == "start"} == {2}
    assert sorted(p.name for p in (run_dir / "checkpoints" / "step_00000002").glob("rank_*.pt")) == \
        ["rank_00000.pt", "rank_00001.pt"]
