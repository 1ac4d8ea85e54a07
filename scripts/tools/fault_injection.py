"""Fault injection over the real trainer on CPU: kill -9 at random moments (mid-checkpoint
included), damaged checkpoints (a tampered safetensors too), a concurrent start, NaN weights
and gradients, a collapsed model in the eval command, bad values and weights, half-empty data,
Ctrl-C, a frozen or killed loader worker, signals in the final eval, the shard builder on
hostile folders (bad captions, a FIFO, /dev/zero), the eval command racing checkpoint pruning,
a full disk (a tmpfs; root only), undecodable eval images, ranks started with different
configurations or never joining, malformed counting files, manifests, presets and output
paths, SIGHUP and a closed stdout. Prints a table: case -> outcome.

    python scripts/tools/fault_injection.py                 # every case (~5-10 min on 2 CPU cores)
    python scripts/tools/fault_injection.py --cases kill9 corrupt --seed 3 --keep /tmp/fi

Each case runs ``train.py`` on a micro model and the bundled synthetic data and checks the
outcome the trainer promises (docs/reliability.md): a resumed run's losses equal an
uninterrupted run's exactly; nothing non-finite is ever saved; refusals are one paragraph
and leave the run folder as it was. A case reports ``ok`` or ``FAIL`` with what it saw.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

STEPS = 12
MICRO = [
    "model.name=infclip-micro", "data.synthetic_train=256", "data.synthetic_eval=64",
    "data.synthetic_image_size=32", "data.workers=1", "data.loader_batch=16", "batch.global_size=32",
    "batch.micro_size=16", "logging.every_n_steps=1", "logging.wandb_mode=disabled", "logging.progress=false",
    "device=cpu", "eval.workers=0",
]
COMMON = [f"steps={STEPS}", "checkpoint.every_n_steps=3", "checkpoint.keep_last=4", "eval.tasks=[]"]


class Ctx:
    """Paths and the uninterrupted reference run shared by the cases."""

    def __init__(self, work: Path, seed: int):
        self.work, self.rng = work, random.Random(seed)
        self.data = work / "synthetic"
        self.ref_dir = work / "reference"
        self.reference: dict[int, float] = {}
        self.n = 0

    def cmd(self, run_dir: Path, *overrides: str, micro: Optional[list[str]] = None) -> list[str]:
        return [sys.executable, str(ROOT / "train.py"), f"data.synthetic_root={self.data}",
                f"run_dir={run_dir}", *(MICRO if micro is None else micro), *overrides]

    def fresh(self, name: str) -> Path:
        self.n += 1
        return self.work / f"{self.n:02d}-{name}"


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "INFCLIP_"))}
    e.update(WANDB_MODE="disabled", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return e


def run(cmd: list[str], **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=env(**extra), capture_output=True, text=True, timeout=600)


def start(cmd: list[str], log: Path, **extra: str) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=env(**extra), stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def records(run_dir: Path) -> list[dict]:
    out = []
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def losses(run_dir: Path) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for r in records(run_dir):
        if "loss" in r:
            out.setdefault(r["step"], []).append(r["loss"])
    return out


def last_step(run_dir: Path) -> int:
    return max((r["step"] for r in records(run_dir) if "loss" in r), default=0)


def wait_until(proc: subprocess.Popen, done: Callable[[], bool], timeout: float = 300) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if done():
            return True
        time.sleep(0.001)
    return done()


def checkpoints(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step_") and p.is_dir()) if root.is_dir() else []


def compare(ctx: Ctx, run_dir: Path) -> tuple[bool, str]:
    """Every step logged once, with the reference run's loss."""
    got = losses(run_dir)
    if sorted(got) != sorted(ctx.reference):
        return False, f"steps logged {sorted(got)}"
    dup = [s for s, v in got.items() if len(v) != 1]
    diff = max(abs(v[0] - ctx.reference[s]) for s, v in got.items())
    return (not dup and diff == 0.0), f"losses vs uninterrupted: max abs difference {diff:g}" + (f", duplicates {dup}" if dup else "")


def resumed_from(out: str) -> str:
    line = next((x for x in out.splitlines() if x.startswith("resumed from ")), "")
    return line.split("/")[-1].split(" ")[0] if line else "nothing"


def one_paragraph(proc: subprocess.CompletedProcess) -> bool:
    return proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.startswith("error (")


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# -- cases --------------------------------------------------------------------------------------


def case_kill9(ctx: Ctx) -> tuple[bool, str]:
    run_dir = ctx.fresh("kill9")
    at = ctx.rng.randint(1, STEPS - 1)
    proc = start(ctx.cmd(run_dir, *COMMON), run_dir.with_suffix(".log"))
    wait_until(proc, lambda: last_step(run_dir) >= at)
    time.sleep(ctx.rng.random() * 0.3)  # anywhere inside the following step or checkpoint
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed = last_step(run_dir)
    second = run(ctx.cmd(run_dir, *COMMON))
    ok, detail = compare(ctx, run_dir)
    return ok and second.returncode == 0, f"killed after step {killed}; resumed from {resumed_from(second.stdout)}; {detail}"


def case_kill9_mid_checkpoint(ctx: Ctx) -> tuple[bool, str]:
    run_dir = ctx.fresh("kill9-mid-ckpt")
    proc = start(ctx.cmd(run_dir, *COMMON), run_dir.with_suffix(".log"))
    root = run_dir / "checkpoints"
    hit = wait_until(proc, lambda: root.is_dir() and any(p.name.endswith(".tmp") and p.name != ".step_00000003.tmp"
                                                           for p in root.iterdir()))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    tmp = [p.name for p in root.iterdir() if p.name.endswith(".tmp")] if root.is_dir() else []
    second = run(ctx.cmd(run_dir, *COMMON))
    ok, detail = compare(ctx, run_dir)
    where = f"killed while writing {tmp[0]}" if hit and tmp else "killed (the write had finished: not mid-checkpoint)"
    return ok and second.returncode == 0, f"{where}; resumed from {resumed_from(second.stdout)}; {detail}"


