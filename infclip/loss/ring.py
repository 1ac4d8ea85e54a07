"""The Inf-CL loss across ranks: text blocks travel around a ring, images stay put.

Each of the W ranks of ``group`` holds its local (m, c) images I_r and texts T_r; the
global batch is b = W * m. With x_ij = s * <I_i, T_j> over the global batch:

    ring_forward  -> row_lse (m,)  = LSE over all b texts, for the local images
                     col_lse (m,)  = LSE over all b images, for the local texts
    ring_backward -> dI_r, dT_r, ds_r  (see "Gradient semantics")

Schedule (send to group rank r+1, receive from r-1, ``dist.batch_isend_irecv``). At step
k = 0..W-1 rank r holds the text block of rank r-k and computes the tile (I_r, T_{r-k})
with the tile backend ``ops`` (``TorchTileOps`` on CPU, ``TritonTileOps`` on CUDA; the
protocol is in ``infclip.loss.tiled``). Before the tile starts, the transfers of step k
are posted:

* the current block itself (with its positives' dot products; in backward also its col_lse and
  g_col) goes to r+1, where
  it is used at step k+1 (double-buffered: two receive buffers alternate);
* the block's accumulator (column-LSE partial in forward, dT partial in backward) travels
  one step *behind* its block: rank r receives the accumulator of block r-k (from rank r-1,
  which finished its tile at step k-1) while it computes its own partial for that block,
  then merges the two (``logaddexp`` / ``+``). So no transfer ever waits for a tile.

After the last step one more hop carries each finished accumulator home: W hops in all. The
dT accumulators make that hop in the dtype of the returned gradient (bf16 for bf16 features:
half the bytes of fp32, the same bits as rounding at home), and with m >= 2 x
``HOME_CHUNK_MIN_ROWS`` the backward's last tile runs in column chunks (m/2, m/4, ..., the last
two equal: ``home_cuts``) whose finished dT rows go home while the next chunk computes
(``_last_tile_chunked``): only the last chunk's part of the hop is left for no tile to hide (at
W = 2 over sockets this hop was the exposed time).
Images never move, so dI accumulates in place. On CUDA with NCCL the P2P kernels run on
the process group's internal communication stream, which waits (through events) on the
compute stream for the data being sent; ``Work.wait()`` makes the compute stream wait on
the communication stream, without blocking the host. The whole ring is therefore queued
without host synchronization and the transfer of step k+1's block overlaps step k's tile.

Memory per rank beyond the inputs (``backward_extra_bytes``): two (m, c) text receive
buffers; in backward the fp32 dI sum and three fp32 (m, c) dT buffers (the one arriving,
the one leaving, the tile's own), plus the tile backend's scratch (the one-pass Triton
strips take 4 c bytes a row more than the one-GPU rule's: the room of the accumulator they
never allocate, for strips about three times taller) and O(m) vectors. Never O(b * c).
With a one-pass tile backend (``TorchTileOps``; ``TritonTileOps`` where its ``path_for``
says "onepass": bf16 on CUDA) each tile sums straight into the fp32 dI sum and
into its fp32 dT buffer: no per-tile gradient in the input dtype, no rounding before the sum.
The two-pass Triton path instead writes fresh (m, c) dI and dT in the input dtype (its
strip path needs them) and the ring adds them to the fp32 sums.

Gradient semantics. Every rank calls backward on its own loss L_r (the mean over its
local rows). Feature gradients are d(sum_q L_q)/d(local features): the column terms
g_col of remote ranks travel with their blocks. The logit-scale gradient is *not*
all-reduced: rank r returns the part of d(sum_q L_q)/ds that flows through the tiles
(I_r, T_*) it computed. DDP averages parameter gradients, (1/W) * d(sum_q L_q)/dθ, which
is exactly the single-process gradient of the global mean (sum_q L_q = W * global mean).

Unequal local batch sizes are not supported: DDP's average of local means is the global
mean only when every rank has the same m. ``check_equal_shapes`` (one small all_gather per
forward) raises ``ValueError`` instead of letting a receive with the wrong size hang.

Logging: ``global_mean_loss(loss, group)`` all-reduces one detached scalar, O(1) traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from infclip.loss import duplicates
from infclip.loss.tiled import _acc_dtype

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class Ring:
    """Peers of this process in ``group``: group rank, world size, global ranks of r+-1."""

    group: object
    rank: int
    world: int
    send_to: int  # global rank of group rank (rank + 1) % world
    recv_from: int  # global rank of group rank (rank - 1) % world

    @classmethod
    def of(cls, group) -> "Ring":
        if isinstance(group, (Ring, LoopbackRing)):
            return group
        group = dist.group.WORLD if group is None else group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            raise ValueError("this process is not a member of the process group passed to the loss")
        return cls(
            group, rank, world,
            dist.get_global_rank(group, (rank + 1) % world),
            dist.get_global_rank(group, (rank - 1) % world),
        )

    def post(self, sends: list[Tensor], recvs: list[Tensor]) -> list:
        """Sends sends[i] to r+1 and receives recvs[i] from r-1 (tag i); returns the works."""
        ops = [dist.P2POp(dist.isend, t, self.send_to, self.group, tag=i) for i, t in enumerate(sends)]
        ops += [dist.P2POp(dist.irecv, t, self.recv_from, self.group, tag=i) for i, t in enumerate(recvs)]
        return dist.batch_isend_irecv(ops) if ops else []

    @staticmethod
    def wait(works: list) -> None:
        for w in works:
            w.wait()


class LoopbackRing:
    """A ring of ``world`` ranks that all hold this process's data; every hop is a local copy.

    Pass it as ``group`` to ``lse_pair``/``_tiled_loss``: the ring does exactly the tile
    work and bookkeeping of one rank of a real W-rank ring, without communication. Used to
    measure the ring's overhead on one GPU and to test the schedule in one process: the
    result is that of a global batch made of ``world`` copies of the local batch.
    """

    group = None
    rank = 0

    def __init__(self, world: int):
        if world < 1:
            raise ValueError(f"LoopbackRing needs world >= 1, got {world}")
        self.world = world

    @staticmethod
    def post(sends: list[Tensor], recvs: list[Tensor]) -> list:
        for src, dst in zip(sends, recvs):
            dst.copy_(src)
        return []

    wait = staticmethod(Ring.wait)


def check_equal_shapes(img: Tensor, txt: Tensor, scale: Tensor, group) -> None:
    """Raises ValueError unless every rank of ``group`` has the same (m, c), dtype and scale.

    One all_gather of a 4-element float64 tensor (and, on CUDA, one host sync).
    """
    world = dist.get_world_size(group)
    shape = torch.tensor([img.shape[0], img.shape[1], _DTYPES.index(img.dtype)], dtype=torch.float64)
    mine = torch.cat([shape.to(img.device), scale.detach().to(torch.float64).reshape(1)])
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    rows = torch.stack(every).tolist()  # one host sync
    if any(r[:3] != rows[0][:3] for r in rows):
        shapes = ", ".join(f"rank {i}: ({int(r[0])}, {int(r[1])}) {_DTYPES[int(r[2])]}" for i, r in enumerate(rows))
        raise ValueError(
            f"the distributed CLIP loss needs the same local batch shape and dtype on every rank, got "
            f"{shapes}; give every rank the same per-rank batch (drop or pad the last global batch)"
        )
    if any(r[3] != rows[0][3] for r in rows):
        raise ValueError(
            f"logit_scale differs across ranks ({[r[3] for r in rows]}); the parameters are out of "
            "sync: wrap the model in DistributedDataParallel or broadcast logit_scale"
        )


def _post_step(ring, k: int, blocks: list[Tensor], bufs: list, acc_out, new_acc):
    """Posts the transfers of step k, before its tile runs.

    ``blocks`` (the block of rank r-k) go to r+1 into the alternate receive buffers, except
    at the last step; from step 1 on, ``acc_out`` (the accumulator finished at step k-1) goes
    to r+1 and the accumulator of block r-k arrives from r-1 into ``new_acc()`` (no
    accumulator travels when ``new_acc`` is None).
    Returns (works, the blocks of the next step or None, the arriving accumulator or None).
    """
    sends, recvs, nxt, acc_in = [], [], None, None
    if k < ring.world - 1:
        if len(bufs) < 2:
            bufs.append([torch.empty_like(t) for t in blocks])
        nxt = bufs[k % 2]
        sends += blocks
        recvs += nxt
    if k > 0 and new_acc is not None:
        acc_in = new_acc()
        sends.append(acc_out)
        recvs.append(acc_in)
    return ring.post(sends, recvs), nxt, acc_in


def ring_forward(img: Tensor, txt: Tensor, scale: Tensor, ops, group, pos: Tensor, dup=None
                 ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """(row_loss (m,), col_loss (m,), pos_row, pos_col) over the global batch: LSE_j x_ij - x_ii
    for the local images and LSE_i x_ij - x_jj for the local texts; the caller's autograd saves
    them. pos_row / pos_col: None, or with ``dup`` in mode "positive" the within-group LSEs
    (relative to x_ii, ``infclip.loss.duplicates``) of the local rows and texts.

    pos (m,): the local positives' dot products <I_i, T_i> (``function.positive_dots``). They
    are every tile's offsets (rows: the local ones; columns: those of the travelling text
    block, which travel with it) and, at step 0, the logits of the diagonal block's
    positives, so every partial LSE is already relative to the positive logit.
    dup (a ``duplicates.Duplicates``): the block's group ids travel with it; "mask" passes
    (local ids, block ids) to the tiles; "positive" merges the same-group pairs' LSEs of
    each block pair, the columns' part travelling with the column-LSE accumulator."""
    ring = Ring.of(group)
    if isinstance(ring, Ring):
        check_equal_shapes(img, txt, scale, ring.group)
    positive = dup is not None and dup.mode == "positive"
    blocks, bufs = _blocks(txt, pos, dup), []
    row_lse, acc, pos_row = None, None, None  # acc: column-LSE accumulator of the block of the last step
    for k in range(ring.world):
        works, nxt, acc_in = _post_step(ring, k, blocks, bufs, acc, lambda: torch.empty_like(acc))
        # -- compute tile -- (I_r, T_{r-k}) while the next block and acc_in are in flight.
        row_part, col_part = ops.forward(img, blocks[0], scale, offsets=(pos, blocks[1]), diag=k == 0,
                                         **_groups(dup, blocks))
        if positive:  # the same-group pairs of this block pair, sparse (duplicates.positive_forward)
            p_row, p_col = duplicates.positive_forward(img, blocks[0], scale, pos, blocks[1], dup.ids, blocks[2],
                                                       k == 0)
            pos_row = p_row if pos_row is None else torch.logaddexp(pos_row, p_row)
            col_part = torch.stack([col_part, p_col.to(col_part.dtype)])
        row_lse = row_part if row_lse is None else torch.logaddexp(row_lse, row_part)
        ring.wait(works)
        acc = col_part if acc_in is None else torch.logaddexp(acc_in, col_part)
        blocks = nxt
    col = _home(ring, acc)
    if not positive:
        return row_lse, col, None, None
    return row_lse, col[0], duplicates.with_self(pos_row), duplicates.with_self(col[1])


