"""Run under torchrun by the tests: ``PROBE_TARGET=train`` trains through
``infclip.train.loop.train``, ``PROBE_TARGET=eval`` evaluates through
``infclip.eval.__main__.evaluate`` (an ``EvalConfigError`` is caught and named, as the command
reports it). Prints this process's native thread count before the process group exists and
once the call has returned or its error has been handled (``native threads: before=N after=M``,
one write per rank). Threads left then (gloo's workers, kept by a process group that is still
referenced or not destroyed) are torn down at interpreter exit, where they can abort the process
after a finished run or turn an error's exit status 2 into SIGABRT."""

import gc
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TARGET = os.environ.get("PROBE_TARGET", "train")

if TARGET == "train":
    from infclip.config import register_configs

    register_configs()
    CONFIG_DIR, CONFIG_NAME = str(ROOT / "configs"), "train"
else:
    from infclip.eval import cli

    cli.register()
    CONFIG_DIR, CONFIG_NAME = str(cli.CONFIG_DIR), "eval"


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def run(cfg: DictConfig) -> None:
    if TARGET == "train":
        from infclip.train.loop import train

        train(cfg)
        return
    from infclip.eval.__main__ import evaluate
    from infclip.eval.config import EvalConfigError

    try:
        evaluate(cfg)
    except EvalConfigError:
        os.write(1, b"eval error caught\n")


@hydra.main(version_base=None, config_path=CONFIG_DIR, config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> None:
    before = native_threads()
    run(cfg)
    gc.collect()  # what the commands do once an error's traceback is gone
    os.write(1, f"native threads: before={before} after={native_threads()}\n".encode())  # one write a rank


if __name__ == "__main__":
    main()