def _copy_reference(ctx: Ctx, name: str, until: int) -> Path:
    run_dir = ctx.fresh(name)
    shutil.copytree(ctx.ref_dir, run_dir)
    for p in checkpoints(run_dir):
        if int(p[5:]) > until:
            shutil.rmtree(run_dir / "checkpoints" / p)
    return run_dir


def case_corrupt(how: str) -> Callable[[Ctx], tuple[bool, str]]:
    def case(ctx: Ctx) -> tuple[bool, str]:
        run_dir = _copy_reference(ctx, f"corrupt-{how}", 9)
        target = run_dir / "checkpoints" / "step_00000009" / ("train.pt" if how == "cut-train.pt" else "model.pt")
        data = target.read_bytes()
        target.write_bytes({"truncate-model.pt": data[: len(data) // 2], "random-model.pt": os.urandom(len(data)),
                            "cut-train.pt": data[:1000]}[how])
        second = run(ctx.cmd(run_dir, *COMMON))
        warned = "skipping damaged checkpoint" in second.stdout
        ok, detail = compare(ctx, run_dir)
        return (ok and warned and second.returncode == 0,
                f"{'warned, ' if warned else 'NO warning, '}resumed from {resumed_from(second.stdout)}; {detail}")
    return case


def _zero_text_projection(path: Path) -> None:
    """Tamper with open_clip_model.safetensors: its text projection zeroed, same size."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(path))
    state["text_projection"] = state["text_projection"] * 0
    save_file(state, str(path), metadata={"format": "pt"})


def eval_cmd(ctx: Ctx, checkpoint: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "infclip.eval", f"checkpoint={checkpoint}", f"synthetic_root={ctx.data}",
            "device=cpu", "eval.workers=0", "log_to_run=false", *overrides]


def case_tampered_safetensors(ctx: Ctx) -> tuple[bool, str]:
    """The eval command and resume verify open_clip_model.safetensors too: fall back."""
    run_dir = _copy_reference(ctx, "tampered-safetensors", 9)
    _zero_text_projection(run_dir / "checkpoints" / "step_00000009" / "open_clip_model.safetensors")
    out = run_dir / "eval.json"
    evaluated = run(eval_cmd(ctx, run_dir, f"output={out}"))
    resolved = json.loads(out.read_text())["resolved"].split("/")[-2] if out.is_file() else "nothing"
    eval_ok = evaluated.returncode == 0 and "open_clip_model.safetensors does not match" in evaluated.stderr
    shutil.move(str(run_dir / "checkpoints" / "step_00000009.damaged"), str(run_dir / "checkpoints" / "step_00000009"))
    second = run(ctx.cmd(run_dir, *COMMON))
    warned = "skipping damaged checkpoint" in second.stdout
    ok, detail = compare(ctx, run_dir)
    return (eval_ok and resolved == "step_00000006" and ok and warned and second.returncode == 0,
            f"eval: exit {evaluated.returncode}, {'warned' if eval_ok else 'NO warning'}, evaluated {resolved}; "
            f"resume: {'warned, ' if warned else 'NO warning, '}resumed from {resumed_from(second.stdout)}; {detail}")


def case_collapsed_model(ctx: Ctx) -> tuple[bool, str]:
    """A model trained into collapse (text projection zero, a consistent checkpoint: its
    manifest rewritten) gets NaN class embeddings; it must not score 100 %."""
    import torch

    from infclip.manifest import write_manifest

    run_dir = _copy_reference(ctx, "collapsed-model", 3)
    step = run_dir / "checkpoints" / "step_00000003"
    state = torch.load(step / "model.pt", weights_only=True)
    state["text_projection"].zero_()
    torch.save(state, step / "model.pt")
    _zero_text_projection(step / "open_clip_model.safetensors")
    write_manifest(step)
    out = run_dir / "eval.json"
    proc = run(eval_cmd(ctx, step, f"output={out}", "tasks=[synthetic_zeroshot]"))
    metrics = json.loads(out.read_text())["metrics"] if out.is_file() else {}
    top1, counted = metrics.get("eval/synthetic_zeroshot/top1"), metrics.get("eval/synthetic_zeroshot/num_nonfinite")
    warned = "scored non-finite similarities" in proc.stderr
    return (proc.returncode == 0 and top1 == 0.0 and bool(counted) and warned,
            f"exit {proc.returncode}; top-1 {top1}; non-finite queries counted: {counted}; warned: {warned}")


def _freeze_worker(ctx: Ctx, name: str, *overrides: str) -> tuple[subprocess.Popen, Path, Path]:
    """Training with its one loader worker SIGSTOPped after step 2 (an NFS stall, a hung pipe:)."""
    run_dir = ctx.fresh(name)
    log = run_dir.with_suffix(".log")
    proc = start(ctx.cmd(run_dir, *COMMON, *overrides), log)
    wait_until(proc, lambda: last_step(run_dir) >= 2)
    children = [c for t in Path(f"/proc/{proc.pid}/task").glob("*/children") for c in t.read_text().split()]
    os.kill(int(children[0]), signal.SIGSTOP)
    return proc, run_dir, log


def case_frozen_worker(ctx: Ctx) -> tuple[bool, str]:
    proc, run_dir, log = _freeze_worker(ctx, "frozen-worker", "data.stall_warn_s=2", "data.stall_abort_s=6")
    rc = proc.wait(timeout=300)
    text = log.read_text()
    warning = next((x for x in text.splitlines() if x.startswith("warning: the data loader")), "")
    stopped, at = checkpoints(run_dir)[-1], last_step(run_dir)
    second = run(ctx.cmd(run_dir, *COMMON))
    ok, detail = compare(ctx, run_dir)
    named = warning.split("it waits on ")[-1].split(";")[0]
    return (ok and rc == 2 and "Traceback" not in text and bool(warning) and stopped == f"step_{at:08d}"
            and second.returncode == 0,
            f"warned: '{named}'; abort exit {rc}, checkpoint {stopped} (last step {at}); resumed; {detail}")


def case_sigterm_frozen_worker(ctx: Ctx) -> tuple[bool, str]:
    proc, run_dir, log = _freeze_worker(ctx, "sigterm-frozen-worker", "data.stall_warn_s=1", "data.stall_abort_s=0")
    wait_until(proc, lambda: "delivered nothing" in log.read_text())
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=300)
    took = time.monotonic() - t0
    stopped, at = checkpoints(run_dir)[-1], last_step(run_dir)
    second = run(ctx.cmd(run_dir, *COMMON))
    ok, detail = compare(ctx, run_dir)
    return (ok and rc == 0 and took < 30 and stopped == f"step_{at:08d}" and second.returncode == 0,
            f"exit {rc} {took:.1f} s after SIGTERM, checkpoint {stopped} (last step {at}); resumed; {detail}")


def case_killed_worker(ctx: Ctx) -> tuple[bool, str]:
    """SIGKILL to the loader worker (the out-of-memory killer): one paragraph, a checkpoint."""
    run_dir = ctx.fresh("killed-worker")
    log = run_dir.with_suffix(".log")
    proc = start(ctx.cmd(run_dir, *COMMON), log)
    wait_until(proc, lambda: last_step(run_dir) >= 2)
    children = [c for t in Path(f"/proc/{proc.pid}/task").glob("*/children") for c in t.read_text().split()]
    os.kill(int(children[0]), signal.SIGKILL)
    rc = proc.wait(timeout=300)
    text = log.read_text()
    stopped, at = checkpoints(run_dir)[-1], last_step(run_dir)
    second = run(ctx.cmd(run_dir, *COMMON))
    ok, detail = compare(ctx, run_dir)
    para = "error (DataError): a data loader worker died" in text and "Traceback" not in text
    return (ok and rc == 2 and para and stopped == f"step_{at:08d}" and second.returncode == 0,
            f"exit {rc}, one paragraph: {para}, checkpoint {stopped} (last step {at}); resumed; {detail}")


def case_long_name(ctx: Ctx) -> tuple[bool, str]:
    proc = run(ctx.cmd(ctx.work / ("x" * 300), *COMMON))
    ok = one_paragraph(proc) and "longer than the file system allows" in proc.stderr
    return ok, f"exit {proc.returncode}, no traceback: {'Traceback' not in proc.stderr}, '{proc.stderr.splitlines()[0][:80]}'"


def case_eval_error(ctx: Ctx) -> tuple[bool, str]:
    proc = run(eval_cmd(ctx, ctx.work / "absent" / "model.pt"))
    ok = one_paragraph(proc) and "does not exist" in proc.stderr
    return ok, f"exit {proc.returncode}, no traceback: {'Traceback' not in proc.stderr}, '{proc.stderr.splitlines()[0][:80]}'"


def case_concurrent(ctx: Ctx) -> tuple[bool, str]:
    run_dir = ctx.fresh("concurrent")
    first = start(ctx.cmd(run_dir, "steps=400", "eval.tasks=[]"), run_dir.with_suffix(".log"))
    wait_until(first, lambda: last_step(run_dir) >= 1)
    second = run(ctx.cmd(run_dir, "steps=400", "eval.tasks=[]"))
    os.killpg(first.pid, signal.SIGTERM)
    rc = first.wait(timeout=300)
    steps = [r["step"] for r in records(run_dir) if "loss" in r]
    ok = one_paragraph(second) and rc == 0 and steps == list(range(1, len(steps) + 1))
    return ok, f"second start: exit {second.returncode}, '{second.stderr.splitlines()[0][:70]}...'; first: exit {rc} after {len(steps)} steps, records in order"


def case_stale_lock(ctx: Ctx) -> tuple[bool, str]:
    run_dir = ctx.fresh("stale-lock")
    proc = start(ctx.cmd(run_dir, *COMMON), run_dir.with_suffix(".log"))
    wait_until(proc, lambda: last_step(run_dir) >= 2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    left = (run_dir / "train.lock").exists()
    second = run(ctx.cmd(run_dir, *COMMON))
    took = "taking over the stale lock" in second.stderr
    ok, detail = compare(ctx, run_dir)
    return ok and left and took and second.returncode == 0, f"lock left by kill -9: {left}; taken over: {took}; {detail}"


def case_nan_weights(ctx: Ctx) -> tuple[bool, str]:
    import torch

    run_dir = ctx.fresh("nan-weights")
    proc = run(ctx.cmd(run_dir, *COMMON, "checkpoint.every_n_steps=1"), INFCLIP_INJECT_NAN_WEIGHTS_AT_STEPS="5")
    names = checkpoints(run_dir)
    finite = all(torch.isfinite(v).all() for n in names for v in torch.load(
        run_dir / "checkpoints" / n / "model.pt", weights_only=True).values() if v.is_floating_point())
    command = next((x.strip() for x in proc.stderr.splitlines() if x.strip().startswith("python train.py")), "")
    again = subprocess.run(["bash", "-c", shlex.quote(sys.executable) + command[len("python"):]], cwd=ROOT, env=env(),
                           capture_output=True, text=True, timeout=600) if command else None
    ok = one_paragraph(proc) and names[-1] == "step_00000004" and finite and again is not None and again.returncode == 0
    return ok, (f"abort exit {proc.returncode}; checkpoints up to {names[-1]}, all finite: {finite}; "
                f"printed resume command (lr/10) exit {again.returncode if again else 'none'}, "
                f"reached step {last_step(run_dir)}")


def case_nan_grads(ctx: Ctx) -> tuple[bool, str]:
    run_dir = ctx.fresh("nan-grads")
    proc = run(ctx.cmd(run_dir, *COMMON), INFCLIP_INJECT_NAN_AT_STEPS="4")
    skipped = [r["step"] for r in records(run_dir) if r.get("skipped_step")]
    return proc.returncode == 0 and skipped == [4], f"exit {proc.returncode}; skipped steps {skipped}; reached {last_step(run_dir)}"


def case_refused(name: str, *overrides: str, expect: str) -> Callable[[Ctx], tuple[bool, str]]:
    def case(ctx: Ctx) -> tuple[bool, str]:
        run_dir = ctx.fresh(name)
        proc = run(ctx.cmd(run_dir, *COMMON, *overrides))
        ok = one_paragraph(proc) and expect in proc.stderr and not run_dir.exists()
        return ok, f"exit {proc.returncode}, no traceback, no run folder: '{proc.stderr.splitlines()[0][:90]}'"
    return case


def case_bad_image_pretrained(ctx: Ctx) -> tuple[bool, str]:
    """A file whose keys match nothing of the image tower: refused, not a random tower trained."""
    import torch

    path = ctx.work / "unrelated-tower.pt"
    torch.save({"encoder.weight": torch.ones(2, 2)}, path)
    return case_refused("image-pretrained", f"model.image_pretrained={path}",
                        expect="match nothing in the tower")(ctx)


def case_new_lr(ctx: Ctx) -> tuple[bool, str]:
    run_dir = _copy_reference(ctx, "new-lr", 6)
    proc = run(ctx.cmd(run_dir, *COMMON, "optim.lr=1e-4"))
    line = next((x for x in proc.stdout.splitlines() if x.startswith("resume: ")), "")
    recorded = [r["changes"] for r in records(run_dir) if r.get("event") == "config_change"]
    return proc.returncode == 0 and "optim.lr" in line and bool(recorded), f"'{line}'; recorded {recorded}"


def case_refused_resume(ctx: Ctx) -> tuple[bool, str]:
    run_dir = _copy_reference(ctx, "refused-resume", STEPS)
    before = snapshot(run_dir)
    proc = run(ctx.cmd(run_dir, *COMMON, "model.name=infclip-tiny"))
    same = snapshot(run_dir) == before
    return one_paragraph(proc) and same, f"exit {proc.returncode}; run folder byte-identical: {same}"


def case_half_empty(ctx: Ctx) -> tuple[bool, str]:
    from infclip.data.stream import StreamSpec, epoch_shards

    folder = ctx.work / "half-empty-shards"
    folder.mkdir()
    for i in range(4):
        if i < 2:
            tarfile.open(folder / f"{i:05d}.tar", "w").close()
        else:
            shutil.copy(ctx.data / "train" / f"{i:05d}.tar", folder / f"{i:05d}.tar")
    urls = [str(folder / f"{i:05d}.tar") for i in range(4)]
    spec = lambda s: StreamSpec(urls, [1.0] * 4, False, s, 0, 1, 16, 2, 0, streams=2)  # noqa: E731
    seed = next(s for s in range(100) if sorted(Path(u).name for u in epoch_shards(spec(s), 0, 0))
                == ["00000.tar", "00001.tar"])  # one worker's whole share is the two empty shards
    run_dir = ctx.fresh("half-empty")
    micro = [o for o in MICRO if not o.startswith("data.workers")]
    proc = run(ctx.cmd(run_dir, "data.kind=wds", f"data.shards='{folder}/{{00000..00003}}.tar'", "data.num_samples=32",
                       "data.workers=2", f"seed={seed}", "steps=4", "eval.tasks=[]", micro=micro))
    skips = next((r["summary"]["skipped_samples"] for r in records(run_dir) if "summary" in r), {})
    return proc.returncode == 0 and last_step(run_dir) == 4, f"exit {proc.returncode}; trained {last_step(run_dir)} steps; counted {skips}"


def case_sigterm_final_eval(ctx: Ctx) -> tuple[bool, str]:
    run_dir = ctx.fresh("sigterm-final-eval")
    proc = start(ctx.cmd(run_dir, "steps=6", "checkpoint.every_n_steps=4", "eval.batch_size=1"),
                 run_dir.with_suffix(".log"))
    wait_until(proc, lambda: last_step(run_dir) >= 6)
    time.sleep(0.5)  # inside the final eval (about 2 s with eval.batch_size=1)
    os.killpg(proc.pid, signal.SIGTERM)
    rc = proc.wait(timeout=300)
    names = checkpoints(run_dir)
    evals = next((sorted(k for k in r["summary"] if k.startswith("eval/") and k.endswith("top1"))
                  for r in records(run_dir) if "summary" in r), [])
    return rc == 0 and names[-1:] == ["step_00000006"], f"exit {rc}; checkpoints {names}; final eval finished: {evals}"


def case_stop_signal(sig: int) -> Callable[[Ctx], tuple[bool, str]]:
    def case(ctx: Ctx) -> tuple[bool, str]:
        run_dir = ctx.fresh(signal.Signals(sig).name.lower())
        log = run_dir.with_suffix(".log")
        proc = start(ctx.cmd(run_dir, *COMMON), log)
        wait_until(proc, lambda: last_step(run_dir) >= ctx.rng.randint(1, STEPS - 2))
        os.killpg(proc.pid, sig)  # the whole group, as a terminal's Ctrl-C or scancel does
        rc = proc.wait(timeout=300)
        stopped, at = checkpoints(run_dir)[-1], last_step(run_dir)
        clean = "Traceback" not in log.read_text()
        second = run(ctx.cmd(run_dir, *COMMON))
        ok, detail = compare(ctx, run_dir)
        return (ok and rc == 0 and clean and stopped == f"step_{at:08d}" and second.returncode == 0,
                f"exit {rc}, checkpoint {stopped} (last step {at}), traceback: {not clean}; resumed; {detail}")
    return case


def case_double_sigint(ctx: Ctx) -> tuple[bool, str]:
    """Two Ctrl-C: the second exits at once (130); the next start removes a leftover
    .step_N.tmp with one line and resumes from the newest complete checkpoint."""
    run_dir = ctx.fresh("double-sigint")
    proc = start(ctx.cmd(run_dir, *COMMON), run_dir.with_suffix(".log"))
    root = run_dir / "checkpoints"
    wait_until(proc, lambda: root.is_dir() and any(p.name.endswith(".tmp") and p.name != ".step_00000003.tmp"
                                                    for p in root.iterdir()))
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    rc = proc.wait(timeout=300)
    left = sorted(p.name for p in root.iterdir() if p.name.endswith(".tmp"))
    second = run(ctx.cmd(run_dir, *COMMON))
    removed = next((x for x in second.stdout.splitlines() if x.startswith("removed .step_")), "")
    ok, detail = compare(ctx, run_dir)
    return (ok and rc == 130 and second.returncode == 0 and (removed != "" or not left),
            f"exit {rc}; left {left or 'no temp folder'}; next start: '{removed[:60] or 'nothing to remove'}'; "
            f"resumed from {resumed_from(second.stdout)}; {detail}")



def _build_shards(src: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "data" / "build_shards.py"), str(src), "--out", str(out), "--workers", "2",
           *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)


def case_build_bad_captions(ctx: Ctx) -> tuple[bool, str]:
    """A caption that is not UTF-8, a folder named x.txt, a .gif, a ..jpg: counted, not fatal."""
    src = ctx.fresh("build-bad-captions")
    src.mkdir()
    _jpeg(src / "good.jpg", b"fine")
    _jpeg(src / "latin1.jpg", "caf\xe9".encode("latin-1"))
    _jpeg(src / "dir.jpg")
    (src / "dir.txt").mkdir()
    _jpeg(src / "anim.gif", b"a gif")
    _jpeg(src / "..jpg", b"hidden")
    proc = _build_shards(src, src.with_suffix(".out"))
    stats = src.with_suffix(".out") / "build_stats.json"
    skipped = json.loads(stats.read_text())["skipped"] if stats.is_file() else {}
    want = {"caption_not_utf8": 1, "caption_not_regular_file": 1, "unknown_extension": 1, "hidden_file": 1}
    return (proc.returncode == 0 and skipped == want and "Traceback" not in proc.stderr,
            f"exit {proc.returncode}; {proc.stdout.splitlines()[0][:40] if proc.stdout else ''}...; counted {skipped}")


def case_build_fifo(ctx: Ctx) -> tuple[bool, str]:
    """A FIFO image, a FIFO caption and /dev/zero behind a link: counted, never read (with
    --follow-links, so the link's target is looked at; without it the link is skipped as
    leading outside the input folder)."""
    src = ctx.fresh("build-fifo")
    src.mkdir()
    _jpeg(src / "good.jpg", b"fine")
    os.mkfifo(src / "pipe.jpg")
    (src / "pipe.txt").write_text("a FIFO")
    _jpeg(src / "fifo-caption.jpg")
    os.mkfifo(src / "fifo-caption.txt")
    os.symlink("/dev/zero", src / "zero.jpg")
    (src / "zero.txt").write_text("/dev/zero")
    t0 = time.monotonic()
    try:
        proc = _build_shards(src, src.with_suffix(".out"), "--follow-links")
    except subprocess.TimeoutExpired:
        return False, "hung for 120 s"
    took = time.monotonic() - t0
    stats = src.with_suffix(".out") / "build_stats.json"
    skipped = json.loads(stats.read_text())["skipped"] if stats.is_file() else {}
    want = {"image_not_regular_file": 2, "caption_not_regular_file": 1}
    return (proc.returncode == 0 and skipped == want,
            f"exit {proc.returncode} in {took:.1f} s; counted {skipped}")


def _jpeg(path: Path, caption: Optional[bytes] = None) -> None:
    """A small valid JPEG at ``path`` (+ its sidecar caption bytes)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 30, 30)).save(buf, format="JPEG")
    path.write_bytes(buf.getvalue())
    if caption is not None:
        path.with_suffix(".txt").write_bytes(caption)


