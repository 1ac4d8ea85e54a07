"""``python -m infclip.eval checkpoint=... model=... tasks=[...]`` (Hydra config: configs/eval.yaml).

See :mod:`infclip.eval.cli` and docs/eval.md.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from infclip import process_group
from infclip.eval import cli
from infclip.eval.config import EvalConfigError
from infclip.eval.runner import make_autocast, run_evals
from infclip.eval.suites import format_suite, summarize
from infclip.eval.zeroshot import write_per_class

cli.register()


@hydra.main(version_base=None, config_path=str(cli.CONFIG_DIR), config_name="eval")
def main(cfg: DictConfig) -> dict:
    """Evaluate; rank 0 prints the tables and writes the results. Returns the metrics. A
    configuration, checkpoint or data error is one paragraph on stderr and exit status 2
    (``INFCLIP_DEBUG=1`` or ``HYDRA_FULL_ERROR=1`` shows the traceback)."""
    from infclip.config import ConfigError
    from infclip.data.shards import DataError

    try:
        return evaluate(cfg)
    except (EvalConfigError, ConfigError, DataError) as err:
        if os.environ.get("INFCLIP_DEBUG") or os.environ.get("HYDRA_FULL_ERROR"):
            raise
        print(f"error ({type(err).__name__}): {str(err).strip()}\n(INFCLIP_DEBUG=1 shows the traceback)",
              file=sys.stderr, flush=True)
    process_group.leave()  # the error's traceback (and its Dist) is gone by now
    sys.exit(2)


def evaluate(cfg: DictConfig) -> dict:
    """The command's work (see ``main``); the torchrun group is left however it ends."""
    dist_info = cli.init_distributed(cfg.device)
    try:
        return _evaluate(cfg, dist_info)
    finally:
        process_group.leave()


def _evaluate(cfg: DictConfig, dist_info: cli.Dist) -> dict:
    """Plan, load, run and report on this rank (``evaluate``)."""
    if cfg.output:  # before any work: a result that cannot be written is lost work
        _rank0_check(dist_info, lambda: cli.check_output(cfg.output))
    tasks, suites = cli.plan_tasks(cfg)
    ecfg = cli._eval_config(cfg, tasks)
    pretrained, (model, tokenizer, preprocess) = cli.load_checkpoint(cfg, dist_info.device)
    if not cfg.output:
        _rank0_check(dist_info, lambda: cli.check_output(cli.default_output(pretrained)))
    if dist_info.rank == 0:  # what is evaluated, before the numbers
        print(f"eval: checkpoint {pretrained or cfg.checkpoint}; tasks {[t.name for t in tasks]} "
              f"(from {cli.task_source(cfg)}); precision={cfg.precision}", flush=True)
    details: dict = {}  # zero-shot tasks' per-class counts and confusion matrices
    try:
        metrics = run_evals(
            model, tokenizer, preprocess, ecfg, step=0, final=True, device=dist_info.device,
            rank=dist_info.rank, world_size=dist_info.world_size, group=dist_info.group,
            autocast=make_autocast(cfg.precision, dist_info.device), details=details,
        )
    except EvalConfigError as e:  # name the command-line key too: eval.tasks[i] is task.<name> here
        raise EvalConfigError(f"{e}\n(on this command line: +task.<task name>.<field>=..., or data_root=...)") from e
    if dist_info.rank == 0:
        _report(cfg, pretrained, ecfg, metrics, suites, dist_info.world_size, details)
    return metrics


def _rank0_check(dist_info: cli.Dist, check) -> None:
    """Runs ``check`` on rank 0 (which writes the results); its EvalConfigError is raised on
    every rank, so none is left waiting in a collective for rank 0."""
    problem = None
    if dist_info.rank == 0:
        try:
            check()
        except EvalConfigError as e:
            problem = str(e)
    if dist_info.world_size > 1:
        import torch.distributed as dist

        box = [problem]
        dist.broadcast_object_list(box, src=0, group=dist_info.group)
        problem = box[0]
    if problem:
        raise EvalConfigError(problem)


def _report(cfg: DictConfig, pretrained, ecfg, metrics: dict, suites: list, world_size: int,
            details: dict) -> None:
    """Print the task table and one table per suite; write the JSON file, each zero-shot task's
    per-class accuracy and confusion matrix (CSV files in ``<output stem>_per_class/``), the
    run's metrics, wandb."""
    print(cli.format_table(metrics))
    for line in cli.nonfinite_warnings(metrics):
        print(line, file=sys.stderr, flush=True)
    for plan in suites:
        summary = summarize(plan, metrics)
        print(format_suite(plan, summary))
        metrics.update(summary)
    output = cfg.output or cli.default_output(pretrained)
    try:
        cli.write_results(output, cfg, pretrained, ecfg, metrics, world_size)
    except OSError as e:  # the metrics are kept: printed whole, then the one paragraph
        print(json.dumps(metrics, indent=1, sort_keys=True), flush=True)
        raise EvalConfigError(f"output={output} could not be written ({e.strerror or e}); the results are "
                              "printed above as JSON. Give output= a writable path") from None
    print(f"results written to {output}")
    for name, task in details.items():
        per_class, _ = write_per_class(Path(output).with_name(Path(output).stem + "_per_class"), name, task)
        print(f"{name}: per-class accuracy in {per_class} (confusion matrix beside it)")
    run, step = cli.run_folder(pretrained), cli.checkpoint_step(pretrained)
    if cfg.log_to_run and run is not None:
        cli.log_to_run(run, step, metrics, cfg)
        print(f"metrics appended to {run / cli.EVAL_LOG}")
    mode = cli.wandb_mode(cfg, run)
    if mode != "disabled":
        cli.log_wandb(mode, cfg, run, step, metrics, suites)


def check_command_line() -> None:
    """A key repeated by the shell's expansion of an unquoted brace range, or an inline task's
    unquoted brace root: one paragraph and exit 2, before Hydra parses anything. A key given
    again further on is a later override: one note names the value used."""
    from infclip.cmdline import composition_problem, overridden_keys, repeated_keys, unquoted_task_roots

    from infclip.eval.config import EvalTaskConfig

    problem = repeated_keys(sys.argv[1:]) or unquoted_task_roots(sys.argv[1:], ("tasks", "eval.tasks")) or \
        composition_problem(str(cli.CONFIG_DIR), "eval", sys.argv[1:], cli.EvalCommandConfig,
                            {"eval.tasks": EvalTaskConfig})
    if problem:
        print(f"error (EvalConfigError): {problem}", file=sys.stderr, flush=True)
        sys.exit(2)
    note = overridden_keys(sys.argv[1:])
    if note and os.environ.get("RANK", "0") == "0":
        print(note, flush=True)


if __name__ == "__main__":
    check_command_line()
    main()
