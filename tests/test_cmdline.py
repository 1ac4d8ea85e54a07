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


CONFIGS = str(ROOT / "configs")


def _problem(*args: str) -> str:
    from infclip.cmdline import composition_problem
    from infclip.config import EvalTaskConfig, TrainConfig, register_configs

    register_configs()
    return composition_problem(CONFIGS, "train", list(args), TrainConfig, {"eval.tasks": EvalTaskConfig})


def test_raw_hydra_errors_become_one_paragraph_naming_the_key_and_the_fix(tmp_path):
    assert _problem("steps=abc").startswith("steps on the command line: Value 'abc'")
    assert "steps takes a whole number (its default: steps=100)" in _problem("steps=abc")
    assert "epochs=N sets the run length by itself: drop steps=null" in _problem("steps=null", "epochs=1")
    assert "logging.progress takes true or false" in _problem("logging.progress=maybe")
    assert _problem("experiment=nope").startswith("experiment=nope: there is no preset experiment/nope.yaml; "
                                                  "choose one of ['lit_b16_cc12m', 'quickstart'")
    typo = _problem("eval.tasks=[{name: h, kind: retrieval, rooot: /x}]")
    assert typo.startswith("eval.tasks: unknown key 'rooot' in an inline task; did you mean root?")
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\nsteps: [1\nname: x\n")
    (tmp_path / "experiment" / "typed.yaml").write_text("# @package _global_\nsteps: many\n")
    bad = _problem("--config-dir", str(tmp_path), "experiment=mine")
    assert bad.startswith(f"the preset {tmp_path}/experiment/mine.yaml, line 3, column 5 is not valid YAML")
    assert _problem(f"--config-dir={tmp_path}", "experiment=typed").startswith(
        "steps in the preset experiment/typed.yaml: Value 'many'")
    for fine in ([], ["steps=3", "loss=siglip"], ["--help"], ["-m", "steps=1,2"], ["hydra/launcher=slurm"]):
        assert _problem(*fine) is None, fine


def test_a_wrong_type_on_train_py_and_the_eval_command_is_one_paragraph_with_exit_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "INFCLIP_DEBUG")}
    for argv in ([str(ROOT / "train.py"), "steps=abc", f"run_dir={tmp_path / 'run'}"],
                 ["-m", "infclip.eval", "checkpoint=none", "eval.batch_size=abc"]):
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "takes a whole number" in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args, match", [
    (["/no/such/folder", "--out", "OUT"], "input '/no/such/folder' does not exist: give a .csv/.tsv/.parquet"),
    (["IN", "--out", "OUT", "--shard-size", "0"], "--shard-size 0 is not valid: it must be a whole number > 0"),
    (["IN", "--out", "OUT", "--quality", "101"], "--quality 101 is not valid: it must be in 1..100"),
    (["TABLE", "--out", "OUT"], "has no column(s) ['caption', 'filepath']; columns: ['path', 'text']"),
])
def test_build_shards_argument_errors_are_one_paragraph_with_exit_2(args, match, tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "t.csv").write_text("path,text\na.jpg,a cat\n")
    subs = {"IN": str(tmp_path / "in"), "OUT": str(tmp_path / "out"), "TABLE": str(tmp_path / "t.csv")}
    proc = subprocess.run([sys.executable, str(ROOT / "data" / "build_shards.py"), *[subs.get(a, a) for a in args]],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and match in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_the_eval_commands_help_shows_its_own_usage_and_keys_not_the_trainers_presets():
    proc = subprocess.run([sys.executable, "-m", "infclip.eval", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("python -m infclip.eval: evaluate a checkpoint") and "Usage:" in proc.stdout
    assert "checkpoint: ???" in proc.stdout and "precision: fp32" in proc.stdout
    assert "experiment:" not in proc.stdout and "loss: clip" not in proc.stdout