def case_eval_while_pruning(ctx: Ctx) -> tuple[bool, str]:
    """The eval command on a run folder while it trains with keep_last=1, a checkpoint every step."""
    run_dir = ctx.fresh("eval-while-pruning")
    proc = start(ctx.cmd(run_dir, "steps=400", "eval.tasks=[]", "checkpoint.every_n_steps=1",
                         "checkpoint.keep_last=1"), run_dir.with_suffix(".log"))
    wait_until(proc, lambda: len(checkpoints(run_dir)) > 0)
    results, fell_back = [], 0
    for i in range(6):
        out = run_dir.with_name(f"{run_dir.name}-eval{i}.json")
        ev = run(eval_cmd(ctx, run_dir, f"output={out}", "tasks=[synthetic_zeroshot]", "eval.batch_size=64"))
        fell_back += ev.stderr.count("was removed while it was")
        results.append((ev.returncode, out.is_file(), "Traceback" in ev.stderr))
    training = proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=300)
    in_cwd = (ROOT / "eval_results.json").exists()
    ok = all(r == (0, True, False) for r in results) and training and not in_cwd
    return ok, (f"6 evals while training: exits {[r[0] for r in results]}, results written {sum(r[1] for r in results)}"
                f"; fell back to a newer checkpoint {fell_back} time(s); still training: {training}; "
                f"eval_results.json in the cwd: {in_cwd}")


