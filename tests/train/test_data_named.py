"""The trainer trains on the data the user named, and says which at startup: ``data.shards``
under a preset with ``data.kind=synthetic`` is trained on (kind inferred, said in one line);
``data.kind=synthetic`` beside it on the command line is refused (exit 2, no run folder); a
folder of shards stands for its ``*.tar`` files; the startup line names the source, the
shards, the samples per epoch and where that count came from."""

import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from infclip.data.shards import count_samples_from, expand, folder_spec
from infclip.data.writer import ShardWriter

ROOT = Path(__file__).resolve().parents[2]
FAST = ["model.name=infclip-micro", "steps=2", "batch.global_size=8", "batch.micro_size=4", "data.loader_batch=4",
        "data.workers=0", "logging.progress=false", "logging.wandb_mode=disabled", "eval.workers=0"]


def write_shards(folder: Path, shards: int, per_shard: int) -> None:
    """``shards`` shards of ``per_shard`` captioned 24-px JPEGs, with sizes.json beside them."""
    rng = np.random.default_rng(0)
    with ShardWriter(str(folder), max_samples=per_shard) as w:
        for i in range(shards * per_shard):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (24, 24, 3), dtype=np.uint8)).save(buf, format="JPEG")
            w.write(f"{i:06d}", buf.getvalue(), f"a photo number {i}", {})


def _train(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, WANDB_MODE="disabled", OMP_NUM_THREADS="1"))


def test_a_shard_folder_counts_its_tars_and_says_where_the_count_came_from(tmp_path):
    write_shards(tmp_path / "mine", 3, 4)
    urls = expand(folder_spec(str(tmp_path / "mine")))
    assert [Path(u).name for u in urls] == ["00000.tar", "00001.tar", "00002.tar"]
    assert count_samples_from(urls) == (12, "sizes.json")
    (tmp_path / "mine" / "sizes.json").unlink()
    assert count_samples_from(urls)[1] in ("*_stats.json", "unknown")
    spec = f"{tmp_path}/mine/{{00000..00001}}.tar"
    assert folder_spec(spec) == spec and folder_spec(str(tmp_path / "none")) == str(tmp_path / "none")


def test_shards_without_data_kind_train_on_the_shards_and_the_startup_line_says_so(tmp_path):
    write_shards(tmp_path / "mine", 4, 6)
    proc = _train([f"data.shards={tmp_path / 'mine'}", *FAST, f"run_dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "data.kind=wds inferred from data.shards" in proc.stdout
    assert (f"data: training on data.kind=wds {tmp_path / 'mine'}: 4 shard(s), 24 samples per epoch "
            "(counted from sizes.json)") in proc.stdout
    assert "kind: wds" in (tmp_path / "run" / "config.yaml").read_text()


def test_the_synthetic_run_names_its_data_at_startup(tmp_path):
    proc = _train([*[a for a in FAST if a != "steps=2"], "steps=1", "data.synthetic_train=64", "data.synthetic_eval=16", "eval.tasks=[]",
                   f"data.synthetic_root={tmp_path / 'syn'}", f"run_dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "data: training on the embedded synthetic captioned shapes (data.kind=synthetic)" in proc.stdout
    assert "64 samples per epoch (the generated set's size, data.synthetic_train)" in proc.stdout


def test_data_kind_synthetic_beside_data_shards_is_refused_before_any_work(tmp_path):
    write_shards(tmp_path / "mine", 1, 2)
    proc = _train(["data.kind=synthetic", f"data.shards={tmp_path / 'mine'}", f"run_dir={tmp_path / 'run'}"],
                  tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "data.kind=synthetic and data.shards are both given" in proc.stderr and "data.kind=wds" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()
