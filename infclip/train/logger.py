"""Metrics sinks: terminal progress, a JSON-lines file in the run directory, wandb.

Only rank 0 writes. The JSON-lines file is appended (a resumed run continues it) and
holds everything wandb gets, so nothing depends on wandb. wandb never prompts: its mode
is online/offline/disabled from config, and a resumed run reuses the stored run id.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch


def _fmt(key: str, v: Any) -> str:
    if isinstance(v, float):
        return f"{key}={v:.4g}"
    return f"{key}={v}"


class MetricsLogger:
    def __init__(self, run_dir: Path, cfg: Any, enabled: bool, total_steps: int, config_dict: dict):
        self.enabled, self.total = enabled, total_steps
        self.path = run_dir / "metrics.jsonl"
        self._wandb = None
        self._bar = None
        if not enabled:
            return
        if cfg.progress and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, dynamic_ncols=True, desc="train")
        if cfg.wandb_mode != "disabled":
            self._wandb = _init_wandb(run_dir, cfg, config_dict)

    def set_start(self, step: int) -> None:
        if self._bar is not None:
            self._bar.n = step
            self._bar.refresh()

    def log(self, step: int, metrics: dict[str, Any], echo: bool = True) -> None:
        if not self.enabled:
            return
        record = {"step": step, "time": time.time(), **metrics}
        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=_json_default) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)
        if echo:
            self.write(f"step {step:>6}/{self.total} " + " ".join(_fmt(k, v) for k, v in metrics.items()))

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


def _json_default(o: Any) -> Any:
    if isinstance(o, torch.Tensor):
        return o.item()
    return str(o)


def _init_wandb(run_dir: Path, cfg: Any, config_dict: dict):
    import wandb

    id_file = run_dir / "wandb_id.txt"
    run_id: Optional[str] = id_file.read_text().strip() if id_file.exists() else None
    if run_id is None:
        run_id = wandb.util.generate_id()
        id_file.write_text(run_id)
    return wandb.init(
        project=cfg.wandb_project, entity=cfg.wandb_entity, mode=cfg.wandb_mode, id=run_id,
        resume="allow", dir=str(run_dir), config=config_dict, name=run_dir.name,
    )


def gpu_memory_gb(device: torch.device) -> float:
    if device.type != "cuda":
        return 0.0
    return torch.cuda.max_memory_allocated(device) / 2**30


def finite(x: float) -> bool:
    return math.isfinite(x)
