"""Presets checked before Hydra composes them: a YAML file that does not parse, or a preset
name that does not exist, is one paragraph (ConfigError) naming the file or the choices.

Hydra itself answers a broken preset with a long traceback and an unknown one with exit
status 1; the trainer promises one paragraph and exit status 2 for any bad input.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

import yaml

from infclip.config import ConfigError

GROUPS = ("experiment", "loss")  # the groups chosen on the command line by name


def config_dirs(args: list[str], own: Path) -> list[Path]:
    """The trainer's configs folder and every ``--config-dir`` / ``-cd`` given (Hydra's flags)."""
    dirs = [own]
    for i, arg in enumerate(args):
        if arg in ("--config-dir", "-cd") and i + 1 < len(args):
            dirs.append(Path(args[i + 1]))
        elif arg.startswith("--config-dir="):
            dirs.append(Path(arg.split("=", 1)[1]))
    return dirs


def yaml_problem(path: Path) -> Optional[str]:
    """None when ``path`` parses as a YAML mapping (or is empty), else what is wrong."""
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        return f"is not valid YAML{where} ({getattr(e, 'problem', None) or type(e).__name__})"
    except (OSError, UnicodeDecodeError) as e:
        return f"cannot be read ({e})"
    if data is not None and not isinstance(data, dict):
        return f"holds a YAML {type(data).__name__}, not a mapping of config keys"
    return None


def check_presets(args: list[str], own: Path, groups: Iterable[str] = GROUPS) -> None:
    """Every YAML file of the extra config folders parses, and each ``group=name`` override
    names a preset that exists in one of the folders. Raises ConfigError otherwise."""
    dirs = config_dirs(args, own)
    for folder in dirs[1:]:
        for path in sorted(folder.rglob("*.yaml")) if folder.is_dir() else []:
            problem = yaml_problem(path)
            if problem:
                raise ConfigError(f"preset {path} {problem}; fix the file (or leave its folder out of --config-dir)")
    for arg in args:
        key, _, name = arg.partition("=")
        if key.lstrip("+") not in groups or not name or name == "null":
            continue
        group = key.lstrip("+")
        known = sorted({p.stem for d in dirs for p in (d / group).glob("*.yaml")})
        if name not in known:
            raise ConfigError(f"{group}={name}: no such preset; choose one of {known} "
                              f"(configs/{group}/*.yaml, or a --config-dir folder with {group}/<name>.yaml)")
        for d in dirs:
            path = d / group / f"{name}.yaml"
            problem = yaml_problem(path) if path.is_file() else None
            if problem:
                raise ConfigError(f"preset {path} {problem}; fix the file")