def _blocks(txt: Tensor, first_meta: Tensor, dup) -> list[Tensor]:
    """The travelling block: texts, their per-column vectors, and their group ids when ``dup``."""
    return [txt.contiguous(), first_meta.contiguous()] + ([dup.ids.contiguous()] if dup is not None else [])


def _groups(dup, blocks: list[Tensor]) -> dict:
    """The tiles' ``groups`` keyword: (local ids, the travelling block's ids) when masking."""
    if dup is None or dup.mode != "mask":
        return {}
    return {"groups": (dup.ids, blocks[2])}


def _home(ring: Ring, acc: Tensor, pool: "_Pool | None" = None, dtype: torch.dtype | None = None) -> Tensor:
    """The last hop: the finished accumulator of block r+1 goes to its owner r+1, into a buffer
    of ``pool`` (its free buffers are the accumulator's shape and dtype) or a new one.

    dtype: the dtype the accumulator travels and arrives in, when the owner only rounds it to
    that dtype (the returned feature gradient): every rank's part is summed in before this hop,
    so rounding before the hop gives the owner the same bits as rounding after it, in half the
    bytes for bf16 from fp32 (this hop is the one transfer no tile hides). The pool's free
    buffers are then dropped, so the hop's two buffers reuse their memory."""
    if dtype is not None and dtype != acc.dtype:
        acc = acc.to(dtype)
        if pool is not None:
            pool.free.clear()
            pool = None
    if ring.world == 1:
        return acc
    out = pool.take(zero=False) if pool is not None else torch.empty_like(acc)
    ring.wait(ring.post([acc], [out]))
    return out


