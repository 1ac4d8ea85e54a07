"""Command-line override checks shared by ``train.py`` and ``python -m infclip.eval``, run on
the raw arguments before Hydra parses them.

Each check returns the problem as one paragraph naming the key and the fix, or None; the
caller raises its own error type (and exits 2). Invariants they protect:

- no key is given in two neighbouring arguments: bash expands an unquoted brace range or
  wildcard (``data.shards=/d/{00000..00005}.tar``) into one override per file, side by side,
  and Hydra keeps the last one silently, so a run would train on one shard of six. A key
  given again further on (a later override of an earlier one, as scripts that extend a base
  command do) is not refused; :func:`overridden_keys` names it in a note;
- a shard spec inside an inline eval task (``root: /d/{0..3}.tar``) is single-quoted for
  Hydra, whose grammar rejects bare braces in a dict value with "no viable alternative".
"""

from __future__ import annotations

import os
from typing import Optional

QUOTING = ("double quotes for the shell (which would expand the braces or wildcard into one argument per "
           "file) and single quotes inside them for Hydra")


def override_key(arg: str) -> Optional[str]:
    """The key an argument sets (``+``/``++``/``~`` stripped), or None for a flag or a
    bare word (``--help``, ``-m``)."""
    if "=" not in arg or arg.startswith("-"):
        return None
    return arg.split("=", 1)[0].lstrip("+~") or None


def _runs(args: list[str]) -> list[tuple[str, list[str]]]:
    """(key, values) of each run of neighbouring arguments setting the same key."""
    runs: list[tuple[str, list[str]]] = []
    for arg in args:
        key = override_key(arg)
        if key is not None and runs and runs[-1][0] == key:
            runs[-1][1].append(arg.split("=", 1)[1])
        else:
            runs.append((key, [arg.split("=", 1)[1]] if key else []))
    return runs


def repeated_keys(args: list[str]) -> Optional[str]:
    """A key set by neighbouring arguments (what the shell makes of an unquoted brace range or
    wildcard): the paragraph naming it, its values and the quoting rule."""
    key, given = next(((k, v) for k, v in _runs(args) if len(v) > 1), (None, None))
    if key is None:
        return None
    shown = " ".join(f"{key}={v}" for v in (given if len(given) <= 4 else [*given[:2], "...", given[-1]]))
    spec = brace_range(given)
    if spec is not None:
        fix = (f"these look like a brace range that the shell expanded before the program saw it: quote it, "
               f"{QUOTING}: \"{key}='{spec}'\"")
    else:
        fix = (f"give {key} once (if the values came from a brace range or wildcard, the shell expanded it: "
               f"quote it, {QUOTING}, e.g. \"{key}='/data/{{00000..00009}}.tar'\")")
    return (f"{key} is given {len(given)} times on the command line ({shown}), and Hydra would silently keep "
            f"only the last value; {fix}.")


def overridden_keys(args: list[str]) -> Optional[str]:
    """A note naming each key given more than once (apart), and the value that is used."""
    last: dict[str, str] = {}
    repeated = []
    for arg in args:
        key = override_key(arg)
        if key is not None:
            if key in last and key not in repeated:
                repeated.append(key)
            last[key] = arg.split("=", 1)[1]
    if not repeated:
        return None
    used = ", ".join(f"{k}={last[k]}" for k in repeated)
    return f"note: {', '.join(repeated)} given more than once on the command line; the last is used: {used}"


def brace_range(values: list[str]) -> Optional[str]:
    """``prefix{first..last}suffix`` when ``values`` are consecutive zero-padded numbers
    between a common prefix and suffix (what bash made of that range), else None."""
    prefix = os.path.commonprefix(values)
    suffix = os.path.commonprefix([v[len(prefix):][::-1] for v in values])[::-1]
    while prefix and prefix[-1].isdigit():  # 00000..00005 share "0000": keep the digits together
        prefix = prefix[:-1]
    while suffix and suffix[0].isdigit():
        suffix = suffix[1:]
    middles = [v[len(prefix):len(v) - len(suffix)] for v in values]
    if not (prefix or suffix) or not all(m.isdigit() and len(m) == len(middles[0]) for m in middles):
        return None
    numbers = [int(m) for m in middles]
    if numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        return None
    return f"{prefix}{{{middles[0]}..{middles[-1]}}}{suffix}"


def unquoted_task_roots(args: list[str], keys: tuple[str, ...] = ("eval.tasks",)) -> Optional[str]:
    """An inline eval task (``keys``: the list override) whose ``root:`` holds braces without
    quotes: the paragraph naming it and the quoted form."""
    for arg in args:
        if override_key(arg) not in keys:
            continue
        key, value = arg.lstrip("+~").split("=", 1)
        root = _bare_brace_root(value)
        if root is not None:
            return (f"{key}: the task root {root} holds a brace range without quotes, which Hydra cannot parse "
                    f"inside a task dict; quote the root with single quotes, and the whole override with "
                    f"double quotes for the shell: \"{key}=[{{..., root: '{root}'}}]\"")
    return None


def _bare_brace_root(value: str) -> Optional[str]:
    """The first ``root:`` value of an inline dict list that is unquoted and holds ``{``."""
    start = 0
    while (at := value.find("root:", start)) >= 0:
        i = at + len("root:")
        while i < len(value) and value[i] == " ":
            i += 1
        depth, j = 0, i
        while j < len(value) and value[i:i + 1] not in ("'", '"') and (depth or value[j] not in ",}]"):
            depth += {"{": 1, "}": -1}.get(value[j], 0)
            j += 1
        token = value[i:j].strip()
        if "{" in token:
            return token
        start = j if j > at else at + 1
    return None
