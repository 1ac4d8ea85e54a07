"""Metrics sinks: terminal progress, a JSON-lines file in the run directory, wandb, TensorBoard.

Only rank 0 writes, and nothing before ``start`` (a refused start leaves the run folder
as it was). The JSON-lines file is appended (a resumed run continues it, after dropping the
records of the steps it replays) and holds everything wandb gets, so nothing depends on
wandb. wandb never prompts: its mode is online/offline/disabled from config, and a resumed
run reuses the stored run id. TensorBoard (``logging.tensorboard``) gets the numbers wandb
gets, under ``<run_dir>/tensorboard/``; a resumed run purges the replayed steps' events.
"""

from __future__ import annotations

import errno
import json
import math
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import torch


def _num(v: Any) -> str:
    """One format for every number of a progress line: whole numbers from 1000 on (never
    ``4.556e+04`` beside ``8097``), 4 significant digits below (``0.0001000``, ``2.000``)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return str(v)
    if isinstance(v, int) or abs(v) >= 1000:
        return f"{v:.0f}"
    return f"{v:#.4g}"


def _fmt(key: str, v: Any) -> str:
    return f"{key}={_num(v)}"


def clock(seconds: float) -> str:
    """``H:MM:SS``."""
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def eval_table(step: int, metrics: dict[str, Any]) -> list[str]:
    """The eval metrics of a record as a short table: one line per task."""
    tasks: dict[str, list[str]] = {}
    for key, value in metrics.items():
        if key.startswith("eval/") and _shown(key) and key.count("/") >= 2:
            task, name = key[len("eval/"):].rsplit("/", 1)
            tasks.setdefault(task, []).append(f"{name} {_num(value) if not isinstance(value, float) else f'{value:.4f}'}")
    if not tasks:
        return []
    width = max(len(t) for t in tasks)
    return [f"eval at step {step}:"] + [f"  {task:<{width}}  " + "  ".join(vals) for task, vals in tasks.items()]


class MetricsLogger:
    def __init__(self, run_dir: Path, cfg: Any, enabled: bool, total_steps: int, config_dict: dict):
        self.enabled, self.total = enabled, total_steps
        self.path = run_dir / "metrics.jsonl"
        self.run_dir, self.cfg, self.config_dict = run_dir, cfg, config_dict
        self._wandb = None
        self._wandb_started = False
        self._tb = None  # SummaryWriter, opened by ``start`` when logging.tensorboard
        self._bar = None
        self._t0, self._step0 = time.perf_counter(), 0  # this process's first step (set_start): elapsed
        self._pace: Optional[tuple[float, int]] = None  # (time, step) of this process's first progress line: ETA
        if not enabled:
            return
        if cfg.progress and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, dynamic_ncols=True, desc="train")

    def _ensure_wandb(self) -> None:
        """wandb starts with the first record (it writes into the run folder)."""
        if not self._wandb_started and self.cfg.wandb_mode != "disabled":
            self._wandb = _init_wandb(self.run_dir, self.cfg, self.config_dict)
        self._wandb_started = True

    def start(self, step: int, info: dict[str, Any], changes: Optional[dict] = None) -> None:
        """An accepted start at ``step``: drops the records of later steps (they belong to a
        run segment lost to a kill, and are about to be replayed), then the start record and
        any config changes applied on resume (``{"event": "config_change", ...}``)."""
        if not self.enabled:
            return
        self.drop_after(step)
        if getattr(self.cfg, "tensorboard", False):
            self._tb = _open_tensorboard(self.run_dir, step)
        self.log_run_info(info)
        if changes:
            self._append({"event": "config_change", "step": step, "time": time.time(), "changes": changes})

    def drop_after(self, step: int) -> int:
        """Rewrites metrics.jsonl (atomically) without step records past ``step``; returns
        how many were dropped. Records without a step (start events) are kept."""
        if not self.enabled or not self.path.exists():
            return 0
        kept, dropped, damaged = [], 0, []
        for number, line in enumerate(self.path.read_text(errors="replace").splitlines(), 1):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1  # a line cut short by a kill
                damaged.append(number)
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] > step:
                dropped += 1
            else:
                kept.append(line)
        if damaged:  # said, not silently dropped: a damaged line in the middle is not a kill's cut
            print(f"warning: {self.path}: dropped {len(damaged)} line(s) that are not JSON records (line "
                  f"{', '.join(map(str, damaged[:5]))}{' ...' if len(damaged) > 5 else ''}; a line cut short by "
                  "a kill is expected)", file=sys.stderr, flush=True)
        if dropped:
            self._rewrite("".join(line + "\n" for line in kept))
        return dropped

    def _rewrite(self, text: str) -> None:
        """metrics.jsonl becomes ``text`` (never longer than it was): atomically through a
        copy, or, when the disk has no room for a copy, in place (no new blocks needed)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(text)
            os.replace(tmp, self.path)
            return
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
        print(f"warning: no room for a copy of {self.path} on its disk: rewritten in place", flush=True)
        with open(self.path, "r+") as f:
            f.write(text)
            f.truncate()

    def _append(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=_json_default) + "\n")

    def log_run_info(self, info: dict[str, Any]) -> None:
        """One ``{"event": "start", ...}`` record per process start (a resumed run appends
        another), and the same facts in the wandb run config."""
        if not self.enabled:
            return
        self._ensure_wandb()
        with open(self.path, "a+b") as f:  # a record cut short by a kill must not swallow ours
            if f.tell() and (f.seek(-1, os.SEEK_END), f.read(1))[1] != b"\n":
                f.write(b"\n")
        with open(self.path, "a") as f:
            f.write(json.dumps({"event": "start", "time": time.time(), **info}, default=_json_default) + "\n")
        if self._wandb is not None:
            self._wandb.config.update({"run": info}, allow_val_change=True)

    def set_start(self, step: int) -> None:
        """Training starts (or resumes) at ``step`` now: the origin of elapsed time and ETA."""
        self._t0, self._step0, self._pace = time.perf_counter(), step, None
        if self._bar is not None:
            self._bar.n = step
            self._bar.refresh()

    def log(self, step: int, metrics: dict[str, Any], echo: bool = True) -> None:
        if not self.enabled:
            return
        self._ensure_wandb()
        self._append({"step": step, "time": time.time(), **metrics})
        if self._wandb is not None:
            self._wandb.log(_scalars(metrics), step=step)
        if self._tb is not None:
            for key, value in _scalars(metrics).items():
                self._tb.add_scalar(key, value, global_step=step)
        if echo:
            self._echo(step, metrics)

    def _echo(self, step: int, metrics: dict[str, Any]) -> None:
        """A step record as one short line (the epoch, this process's elapsed time and the ETA at
        the end); its eval metrics, if any, as a table. The ETA paces the steps after this
        process's first progress line, whose steps carry compilation and warm-up (a compiled
        ViT-B/32's first step takes 16-150 s, the next ones under 1 s), so that line has none."""
        shown = {k: v for k, v in metrics.items() if _shown(k) and not k.startswith("eval/")
                 and not (k == "gpu_mem_gb" and not v)}  # no GPU: no GPU memory to show
        if shown:
            now = time.perf_counter()
            timing = [f"epoch={metrics['epoch']:.2f}"] if "epoch" in metrics else []
            if step > self._step0:
                timing.append(f"elapsed={clock(now - self._t0)}")
                timing += self._eta(now, step)
            self.write(f"step {step:>6}/{self.total}  " + "  ".join([*(_fmt(k, v) for k, v in shown.items()),
                                                                     *timing]))
        for line in eval_table(step, metrics):
            self.write(line)

    def _eta(self, now: float, step: int) -> list[str]:
        """``["eta=H:MM:SS"]`` at the pace since the first progress line (which sets it and gets none)."""
        if self._pace is None:
            self._pace = (now, step)
            return []
        since, first = self._pace
        return [f"eta={clock((now - since) / (step - first) * (self.total - step))}"] if step > first else []

    @property
    def first_step(self) -> int:
        """The step this process started (or resumed) from (``set_start``)."""
        return self._step0

    def run_time(self) -> tuple[float, int]:
        """(seconds, starts) of the whole run so far from metrics.jsonl: each process start
        counts from its start record to its last record (the gaps between starts do not)."""
        total, starts, begin, last = 0.0, 0, None, None
        if not self.enabled or not self.path.exists():
            return 0.0, 0
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("event") == "start":
                total += (last - begin) if begin is not None and last is not None else 0.0
                starts, begin, last = starts + 1, rec.get("time"), rec.get("time")
            elif isinstance(rec.get("time"), (int, float)):
                last = rec["time"]
        total += (last - begin) if begin is not None and last is not None else 0.0
        return total, starts

    def progress(self, step: int, metrics: dict[str, Any]) -> None:
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in metrics.items()}, refresh=True)

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()


