"""Command-line checks before Hydra: a key given by neighbouring arguments (an unquoted brace
range that bash expanded into one override per file) and an inline task's unquoted brace root are refused
in one paragraph with the quoting rule, exit 2, before any run directory or model."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from infclip.cmdline import brace_range, overridden_keys, repeated_keys, unquoted_task_roots

ROOT = Path(__file__).resolve().parents[1]


def _bash(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """``command`` as a user types it into bash (braces expanded by the shell)."""
    return subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "INFCLIP_DEBUG")})


def _shards(folder: Path, n: int) -> None:
    folder.mkdir()
    for i in range(n):
        (folder / f"{i:05d}.tar").write_bytes(b"")


def test_an_unquoted_brace_range_on_train_py_is_refused_with_the_quoted_spec(tmp_path):
    _shards(tmp_path / "shards", 6)
    proc = _bash(f"{sys.executable} {ROOT / 'train.py'} data.kind=wds data.shards={tmp_path}/shards/{{00000..00005}}.tar "
                 f"run_dir={tmp_path / 'run'}", tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "data.shards is given 6 times" in proc.stderr
    assert f"\"data.shards='{tmp_path}/shards/{{00000..00005}}.tar'\"" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_an_unquoted_brace_range_on_the_eval_command_is_refused(tmp_path):
    _shards(tmp_path / "val", 3)
    task = "task.val.root"
    proc = _bash(f"{sys.executable} -m infclip.eval checkpoint=none {task}={tmp_path}/val/{{00000..00002}}.tar",
                 ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "task.val.root is given 3 times" in proc.stderr and "{00000..00002}" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("command", ["train.py", "-m infclip.eval checkpoint=none"])
def test_an_unquoted_brace_root_in_an_inline_task_gets_the_quoting_rule_not_hydras_grammar_error(command, tmp_path):
    tasks = "[{name: val, kind: contrastive, root: /d/{00000..00003}.tar, batch: 8}]"
    key = "eval.tasks" if command == "train.py" else "tasks"
    proc = _bash(f"{sys.executable} {command} \"{key}={tasks}\" run_dir={tmp_path / 'run'}", ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{key}: the task root /d/{{00000..00003}}.tar" in proc.stderr and "root: '/d/{00000..00003}.tar'" \
        in proc.stderr
    assert "no viable alternative" not in proc.stderr and not (tmp_path / "run").exists()


def test_the_checks_name_what_they_find_and_pass_what_is_fine():
    assert brace_range(["/d/00008.tar", "/d/00009.tar", "/d/00010.tar"]) == "/d/{00008..00010}.tar"
    assert brace_range(["/d/a.tar", "/d/b.tar"]) is None and brace_range(["1", "2"]) is None
    assert brace_range(["/d/00001.tar", "/d/00003.tar"]) is None  # not consecutive: not a range
    assert repeated_keys(["steps=3", "+steps=4"]).startswith("steps is given 2 times")
    later = ["steps=3", "seed=1", "steps=4"]  # a later override of an earlier one (apart): a note
    assert repeated_keys(later) is None and overridden_keys(later).endswith("the last is used: steps=4")
    for fine in (["data.shards='/d/{0..3}.tar'", "steps=3", "-m", "--cfg", "job"],
                 ["eval.tasks=[{name: h, root: '/d/{0..3}.tar'}]", "data.kind=wds"]):
        assert repeated_keys(fine) is None and unquoted_task_roots(fine) is None
    assert unquoted_task_roots(["eval.tasks=[{name: a, root: /x}, {name: b, root: /e/{1..3}.tar}]"]) \
        .startswith("eval.tasks: the task root /e/{1..3}.tar")
