"""A labelled table becomes training shards and a zero-shot eval set: ``--split-col`` holds
out the rows of the eval splits, ``--label-col`` writes them as class folders too, and the
printed command evaluates both the retrieval and the zero-shot sets."""

import csv
import subprocess
import sys
from pathlib import Path

import numpy as np
from hydra import compose, initialize_config_dir
from PIL import Image

from infclip.config import register_configs, validate
from infclip.eval import check_tasks
from infclip.train.build import _eval_config

ROOT = Path(__file__).resolve().parents[2]
register_configs()


def _table(tmp_path: Path) -> Path:
    """24 rows, 3 classes ("red/blue" has a slash), every 4th row in the val split."""
    rng = np.random.default_rng(0)
    (tmp_path / "img").mkdir()
    rows = []
    for i in range(24):
        Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(tmp_path / "img" / f"{i}.jpg")
        label = ("cat", "dog", "red/blue")[i % 3]
        rows.append({"filepath": f"img/{i}.jpg", "caption": f"a photo of a {label} {i}", "label": label,
                     "split": "val" if i % 4 == 0 else "train"})
    with open(tmp_path / "t.csv", "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return tmp_path / "t.csv"


def _build(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "data" / "build_shards.py"), *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


def test_split_and_label_columns_make_shards_and_a_zero_shot_set_the_printed_command_evaluates(tmp_path):
    table, out = _table(tmp_path), tmp_path / "mine"
    proc = _build(str(table), "--out", str(out), "--split-col", "split", "--label-col", "label", "--shard-size", "6")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "held out 6 samples" in proc.stdout and "wrote 18 samples in 3 shards" in proc.stdout
    assert "held out 6 labelled images of 3 classes as a zero-shot set" in proc.stdout
    classes = out / "holdout_classes"
    assert sorted(p.name for p in classes.iterdir()) == ["cat", "dog", "red_blue"]
    assert sum(len(list(p.iterdir())) for p in classes.iterdir()) == 6
    command = next(x for x in proc.stdout.splitlines() if x.startswith("train with: "))[len("train with: python "):]
    assert f"python -m infclip.eval.wds_export {classes} --out {classes}_wds" in proc.stdout
    args = subprocess.run(["bash", "-c", f"printf '%s\\0' {command[len('train.py '):]}"], capture_output=True,
                          text=True, check=True).stdout.split("\0")[:-1]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=args)
    validate(cfg, 1)
    assert [(t.name, t.kind) for t in cfg.eval.tasks] == [("holdout", "retrieval"), ("holdout_classes", "zeroshot")]
    check_tasks(_eval_config(cfg))  # both sets open: 6 pairs, 6 labelled images in 3 classes


def test_label_and_split_column_mistakes_are_one_paragraph(tmp_path):
    table = _table(tmp_path)
    for args, match in ((["--label-col", "label"], "--label-col labels the held-out rows"),
                        (["--split-col", "kind"], "has no column(s) ['kind']"),
                        (["--split-col", "split", "--eval-splits", "dev"], "0 of 24 rows have a split in"),
                        (["--split-col", "split", "--holdout", "3"], "both choose the held-out rows")):
        proc = _build(str(table), "--out", str(tmp_path / "o"), *args)
        assert proc.returncode == 2 and match in proc.stderr, (args, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr
