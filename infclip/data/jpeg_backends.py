"""JPEG decoders for the trainer-side decode (``data.decode=device``), and how one is chosen.

Each backend turns a list of JPEG byte strings (host memory) into ``(H, W, 3)`` uint8 images
(interleaved RGB, nvImageCodec's own layout) on the training device, ``None`` where an image
could not be decoded. The trainer never
writes a decoder: these wrap maintained libraries.

* ``hardware``: NVIDIA nvImageCodec on the GPU's JPEG engines (NVJPG: A100, A30, H100, H200,
  ...). Decoding costs the SMs nothing, so it overlaps the towers fully. Images the engines
  do not take (rare chroma layouts) go to nvImageCodec's CUDA decoder in the same call.
* ``cuda``: nvImageCodec's CUDA decoder (Huffman on the CPU, IDCT on the SMs).
* ``nvjpeg``: ``torchvision.io.decode_jpeg(device="cuda")`` (nvJPEG on the SMs), the path
  before nvImageCodec; needs nothing beyond torchvision.
* ``cpu``: on a CPU training device, nvImageCodec's libjpeg-turbo backend or PIL.

:func:`select_backend` tries them in that order (or only the one asked for), each on a probe
image that it must decode to within 2 levels of PIL's pixels, and says which runs and why
the faster ones did not.

nvImageCodec is asked for libjpeg-turbo's conventions (fancy chroma upsampling, no EXIF
rotation), so the GPU pixels match the CPU path's PIL decode as closely as the IDCTs allow.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from PIL import Image
from torch import Tensor

ORDER = ("hardware", "cuda", "nvjpeg", "cpu")  # fastest first (data.device_decoder=auto)
Bytes = np.ndarray  # uint8 (n,) view of one JPEG in host memory


@dataclass
class Backend:
    """A decoder: ``decode(datas, stream, regions=None) -> [(H,W,3) uint8 on device | None]``
    (a tensor, or nvImageCodec's :class:`DeviceImage` on CUDA: pointer, shape and strides).

    ``regions`` (only where ``roi``): per image ``(top, left, height, width)``, and the
    image returned is that region only (``data.decode_roi``: the training crop, decoded
    without the pixels the crop throws away)."""

    name: str
    on_sms: bool  # decoding occupies the GPU's SMs (competes with the towers)
    decode_fn: Callable[..., list]
    threads: int = 1  # decoder instances decoding parts of a batch at once
    lock: threading.Lock = field(default_factory=threading.Lock)
    roi: bool = False  # decodes regions of interest (nvImageCodec backends)
    options: str = ""  # nvImageCodec decoder options added by data.decoder_options

    def decode(self, datas: Sequence[Bytes], stream=None, regions: Optional[Sequence] = None) -> list[Optional[Tensor]]:
        if regions is not None and not self.roi:
            raise ValueError(f"the {self.name} decoder does not decode regions of interest")
        with self.lock:  # one decode at a time per decoder object (library state is per instance)
            if regions is None:
                return self.decode_fn(datas, stream)
            return self.decode_fn(datas, stream, regions)


_NOISE = ("nvjpeg2k", "nvJPEG2000", "nvtiff", "nvTIFF")  # codecs we never use: their absence is no news


@contextlib.contextmanager
def _quiet_optional_codecs():
    """nvImageCodec prints (C-level, to fd 2) one paragraph per optional codec library it
    cannot load (JPEG 2000, TIFF) whenever a decoder is made. Hide those lines, pass the rest."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real fd 2 (embedded interpreters): leave it alone
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines = tmp.read().decode(errors="replace").splitlines()
    kept = [ln for ln in lines if ln.strip() and not any(n in ln for n in _NOISE)]
    if kept:
        print("\n".join(kept), file=sys.stderr, flush=True)


def _nvimgcodec():
    """The nvImageCodec module, or None when the wheel (``pip install infclip[hwdecode]``) is absent."""
    try:
        os.environ.setdefault("NVIMGCODEC_LOG_LEVEL", "1")  # its C side otherwise logs per bad image
        from nvidia import nvimgcodec
    except Exception:  # ImportError, or a broken CUDA runtime underneath
        return None
    return nvimgcodec


def _nvimgcodec_backend(kind: str, device: torch.device, fallback: bool = True, threads: int = 1,
                        options: str = "") -> Backend:
    """nvImageCodec decoder restricted to ``kind``: hardware (+ CUDA for what NVJPG refuses,
    when ``fallback``), cuda, or cpu (libjpeg-turbo). ``options``: more nvImageCodec decoder
    options (``data.decoder_options``, e.g. ``nvjpeg_hw_decoder:force_legacy_batch=1``),
    appended to the ones set here.

    ``threads`` > 1 (GPU kinds): that many decoder instances, each on a CUDA stream of its
    own, decode contiguous parts of a batch at once (the calling thread takes the first part).
    A decode call is a chain of host parsing, engine submissions and small SM kernels with
    waits between them; while the towers fill the SMs each wait grows, and parallel chains
    keep the engines busy through them."""
    nv = _nvimgcodec()
    if nv is None:
        raise RuntimeError("nvImageCodec is not installed (pip install 'infclip[hwdecode]', "
                           "i.e. nvidia-nvimgcodec-cu13 and nvidia-nvjpeg)")
    kinds = {"hardware": [nv.BackendKind.HW_GPU_ONLY] + ([nv.BackendKind.GPU_ONLY] if fallback else []),
             "cuda": [nv.BackendKind.GPU_ONLY], "cpu": [nv.BackendKind.CPU_ONLY]}[kind]
    dev_id = nv.NVIMGCODEC_DEVICE_CPU_ONLY if kind == "cpu" else (device.index or 0)
    threads = 1 if kind == "cpu" or device.type != "cuda" else max(1, int(threads))
    with _quiet_optional_codecs():
        # enable_roi_fancy_upsampling: the engines' decoder refuses regions with fancy
        # upsampling on nvJPEG < 13.2 (possible 1-pixel edge errors; parity is measured by
        # scripts/bench/bench_decode.py --roi 1); whole-image decodes are unaffected.
        # force_batch_single: the engines' per-image pipeline (nvjpegDecodeJpegHost /
        # TransferToDevice / Device on a pool of worker streams) instead of one batched call,
        # which nvImageCodec picks by default for batches without mixed chroma subsampling.
        # Beside the towers it is much faster (one H200, 256-px photos: 5,726 vs 3,570 images/s
        # beside matmuls; LiT 65,536: 5,221 vs 4,739 samples/s in one call; measured there only:
        # nvImageCodec keeps single-engine GPUs such as the A100 on the batched path for small
        # batches). Options given later (data.decoder_options) override it.
        own = ":fancy_upsampling=1 :enable_roi_fancy_upsampling=1 nvjpeg_hw_decoder:force_batch_single=1"
        decs = [nv.Decoder(device_id=dev_id, backends=[nv.Backend(k) for k in kinds],
                           options=f"{own} {options.strip()}".strip())
                for _ in range(threads)]
    params = nv.DecodeParams(apply_exif_orientation=False, color_spec=nv.ColorSpec.SRGB,
                             allow_any_depth=False, sample_format=nv.SampleFormat.I_RGB)
    side = [torch.cuda.Stream(device, priority=-1) for _ in range(threads - 1)]
    pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="nvimgcodec") if threads > 1 else None

    reuse: list[list] = [[] for _ in decs]  # each instance's last output images (their buffers are reused)

    def streams(datas: Sequence[Bytes], regions: Optional[Sequence]) -> list:
        if regions is None:
            return [nv.CodeStream(d) for d in datas]
        return [nv.CodeStream(d).get_sub_code_stream(region=nv.Region(t, x, t + h, x + w))
                for d, (t, x, h, w) in zip(datas, regions)]

    def part(i: int, datas: Sequence[Bytes], handle: int, regions: Optional[Sequence] = None) -> list:
        # Decoding into the previous call's images saves a device allocation and free per
        # image. The caller guarantees stream order: what read them was enqueued on the
        # stream this decode (or its side stream, which waits for it) runs after.
        prev = reuse[i]
        images = prev[:len(datas)] if (len(prev) >= len(datas) and regions is None) else None
        outs = decs[i].decode(streams(datas, regions), images=images, params=params, cuda_stream=handle)
        if regions is None and all(o is not None for o in outs) and len(outs) >= len(prev):
            reuse[i] = list(outs)
        return outs

    def decode(datas: Sequence[Bytes], stream, regions: Optional[Sequence] = None) -> list:
        handle = 0 if stream is None else stream.cuda_stream
        n = len(datas)
        if pool is None or stream is None or n < 2 * threads:
            outs = part(0, datas, handle, regions)
        else:
            cuts = [n * i // threads for i in range(threads + 1)]
            cut = (lambda a, b: None) if regions is None else (lambda a, b: regions[a:b])
            for s in side:  # their output memory may reuse blocks the caller's stream freed
                s.wait_stream(stream)
            futs = [pool.submit(part, i, datas[cuts[i]:cuts[i + 1]], side[i - 1].cuda_stream, cut(cuts[i], cuts[i + 1]))
                    for i in range(1, threads)]
            outs = part(0, datas[:cuts[1]], handle, cut(0, cuts[1]))
            for f in futs:
                outs += f.result()
            for s in side:  # the caller's stream reads what they decoded
                stream.wait_stream(s)
        return [None if o is None else _as_image(o, device) for o in outs]

    return Backend(kind if kind != "cpu" else "cpu-nvimgcodec", on_sms=kind == "cuda", decode_fn=decode,
                   threads=threads, roi=True, options=options.strip())


class DeviceImage:
    """A decoded (H, W, 3) uint8 image in device memory as the resize kernel reads it: its
    pointer, shape and strides, read off the decoder's ``__cuda_array_interface__``; no torch
    tensor is built for it (``torch.as_tensor`` took ~23 us an image in the decode thread, 1.5 s
    of a 65,536-image LiT step, H200). Holds ``owner`` (the decoder's image, which owns the
    memory) so the memory lives as long as this does. A reader of its pixels (the probe's
    ``cpu()``, a reference resize) makes a tensor of it: ``torch.as_tensor(image)``."""

    __slots__ = ("owner", "ptr", "shape", "strides", "device")
    dtype = torch.uint8

    def __init__(self, owner, device: torch.device):
        cai = owner.__cuda_array_interface__
        shape = tuple(int(n) for n in cai["shape"])
        if cai["typestr"] != "|u1" or len(shape) != 3:
            raise ValueError(f"decoded image is {cai['typestr']} {shape}, not (H, W, C) uint8")
        strides = cai.get("strides")
        self.owner, self.ptr, self.shape, self.device = owner, int(cai["data"][0]), shape, device
        self.strides = tuple(int(x) for x in strides) if strides is not None else (shape[1] * shape[2], shape[2], 1)

    @property
    def __cuda_array_interface__(self) -> dict:
        return self.owner.__cuda_array_interface__

    def dim(self) -> int:
        return 3

    def data_ptr(self) -> int:
        return self.ptr

    def stride(self) -> tuple[int, int, int]:  # in elements (= bytes for uint8)
        return self.strides

    def cpu(self) -> Tensor:
        return torch.as_tensor(self, device=self.device).cpu()


def _as_image(img, device: torch.device):
    """An nvImageCodec image (interleaved RGB): on CUDA a :class:`DeviceImage` (no copy, no
    tensor), else an (H, W, 3) uint8 host tensor."""
    if device.type == "cuda":
        return DeviceImage(img, device)
    return torch.from_numpy(np.asarray(img.cpu()))


def _torchvision_backend(device: torch.device) -> Backend:
    from torchvision.io import ImageReadMode, decode_jpeg

    def one(d: Bytes) -> Optional[Tensor]:
        try:
            return decode_jpeg(torch.from_numpy(np.array(d)), mode=ImageReadMode.RGB, device=device).permute(1, 2, 0)
        except RuntimeError:
            return None

    def decode(datas: Sequence[Bytes], stream) -> list:
        try:  # one batched call; a single bad image fails all of it, then one by one
            out = decode_jpeg([torch.from_numpy(np.array(d)) for d in datas], mode=ImageReadMode.RGB, device=device)
            return [im.permute(1, 2, 0) for im in out]
        except RuntimeError:
            return [one(d) for d in datas]

    return Backend("nvjpeg", on_sms=True, decode_fn=decode)


def pil_decode(data: Bytes) -> Optional[Tensor]:
    """(H, W, 3) uint8 on the CPU from PIL (the CPU path's decoder), None if it fails."""
    try:
        with Image.open(io.BytesIO(data.tobytes())) as im:
            arr = np.asarray(im.convert("RGB"))
    except Exception:
        return None
    return torch.from_numpy(arr.copy())


def _pil_backend(device: torch.device) -> Backend:
    return Backend("cpu-pil", on_sms=False, decode_fn=lambda datas, stream: [pil_decode(d) for d in datas])


def _build(name: str, device: torch.device, threads: int = 1, options: str = "") -> Backend:
    if name in ("hardware", "cuda"):
        if device.type != "cuda":
            raise RuntimeError("needs a CUDA training device")
        if name == "hardware":  # the engines alone must decode the probe (else CUDA would, silently)
            _probe(_nvimgcodec_backend(name, device, fallback=False), device)
        return _nvimgcodec_backend(name, device, threads=threads, options=options)
    if name == "nvjpeg":
        if device.type != "cuda":
            raise RuntimeError("needs a CUDA training device")
        return _torchvision_backend(device)
    if device.type == "cuda":
        raise RuntimeError("the CPU decoder is for CPU training devices")
    try:
        return _nvimgcodec_backend("cpu", device)
    except Exception:
        return _pil_backend(device)


def probe_jpeg() -> tuple[bytes, np.ndarray]:
    """A 4:2:0 baseline JPEG of a smooth 96x80 gradient and PIL's decode of it."""
    y, x = np.mgrid[0:80, 0:96]
    rgb = np.stack([x * 2.5, y * 3.0, (x + y) * 1.4], -1).clip(0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="JPEG", quality=90, subsampling=2)
    data = buf.getvalue()
    return data, np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def _probe(backend: Backend, device: torch.device) -> None:
    """Decode the probe image; raise unless it matches PIL within 2 levels on average."""
    data, ref = probe_jpeg()
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    out = backend.decode([np.frombuffer(data, np.uint8)], stream)
    if stream is not None:
        stream.synchronize()
    if not out or out[0] is None:
        raise RuntimeError("could not decode a baseline 4:2:0 JPEG")
    got = out[0].cpu().numpy().astype(np.int16)
    err = np.abs(got - ref).mean() if got.shape == ref.shape else np.inf
    if not err <= 2.0:
        raise RuntimeError(f"decoded the probe JPEG {err:.2f} levels away from PIL on average")


@dataclass
class Selection:
    backend: Backend
    skipped: list[tuple[str, str]]  # (faster backend, why it was not taken)

    def describe(self) -> str:
        why = "; ".join(f"{n}: {r}" for n, r in self.skipped)
        where = "GPU JPEG engines" if self.backend.name == "hardware" else (
            "GPU SMs" if self.backend.on_sms else "CPU")
        par = f", {self.backend.threads} decoders in parallel" if self.backend.threads > 1 else ""
        par += f", options {self.backend.options!r}" if self.backend.options else ""
        return f"{self.backend.name} ({where}{par})" + (f" [not taken: {why}]" if why else "")


def select_backend(device: torch.device | str, preference: str = "auto", threads: int = 1,
                   options: str = "") -> Selection:
    """The fastest working backend for ``device`` (``preference`` "auto"), or exactly the one
    named; nvImageCodec backends with ``threads`` decoder instances and ``options`` appended to
    their decoder options. Raises RuntimeError naming every failure when none works."""
    device = torch.device(device)
    names = ORDER if preference == "auto" else (preference,)
    if preference not in ("auto", *ORDER):
        raise ValueError(f"data.device_decoder must be auto or one of {ORDER}, got {preference!r}")
    skipped = []
    for name in names:
        if device.type != "cuda" and name != "cpu" and preference == "auto":
            continue  # not applicable on a CPU device: not worth a line
        try:
            with _quiet_optional_codecs():  # nvImageCodec loads its codec libraries lazily
                backend = _build(name, device, threads, options)
                _probe(backend, device)
            return Selection(backend, skipped)
        except Exception as e:  # a missing library, no engine on this GPU, a bad driver ...
            skipped.append((name, str(e).splitlines()[0][:160] if str(e) else type(e).__name__))
    raise RuntimeError("no JPEG decoder works on " + str(device) + ": "
                       + "; ".join(f"{n}: {r}" for n, r in skipped))


def hardware_available(device: torch.device | str) -> Optional[str]:
    """None when the GPU's JPEG engines decode the probe image, else the reason they do not."""
    try:
        dev = torch.device(device)
        with _quiet_optional_codecs():
            backend = _build("hardware", dev)
            _probe(backend, dev)
        return None
    except Exception as e:
        return str(e).splitlines()[0][:160] if str(e) else type(e).__name__
