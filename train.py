"""Train a CLIP model: ``python train.py [experiment=...] key=value ...`` or under torchrun.

    torchrun --nproc_per_node=8 train.py experiment=vit_b32_laion \
        data.shards='/data/laion/{00000..41407}.tar' batch.global_size=262144 batch.micro_size=512

The configuration schema is ``infclip.config.TrainConfig``; presets live in ``configs/``.
"""

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from infclip.config import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    from infclip.train.loop import train

    train(cfg, overrides=list(HydraConfig.get().overrides.task))


if __name__ == "__main__":
    main()
