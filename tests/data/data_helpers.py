"""Helpers for the data tests: tiny JPEGs, shards with id captions, an id tokenizer."""

import io
import os

import torch
from PIL import Image

from infclip.data.writer import ShardWriter


def jpeg(value: int, side: int = 16) -> bytes:
    """A tiny JPEG: gradients in red/green (so crops differ), blue encodes ``value``."""
    grid = torch.arange(side, dtype=torch.int64) * (256 // side)
    pixels = torch.stack([grid.view(1, -1).expand(side, side), grid.view(-1, 1).expand(side, side),
                          torch.full((side, side), value % 256)], dim=-1).to(torch.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def write_shards(folder, sizes, start=0, prefix="s", first_id=0):
    """Shards with ``sizes[i]`` samples each; captions are the global sample ids ("s000017")."""
    os.makedirs(folder, exist_ok=True)
    with ShardWriter(str(folder), max_samples=max(sizes), start_shard=start) as w:
        gid = first_id
        for n in sizes:
            for _ in range(n):
                w.write(f"{prefix}{gid:06d}", jpeg(gid), f"{prefix}{gid:06d}", {"captions": [f"alt{gid}"]})
                gid += 1
            w._finish_shard()
    return [os.path.join(folder, name) for name in sorted(w.stats.sizes)]


class IdTokenizer:
    """Tokenizer stand-in: caption "s000017" -> [[17]] so tests can read back sample ids."""

    def __call__(self, texts):
        return torch.tensor([[int(t.lstrip("salt"))] for t in texts], dtype=torch.int64)


def ids(tokens):
    return tokens[:, 0].tolist()
