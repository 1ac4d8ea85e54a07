"""What the Hopper Gluon kernels (``gluon_fwd``, ``gluon_strip``) share on the host side.

The guarded import of triton's Gluon (triton >= 3.6, whose API the kernels are written
against): importing this module never fails; without Gluon ``gluon`` and ``gl`` are None,
``jit`` returns the plain function (never launched) and ``sm90_16bit`` says no. Also the
base-2 constants the kernels read as constexprs, the shared-memory budget, the availability
prelude both kernels need (sm_90, 16-bit, TMA-able rows, K a multiple of ``BK``), the checks of
their group-id arguments (``band_args``: the sorted-band case only) and the compiled-kernel
report of the check scripts.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..launching import tma_ok

try:  # triton >= 3.6 with Gluon (Hopper); anything else: the module imports, the kernels are off
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    GLUON_ERROR: Exception | None = None
except Exception as err:  # noqa: BLE001 -- ImportError, or an older Gluon missing a name
    gluon = gl = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = None
    GLUON_ERROR = err

LOG2E = gl.constexpr(1.4426950408889634) if gl is not None else 1.4426950408889634
LN2 = gl.constexpr(0.6931471805599453) if gl is not None else 0.6931471805599453
SMEM_BYTES = 220 << 10  # usable shared memory per block on Hopper, minus slack (as launch.SMEM_BYTES)
SMEM_RESERVE = 8 << 10  # barriers + the compiler's reduction / layout-conversion scratch
MAX_STAGES = 12  # ring depth cap: more chunks in flight buy nothing (~1.5 tiles at K = 512)
MIN_GLUON = (3, 6)  # the Gluon API the kernels are written against (warp_specialize's list form)
BK = 64  # K chunk of every ring: 128 bytes of 16-bit inputs, the widest TMA swizzle


def jit(fn):
    """``gluon.jit`` when Gluon imported, else the plain function (never launched)."""
    return gluon.jit(fn) if gluon is not None else fn


@functools.cache
def version_ok() -> bool:
    """Whether the installed triton is at least ``MIN_GLUON``."""
    import triton

    parts = triton.__version__.split(".")
    try:
        return (int(parts[0]), int(parts[1])) >= MIN_GLUON
    except (ValueError, IndexError):
        return False


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def sm90_16bit(a: Tensor, b: Tensor) -> bool:
    """The prelude of both kernels' availability: Gluon importable (triton >= 3.6), a and b
    2-D CUDA tensors of one 16-bit dtype with the same K, a multiple of ``BK``, rows TMA can
    load, on an sm_90 device (H100 / H200)."""
    if gluon is None or not (a.is_cuda and b.is_cuda) or not version_ok():
        return False
    if a.dim() != 2 or b.dim() != 2 or a.dtype != b.dtype or a.dtype not in (torch.bfloat16, torch.float16):
        return False
    k = a.shape[1]
    if b.shape[1] != k or k == 0 or k % BK or not tma_ok(a, b):
        return False
    return _capability(a.device.index if a.device.index is not None else torch.cuda.current_device()) == (9, 0)


@jit
def turn_barriers(STAGES: gl.constexpr):
    """(ready, empty, turn): the ring's per-slot mbarriers (a chunk landed / a slot released)
    and the two consumers' turn barriers, each initialized for one arrival; the caller fences
    (``fence_async_shared``) once its own barriers are initialized too."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    return ready, empty, turn


