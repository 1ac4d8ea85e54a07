#!/usr/bin/env python
"""Submit one Slurm job per global batch size, with a learning-rate scaling rule.

    python scripts/slurm/sweep.py --name b32_sweep --batches 32k,64k,128k,256k,512k,1M \
        --lr-rule sqrt --ref-batch 32k --ref-lr 1e-3 --nodes 4 -- \
        experiment=vit_b32_laion "data.shards='/data/laion/{00000..41407}.tar'" steps=20000

Each job runs ``scripts/slurm/train.sbatch`` with ``batch.global_size=B optim.lr=LR
name=<name>_b<B> run_dir=<sweep dir>/b<B>``; a requeued job therefore resumes in its own
directory. Every member's config is validated first, as train.py will on its ranks; if any
cannot run, each such member is named and nothing is submitted (exit 2). ``--dry-run`` prints
the exact sbatch commands and submits nothing. The sweep's
manifest (``<sweep dir>/sweep.json``) lists the runs for ``scripts/slurm/gather.py``.

Learning-rate rules, from a reference (batch b0, lr0): constant lr = lr0; linear
lr = lr0 * B / b0 (Goyal et al.); sqrt lr = lr0 * sqrt(B / b0) (the usual choice for
Adam-type optimizers at very large batches).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SBATCH_SCRIPT = REPO / "scripts" / "slurm" / "train.sbatch"
LR_RULES = ("constant", "linear", "sqrt")


def parse_size(text: str) -> int:
    """'32768', '32k' (= 32 * 1024) or '1M' (= 2**20) -> int."""
    m = re.fullmatch(r"(\d+)([kKmM]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not a batch size: {text!r} (use e.g. 32768, 32k or 1M)")
    return int(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20}[m.group(2).lower()]


def scaled_lr(rule: str, batch: int, ref_batch: int, ref_lr: float) -> float:
    """The learning rate for ``batch`` under ``rule`` from the reference (ref_batch, ref_lr)."""
    if rule == "constant":
        return ref_lr
    if rule == "linear":
        return ref_lr * batch / ref_batch
    if rule == "sqrt":
        return ref_lr * math.sqrt(batch / ref_batch)
    raise ValueError(f"unknown lr rule {rule!r}; choose one of {LR_RULES}")


@dataclass
class SweepRun:
    batch: int
    lr: float
    name: str
    run_dir: str
    command: list[str]
    job_id: str | None = None


def plan(args: argparse.Namespace) -> list[SweepRun]:
    """One run per batch size: its overrides and its sbatch command line."""
    runs = []
    for batch in args.batches:
        lr = scaled_lr(args.lr_rule, batch, args.ref_batch, args.ref_lr)
        name = f"{args.name}_b{batch}"
        run_dir = str(Path(args.sweep_dir) / f"b{batch}")
        sbatch = [args.sbatch, f"--job-name={name}", f"--nodes={args.nodes}",
                  f"--gpus-per-node={args.gpus_per_node}", f"--output={Path(args.sweep_dir) / 'logs'}/%x-%j.out",
                  *args.sbatch_arg]
        overrides = member_overrides(args, batch, lr, name, run_dir)
        runs.append(SweepRun(batch, float(f"{lr:.6g}"), name, run_dir, [*sbatch, str(SBATCH_SCRIPT), *overrides]))
    return runs


def member_overrides(args: argparse.Namespace, batch: int, lr: float, name: str, run_dir: str) -> list[str]:
    """The train.py overrides of one member: the shared ones, then what the sweep sets."""
    return [*args.overrides, f"batch.global_size={batch}", f"optim.lr={lr:.6g}", f"name={name}", f"run_dir={run_dir}"]


def member_problems(args: argparse.Namespace, runs: list[SweepRun]) -> list[str]:
    """Each member's config composed and validated as train.py will on its nodes x GPUs ranks
    (a micro-batch that does not divide the per-rank batch, a missing data.shards, ...), one
    line per member that cannot run. Devices are taken to be GPUs (the members run on GPU
    nodes, whatever this host has) unless the overrides set ``device``; data files are not
    opened (the submitting host may not see them)."""
    from hydra import compose, initialize_config_dir
    from omegaconf.errors import MissingMandatoryValue

    from infclip.config import register_configs, validate

    register_configs()
    world = args.nodes * args.gpus_per_node
    gpu = [] if any(o.split("=", 1)[0].lstrip("+") == "device" for o in args.overrides) else ["device=cuda"]
    problems = []
    for run in runs:
        overrides = member_overrides(args, run.batch, run.lr, run.name, run.run_dir)
        try:
            with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
                validate(compose(config_name="train", overrides=[*overrides, *gpu]), world)
        except MissingMandatoryValue as e:
            problems.append(f"{run.name}: {e.full_key} has no value (??? in the preset): set {e.full_key}=... "
                            "after --")
        except Exception as e:  # ConfigError and Hydra's composition errors: their message is the story
            problems.append(f"{run.name} (batch.global_size={run.batch} on {world} ranks): "
                            f"{str(e).strip().splitlines()[0]}")
    return problems


def submit(run: SweepRun) -> str:
    out = subprocess.run(run.command, capture_output=True, text=True, check=True, cwd=REPO).stdout
    m = re.search(r"Submitted batch job (\d+)", out)
    return m.group(1) if m else out.strip()


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default="sweep", help="sweep name; runs are <name>_b<batch>")
    p.add_argument("--sweep-dir", default=None, help="where the runs live (default: runs/<name>)")
    p.add_argument("--batches", default="32k,64k,128k,256k,512k,1M",
                   type=lambda s: [parse_size(x) for x in s.split(",")], help="global batch sizes")
    p.add_argument("--lr-rule", choices=LR_RULES, default="sqrt")
    p.add_argument("--ref-batch", type=parse_size, default=parse_size("32k"), help="batch of the reference lr")
    p.add_argument("--ref-lr", type=float, default=1e-3, help="lr at --ref-batch (the paper's 1e-3)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--sbatch", default="sbatch", help="sbatch executable")
    p.add_argument("--sbatch-arg", action="append", default=[],
                   help="extra sbatch option, e.g. --sbatch-arg=--partition=gpu")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch commands, submit nothing")
    p.add_argument("overrides", nargs="*", help="train.py overrides shared by all runs (after --)")
    args = p.parse_args(argv)
    args.sweep_dir = args.sweep_dir or str(REPO / "runs" / args.name)
    bad = [o for o in args.overrides if o.split("=")[0] in ("batch.global_size", "optim.lr", "name", "run_dir")]
    if bad:
        p.error(f"{bad} are set per run by the sweep; drop them")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    runs = plan(args)
    problems = member_problems(args, runs)
    if problems:  # nothing is submitted: a member that cannot run would fail inside its job's log
        print(f"error: {len(problems)} of {len(runs)} sweep members cannot run, so none was submitted:\n  "
              + "\n  ".join(problems), file=sys.stderr)
        return 2
    if not args.dry_run:  # Slurm cannot create the log directory itself
        (Path(args.sweep_dir) / "logs").mkdir(parents=True, exist_ok=True)
    for run in runs:
        print(shlex.join(run.command), flush=True)
        if not args.dry_run:
            run.job_id = submit(run)
            print(f"  -> job {run.job_id}", flush=True)
    if not args.dry_run:
        manifest = Path(args.sweep_dir) / "sweep.json"
        manifest.write_text(json.dumps({"lr_rule": args.lr_rule, "ref_batch": args.ref_batch, "ref_lr": args.ref_lr,
                                        "runs": [asdict(r) for r in runs]}, indent=2))
        print(f"manifest: {manifest}; gather with: python scripts/slurm/gather.py {args.sweep_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
