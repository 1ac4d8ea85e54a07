"""docs/data.md's data/build_shards.py commands, run as printed on generated inputs: a CSV
table, a Parquet table and a folder of images with sidecar captions, placed where the commands
look for them (the ``/data/`` prefix becomes a temporary folder; nothing else changes)."""

import csv
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]


def doc_commands() -> list[str]:
    text = (ROOT / "docs" / "data.md").read_text()
    lines = [ln for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)
             for ln in block.replace("\\\n", " ").splitlines()]
    return [ln.split("  #")[0].strip() for ln in lines if ln.startswith("python data/build_shards.py")]


def make_inputs(cwd: Path, data: Path, n: int) -> None:
    """captions.csv and images.parquet in ``cwd`` (as the commands name them), both pointing at
    ``data/photos/a/<i>.jpg``, each image with its sidecar caption ``<i>.txt``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = data / "photos" / "a"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(folder / f"{i}.jpg", quality=85)
        (folder / f"{i}.txt").write_text(f"picture {i}\n")
        rows.append({"filepath": str(folder / f"{i}.jpg"), "caption": f"picture {i}"})
    with open(cwd / "captions.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["filepath", "caption"])
        w.writeheader()
        w.writerows(rows)
    pq.write_table(pa.Table.from_pylist(rows), cwd / "images.parquet")


def test_build_shards_commands_of_docs_data_run_as_printed(tmp_path):
    commands = doc_commands()
    assert len(commands) >= 4
    data = tmp_path / "data"
    make_inputs(tmp_path, data, 520)  # --holdout 500 needs more rows than it holds out
    for command in commands:
        out = data / "mine"
        subprocess.run(["rm", "-rf", str(out)], check=True)
        argv = [a.replace("/data/", f"{data}/") for a in shlex.split(command)]
        proc = subprocess.run([sys.executable, str(ROOT / argv[1]), *argv[2:]], cwd=tmp_path, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, f"{command}\n{proc.stderr[-2000:]}"
        written = re.search(r"wrote (\d+) samples in (\d+) shards", proc.stdout)
        held = 500 if "--holdout 500" in command else 0
        assert written and int(written.group(1)) == 520 - held, (command, proc.stdout)
        assert "train with: python train.py data.kind=wds" in proc.stdout
        assert (out / "00000.tar").exists() and ((out / "holdout" / "test.json").exists() == bool(held))
