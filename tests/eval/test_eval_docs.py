"""The three commands of docs/eval.md's "Evaluate your own data", run exactly as written, in a
folder holding `runs/quickstart` and the data they name (scikit-learn's digits)."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a fitted model on real images and several subprocess evaluations

REPO = Path(__file__).resolve().parents[2]


def doc_commands() -> list[str]:
    """The ```bash blocks of the section, one command each (backslash continuations joined)."""
    text = (REPO / "docs" / "eval.md").read_text()
    section = text.split("## Evaluate your own data", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return [line.strip() for block in blocks for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_the_three_ways_to_evaluate_your_own_data_run_as_written(digits, tmp_path):
    commands = [c for c in doc_commands() if c.startswith("python -m infclip.eval ")]
    assert len(commands) == 3
    shutil.copytree(digits.run, tmp_path / "runs" / "quickstart")
    for name, source in (("my_images", "imagefolder"), ("my_wds", "wds_digits"), ("my_captions", "retrieval")):
        os.symlink(digits.root / source, tmp_path / name)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    for command in commands:
        argv = shlex.split(command)
        proc = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, capture_output=True, text=True,
                              timeout=600, env=env)
        assert proc.returncode == 0, f"{command}\n{proc.stderr[-3000:]}"
        task = re.search(r"name: (\w+)", command).group(1)
        metric = "top1" if "zeroshot" in command else "i2t_r1"
        assert re.search(rf"^{task}\s+{metric}\s", proc.stdout, flags=re.M), proc.stdout
    step = tmp_path / "runs" / "quickstart" / "checkpoints" / digits.checkpoint.name
    assert json.loads((step / "eval.json").read_text())["metrics"]["eval/my_captions/num_images"] == 360
    lines = (tmp_path / "runs" / "quickstart" / "eval.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["event"] for r in records] == ["eval_command"] * 3
    assert records[0]["eval/my_images/top1"] > 0.2 and records[1]["eval/my_wds/top1"] > 0.2  # chance: 0.1


def test_the_clip_benchmark_recipe_runs_as_written(digits, tmp_path):
    """The image-folder export and clip_benchmark's eval on it, as docs/eval.md prints them."""
    recipe = [c for c in doc_commands() if not c.startswith("python -m infclip.eval ")]
    assert [c.split()[:3] for c in recipe] == [["python", "-m", "infclip.eval.wds_export"], ["clip_benchmark", "eval",
                                                                                               "--model"]]
    shutil.copytree(digits.run, tmp_path / "runs" / "quickstart")
    os.symlink(digits.root / "imagefolder", tmp_path / "my_images")
    shutil.copy(digits.root / "templates.txt", tmp_path / "my_templates.txt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    bindir = os.path.dirname(sys.executable)
    for command in recipe:
        argv = shlex.split(command)
        exe = [sys.executable] if argv[0] == "python" else [os.path.join(bindir, argv[0])]
        proc = subprocess.run([*exe, *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, f"{command}\n{proc.stderr[-3000:]}"
    metrics = json.loads((tmp_path / "my_images_wds.json").read_text())["metrics"]
    assert metrics["acc1"] > 0.2  # chance: 0.1 (exact parity with the eval command: test_eval_parity.py)
