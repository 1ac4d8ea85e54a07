"""build_train_data on the synthetic dataset: shapes, dtypes, epochs, with real DataLoader workers."""

import open_clip
import torch

from infclip.data.config import DataConfig
from infclip.data.pipeline import build_train_data
from infclip.data.synthetic import ensure_synthetic
from infclip.data.transforms import train_transform


def test_synthetic_batches_with_workers(tmp_path):
    cfg = DataConfig(synthetic_root=str(tmp_path / "syn"), synthetic_train=512, synthetic_eval=8,
                     synthetic_image_size=32, loader_batch=64, workers=2, shuffle_buffer=100)
    ds = ensure_synthetic(cfg)
    tok = open_clip.get_tokenizer("RN50")
    data = build_train_data(cfg, transform=train_transform(32), tokenizer=tok, rank=0, world_size=1,
                            seed=0, shards=ds.train_shards, num_samples=ds.num_train)
    assert data.epoch_batches == 8
    it = data.batches()
    for _ in range(data.epoch_batches + 2):  # crosses an epoch boundary
        images, tokens = next(it)
        assert images.dtype == torch.uint8 and images.shape == (64, 3, 32, 32)
        assert tokens.dtype == torch.int64 and tokens.shape == (64, 77)
    assert data.state_dict()["epoch"] == 1 and data.state_dict()["position"] == 10
    assert data.skip_counts() == {}
