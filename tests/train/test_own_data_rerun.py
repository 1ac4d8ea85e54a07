"""A newcomer's own data after the quick start: the command ``data/build_shards.py`` prints
names its own run (never resuming ``runs/quickstart``), fits a set smaller than the preset's
loader batch, and a run folder holding a run on other data is refused with both datasets
named and the fix; a held-out set gets an eval-task snippet instead of a training command."""

import os
import re
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from infclip.config import register_configs, validate

ROOT = Path(__file__).resolve().parents[2]
# what makes a run fast on 2 cores; the loader batch stays the preset's (128)
FAST = ["model.name=infclip-micro", "steps=1", "batch.global_size=32", "batch.micro_size=16", "data.workers=0",
        "logging.progress=false", "logging.wandb_mode=disabled", "eval.workers=0"]
ENV = dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1")
register_configs()


def _folder(root: Path, n: int) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from test_own_data_cli import image_folder

    image_folder(root, n)


def _build(src: Path, out: Path, *extra: str) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "data" / "build_shards.py"), str(src), "--out", str(out),
                           "--shard-size", "5", *extra], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _bash(command: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=600, env=ENV)


def test_the_printed_command_after_the_quickstart_trains_its_own_run_and_other_data_is_refused(tmp_path):
    quick = _bash(f"{sys.executable} {ROOT / 'train.py'} {' '.join(FAST)} data.synthetic_train=64 "
                  f"data.synthetic_eval=16 data.synthetic_root={tmp_path / 'syn'} eval.tasks=[]", tmp_path)
    assert quick.returncode == 0, quick.stdout[-2000:] + quick.stderr[-2000:]
    assert (tmp_path / "runs" / "quickstart" / "checkpoints").is_dir()
    _folder(tmp_path / "photos", 20)
    printed = _build(tmp_path / "photos", tmp_path / "mine")
    command = next(x for x in printed.splitlines() if x.startswith("train with: "))[len("train with: python "):]
    assert command.startswith("train.py ") and command.endswith("name=mine")
    command = f"{ROOT / 'train.py'} {command[len('train.py '):]}"  # from the folder that holds runs/
    ours = _bash(f"{sys.executable} {command} {' '.join(FAST)}", tmp_path)
    assert ours.returncode == 0, ours.stdout[-2000:] + ours.stderr[-2000:]
    assert "note: data.loader_batch=128 lowered to 16: an epoch of 20 samples on 1 rank(s)" in ours.stdout
    assert (tmp_path / "runs" / "mine" / "checkpoints" / "step_00000001").is_dir()
    before = sorted(p.name for p in (tmp_path / "runs" / "quickstart").rglob("*"))
    other = _bash(f"{sys.executable} {command} {' '.join(FAST)} name=quickstart", tmp_path)
    assert other.returncode == 2, other.stdout[-2000:] + other.stderr[-2000:]
    assert re.search(r"run_dir runs/quickstart holds a run trained on the embedded synthetic captioned shapes "
                     r"\(data.kind=synthetic\) \(checkpoints up to step_00000001\), and this command asks for "
                     rf"data.shards={tmp_path}/mine/\{{00000..00003\}}.tar: .* name=mine \(or run_dir=", other.stderr)
    assert "Traceback" not in other.stderr and "data:" not in other.stdout.replace("data: data.kind", "")
    assert sorted(p.name for p in (tmp_path / "runs" / "quickstart").rglob("*")) == before


def test_a_held_out_set_gets_an_eval_task_snippet_that_composes(tmp_path):
    _folder(tmp_path / "photos", 12)
    for out, extra in ((tmp_path / "val", ()), (tmp_path / "mine", ("--use", "eval"))):
        printed = _build(tmp_path / "photos", out, *extra)
        assert "train with:" not in printed and "evaluate on it" in printed
        snippet = printed.splitlines()[printed.splitlines().index(next(
            x for x in printed.splitlines() if x.startswith("a held-out set"))) + 1].strip()
        args = subprocess.run(["bash", "-c", f"printf '%s\\0' {snippet}"], capture_output=True, text=True,
                              check=True).stdout.split("\0")[:-1]
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
            cfg = compose(config_name="train", overrides=args)
        validate(cfg, 1)
        task = cfg.eval.tasks[0]
        assert (task.name, task.kind, task.root, task.batch) == (out.name, "contrastive",
                                                                 f"{out}/{{00000..00002}}.tar", 12)
    assert "train with: " in _build(tmp_path / "photos", tmp_path / "val2", "--use", "train")
