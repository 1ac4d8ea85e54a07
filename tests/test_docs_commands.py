"""Every training command printed in README.md, docs/data.md, docs/launch.md and docs/eval.md, as a user
would paste it: bash splits it (quotes and braces), then the command-line check, Hydra's
composition and the config's validation must accept it. The machines and data they name are
not here, so they are composed and validated, not run (README's quick start and the own-data
path are run for real by tests/train/test_train_cli.py and test_own_data_cli.py)."""

import re
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from infclip.config import check_overrides, check_known_keys, register_configs, validate

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "docs/data.md", "docs/launch.md", "docs/eval.md"]
GROUPS = tuple(p.name for p in (ROOT / "configs").iterdir() if p.is_dir()) + ("optim", "eval")
register_configs()


def train_commands() -> list[tuple[str, str]]:
    """(page, command) for each train.py command of a ```bash block (continuations joined);
    placeholders (``...``), multirun launchers (``-m``) and the install line are left out."""
    found = []
    for page in PAGES:
        for block in re.findall(r"```bash\n(.*?)```", (ROOT / page).read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("  #")[0].strip()
                if "train.py" not in line or line.startswith("#") or "..." in line or " -m " in line or "&&" in line:
                    continue
                found.append((page, line))
    return found


def _bash_args(text: str) -> list[str]:
    out = subprocess.run(["bash", "-c", f"printf '%s\\0' {text}"], capture_output=True, text=True, check=True)
    return out.stdout.split("\0")[:-1]


def test_the_pages_have_training_commands():
    pages = {p for p, _ in train_commands()}
    assert pages == set(PAGES) and len(train_commands()) >= 7


@pytest.mark.parametrize("page, command", train_commands())
def test_a_documented_training_command_composes_and_validates(page, command):
    args = _bash_args(command[command.index("train.py") + len("train.py"):])
    check_overrides(args, GROUPS)
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=args)
    check_known_keys(cfg)
    nproc = re.search(r"--nproc_per_node=(\d+)", command)
    nodes = re.search(r"--nodes[= ](\d+)", command)
    validate(cfg, (int(nproc.group(1)) if nproc else 1) * (int(nodes.group(1)) if nodes else 1))
