"""A generic ring sweep for the losses whose tiles need no travelling softmax statistics.

The CLIP ring (``infclip.loss.ring``) merges column LSEs while blocks travel. SigLIP and
NT-Xent are simpler: in the forward pass every quantity a rank needs (per-row loss sums,
per-row LSEs of a symmetric matrix) is indexed by its *local* rows, so only the feature
block travels; in the backward pass the block's gradient accumulator travels one step
behind it, exactly as the CLIP ring's dT. This module runs that schedule on the same
primitives (``Ring``, ``_Pool``, ``_home``) with the tile supplied by the caller:

    at step k = 0..W-1 rank r holds the block of rank r-k and calls
        tile(k, blocks, part)
    where ``blocks`` is the list of travelling tensors of rank r-k and ``part`` is a zeroed
    accumulator for that block (``None`` when no accumulator travels). The tile does its
    local accumulation itself (row sums, dI) and adds the block's partial into ``part``.

Transfers of step k (the next block to r+1, the previous accumulator to r+1) are posted
before the tile runs, so communication overlaps compute; after the last step one more hop
carries each finished accumulator home. Memory beyond the inputs: two receive buffers of
the travelling blocks and, with an accumulator, three (m, c) accumulator buffers.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from infclip.loss.ring import Ring, _home, _Pool, _post_step

Tile = Callable[[int, list[Tensor], Optional[Tensor]], None]


def ring_sweep(ring: Ring, blocks: list[Tensor], tile: Tile,
               acc_like: Optional[Tensor] = None, acc_dtype: Optional[torch.dtype] = None,
               home_dtype: Optional[torch.dtype] = None) -> Optional[Tensor]:
    """Runs ``tile`` once per rank's block; returns this rank's finished accumulator (or None).

    ``acc_like``: shape/device of the travelling accumulator (usually the local block), in
    ``acc_dtype``; ``None`` means no accumulator travels (forward passes). ``home_dtype``: the
    finished accumulator makes its last hop and is returned in it, for a caller that only
    rounds it to that dtype (``ring._home``: the same bits, fewer bytes).
    """
    blocks = [b.contiguous() for b in blocks]
    pool = None if acc_like is None else _Pool(acc_like, acc_dtype or acc_like.dtype)
    bufs: list[list[Tensor]] = []  # two alternating receive buffer sets
    out = None  # accumulator of the block computed at the previous step
    for k in range(ring.world):
        new_acc = None if pool is None else (lambda: pool.take(zero=False))
        works, nxt, acc_in = _post_step(ring, k, blocks, bufs, out, new_acc)
        # -- compute tile -- against the block of rank r-k while the transfers are in flight.
        part = None if pool is None else pool.take(zero=True)
        tile(k, blocks, part)
        ring.wait(works)
        if acc_in is not None:
            part += acc_in
            pool.give(acc_in, out)
        out = part
        if nxt is not None:
            blocks = nxt
    return None if pool is None else _home(ring, out, pool, home_dtype)
