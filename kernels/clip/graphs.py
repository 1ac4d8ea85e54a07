"""CUDA graphs of the one-GPU CLIP loss, for the small batches where the host is the bottleneck.

At b <= 16k the Triton loss is one to four milliseconds of GPU work issued through ~45
launches (five Triton kernels at ~80 us of host time each, cuBLAS products, LSE merges, the
autograd node): on an H200 the host needs 2.6 ms to issue a forward + backward that the GPU
runs in 1.2 ms (b = 8k, c = 512, profiled at commit f150e58), so the step took 2.4 ms,
as long as vanilla's. Replayed from graphs, a step costs what the GPU needs.

A graph's kernels read fixed addresses, and copying the features into static buffers would
cost 2 b c x the element size of memory the loss's rule does not have room for. So a graph
is captured on the caller's own feature tensors and replayed only for calls whose features
are at those addresses with the same shape, strides and dtype (``_key``): the case of a
training loop or a benchmark that reuses its buffers. It is captured on the second
consecutive call with the same key (a loop whose buffers move never pays a capture); other
calls run eagerly (``TritonCLIPLoss``), as do problems that do not fit (``eligible``).

Static buffers:
- the scale (0-d, copied in every call: the caller's ``logit_scale.exp()`` is a new tensor);
- the feature gradients are written into static buffers and *returned* (no copy). Autograd
  usually copies them into a leaf's ``.grad`` (they are referenced here) and a non-leaf's
  gradient is consumed by the next node of the same backward; but a leaf reached through a
  view (or with a post-accumulate hook) may store one as its ``.grad`` itself, and a hook or
  ``torch.autograd.grad`` may keep one. So if a returned gradient is still referenced when the
  next backward comes (more Python, TensorImpl or storage references than at capture), that
  backward runs eagerly instead of overwriting it. The static gradients are allocated first in
  the forward's capture and never freed, so no forward temporary, and no forward replay, is
  ever where they live.
- the LSEs and positives of the last forward: a second forward before the first one's
  backward stashes them (O(b)) with the first call; its backward copies them back.

Memory, within the loss's rule (the two feature gradients + 1 KB x b + 64 MB): with leaf
features the ``.grad`` copies are the two feature gradients; the static gradient buffers,
the strip scratch, the partial LSE buffers and the O(b) vectors share the 1 KB x b + 64 MB
(``strip_budget``: the scratch shrinks to what is left; no graphs where fewer than
``launch.STRIP_MIN_ROWS`` rows would remain). The static gradients and every temporary above
1 MB are carved from one block of the pool (``arena_bytes``), so what the pool keeps does not
depend on the tiles the tuner picked. With ``backward="onepass"`` the pool also
holds the fp32 dtxt accumulator (4 B x b x c), which the memory rule allows beside the
1 KB x b + 64 MB (the feature gradients' fp32 accumulators). One captured problem is kept at a time and an
eager call drops it first, so no eager call runs beside a resident pool (except a backward
whose gradients were still held, above); ``release()`` drops it. A capture that fails (e.g.
under another capture) leaves that problem eager, with one warning. Not under
``torch.inference_mode()`` (its tensors could not be refilled later). The cache and the static
buffers serve one thread at a time (the trainer calls the loss from its main thread); code that
calls the loss from several threads at once should pass ``cuda_graphs="never"``.
``INFCLIP_CUDA_GRAPHS=0`` or ``TritonTileOps(cuda_graphs="never")`` turns graphs off.
"""

from __future__ import annotations

import os
import sys
import warnings
import weakref

import torch
from torch import Tensor

from . import launch
from .function import loss_backward, loss_forward

MAX_ROWS = 16384  # graphs only where the host is slower than the GPU (b <= 16k, H200)
# ... and only up to this much work (b^2 c): beyond it the GPU's own time exceeds the host's,
# and the graphs' two-pass backward and smaller strips cost more than the launches they save.
# H200, bf16, forward + backward, a loop that reuses its buffers: b = 8k, c = 1024 graphed
# 1.93 ms vs eager 2.15; b = 16k, c = 512 graphed 4.45 ms vs eager 3.40 (twice the work).
MAX_WORK = 8192 * 8192 * 1024
MIN_FWD_ROWS = 64  # the smallest forward tile height (``launch.fwd_candidates``): the largest partials
ALLOCATOR_SLACK_BYTES = 7 << 20  # the pool's 2 MB granules (measured: 72 MB budget -> 74 MB reserved at 4 MB)
SMALL_BLOCK_BYTES = 1 << 20  # the caching allocator's small blocks (<= 1 MB): they share 2 MB segments
SEGMENT_MIN_BYTES = 10 << 20  # requests of 1-10 MB take a 20 MB segment, from 10 MB on their size (2 MB granules)
RULE_FIXED_BYTES = 64 << 20  # the rule's fixed 64 MB
RULE_BYTES_PER_ROW = 1024  # the rule's 1 KB x b
_CACHE: dict = {}  # key -> LossGraphs: at most one problem (one pool within the rule at a time)
_LAST: list = [None]  # the key of the last call not replayed (captured when seen twice in a row)
_FAILED: set = set()  # keys whose capture raised: always eager
_STREAMS: dict = {}  # device -> the side stream of every warm-up and capture (one cuBLAS workspace)


