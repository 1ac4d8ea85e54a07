"""On a CUDA machine: the step pipeline changes nothing that is trained. Runs train.py on a
tiny model with offload (pinned buffers, copy stream, CUDA events) and compares the losses
of (a) prefetch 0 / 2 and the synchronous path, (b) a locked image tower with streamed
vs whole-step images; ``sync_again`` repeats the reference run, to tell the GPU's own
run-to-run nondeterminism (atomics, autotuning) from the pipeline's. Prints one line per
comparison; exits 1 on any difference. ``--amp fp32|bf16``.

    python scripts/pipeline_gpu_check.py --out /tmp/pgc
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ["model.name=infclip-tiny", "data.synthetic_train=2048", "data.synthetic_eval=64", "data.workers=2",
        "data.loader_batch=64", "batch.global_size=512", "batch.micro_size=128", "memory.offload=true",
        "steps=4", "logging.every_n_steps=1", "logging.progress=false", "logging.wandb_mode=disabled",
        "eval.tasks=[]", "precision.amp=bf16", "device=cuda"]


def losses(out: Path, name: str, *overrides: str) -> dict:
    run_dir = out / name
    cmd = [sys.executable, str(ROOT / "train.py"), f"data.synthetic_root={out / 'data'}", f"run_dir={run_dir}",
           *BASE, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        print(proc.stdout[-2000:], proc.stderr[-4000:])
        raise SystemExit(f"{name}: train.py failed")
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/pipeline_gpu_check")
    p.add_argument("--amp", default="bf16", choices=["bf16", "fp32"])
    a = p.parse_args()
    out = Path(a.out)
    BASE[BASE.index("precision.amp=bf16")] = f"precision.amp={a.amp}"
    subprocess.run(["rm", "-rf", str(out)])
    bad = 0
    groups = {
        "clip": [("sync", "memory.pipeline_thread=false"), ("sync_again", "memory.pipeline_thread=false"),
                 ("p0", "memory.prefetch_steps=0"), ("p2", "memory.prefetch_steps=2")],
        "lit": [("whole", "model.lock_image=true", "memory.stream_once_inputs=false"),
                ("streamed", "model.lock_image=true", "memory.stream_rows=128")],
    }
    (out / "data").mkdir(parents=True)
    losses(out, "warmup", "steps=1")  # writes the synthetic data once, before the parallel runs
    jobs = [(g, r) for g, runs in groups.items() for r in runs]
    with ThreadPoolExecutor(len(jobs)) as pool:  # independent processes: run them together
        done = dict(zip([(g, r[0]) for g, r in jobs], pool.map(lambda j: losses(out, f"{j[0]}_{j[1][0]}", *j[1][1:]), jobs)))
    for group, runs in groups.items():
        ref_name = runs[0][0]
        ref = done[(group, ref_name)]
        for name, *_ in runs[1:]:
            got = done[(group, name)]
            same = got == ref
            bad += not same
            diff = max(abs(got[k] - ref[k]) for k in ref) if got.keys() == ref.keys() else float("nan")
            print(f"{group} ({a.amp}): {name} vs {ref_name}: {'identical' if same else f'DIFFERENT, max |d loss| {diff:.2e}'}",
                  flush=True)
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
