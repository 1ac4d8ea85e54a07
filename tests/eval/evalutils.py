"""Helpers for the eval tests: tiny datasets written on the fly and an "oracle" model.

Oracle images are solid PNGs (lossless) whose red channel encodes an id (R = 8 * id + 4,
id < 32); oracle texts carry the id as their first integer ("a photo of item 7"). The oracle
model maps both to the one-hot vector of the id, so matching pairs score 1 and all others 0.
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

DIM = 32


def png(ident: int, extra: int = 0, side: int = 8) -> bytes:
    """A solid PNG whose red channel encodes ``ident`` (< 32); ``extra`` (green) makes it unique."""
    assert 0 <= ident < DIM
    buf = io.BytesIO()
    Image.new("RGB", (side, side), (8 * ident + 4, extra % 256, 0)).save(buf, format="PNG")
    return buf.getvalue()


def _add(tar: tarfile.TarFile, name: str, payload: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(payload)
    tar.addfile(info, io.BytesIO(payload))


def write_wds(root: str, labels: Sequence[int], classnames: Sequence[str], shard_size: int = 4,
              templates: Optional[Sequence[str]] = None, image_ids: Optional[Sequence[int]] = None) -> None:
    """A clip_benchmark-layout split ``root/test`` with one sample per label (image id = label)."""
    os.makedirs(os.path.join(root, "test"), exist_ok=True)
    with open(os.path.join(root, "classnames.txt"), "w") as f:
        f.write("\n".join(classnames) + "\n")
    with open(os.path.join(root, "zeroshot_classification_templates.txt"), "w") as f:
        f.write("\n".join(templates or ["a photo of {c}.", "a drawing of {c}."]) + "\n")
    ids = list(image_ids) if image_ids is not None else list(labels)
    nshards = -(-len(labels) // shard_size)
    for s in range(nshards):
        with tarfile.open(os.path.join(root, "test", f"{s}.tar"), "w") as tar:
            for i in range(s * shard_size, min((s + 1) * shard_size, len(labels))):
                _add(tar, f"s{i:05d}.png", png(ids[i], i))
                _add(tar, f"s{i:05d}.cls", str(labels[i]).encode())
    with open(os.path.join(root, "test", "nshards.txt"), "w") as f:
        f.write(f"{nshards}\n")


def write_karpathy(root: str, n_test: int, n_train: int, caps: int = 5) -> str:
    """dataset_coco.json + root/val2014/*.png; test image k has id k, its captions name item k."""
    os.makedirs(os.path.join(root, "val2014"), exist_ok=True)
    images = []
    for k in range(n_test + n_train):
        split, ident = ("test", k) if k < n_test else ("train", k - n_test)
        name = f"COCO_val2014_{k:012d}.png"
        with open(os.path.join(root, "val2014", name), "wb") as f:
            f.write(png(ident, k))
        sentences = [{"raw": f"item {ident} caption {j} ", "tokens": []} for j in range(caps)]
        images.append({"filepath": "val2014", "filename": name, "split": split, "sentences": sentences,
                       "cocoid": k})
    path = os.path.join(root, "dataset_coco.json")
    with open(path, "w") as f:
        json.dump({"images": images, "dataset": "coco"}, f)
    return path


def write_flat(root: str, n: int, caps: int = 3) -> str:
    """LAVIS-style test.json + root/images/*.png; image k has id k."""
    os.makedirs(os.path.join(root, "images"), exist_ok=True)
    records = []
    for k in range(n):
        with open(os.path.join(root, "images", f"{k}.png"), "wb") as f:
            f.write(png(k, k))
        records.append({"image": f"images/{k}.png", "caption": [f"item {k} take {j}" for j in range(caps)]})
    path = os.path.join(root, "test.json")
    with open(path, "w") as f:
        json.dump(records, f)
    return path


def number_tokenizer(texts: Sequence[str]) -> torch.Tensor:
    """(n, 1) int64: the first integer in each text."""
    return torch.tensor([[int(re.search(r"\d+", t).group())] for t in texts])


def to_tensor(img: Image.Image) -> torch.Tensor:
    """PIL -> float (3, H, W) in [0, 1] (lossless for the oracle's PNGs)."""
    return torch.tensor(list(img.getdata()), dtype=torch.float32).T.reshape(3, img.height, img.width) / 255


class OracleModel(nn.Module):
    """encode_image/encode_text -> one-hot of the encoded id (after an optional id permutation).

    ``image_map``: id -> id applied to images only ("shuffled" model); ``collapse``: every
    embedding is the same vector.
    """

    def __init__(self, image_map: Optional[Sequence[int]] = None, collapse: bool = False):
        super().__init__()
        self.dropout = nn.Dropout(0.5)  # a submodule whose train flag the hook must restore
        self.image_map = None if image_map is None else torch.tensor(list(image_map))
        self.collapse = collapse

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.collapse:
            ids = torch.zeros_like(ids)
        return F.one_hot(ids, DIM).float()

    def encode_image(self, x: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        ids = torch.round((x[:, 0].mean((1, 2)) * 255 - 4) / 8).long()
        if self.image_map is not None:
            ids = self.image_map[ids]
        return self._embed(ids)

    def encode_text(self, tokens: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        return self._embed(tokens[:, 0].long())