class _Pool:
    """Reusable (m, c) accumulator buffers: the backward ring holds two (one leaving, one
    arriving) besides the fresh tile gradient."""

    def __init__(self, like: Tensor, dtype: torch.dtype):
        self.shape, self.dtype, self.device = like.shape, dtype, like.device
        self.free: list[Tensor] = []

    def take(self, zero: bool) -> Tensor:
        buf = self.free.pop() if self.free else torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return buf.zero_() if zero else buf

    def give(self, *bufs: Tensor) -> None:
        self.free.extend(bufs)


@dataclass(frozen=True)
class _RowSide:
    """What every backward tile of this rank shares: its image rows (m, c), the scale, their
    final row losses ``row_lse`` (m,), upstream gradients ``g_row`` (m,) and positives' dot
    products ``pos`` (m,), the tile backend and its extra keywords ``kw``: need=(False, True) for
    a locked image side, spare_room=True for backends that take it (``takes_spare_room``: the
    strips of the one-pass tiles take the room ``backward_extra_bytes`` counts for them)."""
    ops: object
    img: Tensor
    scale: Tensor
    row_lse: Tensor
    g_row: Tensor
    pos: Tensor
    kw: dict


def ring_backward(
    img: Tensor, txt: Tensor, scale: Tensor, row_lse: Tensor, col_lse: Tensor,
    g_row: Tensor, g_col: Tensor, ops, group, pos: Tensor, dup=None, pos_row: Tensor | None = None,
    pos_col: Tensor | None = None, need_img: bool = True, dtxt_dtype: torch.dtype | None = None,
) -> tuple[Tensor | None, Tensor, Tensor]:
    """(dimg (m, c), dtxt (m, c), dscale 0-d) in the accumulation dtype (fp32, fp64 for fp64);
    dtxt in ``dtxt_dtype`` when given: the finished accumulators travel home in it (``_home``),
    bit for bit the accumulation-dtype result rounded to it.
    need_img False (LiT's locked image tower): no dI is formed, dimg is None, on tile backends
    that skip an unwanted side (``takes_need``: the Triton tiles; not with duplicates "positive").

    dimg, dtxt: d(sum over all ranks' losses)/d(local features); dscale: this rank's part.
    One-pass backends (``sums_in_place``) sum each tile straight into the fp32 dI sum and
    a zeroed fp32 dT buffer; otherwise each tile's gradients come fresh from ``ops`` (in the
    input dtype where the backend can write it, which lets Triton's two-pass path take its
    bf16 strip path) and are summed here in fp32.
    row_lse / col_lse are the per-row losses of ``ring_forward`` (relative to ``pos``); the
    step-0 tile (own images x own texts) folds the positives into its dX (g_diag = g_row +
    g_col), before its gradients are rounded. dup: as ``ring_forward``; in mode "positive"
    pos_row / pos_col are its within-group LSEs: g_diag is g_row w_ii + g_col w'_ii and each
    block pair's same-group terms are added to the fp32 sums (``duplicates.positive_backward``).
    """
    ring = Ring.of(group)
    acc = _acc_dtype(img)
    positive = dup is not None and dup.mode == "positive"
    meta = [col_lse, g_col.to(col_lse.dtype), pos.to(col_lse.dtype)] + ([pos_col.to(col_lse.dtype)] if positive else [])
    blocks, bufs = _blocks(txt, torch.stack(meta), dup), []
    pool = _Pool(txt, acc)
    into = sums_in_place(ops, img)
    # ("positive" adds its sparse same-group terms into dimg: it keeps the image side)
    skip_img = not need_img and (dup is None or dup.mode == "mask") and getattr(ops, "takes_need", False)
    kw = {"need": (False, True)} if skip_img else {}
    if into and getattr(ops, "takes_spare_room", False):
        kw["spare_room"] = True
    side = _RowSide(ops, img, scale, row_lse, g_row, pos, kw)
    dimg = torch.zeros(img.shape, dtype=acc, device=img.device) if into and not skip_img else None
    dscale = torch.zeros((), dtype=acc, device=img.device)
    dt_out = None  # finished dT accumulator of the block of the previous step
    cuts = home_cuts(txt.shape[0]) if ring.world > 1 and dup is None else [0, txt.shape[0]]
    for k in range(ring.world):
        works, nxt, dt_in = _post_step(ring, k, blocks, bufs, dt_out, lambda: pool.take(zero=False))
        if k == ring.world - 1 and len(cuts) > 2:  # the last tile in chunks, each chunk's dT going home at once
            dt = pool.take(zero=True) if into else None
            pool.give(dt_out)  # still leaving with ``works``: nothing takes it from the pool again,
            dt_out = None  # and the chunks drop the pool's buffers once it has left
            dimg, home, ds = _last_tile_chunked(ring, side, blocks, (dimg, dt, dt_in), works, pool, cuts,
                                                dtxt_dtype or acc)
            return dimg, home, dscale + ds
        # -- compute tile -- (I_r, T_{r-k}): dI summed in place; dT of block r-k into its own fp32
        # buffer (dt_in is still arriving: summing into it would wait for the transfer).
        g_diag = _g_diag(g_row, g_col, pos_row, pos_col) if k == 0 else None
        sums = (dimg, pool.take(zero=True)) if into else (None, None)
        di, dt, ds = _tile_backward(side, g_diag, *blocks[:2], *sums, **_groups(dup, blocks))
        if not into and di is not None:
            dimg = di.to(acc) if dimg is None else dimg.add_(di)
        dscale += ds
        ring.wait(works)
        if dt_in is None:
            dt_out = dt if dt.dtype == acc else pool.take(zero=False).copy_(dt)
        else:
            pool.give(dt_out)
            dt_out = dt_in.add_(dt)
            if into:
                pool.give(dt)
        if positive:
            m = blocks[1]
            dscale += duplicates.positive_backward(img, blocks[0], scale, pos, m[2], dup.ids, blocks[2], k == 0,
                                                   pos_row, m[3], g_row, m[1], dimg, dt_out)
        blocks = nxt
    return dimg, _home(ring, dt_out, pool, dtxt_dtype), dscale