def case_disk_full(ctx: Ctx) -> tuple[bool, str]:
    """run_dir on a tmpfs with room for 2.5 checkpoints: the third save does not fit."""
    if os.geteuid() != 0:
        return True, "skipped: a full disk needs a tmpfs mount, which needs root"
    step = ctx.ref_dir / "checkpoints" / "step_00000003"
    size = sum(f.stat().st_size for f in step.rglob("*") if f.is_file())
    disk = ctx.fresh("disk-full")
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(2.5 * size) + (1 << 20)}", "tmpfs",
                              str(disk)], capture_output=True, text=True)
    if mounted.returncode != 0:
        return True, f"skipped: cannot mount a tmpfs here ({mounted.stderr.strip()[:80]})"
    try:
        run_dir = disk / "run"
        first = run(ctx.cmd(run_dir, *COMMON))
        left = [p.name for p in (run_dir / "checkpoints").glob(".step_*")]
        from infclip.train.checkpoint import verify_checkpoint

        kept = {p: verify_checkpoint(run_dir / "checkpoints" / p, 1) for p in checkpoints(run_dir)}
        subprocess.run(["mount", "-o", f"remount,size={int(8 * size)}", str(disk)], check=True)
        second = run(ctx.cmd(run_dir, *COMMON))
        ok, detail = compare(ctx, run_dir)
        para = one_paragraph(first) and "checkpoint.keep_last + 1" in first.stderr
        return (ok and para and not left and all(v is None for v in kept.values()) and second.returncode == 0,
                f"exit {first.returncode}, one paragraph: {para} ('{first.stderr[:70]}...'); temp folders left: "
                f"{left or 'none'}; intact: {sorted(kept)}; room again, resumed: exit {second.returncode}; {detail}")
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def case_slurm_preemption(ctx: Ctx) -> tuple[bool, str]:
    """A 2-rank CPU job on a real one-node Slurm cluster (scripts/slurm/local_cluster.sh),
    Slurm's USR1 warning mid-run: checkpoint, requeue by the batch script, resume."""
    state = ctx.fresh("slurm-state")
    cluster = ROOT / "scripts" / "slurm" / "local_cluster.sh"
    up = subprocess.run([str(cluster), "start", str(state)], capture_output=True, text=True, timeout=420)
    if up.returncode != 0:
        return True, f"skipped: no local Slurm cluster ({up.stderr.strip()[-100:]})"
    slurm_env = env(SLURM_CONF=str(state / "slurm.conf"))
    try:
        run_dir, log = ctx.fresh("slurm-run"), ctx.fresh("slurm.log")
        overrides = [o for o in ctx.cmd(run_dir, *COMMON)[2:]]
        sub = subprocess.run(["sbatch", "--gpus-per-node=2", "--cpus-per-task=2", f"--output={log}",
                              str(ROOT / "scripts" / "slurm" / "train.sbatch"), *overrides],
                             cwd=ROOT, env=slurm_env, capture_output=True, text=True, timeout=60)
        job = sub.stdout.split()[-1] if sub.returncode == 0 else None
        if job is None:
            return False, f"sbatch failed: {sub.stderr.strip()[:120]}"
        queued = lambda: subprocess.run(["squeue", "-h", "-j", job], env=slurm_env, capture_output=True,  # noqa: E731
                                        text=True).stdout.strip()
        deadline = time.monotonic() + 300
        while last_step(run_dir) < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm_env, check=True)
        deadline = time.monotonic() + 600
        while queued() and time.monotonic() < deadline:
            time.sleep(1)
        text = log.read_text() if log.exists() else ""
        got = losses(run_dir)
        once = sorted(got) == list(range(1, STEPS + 1)) and all(len(v) == 1 for v in got.values())
        clean = "Traceback" not in text and "srun: error" not in text
        ok = once and clean and "requeueing job" in text and "resumed from" in text
        return ok, (f"job {job}: USR1 after step 3; requeued: {'requeueing job' in text}; resumed: "
                    f"{'resumed from' in text}; every step logged once: {once}; log free of tracebacks and "
                    f"srun errors: {clean}")
    finally:
        subprocess.run(["scancel", "--user=root"], env=slurm_env, capture_output=True)
        subprocess.run([str(cluster), "stop", str(state)], capture_output=True, timeout=60)