_TERMINAL_KEYS = ("loss", "lr", "logit_scale", "samples_per_s", "data_wait_pct", "loader_samples_per_s",
                  "decode_imgs_per_s", "decode_busy_pct", "decode_busy_first_pct", "loader_cpu_decoded_per_s",
                  "gpu_mem_gb", "skipped_samples")
_BOOKKEEPING = ("_chance", "num_samples", "num_classes", "num_images", "num_texts", "seconds")


def _shown(key: str) -> bool:
    """Terminal lines stay short; the metrics file gets everything."""
    if key.startswith("eval/"):
        return not key.endswith(_BOOKKEEPING)
    return key in _TERMINAL_KEYS


def _json_default(o: Any) -> Any:
    if isinstance(o, torch.Tensor):
        return o.item()
    return str(o)


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers of a record (what wandb and TensorBoard get; nested summaries are not)."""
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float))}


def _open_tensorboard(run_dir: Path, step: int):
    """A SummaryWriter on ``<run_dir>/tensorboard``; resuming at ``step`` > 0 purges the events
    of later steps (a killed segment's, about to be replayed), as metrics.jsonl drops them."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(run_dir / "tensorboard"), purge_step=step + 1 if step else None)


def _init_wandb(run_dir: Path, cfg: Any, config_dict: dict):
    import wandb

    id_file = run_dir / "wandb_id.txt"
    run_id: Optional[str] = id_file.read_text().strip() if id_file.exists() else None
    if run_id is None:
        run_id = uuid.uuid4().hex[:12]  # wandb.util.generate_id is gone from recent wandb
        id_file.write_text(run_id)
    return wandb.init(
        project=cfg.wandb_project, entity=cfg.wandb_entity, mode=cfg.wandb_mode, id=run_id,
        resume="allow", dir=str(run_dir), config=config_dict, name=run_dir.name,
    )


def git_commit() -> dict[str, Any]:
    """The source tree's commit and whether it had uncommitted changes ({} outside git)."""
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if sha.returncode != 0:
        return {}
    return {"git_commit": sha.stdout.strip(), "git_dirty": bool(dirty.stdout.strip())}


def run_info(overrides: list[str], info: Any) -> dict[str, Any]:
    """Facts about this process start: git commit, command-line overrides, world, Slurm job."""
    slurm = {k: os.environ[k] for k in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_JOB_NODELIST")
             if k in os.environ}
    return {**git_commit(), "overrides": list(overrides), "world_size": info.world_size,
            "torchelastic_restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), **slurm}


def gpu_memory_gb(device: torch.device) -> float:
    if device.type != "cuda":
        return 0.0
    return torch.cuda.max_memory_allocated(device) / 2**30


def finite(x: float) -> bool:
    return math.isfinite(x)


class TolerantStream:
    """A text stream (stdout) that outlives its reader: once a write or flush fails because the
    reader is gone (``train.py | head``: BrokenPipeError, EPIPE), it drops further output
    instead of raising, so training, checkpoints and metrics.jsonl go on; one line on stderr
    says so."""

    def __init__(self, stream: Any):
        self._stream, self.closed_reader = stream, False

    def _lost(self) -> None:
        if not self.closed_reader:
            self.closed_reader = True
            try:
                sys.stderr.write("warning: stdout was closed by its reader; training goes on, logging to "
                                 "the run folder (metrics.jsonl) only\n")
                sys.stderr.flush()
            except OSError:
                pass

    def write(self, text: str) -> int:
        written = self._guarded(self._stream.write, text)
        return len(text) if written is None else written

    def flush(self) -> None:
        self._guarded(self._stream.flush)

    def _guarded(self, call, *args) -> Any:
        """``call(*args)`` on the stream while its reader is there; a closed pipe (or stream)
        marks the reader gone (``_lost``) and returns None. Other OS errors are raised."""
        if self.closed_reader:
            return None
        try:
            return call(*args)
        except (BrokenPipeError, ValueError):
            self._lost()
        except OSError as e:
            if e.errno != errno.EPIPE:
                raise
            self._lost()
        return None

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, ...
        return getattr(self._stream, name)


def tolerate_closed_stdout() -> None:
    """Replaces ``sys.stdout`` by a :class:`TolerantStream` over it (idempotent)."""
    if not isinstance(sys.stdout, TolerantStream):
        sys.stdout = TolerantStream(sys.stdout)
