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
  Hydra, whose grammar rejects bare braces in a dict value with "no viable alternative";
- the config composes (:func:`composition_problem`): a malformed preset, a value of the wrong
  type, an unknown preset or a typo inside an inline eval task is named in our words, where
  Hydra's raw message would recommend the wrong fix or none.
"""

from __future__ import annotations

import os
from typing import Any, Optional

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


# Hydra's own flags after which nothing is composed here (Hydra answers them itself)
_HYDRA_ONLY = ("-m", "--multirun", "-h", "--help", "--hydra-help", "--info", "-i", "--shell-completion", "-sc")


def _split_flags(args: list[str], config_name: str) -> tuple[Optional[list[str]], list[str], str]:
    """(overrides, extra config dirs, config name) of a command line; overrides None when
    Hydra alone should answer it (help, multirun)."""
    overrides, dirs, name, i = [], [], config_name, 0
    while i < len(args):
        arg = args[i]
        flag, _, inline = arg.partition("=") if arg.startswith("-") else (arg, "", "")
        if arg in _HYDRA_ONLY or arg.split("=")[0] in ("-cp", "--config-path", "hydra.searchpath", "+hydra.searchpath"):
            return None, dirs, name  # (a search path of its own: composed by Hydra alone)
        if flag in ("-cd", "--config-dir", "-cn", "--config-name"):
            value = inline or (args[i + 1] if i + 1 < len(args) else "")
            i += 1 if inline else 2
            dirs += [value] if flag in ("-cd", "--config-dir") else []
            name = value if flag in ("-cn", "--config-name") else name
            continue
        if ("=" in arg or arg.startswith("~")) and not arg.startswith("-") and not arg.lstrip("+~").startswith("hydra"):
            overrides.append(arg)
        i += 1
    return overrides, dirs, name


def composition_problem(config_dir: str, config_name: str, args: list[str], schema: type,
                        list_keys: dict[str, type] = None) -> Optional[str]:
    """Compose the config as Hydra will and name, in one paragraph, the mistakes whose Hydra
    message is raw: a preset that is not valid YAML, a value of the wrong type (``steps=abc``,
    ``steps=null``), an unknown preset name, an unknown key inside an inline list item
    (``list_keys``: list key -> its item dataclass, e.g. ``eval.tasks``). Any other error is
    left to Hydra; None when the config composes."""
    import yaml
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import ConfigCompositionException, MissingConfigException

    overrides, dirs, name = _split_flags(args, config_name)
    if overrides is None:
        return None
    search = [f"hydra.searchpath=[{','.join('file://' + os.path.abspath(d) for d in dirs)}]"] if dirs else []
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            compose(config_name=name, overrides=overrides + search)
        return None
    except yaml.YAMLError as e:
        return _yaml_problem(e)
    except MissingConfigException as e:
        return _missing_preset(str(e), overrides)
    except ConfigCompositionException as e:
        return _composition_problem(e, overrides, schema, list_keys or {})
    except Exception:  # anything else: Hydra reports it itself when it composes
        return None
    finally:
        GlobalHydra.instance().clear()


def _yaml_problem(e: Exception) -> str:
    mark = getattr(e, "problem_mark", None)
    where = f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}" if mark else "a preset"
    what = getattr(e, "problem", None) or str(e).splitlines()[0]
    return (f"the preset {where} is not valid YAML ({getattr(e, 'context', None) or 'parsing it'}: {what}); fix that "
            "line of the file (YAML: one `key: value` per line, lists as [a, b] or `- a` lines)")


def _missing_preset(message: str, overrides: list[str]) -> Optional[str]:
    """``experiment=nope``: the group's presets named; None for Hydra's own groups."""
    import re

    m = re.search(r"Could not find '([\w-]+)/([^']+)'", message)
    if not m or m.group(1).startswith("hydra"):
        return None
    options = re.findall(r"^\t(\S+)$", message.split("Config search path")[0], re.M)
    return (f"{m.group(1)}={m.group(2)}: there is no preset {m.group(1)}/{m.group(2)}.yaml; choose one of "
            f"{options} (presets live in configs/{m.group(1)}/, or in <dir>/{m.group(1)}/ with --config-dir <dir>)")


def _composition_problem(e: Exception, overrides: list[str], schema: type, list_keys: dict) -> Optional[str]:
    from omegaconf.errors import ConfigKeyError, ValidationError

    cause, text = e.__cause__ or e.__context__, str(e)
    where = "on the command line" if text.startswith(("Error merging override", "Could not override")) else (
        f"in the preset {text.split(chr(39))[1]}.yaml" if text.startswith("In '") else "")
    if isinstance(cause, ValidationError) and getattr(cause, "full_key", None):
        return _type_problem(cause, where, overrides, schema)
    if isinstance(cause, ConfigKeyError):
        key = next((k for k in list_keys if text.startswith(f"Could not override '{k}'")), None)
        if key is not None:
            return _item_key_problem(key, list_keys[key], str(getattr(cause, "key", "") or ""))
    return None


def _type_problem(cause: Exception, where: str, overrides: list[str], schema: type) -> str:
    key = cause.full_key
    first = str(cause).splitlines()[0]
    default = _default(schema, key)
    if "is not Optional" in first:
        epochs = key == "steps" and any(o.split("=", 1)[0] == "epochs" for o in overrides)
        fix = ("epochs=N sets the run length by itself: drop steps=null" if epochs
               else f"give a value (its default is {default!r})")
        return f"{key}=null {where}: {key} cannot be null; {fix}"
    kind = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}.get(
        type(default), "a value of its type")
    shown = str(default).lower() if isinstance(default, bool) else default
    return f"{key} {where}: {first.rstrip('.')}; {key} takes {kind} (its default: {key}={shown})"


def _default(schema: type, key: str) -> Any:
    node: Any = schema()
    for part in key.split("."):
        node = getattr(node, part, None) if not isinstance(node, dict) else node.get(part)
    return node


def _item_key_problem(key: str, item: type, bad: str) -> str:
    import dataclasses
    import difflib

    names = [f.name for f in dataclasses.fields(item)]
    near = difflib.get_close_matches(bad, names, n=1)
    hint = f"did you mean {near[0]}? " if near else ""
    return (f"{key}: unknown key {bad!r} in an inline task; {hint}its keys: {names} (a '+{key}=' override, which "
            f"Hydra suggests, fails the same way)")