@jit
def mma_turn(a_smem, b_smem, ready, empty, turn, acc, t, C: gl.constexpr, NK: gl.constexpr,
             STAGES: gl.constexpr, A_RING: gl.constexpr):
    """One consumer's MMA phase of its tile t (the ping-pong both kernels share): wait for its
    turn (the other consumer's tile t - 1 has issued its wgmmas), issue the NK async wgmmas of
    acc = A_t B_t^T over the ring's K chunks g = t NK + k (slot g % STAGES, phase
    (g // STAGES) & 1), give each slot back to the producer once the wgmma after it has
    retired, hand the turn to the other consumer, wait for the last and give back its slot;
    the other consumer's wgmmas then run during this one's epilogue. A chunks: ``a_smem.index(k)`` (resident,
    the forward) or, A_RING, the ring's ``a_smem.index(slot)`` (the strip fill). K is a
    runtime loop after the first chunk (unrolled, the chunks' hoisted addresses spill).
    The turn is handed over once the last wgmma is issued, not once it retired
    (FlashAttention-3's order: the other consumer's wgmmas queue behind it). Sound for the
    shared FIFO: the other consumer's ``ready`` waits still follow every one of this
    consumer's (all issued before the hand-off). Measured (H200, forward alone, b = 65,536,
    commits 1853948 and 0e38f7b): the same times as the hand-off at retirement (within 2 %), and 2 or 3
    wgmma groups in flight before a slot goes back instead of 1 no faster either."""
    mbarrier.wait(turn.index(C), (gl.maximum(t - 1, 0) // 2) & 1, pred=t > 0)
    g = t * NK
    slot = g % STAGES
    mbarrier.wait(ready.index(slot), (g // STAGES) & 1)
    a0 = a_smem.index(slot) if A_RING else a_smem.index(0)
    acc = warpgroup_mma(a0, b_smem.index(slot).permute((1, 0)), acc, use_acc=False, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))  # no wait: the token back to a tensor
    for k in range(1, NK):
        g = t * NK + k
        slot = g % STAGES
        mbarrier.wait(ready.index(slot), (g // STAGES) & 1)
        a_k = a_smem.index(slot) if A_RING else a_smem.index(k)
        acc = warpgroup_mma(a_k, b_smem.index(slot).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))  # the previous chunk's retired
        mbarrier.arrive(empty.index((g - 1) % STAGES))
    mbarrier.arrive(turn.index(1 - C))  # FA3's hand-off: the other's wgmmas queue behind this one's last
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(empty.index((t * NK + NK - 1) % STAGES))
    return acc


def band_args(gid_a: Tensor | None, gid_b: Tensor | None, band: Tensor | None, m: int, n: int,
              has_diag: bool) -> dict:
    """The kernels' group-id arguments (``gid_a_ptr``, ``gid_b_ptr``, ``band_ptr``, ``BAND``) for
    ``lse_forward_gluon`` and ``gluon_strip.fill_strip_gluon``: all None / False without ids;
    else the sorted-band case only (``launch._band``'s): int32 ids of one device, a (1,) int32
    w on it, the positives' square block pair (``has_diag``; the Triton kernels' BAND needs
    it too). Ids without a band (the ring, whose blocks compare every tile) are refused: the
    Triton kernels take those."""
    if gid_a is None and gid_b is None and band is None:
        return dict(gid_a_ptr=None, gid_b_ptr=None, band_ptr=None, BAND=False)
    if gid_a is None or gid_b is None or band is None:
        raise ValueError("the Gluon kernels take group ids only as (gid_a, gid_b, band) of a batch sorted by group "
                         "(the ring's ids without a band run on the Triton kernels)")
    if not has_diag or m != n:
        raise ValueError(f"the band needs the positives' square block pair (has_diag), got {m} x {n}"
                         + ("" if has_diag else " without has_diag"))
    for name, t, size in (("gid_a", gid_a, m), ("gid_b", gid_b, n), ("band", band, 1)):
        if t.dtype != torch.int32 or t.shape != (size,) or not t.is_contiguous() or t.device != gid_a.device:
            raise ValueError(f"{name} must be a contiguous ({size},) int32 tensor on {gid_a.device}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    return dict(gid_a_ptr=gid_a, gid_b_ptr=gid_b, band_ptr=band, BAND=True)


def gl_dtype(t: Tensor):
    """The Gluon dtype of a 16-bit tensor."""
    return gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16


def compile_info(kernel) -> dict:
    """What a compiled kernel says about itself (the check scripts' report): registers,
    spills, shared memory, wgmma in the PTX, HGMMA in the SASS, setmaxnreg, TMA stores."""
    asm = getattr(kernel, "asm", {}) or {}
    ptx = asm.get("ptx", "") or ""
    sass = asm.get("sass", "") or ""
    meta = getattr(kernel, "metadata", None)
    return dict(n_regs=getattr(kernel, "n_regs", None), n_spills=getattr(kernel, "n_spills", None),
                shared=getattr(meta, "shared", None), ptx_wgmma=ptx.count("wgmma.mma_async"),
                ptx_tma_store=ptx.count("cp.async.bulk.tensor") - ptx.count(".shared::cluster.global"),
                sass_hgmma=sass.count("HGMMA") if sass else None, setmaxnreg=ptx.count("setmaxnreg"))


def flops(m: int, n: int, k: int) -> float:
    """Tensor-core FLOPs of one m x n x k product (a forward pass, or one strip fill)."""
    return 2.0 * m * n * k