# -- bad input and unreachable peers ------------------------------------------------------------


def _png(path: Path, ident: int) -> None:
    from PIL import Image

    Image.new("RGB", (32, 32), (8 * ident, 40, 90)).save(path)


def case_eval_bad_images(ctx: Ctx) -> tuple[bool, str]:
    """An image-folder task with a corrupt JPEG and a FIFO, read by 2 loader workers: skipped and
    counted, no hang (bounded here at 240 s), no worker left behind."""
    root = ctx.work / "bad-image-folder"
    for c in ("cat", "dog"):
        (root / c).mkdir(parents=True)
        for i in range(2):
            _png(root / c / f"{i}.png", i)
    (root / "dog" / "bad.jpg").write_bytes(b"\xff\xd8\xff\xe0" + os.urandom(3000))
    os.mkfifo(root / "cat" / "fifo.jpg")
    task = f"tasks=[{{name: folder, kind: zeroshot, format: imagefolder, root: '{root}'}}]"
    out = ctx.work / "bad-images.json"
    cmd = eval_cmd(ctx, ctx.ref_dir, task, f"output={out}", "eval.workers=2")
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        return False, "the eval command hung (240 s)"
    metrics = json.loads(out.read_text())["metrics"] if out.is_file() else {}
    skipped = metrics.get("eval/folder/num_skipped_images")
    ok = proc.returncode == 0 and skipped == 1 and "1 images could not be read or decoded" in proc.stderr
    return ok, f"exit {proc.returncode}; skipped {skipped}; scored {metrics.get('eval/folder/num_samples')} images"


