"""The run directory: where it is (``derive_run_dir``) and what a start writes into it
(``config.yaml``, ``overrides.txt``)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from infclip.train.distributed import DistInfo, on_rank0


def setup_run_dir(cfg: Any, info: DistInfo, overrides: list[str]) -> Path:
    """Creates the run directory and records the resolved config and the overrides (rank 0
    writes; the others only get the path)."""
    run_dir = derive_run_dir(cfg)

    def write() -> None:  # rank 0 writes; the others only read
        run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
        (run_dir / "overrides.txt").write_text("\n".join(overrides) + "\n")

    on_rank0(info, write)
    return run_dir


def derive_run_dir(cfg: Any) -> Path:
    """``run_dir`` if set, else ``runs_root/name``; under a Hydra multirun (``-m``) each job
    gets ``runs_root/name/<its override dirname>`` so sweep members never share (and never
    resume from) one directory, while a requeued job finds its own again."""
    if cfg.run_dir:
        return Path(cfg.run_dir).expanduser()
    run_dir = Path(cfg.runs_root, cfg.name).expanduser()
    sub = _multirun_subdir()
    return run_dir / sub if sub else run_dir


def _multirun_subdir() -> Optional[str]:
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
            return None
        job = HydraConfig.get().job
    except ImportError:
        return None
    sub = (job.override_dirname or f"job{job.num}").replace("/", "_")  # one path component
    if len(sub) > 120:  # keep it readable and within file-name limits, still unique
        sub = f"{sub[:100]}-{hashlib.sha1(sub.encode()).hexdigest()[:10]}"
    return sub
