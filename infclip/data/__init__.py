"""Data: img2dataset-layout webdataset shards, the synthetic default, transforms, writers."""

from infclip.data.config import DataConfig, SourceConfig
from infclip.data.pipeline import DataError, TrainData, build_train_data
from infclip.data.synthetic import SyntheticDataset, ensure_synthetic
from infclip.data.transforms import Normalizer, train_transform, val_transform
from infclip.data.writer import ShardWriter

__all__ = [
    "DataConfig", "SourceConfig", "DataError", "TrainData", "build_train_data", "SyntheticDataset",
    "ensure_synthetic", "Normalizer", "train_transform", "val_transform", "ShardWriter",
]