HOME_CHUNKS = 4  # at most this many column chunks of the last step's tile (``home_cuts``)
HOME_CHUNK_MIN_ROWS = 8192  # no chunk narrower: below it the home hop is short and a tile's width pays


def home_cuts(m: int) -> list[int]:
    """Column bounds of the backward's last tile in chunks (m local rows): halving widths, m/2,
    m/4, ..., the last two equal (4 chunks: m/2, m/4, m/8, m/8), as many as ``HOME_CHUNKS``
    allows with the narrowest >= ``HOME_CHUNK_MIN_ROWS``; [0, m] (the tile whole) below twice
    that. The first chunk is half the tile because the arriving accumulator (a full fp32 block)
    is needed at its end; the small last ones leave little of the home hop exposed."""
    n = 1
    while n < HOME_CHUNKS and m >> n >= HOME_CHUNK_MIN_ROWS:
        n += 1
    return [0] + [m - (m >> j) for j in range(1, n)] + [m]


def _last_tile_chunked(ring: Ring, side: _RowSide, blocks: list[Tensor], sums: tuple, works: list, pool: "_Pool",
                       cuts: list[int], out_dtype: torch.dtype) -> tuple[Tensor | None, Tensor, Tensor]:
    """The backward's last tile, (I_r, T_{r+1}), in column chunks of the text block (bounds
    ``cuts``, ``home_cuts``), the home hop overlapped: once ``works`` end (after the first chunk),
    dt_in holds every other rank's part of block r+1's dT, so chunk j's dT is finished as soon
    as this tile's chunk j is summed into it, and goes home (to r+1) in ``out_dtype`` while
    chunk j+1 computes; only the last chunk's hop is left exposed (1/8 of the whole hop with 4
    chunks). The chunks' texts, column vectors and dT rows are row slices
    (contiguous) of the block; dI and ds sum over the chunks. sums = (dimg, dt, dt_in): the
    dI sum so far (or None), the tile's zeroed fp32 dT buffer (one-pass backends) or None
    (fresh per chunk), and the arriving accumulator. Returns (dimg, this rank's own finished
    dT (m, c) in out_dtype, ds of the tile)."""
    dimg, dt, dt_in = sums
    acc, device = dt_in.dtype, side.img.device
    home = torch.empty(blocks[0].shape, dtype=out_dtype, device=device)
    ds_sum = torch.zeros((), dtype=acc, device=device)
    leaving, hops = [], []
    for j, (a, b) in enumerate(zip(cuts, cuts[1:])):
        into = (None, None) if dt is None else (dimg, dt[a:b])  # one-pass: summed in place; else fresh
        di, dtj, ds = _tile_backward(side, None, blocks[0][a:b], blocks[1][:, a:b], *into)
        if dt is None and di is not None:
            dimg = di.to(acc) if dimg is None else dimg.add_(di)
        ds_sum += ds
        if j == 0:
            ring.wait(works)  # dt_in has arrived, the previous accumulator has left
            pool.free.clear()
        done = dt_in[a:b].add_(dtj)
        leaving.append(done if done.dtype == out_dtype else done.to(out_dtype))
        hops += ring.post([leaving[-1]], [home[a:b]])
    ring.wait(hops)
    return dimg, home, ds_sum


