"""A newcomer's own-data path, as printed: an image folder with sidecar captions ->
``data/build_shards.py --holdout`` -> the "train with:" line it prints, pasted into bash ->
a run that trains on the shards and evaluates retrieval on the held-out pairs."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
# Only what makes the quickstart preset fast on 2 cores; the printed command is kept verbatim.
FAST = ["model.name=infclip-micro", "steps=2", "batch.global_size=8", "batch.micro_size=4", "data.loader_batch=4",
        "data.workers=0", "logging.progress=false", "logging.wandb_mode=disabled", "eval.workers=0"]


def image_folder(root: Path, n: int) -> None:
    """n photos-like JPEGs with sidecar captions (two colours, two shapes)."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    for i in range(n):
        img = np.full((40, 48, 3), 30, np.uint8)
        colour = ("red", (220, 40, 40)) if i % 2 else ("blue", (40, 40, 220))
        img[8:32, 10:38] = colour[1]
        img = np.clip(img + rng.integers(0, 20, img.shape), 0, 255).astype(np.uint8)
        Image.fromarray(img).save(root / f"{i:03d}.jpg", quality=90)
        (root / f"{i:03d}.txt").write_text(f"a {colour[0]} square number {i}\n")


def test_folder_to_shards_holdout_and_the_printed_command_trains_and_evaluates(tmp_path):
    image_folder(tmp_path / "photos", 30)
    build = subprocess.run([sys.executable, str(ROOT / "data" / "build_shards.py"), str(tmp_path / "photos"),
                            "--out", str(tmp_path / "mine"), "--holdout", "6", "--shard-size", "8"],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert build.returncode == 0, build.stderr[-2000:]
    assert "held out 6 samples" in build.stdout and "wrote 24 samples in 3 shards" in build.stdout
    pairs = json.loads((tmp_path / "mine" / "holdout" / "test.json").read_text())
    assert len(pairs) == 6 and all((tmp_path / "mine" / "holdout" / p["image"]).exists() for p in pairs)
    held = {p["caption"][0] for p in pairs}
    trained = set()
    for k in range(3):
        out = subprocess.run(["tar", "-xOf", str(tmp_path / "mine" / f"{k:05d}.tar"), "--wildcards", "*.txt"],
                             capture_output=True, text=True, check=True).stdout
        trained |= set(re.findall(r"a \w+ square number \d+", out))
    assert len(trained) == 24 and not held & trained  # disjoint, and together the whole folder

    line = next(x for x in build.stdout.splitlines() if x.startswith("train with: "))
    command = line[len("train with: "):]
    assert command.startswith("python train.py ")
    run_dir = tmp_path / "run"
    proc = subprocess.run(["bash", "-c", f"{sys.executable} {command[len('python '):]} " + " ".join(FAST)
                           + f" run_dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/holdout/i2t_r1" in r]
    assert evals and evals[-1]["eval/holdout/num_images"] == 6
