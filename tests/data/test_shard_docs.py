"""The shard overrides that README, docs and data/build_shards.py tell users to type parse
when typed into bash: ``"data.shards='/path/{00000..00005}.tar'"`` (double quotes for the
shell, single quotes for Hydra, which rejects a bare ``{``)."""

import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from infclip.config import register_configs

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "docs/data.md", "docs/launch.md", "train.py", "data/build_shards.py",
        "configs/experiment/vit_b32_laion.yaml", "configs/experiment/lit_b16_cc12m.yaml"]
SAFE = re.compile(r"\"data\.shards='[^'\"]*'\"")
register_configs()


def _documented() -> list[str]:
    found = []
    for name in DOCS:
        text = (ROOT / name).read_text()
        unsafe = [m.group(0) for m in re.finditer(r"(?<!\")data\.shards='[^']*'(?!\")", text)]
        assert not unsafe, f"{name}: {unsafe} breaks in bash; write \"data.shards='...'\""
        found += SAFE.findall(text)
    return sorted(set(found))


def _hint() -> str:
    hint = runpy.run_path(str(ROOT / "data" / "build_shards.py"))["train_hint"]("/data/mine", 6)
    assert hint.startswith("python train.py ")
    return hint[len("python train.py "):]


def _bash_args(text: str) -> list[str]:
    """The arguments bash makes of ``text`` (one per NUL)."""
    out = subprocess.run(["bash", "-c", f"printf '%s\\0' {text}"], capture_output=True, text=True, check=True)
    return out.stdout.split("\0")[:-1]


def test_the_docs_have_shard_examples():
    assert len(_documented()) >= 4


@pytest.mark.parametrize("text", _documented() + [_hint()])
def test_every_documented_shard_override_survives_bash_and_hydra(text):
    args = _bash_args(text)
    shards_arg = next(a for a in args if a.startswith("data.shards="))
    expected = shards_arg.split("=", 1)[1].strip("'")
    assert "{" in expected or expected.endswith(".tar")
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[*args, "data.kind=wds"] if "data.kind=wds" not in args else args)
    assert cfg.data.shards == expected


def test_build_shards_hint_pasted_into_bash_runs_train_py():
    """The printed command, through a real shell into train.py (``--cfg job``: compose and print)."""
    command = _hint().replace("python train.py", "")
    proc = subprocess.run(["bash", "-c", f"{sys.executable} train.py {command} --cfg job"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "shards: /data/mine/{00000..00005}.tar" in proc.stdout
