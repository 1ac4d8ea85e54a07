"""Train a CLIP model: ``python train.py [experiment=...] key=value ...`` or under torchrun.

    torchrun --nproc_per_node=8 train.py experiment=vit_b32_laion \
        "data.shards='/data/laion/{00000..41407}.tar'" batch.global_size=262144 batch.micro_size=512

The configuration schema is ``infclip.config.TrainConfig``; presets live in ``configs/``.
A configuration, data or resume error prints one paragraph and exits with status 2 (no
traceback); ``INFCLIP_DEBUG=1`` (or ``HYDRA_FULL_ERROR=1``) shows the traceback as well.
"""

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from infclip.config import register_configs

register_configs()


def user_errors() -> tuple[type, ...]:
    """Errors whose message is the whole story: bad config or data, a busy run_dir, a refused
    resume, a run stopped for non-finite weights or loss, a checkpoint that did not fit on its disk."""
    from infclip.config import ConfigError
    from infclip.data.shards import DataError
    from infclip.eval.config import EvalConfigError
    from infclip.train.checkpoint import DiskFull
    from infclip.train.distributed import PeersMissing
    from infclip.train.guard import NonFiniteError
    from infclip.train.rundir import RunDirBusy, RunDirUnusable

    return (ConfigError, DataError, EvalConfigError, RunDirBusy, RunDirUnusable, NonFiniteError, DiskFull,
            PeersMissing)


def paragraph(err: BaseException) -> str:
    """The error's own message; for one re-raised from a DataLoader worker (whose message
    carries the worker's traceback), the original message only."""
    text = str(err).strip()
    if "Original Traceback" in text:
        text = text.splitlines()[-1].split(": ", 1)[-1]
    return f"error ({type(err).__name__}): {text}"


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    from infclip import process_group
    from infclip.train.logger import tolerate_closed_stdout
    from infclip.train.loop import train
    from infclip.train.signals import exit_zero_on_stop

    tolerate_closed_stdout()  # `train.py | head`: training goes on when the reader is gone
    status = 0
    try:
        train(cfg, overrides=list(HydraConfig.get().overrides.task))
        exit_zero_on_stop()  # finished and saved: a late stop signal is not a failure
    except KeyboardInterrupt:  # Ctrl-C before training began (later, it is a stop signal)
        print("interrupted before training started: nothing was trained or saved", file=sys.stderr, flush=True)
        status = 130
    except user_errors() as err:
        if os.environ.get("INFCLIP_DEBUG") or os.environ.get("HYDRA_FULL_ERROR"):
            raise
        print(paragraph(err) + "\n(INFCLIP_DEBUG=1 shows the traceback)", file=sys.stderr, flush=True)
        status = 2
    process_group.leave()  # again: the error's traceback (and the trainer's frames) is gone by now
    if status:
        sys.exit(status)


def check_command_line() -> None:
    """Overrides checked before Hydra parses them (a typo gets "did you mean", a key repeated by
    the shell's expansion or an unquoted brace range the quoting rule; exit 2). A key given
    again further on is a later override: one note names the value used."""
    from pathlib import Path

    from infclip.cmdline import composition_problem, overridden_keys, repeated_keys, unquoted_task_roots
    from infclip.config import ConfigError, EvalTaskConfig, TrainConfig, check_overrides
    from infclip.presets import check_presets

    configs = Path(__file__).resolve().parent / "configs"
    groups = tuple(p.name for p in configs.iterdir() if p.is_dir())
    try:
        problem = repeated_keys(sys.argv[1:]) or unquoted_task_roots(sys.argv[1:])
        if problem:
            raise ConfigError(problem)
        check_presets(sys.argv[1:], configs)  # a broken or unknown preset: before Hydra's traceback
        check_overrides(sys.argv[1:], groups + ("optim", "eval"))
        problem = composition_problem(str(Path(__file__).resolve().parent / "configs"), "train", sys.argv[1:],
                                      TrainConfig, {"eval.tasks": EvalTaskConfig})
        if problem:
            raise ConfigError(problem)
        note = overridden_keys(sys.argv[1:])
        if note and os.environ.get("RANK", "0") == "0":
            print(note, flush=True)
    except ConfigError as err:
        print(paragraph(err), file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    check_command_line()
    main()