def _g_diag(g_row: Tensor, g_col: Tensor, pos_row: Tensor | None, pos_col: Tensor | None) -> Tensor:
    """The positives' weight: g_row + g_col, or with the within-group LSEs ("positive")
    g_row w_ii + g_col w'_ii (w_ii = exp(-pos_lse_i), exactly 1 for a group of one)."""
    g_col = g_col.to(g_row.dtype)
    if pos_row is None:
        return g_row + g_col
    return g_row * duplicates.positive_weight(pos_row) + g_col * duplicates.positive_weight(pos_col)


def sums_in_place(ops, img: Tensor) -> bool:
    """Whether ``ops``' backward sums each tile straight into the ring's fp32 buffers (one-pass
    backends: ``TorchTileOps``, or a backend whose ``path_for(img)`` is "onepass"). Else the
    tile's gradients come fresh (in the input dtype where ``ops`` writes it: the two-pass
    Triton strip path, which cannot accumulate) and are added here."""
    from infclip.loss.tiled import TorchTileOps

    path_for = getattr(ops, "path_for", None)
    if path_for is not None:
        return path_for(img) == "onepass"
    return isinstance(ops, TorchTileOps)


def backward_extra_bytes(m: int, c: int, esize: int, in_place: bool) -> dict[str, int]:
    """Bytes per rank that ``ring_backward`` holds beyond its inputs at its peak (inside a tile),
    by buffer, for m local rows of c features of ``esize`` bytes; the tile backend's own
    scratch (e.g. the strip scratch, 64 MB + 768 B x m) and O(m) vectors not included.
    in_place: ``sums_in_place`` (the one-pass backends: the tile's fp32 dT buffer); else
    the tiles' fresh dI and dT in the input dtype (the two-pass Triton path). In place, the
    strips of the one-pass Triton tiles are taller by the room of the second fp32 accumulator
    that backward never allocates (``spare_room``: 4 c bytes a row; H200, c = 512, W = 4
    loopback: the backward strips 1,536 rows instead of 512 at 262k a rank, the loss 1.13x at
    b = 1M and 1.20x at 2M, LiT 1.14x / 1.23x)."""
    f32 = 4 * m * c
    out = {"text receive buffers (2)": 2 * m * c * esize, "fp32 dI sum": f32, "fp32 dT arriving + leaving": 2 * f32,
           "fp32 dT of the tile": f32, "strip room of the tile": f32}
    if not in_place:
        out["fp32 dT of the tile"] = 0  # the fresh dT is copied into the leaving buffer (none at step 0)
        out["strip room of the tile"] = 0
        out["fresh dI + dT (input dtype)"] = 2 * m * c * esize
    return out