def _by_hand(ctx: Ctx, run_dir: Path, rank: int, world: int, port: int, *overrides: str) -> subprocess.Popen:
    extra = dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port))
    return subprocess.Popen(ctx.cmd(run_dir, "eval.tasks=[]", *overrides), cwd=ROOT, env=env(**extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def case_ranks_differ(ctx: Ctx) -> tuple[bool, str]:
    """Two ranks started by hand with steps=5 and steps=8: both refuse, naming the key."""
    run_dir, port = ctx.fresh("ranks-differ"), _free_port()
    procs = [_by_hand(ctx, run_dir, r, 2, port, f"steps={n}") for r, n in ((0, 5), (1, 8))]
    outs = [p.communicate(timeout=300)[1] for p in procs]
    named = all("differs from rank 0 in steps (5 on rank 0, 8 on rank 1)" in e for e in outs)
    ok = named and all(p.returncode == 2 and "Traceback" not in e for p, e in zip(procs, outs))
    return ok, f"exits {[p.returncode for p in procs]}; both named steps: {named}"


def case_peer_never_comes(ctx: Ctx) -> tuple[bool, str]:
    """WORLD_SIZE=2 with rank 0 alone and dist.join_timeout_s=20: says so, ends with exit 2."""
    t = time.perf_counter()
    proc = _by_hand(ctx, ctx.fresh("peer-never-comes"), 0, 2, _free_port(), "steps=2", "dist.join_timeout_s=20")
    err = proc.communicate(timeout=300)[1]
    secs = time.perf_counter() - t
    said = "still waiting for the other ranks" in err and "dist.join_timeout_s" in err
    ok = proc.returncode == 2 and said and "Traceback" not in err
    return ok, f"exit {proc.returncode} after {secs:.0f} s; said so: {said}"


def case_bad_sizes_json(ctx: Ctx) -> tuple[bool, str]:
    """Shards whose sizes.json claims negative counts: refused at preflight, one paragraph."""
    folder = ctx.work / "bad-sizes"
    folder.mkdir()
    for i in range(2):
        shutil.copy(ctx.data / "train" / f"{i:05d}.tar", folder / f"{i:05d}.tar")
    (folder / "sizes.json").write_text('{"00000.tar": -5, "00001.tar": 5}')
    run_dir = ctx.fresh("bad-sizes")
    proc = run(ctx.cmd(run_dir, "data.kind=wds", f"data.shards='{folder}/{{00000..00001}}.tar'", *COMMON))
    ok = one_paragraph(proc) and "not a sample count" in proc.stderr and not run_dir.exists()
    return ok, f"exit {proc.returncode}, no run folder: {not run_dir.exists()}, '{proc.stderr.splitlines()[0][:90]}'"


def case_malformed_manifest(ctx: Ctx) -> tuple[bool, str]:
    """The newest checkpoint's manifest.json is {"files": []}: set aside, resumed from the previous."""
    run_dir = _copy_reference(ctx, "malformed-manifest", 9)
    (run_dir / "checkpoints" / "step_00000009" / "manifest.json").write_text('{"files": []}')
    second = run(ctx.cmd(run_dir, *COMMON))
    ok, detail = compare(ctx, run_dir)
    warned = "manifest.json is malformed" in second.stdout + second.stderr
    return (ok and warned and second.returncode == 0 and resumed_from(second.stdout) == "step_00000006",
            f"warned: {warned}; resumed from {resumed_from(second.stdout)}; {detail}")


def case_eval_output_through_a_file(ctx: Ctx) -> tuple[bool, str]:
    (ctx.work / "a-file").write_text("x")
    proc = run(eval_cmd(ctx, ctx.ref_dir, f"output={ctx.work / 'a-file' / 'eval.json'}"))
    ok = one_paragraph(proc) and "nothing was evaluated" in proc.stderr and "top1" not in proc.stdout
    return ok, f"exit {proc.returncode}, table printed: {'top1' in proc.stdout}, '{proc.stderr.splitlines()[0][:90]}'"


def case_broken_preset(ctx: Ctx) -> tuple[bool, str]:
    presets = ctx.work / "presets"
    (presets / "experiment").mkdir(parents=True)
    (presets / "experiment" / "mine.yaml").write_text("steps: [1, 2\n")
    run_dir = ctx.fresh("broken-preset")
    proc = run(ctx.cmd(run_dir, "--config-dir", str(presets), "experiment=mine", *COMMON))
    ok = proc.returncode == 2 and "is not valid YAML" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    return ok, f"exit {proc.returncode}, {len(proc.stderr.strip().splitlines())} line(s) on stderr"


def case_export_out_is_a_file(ctx: Ctx) -> tuple[bool, str]:
    (ctx.work / "export-file").write_text("x")
    proc = run([sys.executable, "-m", "infclip.export", str(ctx.ref_dir), "--out", str(ctx.work / "export-file")])
    ok = (proc.returncode == 2 and "Traceback" not in proc.stderr
          and "cannot be used as the output folder" in proc.stderr)
    return ok, f"exit {proc.returncode}, '{proc.stderr.strip()[:90]}'"


def case_build_shard_size_zero(ctx: Ctx) -> tuple[bool, str]:
    src = ctx.work / "build-args"
    src.mkdir()
    _jpeg(src / "a.jpg", b"a caption")
    proc = run([sys.executable, str(ROOT / "data" / "build_shards.py"), str(src), "--out", str(ctx.work / "o"),
                "--shard-size", "0"])
    ok = proc.returncode == 2 and proc.stderr.strip() == "error: --shard-size 0: must be > 0"
    return ok, f"exit {proc.returncode}, '{proc.stderr.strip()[:90]}'"


def case_closed_stdout(ctx: Ctx) -> tuple[bool, str]:
    """train.py | head -1: training goes on, checkpoints and metrics.jsonl complete."""
    run_dir = ctx.fresh("closed-stdout")
    proc = subprocess.Popen(ctx.cmd(run_dir, *COMMON), cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    rc = proc.wait(timeout=600)
    ok, detail = compare(ctx, run_dir)
    return ok and rc == 0 and "BrokenPipeError" not in err, f"exit {rc}; {detail}"


CASES: dict[str, Callable[[Ctx], tuple[bool, str]]] = {
    "kill9 at a random moment (1)": case_kill9,
    "kill9 at a random moment (2)": case_kill9,
    "kill9 at a random moment (3)": case_kill9,
    "kill9 mid-checkpoint": case_kill9_mid_checkpoint,
    "sigterm mid-run, resume": case_stop_signal(signal.SIGTERM),
    "ctrl-c (SIGINT) mid-run, resume": case_stop_signal(signal.SIGINT),
    "two ctrl-c mid-checkpoint, resume": case_double_sigint,
    "corrupt newest: truncated model.pt": case_corrupt("truncate-model.pt"),
    "corrupt newest: random-bytes model.pt": case_corrupt("random-model.pt"),
    "corrupt newest: train.pt cut to 1000 B": case_corrupt("cut-train.pt"),
    "tampered open_clip_model.safetensors (eval, resume)": case_tampered_safetensors,
    "collapsed model (NaN class embeddings), eval": case_collapsed_model,
    "frozen loader worker (SIGSTOP)": case_frozen_worker,
    "sigterm while the loader worker is frozen": case_sigterm_frozen_worker,
    "killed loader worker (SIGKILL)": case_killed_worker,
    "eval command: a checkpoint that does not exist": case_eval_error,
    "run name too long for the file system": case_long_name,
    "concurrent start on one run_dir": case_concurrent,
    "stale lock after kill9": case_stale_lock,
    "NaN injected into the weights": case_nan_weights,
    "NaN injected into the gradients": case_nan_grads,
    "optim.lr=inf": case_refused("lr-inf", "optim.lr=inf", expect="optim.lr=inf is not a finite number"),
    "+optim.lrr=1 (typo added with +)": case_refused("plus-typo", "+optim.lrr=1", expect="did you mean optim.lr?"),
    "model.image_pretrained whose keys match nothing": case_bad_image_pretrained,
    "model.pretrained=no-such-tag": case_refused("pretrained-tag", "model.pretrained=no-such-tag",
                                                 expect="model.pretrained='no-such-tag' cannot be loaded"),
    "resume with a new optim.lr": case_new_lr,
    "resume with another model.name": case_refused_resume,
    "half of the shards empty": case_half_empty,
    "sigterm during the final eval": case_sigterm_final_eval,
    "build_shards: bad captions, .gif, ..jpg": case_build_bad_captions,
    "build_shards: a FIFO and /dev/zero in the input": case_build_fifo,
    "eval command while training prunes (keep_last=1)": case_eval_while_pruning,
    "disk full (tmpfs) while a checkpoint is written": case_disk_full,
    "Slurm USR1 warning on a real one-node cluster (2 ranks)": case_slurm_preemption,
    "eval: a corrupt JPEG and a FIFO in an image folder (2 workers)": case_eval_bad_images,
    "two ranks by hand with steps=5 and steps=8": case_ranks_differ,
    "WORLD_SIZE=2, the second rank never comes": case_peer_never_comes,
    "sizes.json with a negative count": case_bad_sizes_json,
    "newest manifest.json of the wrong shape": case_malformed_manifest,
    "eval output= through a regular file": case_eval_output_through_a_file,
    "a --config-dir preset that is not YAML": case_broken_preset,
    "experiment=nosuch": case_refused("no-preset", "experiment=nosuch", expect="no such preset"),
    "name=../../x": case_refused("name-escape", "run_dir=null", "name=../../x", expect="plain folder name"),
    "export --out an existing file": case_export_out_is_a_file,
    "build_shards --shard-size 0": case_build_shard_size_zero,
    "SIGHUP (closed terminal) mid-run, resume": case_stop_signal(signal.SIGHUP),
    "stdout closed by its reader (head -1)": case_closed_stdout,
}


def reference(ctx: Ctx) -> None:
    proc = run(ctx.cmd(ctx.ref_dir, *COMMON))
    if proc.returncode != 0:
        sys.exit(f"the reference run failed:\n{proc.stderr[-3000:]}")
    ctx.reference = {s: v[0] for s, v in losses(ctx.ref_dir).items()}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="*", default=None, help="substrings of case names to run (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random kill moments")
    p.add_argument("--keep", default=None, help="work folder to keep (default: a temporary one, removed)")
    a = p.parse_args(argv)
    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="infclip-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(work, a.seed)
    chosen = {k: v for k, v in CASES.items() if not a.cases or any(c in k for c in a.cases)}
    t0 = time.perf_counter()
    reference(ctx)
    rows = []
    for name, case in chosen.items():
        t = time.perf_counter()
        try:
            ok, detail = case(ctx)
        except Exception as e:  # a case that breaks is a finding, not the end of the table
            ok, detail = False, f"{type(e).__name__}: {e}"
        rows.append((name, "ok" if ok else "FAIL", detail, time.perf_counter() - t))
        print(f"{rows[-1][1]:4} {name}: {detail}", file=sys.stderr, flush=True)
    print("| case | outcome | what happened | s |\n|---|---|---|---|")
    for name, outcome, detail, secs in rows:
        print(f"| {name} | {outcome} | {detail.replace('|', '/')} | {secs:.0f} |")
    print(f"\n{sum(r[1] == 'ok' for r in rows)}/{len(rows)} ok in {time.perf_counter() - t0:.0f} s "
          f"(seed {a.seed}, {sys.platform}, CPU)")
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r[1] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
