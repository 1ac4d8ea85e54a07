"""``python -m infclip.eval checkpoint=... model=... tasks=[...]`` (Hydra config: configs/eval.yaml).

See :mod:`infclip.eval.cli` and docs/eval.md.
"""

from __future__ import annotations

import hydra
import torch
from omegaconf import DictConfig

from infclip.eval import cli
from infclip.eval.config import EvalConfigError
from infclip.eval.runner import make_autocast, run_evals

cli.register()


@hydra.main(version_base=None, config_path=str(cli.CONFIG_DIR), config_name="eval")
def main(cfg: DictConfig) -> dict:
    """Evaluate; rank 0 prints the table and writes the JSON file. Returns the metrics."""
    dist_info = cli.init_distributed(cfg.device)
    ecfg = cli.build_eval_config(cfg)
    pretrained = cli.resolve_checkpoint(cfg.checkpoint)
    model, tokenizer, preprocess = cli.build(cfg, dist_info.device, pretrained)
    try:
        metrics = run_evals(
            model, tokenizer, preprocess, ecfg, step=0, final=True, device=dist_info.device,
            rank=dist_info.rank, world_size=dist_info.world_size, group=dist_info.group,
            autocast=make_autocast(cfg.precision, dist_info.device),
        )
    except EvalConfigError as e:  # name the command-line key too: eval.tasks[i] is task.<name> here
        raise EvalConfigError(f"{e}\n(on this command line: +task.<task name>.<field>=..., or data_root=...)") from e
    if dist_info.rank == 0:
        output = cfg.output or cli.default_output(pretrained)
        cli.write_results(output, cfg, pretrained, ecfg, metrics, dist_info.world_size)
        print(cli.format_table(metrics))
        print(f"results written to {output}")
    if dist_info.world_size > 1:
        torch.distributed.destroy_process_group()
    return metrics


if __name__ == "__main__":
    main()
