"""Run under torchrun by ``test_train_cli.py``: trains through ``infclip.train.loop.train`` and
prints this process's native thread count before the process group exists and after training
returned (``native threads: before=N after=M``). Threads left alive after ``train`` returns
(gloo's workers, kept by a DDP model in cyclic garbage) are torn down at interpreter exit,
where they can abort the process after a finished run."""

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from infclip.config import register_configs  # noqa: E402

register_configs()


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@hydra.main(version_base="1.3", config_path=str(ROOT / "configs"), config_name="train")
def main(cfg: DictConfig) -> None:
    from infclip.train.loop import train

    before = native_threads()
    train(cfg)
    line = f"native threads: before={before} after={native_threads()}\n"
    os.write(1, line.encode())  # one write: the two ranks share the pipe


if __name__ == "__main__":
    main()
