"""Data: img2dataset-layout webdataset shards, the synthetic default, transforms, writers.

The names below are imported on first use (PEP 562), so that ``infclip.data.writer`` imports
with numpy and PIL alone (no webdataset, open_clip or torchvision): data/write_photo_shards.py
runs on machines that have only those.
"""

import importlib

_EXPORTS = {
    "DataConfig": "infclip.data.config", "SourceConfig": "infclip.data.config",
    "DataError": "infclip.data.pipeline", "TrainData": "infclip.data.pipeline",
    "build_train_data": "infclip.data.pipeline", "SyntheticDataset": "infclip.data.synthetic",
    "ensure_synthetic": "infclip.data.synthetic", "Normalizer": "infclip.data.transforms",
    "train_transform": "infclip.data.transforms", "val_transform": "infclip.data.transforms",
    "ShardWriter": "infclip.data.writer",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
