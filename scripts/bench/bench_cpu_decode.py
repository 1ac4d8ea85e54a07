"""CPU loader throughput: full JPEG decode vs draft (DCT-scaled) decode, plus simplejpeg and
PyTurboJPEG decoding at the same DCT scale, on photo shards written to a temporary folder.

    python scripts/bench/bench_cpu_decode.py --sides 128,256,512 --size 224 --num-samples 2000 --workers 16

For each stored shorter side: photo shards (photos.py in this folder), then for each decoder the
loader alone (build_train_data: tar reading, shuffle, decode, crop, resize, uint8; a
zero-cost tokenizer) at data.workers=0 (one core) and data.workers=N, in images/s after the
first batch; and the transform alone on --compare images in memory (one core). Speedups
are over today's full PIL decode; "diff" is the mean absolute difference from it in grey
levels (same seeds, same crops); "drafted": share of crops decoded below full size by PIL. simplejpeg / PyTurboJPEG columns
appear when they are installed (PyTurboJPEG also needs the libturbojpeg library).
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
import time
from typing import Callable, Optional

import torch
from PIL import Image
from torchvision.transforms import RandomResizedCrop

from infclip.data.config import DataConfig
from infclip.data.pipeline import build_train_data
from infclip.data.transforms import (DraftRandomResizedCrop, ImageDecodeError, crop_resize, draft_factor,
                                     train_transform)
from infclip.data.writer import ShardStats
from photos import PhotoShardOptions, load_photos, shard_jpegs, write_photo_shards  # this folder's writer


class ZeroTokenizer:
    """Free tokenizer: the benchmark measures image work only."""

    def __call__(self, texts: list[str]) -> torch.Tensor:
        return torch.zeros(len(texts), 1, dtype=torch.int64)


class _LibCrop(DraftRandomResizedCrop):
    """A DraftRandomResizedCrop whose JPEG decode (at the same 1/r) is another library's.
    Subclasses give ``header(data) -> (w, h)`` and ``decode_scaled(data, r) -> HxWx3 uint8``."""

    def __call__(self, data: bytes) -> torch.Tensor:
        try:
            w, h = self.header(data)
        except Exception:
            return super().__call__(data)  # not a JPEG this library reads: PIL's path
        state = torch.get_rng_state()
        like = torch.empty(()).expand(1, h, w)  # get_params reads only the size
        top, left, ch, cw = RandomResizedCrop.get_params(like, self.scale, self.ratio)
        r = draft_factor(cw, ch, self.size)
        try:
            rgb = Image.fromarray(self.decode_scaled(data, r))
        except Exception as e:
            torch.set_rng_state(state)
            raise ImageDecodeError(str(e)) from None
        if rgb.size != (-(-w // r), -(-h // r)):
            raise AssertionError(f"{type(self).__name__}: got {rgb.size} for {(w, h)} at 1/{r}")
        return crop_resize(rgb, r, (top, left, ch, cw), self.size)


class SimpleJpegCrop(_LibCrop):
    def header(self, data: bytes) -> tuple[int, int]:
        import simplejpeg

        h, w, _, _ = simplejpeg.decode_jpeg_header(data)
        return w, h

    def decode_scaled(self, data: bytes, r: int):
        import simplejpeg

        w, h = self.header(data)
        return simplejpeg.decode_jpeg(data, "RGB", min_height=-(-h // r), min_width=-(-w // r))


class SimpleJpegFineCrop(SimpleJpegCrop):
    """simplejpeg choosing its own scale among libjpeg-turbo's n/8 factors (min_height/min_width:
    the smallest decode in which the crop still spans ``size`` pixels); r = 8 / n, not a power of 2."""

    def __call__(self, data: bytes) -> torch.Tensor:
        import simplejpeg

        try:
            w, h = self.header(data)
        except Exception:
            return DraftRandomResizedCrop.__call__(self, data)
        top, left, ch, cw = RandomResizedCrop.get_params(torch.empty(()).expand(1, h, w), self.scale, self.ratio)
        arr = simplejpeg.decode_jpeg(data, "RGB", min_height=-(-h * self.size // ch),
                                     min_width=-(-w * self.size // cw))
        n = next(n for n in range(1, 9) if (-(-w * n // 8), -(-h * n // 8)) == (arr.shape[1], arr.shape[0]))
        return crop_resize(Image.fromarray(arr), 8 / n, (top, left, ch, cw), self.size)


class TurboJpegCrop(_LibCrop):
    _jpeg = None

    def _lib(self):
        if TurboJpegCrop._jpeg is None:
            from turbojpeg import TurboJPEG

            TurboJpegCrop._jpeg = TurboJPEG()
        return TurboJpegCrop._jpeg

    def header(self, data: bytes) -> tuple[int, int]:
        w, h, _, _ = self._lib().decode_header(data)
        return w, h

    def decode_scaled(self, data: bytes, r: int):
        from turbojpeg import TJPF_RGB

        return self._lib().decode(data, pixel_format=TJPF_RGB, scaling_factor=(1, r))


def available(size: int) -> dict[str, Callable]:
    """Decoders to compare; the optional libraries only where they import and work."""
    out: dict[str, Callable] = {"pil-full": train_transform(size, draft=False),
                                "pil-draft": train_transform(size)}
    for name, cls in (("simplejpeg", SimpleJpegCrop), ("simplejpeg-n/8", SimpleJpegFineCrop),
                      ("turbojpeg", TurboJpegCrop)):
        try:
            probe = cls(size)
            probe.header(_probe_jpeg())
            out[name] = probe
        except Exception as e:  # ImportError, or no libturbojpeg
            print(f"[{name} unavailable: {type(e).__name__}: {str(e).splitlines()[0][:90]}]")
    return out


def _probe_jpeg() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (10, 200, 30)).save(buf, format="JPEG")
    return buf.getvalue()


def loader_rate(spec: str, n: int, transform: Callable, workers: int, batch: int) -> float:
    """Images/s of one epoch through the training loader, timed from the first batch: CPU time
    of this process for workers=0 (robust to other load on the machine), else wall time."""
    clock = time.process_time if workers == 0 else time.perf_counter
    cfg = DataConfig(kind="wds", shards=spec, loader_batch=batch, workers=workers)
    data = build_train_data(cfg, transform=transform, tokenizer=ZeroTokenizer(), rank=0, world_size=1,
                            seed=0, num_samples=n)
    it = data.batches()
    next(it)
    start = clock()
    for _ in range(data.epoch_batches - 1):
        next(it)
    seconds = clock() - start
    it.close()
    return (data.epoch_batches - 1) * batch / seconds


def transform_rate(jpegs: list[bytes], transform: Callable) -> float:
    """Images/s of the transform alone (bytes in memory -> uint8 crop), in CPU time."""
    takes_bytes = getattr(transform, "decodes_bytes", False)
    torch.manual_seed(0)
    start = time.process_time()
    for data in jpegs:
        if takes_bytes:
            transform(data)
        else:
            with Image.open(io.BytesIO(data)) as img:
                transform(img.convert("RGB"))
    return len(jpegs) / (time.process_time() - start)


def compare(jpegs: list[bytes], transform: Callable, reference: Callable, size: int
            ) -> tuple[float, float, float]:
    """(mean and max over images of the mean |transform - reference| in grey levels, share of
    crops >= 2x the output, i.e. drafted by the PIL path); same seeds, so the same crops."""
    diffs, drafted = [], 0
    for i, data in enumerate(jpegs):
        with Image.open(io.BytesIO(data)) as img:
            full = img.convert("RGB")
        torch.manual_seed(i)
        _, _, h, w = RandomResizedCrop.get_params(full, [0.08, 1.0], [0.75, 1.3333333])
        drafted += draft_factor(w, h, size) > 1
        torch.manual_seed(i)
        a = transform(data) if getattr(transform, "decodes_bytes", False) else transform(full)
        torch.manual_seed(i)
        diffs.append((a.float() - reference(full).float()).abs().mean().item())
    return sum(diffs) / len(diffs), max(diffs), drafted / len(jpegs)


def bench_side(side: int, a: argparse.Namespace, root: str, photos) -> list[list[str]]:
    """One table row per decoder; the repeats are interleaved over the decoders (a burst of
    other load then hits every decoder alike) and the best rate of each is kept."""
    out = os.path.join(root, f"side{side}")
    opts = PhotoShardOptions(out_dir=out, num_samples=a.num_samples, seed=0, side=side,
                             shard_size=max(1, a.num_samples // max(2 * a.workers, 4)), workers=a.workers)
    report = write_photo_shards(photos, opts)
    spec = ShardStats(report.sizes).brace_spec(out)
    sample = shard_jpegs(out, a.compare)
    decoders = available(a.size)
    rates = {name: {"alone": 0.0, "one": 0.0, "many": 0.0} for name in decoders}
    for _ in range(a.repeats):
        for name, t in decoders.items():
            got = {"alone": transform_rate(sample, t),
                   "one": loader_rate(spec, report.samples, t, 0, a.batch),
                   "many": loader_rate(spec, report.samples, t, a.workers, a.batch)}
            rates[name] = {k: max(v, got[k]) for k, v in rates[name].items()}
    rows, base = [], rates["pil-full"]
    for name, t in decoders.items():
        mean, worst, drafted = compare(sample, t, decoders["pil-full"], a.size)
        rows.append([str(side), f"{report.mean_kb:.1f}", name]
                    + [f"{rates[name][k]:.0f} ({rates[name][k] / base[k]:.2f}x)" for k in ("alone", "one", "many")]
                    + [f"{mean:.2f}", f"{worst:.2f}", f"{100 * drafted:.0f}%"])
    return rows


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sides", default="128,256,512", help="stored shorter sides to test")
    p.add_argument("--size", type=int, default=224, help="training crop size")
    p.add_argument("--num-samples", type=int, default=2000, help="samples per side")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="loader workers for the N column")
    p.add_argument("--batch", type=int, default=64, help="loader batch")
    p.add_argument("--compare", type=int, default=200, help="images for the transform and difference columns")
    p.add_argument("--repeats", type=int, default=3, help="best of this many timings")
    p.add_argument("--photos", default=None, help="folder of source photos (default: bundled)")
    a = p.parse_args(argv)
    photos = load_photos(a.photos)
    header = ["side", "kB/img", "decoder", "transform 1 core", "loader 1 core",
              f"loader {a.workers} workers", "diff", "max diff", "drafted"]
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for side in (int(s) for s in a.sides.split(",")):
            done = bench_side(side, a, root, photos)
            print(table(done, header), flush=True)  # progress
            rows += done
    print(f"\nimages/s, crop {a.size}, {a.num_samples} samples per side, loader batch {a.batch}")
    print(table(rows, header))
    print("images/s (speedup vs pil-full), best of the repeats; 1-core columns in CPU time, the "
          "workers column in wall time; diff: mean over images of the mean "
          "|decoder - pil-full| in grey levels (0-255), max diff: the worst image; drafted: crops "
          ">= 2x the output in both directions (decoded at 1/2..1/8 by the PIL draft path)")


if __name__ == "__main__":
    main()
