#!/usr/bin/env python
"""Smoke-test fault tolerance on a machine (GPU or CPU): torchrun a short run, kill it
mid-run, let it resume, and compare its losses with an uninterrupted run.

    python scripts/slurm/resume_check.py --nproc 2 --mode worker --out /tmp/rc -- model.name=infclip-tiny

--mode worker  SIGKILL one training process; torchrun (--max_restarts=1) restarts all
               ranks, which resume from the last checkpoint (resume=auto).
--mode all     SIGKILL torchrun and every worker (a lost node / job); start the same
               command again, which resumes.
--mode usr1    send SIGUSR1 (Slurm's warning) to one worker only: every rank stops after
               the same step, checkpoints and exits 0; start the same command again.
Several modes (--mode worker,usr1) share one reference run.

--resume-nproc N (modes all and usr1) starts the resumed run on N processes instead of
--nproc: a checkpoint of one world size going on on another (docs/launch.md, "Resuming on
another number of GPUs"). The losses then differ by the reduction order only: give --tol.

    python scripts/slurm/resume_check.py --nproc 2 --resume-nproc 1 --mode usr1 --tol 1e-3 --out /tmp/rc

Prints one line per step (reference loss, resumed run's losses, difference) and a verdict.
On CPU (gloo) the losses must be equal bit for bit; on GPU, kernels may be nondeterministic,
so the difference is reported against --tol.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


# torchrun shares its rendezvous store with the workers by default; after a restart the new
# workers can then read the previous attempt's addresses (pytorch/pytorch#135712).
os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def torchrun(nproc: int, run_dir: Path, overrides: list[str], max_restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            f"--max_restarts={max_restarts}", str(REPO / "train.py"), f"run_dir={run_dir}", *overrides]


def losses(run_dir: Path) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in r and "step" in r:
            out.setdefault(r["step"], []).append(r["loss"])
    return out


def children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        text = (task / "children").read_text().split()
        kids += [int(k) for k in text]
    return kids


def wait_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not losses(run_dir) or max(losses(run_dir)) < step:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"run ended ({proc.returncode}) or timed out before step {step}")
        time.sleep(0.05)


def killed_run(args: argparse.Namespace, mode: str, run_dir: Path, overrides: list[str], log) -> float:
    """Runs, kills at --kill-at, resumes; returns the wall time of the recovery."""
    restarts = 1 if mode == "worker" else 0
    proc = subprocess.Popen(torchrun(args.nproc, run_dir, overrides, restarts), stdout=log, stderr=subprocess.STDOUT,
                            cwd=REPO)
    wait_step(proc, run_dir, args.kill_at, args.timeout)
    t0 = time.monotonic()
    if mode == "usr1":
        print(f"SIGUSR1 to one worker after step {max(losses(run_dir))}", flush=True)
        os.kill(max(children(proc.pid)), signal.SIGUSR1)
        rc = proc.wait(timeout=args.timeout)
        print(f"stopped: exit code {rc} after step {max(losses(run_dir))}", flush=True)
        if rc == 0:
            rc = subprocess.run(torchrun(args.resume_nproc or args.nproc, run_dir, overrides), stdout=log,
                                stderr=subprocess.STDOUT, cwd=REPO, timeout=args.timeout).returncode
    elif mode == "worker":
        victim = max(children(proc.pid))
        print(f"killing worker pid {victim} after step {max(losses(run_dir))}", flush=True)
        os.kill(victim, signal.SIGKILL)
        rc = proc.wait(timeout=args.timeout)
    else:
        print(f"killing torchrun and its workers after step {max(losses(run_dir))}", flush=True)
        for pid in [*children(proc.pid), proc.pid]:  # workers run in sessions of their own
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=60)
        rc = subprocess.run(torchrun(args.resume_nproc or args.nproc, run_dir, overrides), stdout=log,
                            stderr=subprocess.STDOUT, cwd=REPO, timeout=args.timeout).returncode
    if rc != 0:
        raise SystemExit(f"the resumed run failed with exit code {rc}; see {log.name}")
    return time.monotonic() - t0


def spread_of(a: dict[int, list[float]], b: dict[int, list[float]]) -> float:
    """The largest |loss difference| of two uninterrupted runs over their common steps."""
    return max((abs(a[k][0] - b[k][0]) for k in a.keys() & b.keys()), default=0.0)


def compare(ref: dict[int, list[float]], got: dict[int, list[float]], tol: float) -> bool:
    worst = 0.0
    print(f"{'step':>5} {'reference':>12} {'killed+resumed (every logged value)':>40} {'max |diff|':>11}")
    for step in sorted(ref):
        vals = got.get(step, [])
        diff = max((abs(v - ref[step][0]) for v in vals), default=float("inf"))
        worst = max(worst, diff)
        print(f"{step:>5} {ref[step][0]:>12.6f} {', '.join(f'{v:.6f}' for v in vals):>40} {diff:>11.2e}")
    ok = sorted(got) == sorted(ref) and worst <= tol
    print(f"steps {sorted(got) == sorted(ref) and 'complete' or 'MISSING'}; worst |diff| {worst:.3e} "
          f"(tol {tol:g}) -> {'PASS' if ok else 'FAIL'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--resume-nproc", type=int, default=None,
                   help="modes all, usr1: resume on this many processes (default --nproc)")
    p.add_argument("--mode", default="worker", help="worker | all | usr1, or several: worker,usr1")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--kill-at", type=int, default=15, help="kill once this step is logged")
    p.add_argument("--tol", type=float, default=0.0, help="allowed |loss difference| (0: bit-exact)")
    p.add_argument("--refs", type=int, default=1,
                   help="uninterrupted reference runs; with 2 or more the allowed difference is also their "
                        "own largest spread (nondeterministic GPU kernels: within the run-to-run spread)")
    p.add_argument("--parallel", action="store_true",
                   help="run the reference runs beside the killed one instead of before it (a GPU "
                        "machine: the wall time of about one run; the losses do not depend on it)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    common = [f"steps={args.steps}", f"checkpoint.every_n_steps={args.ckpt_every}", "logging.every_n_steps=1",
              "logging.progress=false", *args.overrides]
    for mode in args.mode.split(","):
        if mode not in ("worker", "all", "usr1"):
            p.error(f"unknown mode {mode!r}")
        if mode == "worker" and args.resume_nproc not in (None, args.nproc):
            p.error("--resume-nproc needs --mode all or usr1 (torchrun restarts mode worker on --nproc)")
    args.out.mkdir(parents=True, exist_ok=True)
    refs = reference_runs(args, common)
    ok = True
    for mode in args.mode.split(","):
        with open(args.out / f"{mode}.log", "w") as log:
            took = killed_run(args, mode, args.out / mode, common, log)
        text = (args.out / f"{mode}.log").read_text().splitlines()
        resumed = [line for line in text if "resumed from" in line]
        print(f"[{mode}] recovery to the end: {took:.1f} s; {resumed[-1].strip() if resumed else 'NO RESUME LINE'}")
        print("".join(f"[{mode}] {line.strip()}\n" for line in text if "resume: written on" in line), end="")
    if args.parallel:
        wait_references(args, refs)
    if args.refs > 1:
        spread = max(spread_of(losses(args.out / "ref"), losses(args.out / f"ref{k}")) for k in range(1, args.refs))
        print(f"run-to-run spread of {args.refs} uninterrupted runs: {spread:.3e}", flush=True)
        args.tol = max(args.tol, spread)
    for mode in args.mode.split(","):
        ok &= compare(losses(args.out / "ref"), losses(args.out / mode), args.tol)
    return 0 if ok else 1


def reference_runs(args: argparse.Namespace, common: list[str]) -> list[tuple[subprocess.Popen, float, object]]:
    """Start the --refs uninterrupted runs at once when --parallel, else one after another
    (each awaited before the next starts); (process, start time, log) of each."""
    started = []
    for k in range(args.refs):
        log = open(args.out / ("reference.log" if k == 0 else f"reference{k}.log"), "w")
        proc = subprocess.Popen(torchrun(args.nproc, args.out / ("ref" if k == 0 else f"ref{k}"), common),
                                stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        started.append((proc, time.monotonic(), log))
        if not args.parallel:
            wait_references(args, started[-1:])
    return started


def wait_references(args: argparse.Namespace, refs: list[tuple[subprocess.Popen, float, object]]) -> None:
    """Wait for the reference runs; one that fails or outlives --timeout ends the check."""
    for k, (proc, t0, log) in enumerate(refs):
        if proc.returncode is not None:
            continue
        try:
            rc = proc.wait(timeout=max(1.0, args.timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            raise SystemExit(f"reference run {k + 1} did not end within {args.timeout:.0f} s; see {log.name}")
        log.close()
        if rc != 0:
            raise SystemExit(f"reference run {k + 1} failed with exit code {rc}; see {log.name}")
        print(f"reference run {k + 1}: {time.monotonic() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