def _tile_backward(side: _RowSide, g_diag, txt, meta, dimg=None, dtxt=None,
                   **groups) -> tuple[Tensor | None, Tensor, Tensor]:
    """(dI, dT, ds) of one tile: summed into ``dimg`` / ``dtxt`` (fp32) when given, else fresh,
    in the input dtype where ``ops`` can write it.

    ``meta`` (3 or 4, n): the text block's final column loss (LSE less its positives' logits),
    its upstream gradient g_col and its positives' dot products (and, "positive", its
    within-group LSEs). g_diag: the diagonal block's. groups: the tiles' ``groups`` keyword;
    ``side.kw`` (need=, spare_room=) is passed through to the backends that take it.
    """
    fresh = dimg is None and getattr(side.ops, "writes_out_dtype", False)
    kw = {"out_dtype": side.img.dtype} if fresh else {}
    return side.ops.backward(side.img, txt, side.scale, side.row_lse, meta[0], side.g_row, meta[1], dimg, dtxt,
                             offsets=(side.pos, meta[2]), g_diag=g_diag, **kw, **groups, **side.kw)


def global_mean_loss(loss: Tensor, group=None) -> Tensor:
    """Detached mean of every rank's (local-rows) loss: the global-batch loss, for logging.

    One all-reduce of a scalar; with equal local batch sizes this equals the loss of a
    single process on the concatenated global batch. Without distributed, returns loss.
    """
    out = loss.detach().clone()
    if not dist.is_available() or not dist.is_initialized():
        return out
    world = dist.get_world_size(group)
    if world > 1:
        dist.all_reduce(out, group=group)
        out /= world
    return out


def distributed_clip_loss(
    img: Tensor, txt: Tensor, scale: Tensor, *, impl: str, group, fp32_precision: str = "ieee", dup=None,
) -> Tensor:
    """``clip_loss`` on a process group of world size > 1: this rank's local-rows loss.

    impl "auto" | "torch" | "triton": the ring above with that tile backend.
    impl "vanilla" | "local": all-gather-with-grad baselines (``infclip.loss.reference``).
    """
    from infclip.loss import _tiled_loss, tile_ops
    from infclip.loss import reference

    if impl in ("vanilla", "local"):
        check_equal_shapes(img, txt, scale, group)
        fn = reference.distributed_vanilla_loss if impl == "vanilla" else reference.distributed_local_loss
        return fn(img, txt, scale, group)
    ops = tile_ops(impl, img.device, fp32_precision=fp32_precision)
    return _tiled_loss(img, txt, scale, ops, group, dup)
