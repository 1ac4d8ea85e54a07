"""Per-sample duplicate group ids: a 62-bit hash of the tokenized caption (and optionally the image).

``group_ids(tokens, images=None)`` -> (n,) int64 on the tokens' device. Equal captions (equal
token rows) get equal ids on every rank and in every step, so the ids are global across a
ring without communication; different captions collide with probability ~ L^2 / 2^62 per
pair (two independent polynomial hashes modulo primes below 2^31, each < (L / 2^31)).

The hash, per row v (tokens, then the image's bytes when given, as one sequence):
    h_p = sum_k (v_k + 1) B_p^k  mod p,   for (p, B_p) in PRIMES,   id = h_1 * 2^31 + h_2.
Vectorized over rows (no Python loop per sample): products stay below 2^55 (values < 2^24,
weights < 2^31) and are reduced modulo p every 128 columns, so int64 never overflows.

``images``: the uint8 tensor the trainer receives (``data.decode=cpu``: the decoded, augmented
pixels -- two copies of one photo match only where their crops do; ``data.decode=device``:
the encoded JPEG bytes themselves). Depends on torch only (no trainer imports).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

PRIMES = ((2_147_483_647, 1_000_003), (2_147_483_629, 998_244_353 % 2_147_483_629))
VALUE_LIMIT = 1 << 24  # token ids (and bytes) must be below this: products stay < 2^55
REDUCE_EVERY = 128  # columns summed before each reduction modulo p (128 * 2^55 < 2^63)
ROW_CHUNK_BYTES = 64 << 20  # int64 temporaries per chunk of rows


@functools.lru_cache(maxsize=16)
def _powers(p: int, base: int, start: int, length: int) -> Tensor:
    """(length,) int64 base^(start + k) mod p on the CPU (cached per shape)."""
    out, x = [], pow(base, start, p)
    for _ in range(length):
        out.append(x)
        x = x * base % p
    return torch.tensor(out, dtype=torch.int64)


def _poly(rows: Tensor, p: int, base: int, start: int) -> Tensor:
    """(n,) sum_k (rows[:, k] + 1) base^(start + k) mod p, int64, chunked over rows."""
    n, d = rows.shape
    w = _powers(p, base, start, d).to(rows.device)
    pad = (-d) % REDUCE_EVERY
    out = torch.empty(n, dtype=torch.int64, device=rows.device)
    step = max(1, ROW_CHUNK_BYTES // (8 * max(d, 1)))
    for lo in range(0, n, step):
        v = (rows[lo:lo + step].long() + 1) * w  # < 2^24 * 2^31
        if pad:
            v = torch.nn.functional.pad(v, (0, pad))
        part = v.view(v.shape[0], -1, REDUCE_EVERY).sum(-1) % p  # each sum < 2^62
        out[lo:lo + step] = part.sum(-1) % p
    return out


def group_ids(tokens: Tensor, images: Tensor | None = None) -> Tensor:
    """(n,) int64 duplicate group ids of n samples: the hash above of each token row (n, L)
    (int token ids in [0, 2^24)), followed by the row's image bytes when ``images`` (n, ...)
    uint8 is given. Deterministic across processes, devices and steps."""
    if tokens.dim() != 2 or tokens.is_floating_point():
        raise ValueError(f"tokens must be an integer (n, L) tensor, got {tokens.dtype} {tuple(tokens.shape)}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= VALUE_LIMIT):
        raise ValueError(f"token ids must be in [0, {VALUE_LIMIT}) to be hashed, got "
                         f"[{int(tokens.min())}, {int(tokens.max())}]")
    parts = [tokens]
    if images is not None:
        if images.dtype != torch.uint8 or images.shape[0] != tokens.shape[0]:
            raise ValueError(f"images must be uint8 with one row per token row, got {images.dtype} "
                             f"{tuple(images.shape)} for {tokens.shape[0]} captions")
        parts.append(images.reshape(images.shape[0], -1).to(tokens.device))
    ids = []
    for p, base in PRIMES:
        h, start = torch.zeros(tokens.shape[0], dtype=torch.int64, device=tokens.device), 0
        for rows in parts:
            h = (h + _poly(rows, p, base, start)) % p
            start += rows.shape[1]
        ids.append(h)
    return ids[0] * (1 << 31) + ids[1]