def partial_bytes(b: int) -> int:
    """The forward's column partial LSEs at most: those of the tallest-partials tile, capped as
    ``launch.PART_BUDGET_BYTES`` (the tuned tile's may be smaller: 1 MB at 256 rows, b = 8k)."""
    return min(launch.PART_BUDGET_BYTES, -(-b // MIN_FWD_ROWS) * b * 4)


def reserve_bytes(b: int) -> int:
    """The forward's temporaries in the pool (``partial_bytes``; the row partials; O(b)
    vectors) plus the allocator's segment granules."""
    return partial_bytes(b) + 16 * b * 4 + 64 * b + ALLOCATOR_SLACK_BYTES


def arena_bytes(b: int, c: int, esize: int, budget: int, strips: bool, temp: bool = False,
                onepass: bool = False) -> int:
    """The pool's one large block, allocated and freed first thing in the forward's capture:
    the static gradients (where above 1 MB; smaller ones are small blocks), then every
    temporary above 1 MB of both captures is carved from it (the allocator's best fit: the
    pool has no other free block), so the pool keeps this block and the small pool's 2 MB
    segments, whatever tiles the tuner picked. Beyond the gradients it holds the larger of
    the forward's temporaries (``partial_bytes`` and logsumexp's temporary of their size) and
    the backward's (``strips``: the strip scratch within ``budget``; the fixup's fp32 product
    with ``temp``; the fp32 dtxt accumulator with ``onepass``), never alive together; at least
    ``SEGMENT_MIN_BYTES``; 0 where all are small blocks. (Without it a 1-10 MB temporary with
    no free block to go to took a fresh 20 MB segment: the partials of a 64- or 128-row
    forward tile at c = 1024, b = 8k, beside gradients that fill their 16 MB segments, kept
    84 MB against the rule's 72; 256-row tiles' are small blocks: ~64 MB.) The caching
    allocator's defaults are assumed (no ``max_split_size_mb``: a block above it is never split)."""
    grads = 2 * _block(b * c * esize) if b * c * esize > SMALL_BLOCK_BYTES else 0
    backward = 0
    if strips:
        rows = min(b, launch.strip_rows(b, esize, budget=budget, k=c, temp=temp))
        product = 4 * rows * c if temp else 0
        backward = _block(rows * b * esize) + _block(product) + _block(_acc_bytes(b, c, esize, onepass))
    temps = max(2 * _block(partial_bytes(b)), backward)
    arena = grads + (temps if temps > SMALL_BLOCK_BYTES else 0)
    return max(arena, SEGMENT_MIN_BYTES) if arena else 0


def pool_bytes(b: int, c: int, esize: int, arena: int) -> int:
    """What a captured problem keeps at most: the arena, the static gradients where they are
    small blocks, and ``reserve_bytes`` but the partials (the arena holds them): the O(b)
    vectors and the allocator's granules."""
    small_grads = 0 if b * c * esize > SMALL_BLOCK_BYTES else 2 * b * c * esize
    return arena + small_grads + reserve_bytes(b) - partial_bytes(b)


def _block(nbytes: int) -> int:
    """A request's size in the caching allocator (512 B granules)."""
    return -(-nbytes // 512) * 512


def _acc_bytes(b: int, c: int, esize: int, onepass: bool) -> int:
    """The one-pass backward's fp32 dtxt accumulator (none for fp32 features: dtxt is one)."""
    return 4 * b * c if onepass and esize != 4 else 0


def strip_budget(b: int, c: int, esize: int, strips: bool, temp: bool = False) -> int | None:
    """Scratch bytes left for the strip backward once the static gradients are in the rule's
    1 KB x b + 64 MB, or None when graphs would not fit (``strips``: the backward takes the
    strip path and needs ``launch.STRIP_MIN_ROWS`` rows; otherwise no scratch is used;
    ``temp``: the positives' fixup also takes its fp32 temporary, ``launch.STRIP_TEMP_BYTES``)."""
    room = RULE_BYTES_PER_ROW * b + RULE_FIXED_BYTES - 2 * b * c * esize - reserve_bytes(b)
    room -= launch.STRIP_TEMP_BYTES if strips and temp else 0
    need = launch.STRIP_MIN_ROWS * b * esize if strips else 0
    default = launch.STRIP_BUDGET_BYTES + launch.STRIP_BYTES_PER_COLUMN * b + (0 if temp else launch.STRIP_TEMP_BYTES)
    return min(room, default) if room >= need else None


def eligible(ops, img: Tensor, txt: Tensor) -> bool:
    """Whether ``ops``' loss of (img, txt) runs through graphs: CUDA, b <= MAX_ROWS and
    b^2 c <= MAX_WORK, not inside another capture, no NaN-poisoned buffers or gradient filter
    (their host-side state), the static buffers within the memory rule."""
    if not img.is_cuda or getattr(ops, "cuda_graphs", "auto") != "auto" or os.environ.get(
            "INFCLIP_CUDA_GRAPHS", "1") == "0":
        return False
    if ops.poison or ops.threshold is not None or img.shape[0] > MAX_ROWS or torch.cuda.is_current_stream_capturing():
        return False
    if img.shape[0] * txt.shape[0] * img.shape[1] > MAX_WORK:
        return False
    if torch.is_inference_mode_enabled() or txt.device != img.device:  # (inference tensors can't be refilled)
        return False
    return _budget(ops, img) is not None


def _budget(ops, img: Tensor) -> int | None:
    """``strip_budget`` of ops' backward for img, or None also where its ``pool_bytes`` would not
    fit the rule (arenas the forward's partials size; the one-pass path: with its accumulator)."""
    (b, c), esize = img.shape, img.element_size()
    budget = strip_budget(b, c, esize, _strips(ops, img), temp=not ops.fold)
    if budget is None:
        return None
    rule = RULE_BYTES_PER_ROW * b + RULE_FIXED_BYTES + _acc_bytes(b, c, esize, _onepass(ops))
    return budget if pool_bytes(b, c, esize, _arena(ops, img, budget)) <= rule else None


def _strips(ops, img: Tensor) -> bool:
    """Whether ops' backward takes the strip path for img (as ``TritonTileOps._use_strips``)."""
    strips = ops.strips == "always" or (ops.strips == "auto" and img.dtype == torch.bfloat16)
    return strips or _onepass(ops)  # (its fp32 dtxt accumulator: the rule's, not the 1 KB x b)


def _arena(ops, img: Tensor, budget: int) -> int:
    """``arena_bytes`` of ops' loss of img with this strip budget."""
    return arena_bytes(img.shape[0], img.shape[1], img.element_size(), budget, _strips(ops, img),
                       temp=not ops.fold, onepass=_onepass(ops))


def _onepass(ops) -> bool:
    return _backward(ops) == "onepass"


def _backward(ops) -> str:
    """The graphs' backward path: ops' own when set; "auto" keeps the two-pass path here (small b,
    where the one-pass path was not measured faster)."""
    return "twopass" if ops.backward_path == "auto" else ops.backward_path


def release() -> None:
    """Drop every captured problem (their static buffers and graph memory, once no pending
    backward references them) and forget failed and recent keys."""
    _CACHE.clear()
    _FAILED.clear()
    _LAST[0] = None


def _key(ops, img: Tensor, txt: Tensor) -> tuple:
    """What a captured graph depends on: the features' addresses, layout and dtype, ops' config."""
    return (img.device, img.data_ptr(), txt.data_ptr(), img.shape, txt.shape, img.stride(), txt.stride(),
            img.dtype, ops.fp32_precision, ops.fold, ops.strips, ops.backward_path)


def graphed_loss(ops, img: Tensor, txt: Tensor, scale: Tensor) -> Tensor:
    """The CLIP loss of ``TritonCLIPLoss``, replayed from this problem's graphs once captured."""
    from .function import TritonCLIPLoss

    key = _key(ops, img, txt)
    graphs = _CACHE.get(key)
    if graphs is None:
        _CACHE.clear()  # an eager call or a capture never runs beside a resident pool (the memory rule)
        if _LAST[0] != key or key in _FAILED:  # first call at these addresses: eager (buffers may move)
            _LAST[0] = key
            return TritonCLIPLoss.apply(img, txt, scale, ops)
        graphs = _capture(ops, img, txt, scale, key)
        if graphs is None:
            return TritonCLIPLoss.apply(img, txt, scale, ops)
        _CACHE[key] = graphs
    return GraphedCLIPLoss.apply(img, txt, scale, graphs)


def _capture(ops, img: Tensor, txt: Tensor, scale: Tensor, key: tuple):
    """``LossGraphs`` of this problem, or None (the key then stays eager) if the capture
    raised: the caller's stream is restored and the reason is warned once."""
    stream = torch.cuda.current_stream(img.device)
    try:
        return LossGraphs(ops, img, txt, scale)
    except Exception as err:  # noqa: BLE001 -- any capture failure: run eagerly, never retry the key
        torch.cuda.set_stream(stream)
        _FAILED.add(key)
        warnings.warn(f"CUDA graph capture of the CLIP loss failed ({type(err).__name__}: {err}); "
                      "this problem runs eagerly", RuntimeWarning, stacklevel=3)
        return None


class _Call:
    """One forward's claim on the static buffers: ``stash`` (row, col, pos) is set when a
    later forward overwrites them before this call's backward ran."""

    def __init__(self):
        self.stash: tuple | None = None
        self.done = False


class LossGraphs:
    """Forward and backward graphs of the CLIP loss on one pair of feature tensors (``_key``).

    Read in place: img, txt (b, c), the caller's tensors at capture (a replay reads whatever
    tensors are at those addresses: the call's own, by the key). Static tensors: scale 0-d
    fp32 (input); loss 0-d, row, col, pos (b,) fp32 (forward outputs); g 0-d fp32 (upstream
    gradient); dimg, dtxt (b, c) input dtype, ds 0-d fp32 (backward outputs)."""

    def __init__(self, ops, img: Tensor, txt: Tensor, scale: Tensor):
        from .ops import TritonTileOps

        budget = _budget(ops, img)
        budget = budget if ops.strip_budget is None else min(budget, ops.strip_budget)
        # The Triton kernels always: the arena and budget count their buffers (the Gluon ones are
        # for b >= ops.GLUON_MIN_ROWS, above MAX_ROWS), whatever the caller or environment asks.
        self.ops = TritonTileOps(ops.fp32_precision, strips=ops.strips, strip_positives="fold" if ops.fold else "fixup",
                                 strip_budget=budget, cuda_graphs="never", backward=_backward(ops),
                                 forward_kernel="triton", strip_kernel="triton")
        self.arena = _arena(ops, img, budget)
        self.current = lambda: None  # weakref to the _Call whose state the buffers hold
        self.counts = {"forward": 0, "backward": 0, "eager_backward": 0, "restored": 0}  # (tests)
        with torch.cuda.device(img.device):
            self.scale = scale.detach().float().reshape(()).clone()
            self.g = torch.ones((), device=img.device)
            self._capture(img.detach(), txt.detach())  # (no reference kept: the key holds addresses)

    def _backward(self, img: Tensor, txt: Tensor, g: Tensor, out: tuple | None = None):
        return loss_backward(self.ops, img, txt, self.scale, self.row, self.col, self.pos, g, out)

    def _capture(self, img: Tensor, txt: Tensor) -> None:
        """Warm up eagerly on a side stream (compiles and tunes every kernel the capture will
        launch), then capture forward and backward into one memory pool."""
        if img.device not in _STREAMS:
            _STREAMS[img.device] = torch.cuda.Stream(img.device)
        side = _STREAMS[img.device]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad(), torch.autocast("cuda", enabled=False):
            self.loss, self.row, self.col, self.pos = loss_forward(self.ops, img, txt, self.scale)
            self._backward(img, txt, self.g)
        torch.cuda.current_stream().wait_stream(side)  # (torch.cuda.graph syncs the device on entry)
        # The gradients the backward returns are allocated first thing in the forward's capture
        # (carved from the arena, ``arena_bytes``, left as the pool's one free block just before)
        # and stay alive: the forward's temporaries, freed at the end of its capture, can never be
        # where they live (a forward replay must not write into a gradient the caller still
        # holds). Thread-local capture: the step pipeline's threads keep making CUDA calls.
        pool = torch.cuda.graph_pool_handle()
        self.fwd, self.bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.autocast("cuda", enabled=False):
            with torch.cuda.graph(self.fwd, pool=pool, stream=side, capture_error_mode="thread_local"):
                _free_block(self.arena, img.device)
                self.dimg = torch.empty(img.shape, device=img.device, dtype=img.dtype)
                self.dtxt = torch.empty(txt.shape, device=txt.device, dtype=txt.dtype)
                self.loss, self.row, self.col, self.pos = loss_forward(self.ops, img, txt, self.scale)
            with torch.cuda.graph(self.bwd, pool=pool, stream=side, capture_error_mode="thread_local"):
                self.ds = self._backward(img, txt, self.g, (self.dimg, self.dtxt))[2]
        self.outputs = (self.dimg, self.dtxt, self.ds)
        self.owned = self._counts()  # references held here alone

    def run_forward(self, scale: Tensor) -> _Call:
        """Replay the forward (on the features at the captured addresses) with this scale;
        returns the call's claim on the buffers."""
        self._stash_holder()
        self.scale.copy_(scale.detach().reshape(()))
        self.fwd.replay()
        self.counts["forward"] += 1
        call = _Call()
        self.current = weakref.ref(call)
        return call

    def _counts(self) -> list:
        """``_references`` of the static outputs (one code path for capture and check)."""
        return [_references(t) for t in self.outputs]

    def _held(self) -> bool:
        """Whether a returned gradient is still held: more references than at capture."""
        return any(now > then for refs, owned in zip(self._counts(), self.owned) for now, then in zip(refs, owned))

    def _stash_holder(self) -> None:
        """Before the buffers are overwritten: stash the state of the call they hold if that
        call's backward is still to come."""
        holder = self.current()
        if holder is not None and not holder.done:
            holder.stash = (self.row.clone(), self.col.clone(), self.pos.clone())

    def run_backward(self, call: _Call, img: Tensor, txt: Tensor, scale: Tensor, g: Tensor):
        """(dimg, dtxt, ds) of ``call``'s forward for upstream g: the static outputs, or fresh
        tensors from an eager backward when a returned gradient is still referenced."""
        if self.current() is not call:  # another forward ran since: restore this call's state
            self._stash_holder()
            self.scale.copy_(scale.detach().reshape(()))
            if call.stash is None:  # (a second backward of a finished call: recompute)
                self.fwd.replay()
            else:
                for dst, src in zip((self.row, self.col, self.pos), call.stash):
                    dst.copy_(src)
            self.current = weakref.ref(call)
            self.counts["restored"] += 1
        call.done = True
        if self._held():  # do not overwrite it: this backward runs eagerly
            self.counts["eager_backward"] += 1
            return self._backward(img, txt, g.detach().float().reshape(()))
        self.g.copy_(g.detach().reshape(()))
        self.bwd.replay()
        self.counts["backward"] += 1
        return self.dimg, self.dtxt, self.ds


def _free_block(nbytes: int, device: torch.device) -> None:
    """Leave one free block of ``nbytes`` (none for 0) in the pool being captured into: allocated
    and freed at once, no kernel (nothing is recorded); the pool keeps its segment, and later
    requests of the capture are split off it while it has room."""
    if nbytes:
        torch.empty(nbytes, device=device, dtype=torch.uint8)


def _references(t: Tensor) -> tuple[int, int, int]:
    """(Python references to the tensor object, C++ references to its TensorImpl, tensors and
    views on its storage): any of them above its value at capture means that a returned
    gradient is still held (the same object through a hook, a view, a C++ holder)."""
    return sys.getrefcount(t), t._use_count(), torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class GraphedCLIPLoss(torch.autograd.Function):
    """``TritonCLIPLoss`` replayed from ``LossGraphs`` (same math, same kernels)."""

    @staticmethod
    def forward(ctx, img: Tensor, txt: Tensor, scale: Tensor, graphs: LossGraphs) -> Tensor:
        ctx.call = graphs.run_forward(scale)
        ctx.graphs = graphs
        ctx.save_for_backward(img, txt, scale)
        return graphs.loss.clone()

    @staticmethod
    def backward(ctx, g: Tensor):
        img, txt, scale = ctx.saved_tensors  # (their version check: not modified in place since)
        dimg, dtxt, ds = ctx.graphs.run_backward(ctx.call, img, txt, scale, g)
        need = ctx.needs_input_grad
        return (dimg if need[0] else None, dtxt if need[1] else None,
                ds.to(scale.dtype) if need[2] else None, None)
