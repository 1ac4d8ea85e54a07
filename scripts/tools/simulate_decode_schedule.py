"""The device decoder's schedule on the CPU: does it leave the decoder idle where decoding bounds
the step?

Runs ``train.py`` with ``data.decode=device`` (on the CPU its stand-in decoder) and every decode
call slowed by ``--decode-s`` seconds of sleep (the GIL released, as while the GPU's JPEG
engines work), so that decoding bounds the step as on a GPU at 512 px, and traces one step
(``logging.decode_trace_step``): the log's per-phase busy share and idle stretches say whether
the threads (decode-ahead during the replay, the prefetch one micro-batch ahead, the LiT ring)
keep the decoder busy. What it leaves out: the GIL held by the towers' host work, the GPU, the
engines.

    python scripts/tools/simulate_decode_schedule.py                      # LiT, no ring
    python scripts/tools/simulate_decode_schedule.py memory.stream_rows=64  # LiT with a 4-micro-batch ring
    python scripts/tools/simulate_decode_schedule.py --decode-s 0.02 model.lock_image=false

Extra arguments are train.py overrides, after the defaults below.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = ["model.name=infclip-micro", "data.synthetic_train=1024", "data.synthetic_image_size=32",
            "data.workers=1", "data.loader_batch=16", "batch.global_size=256", "batch.micro_size=16", "steps=4",
            "data.decode=device", "model.lock_image=true", "memory.offload=true", "logging.decode_trace_step=3",
            "logging.every_n_steps=1", "logging.progress=false", "logging.wandb_mode=disabled", "eval.tasks=[]",
            "checkpoint.every_n_steps=0"]


def slow_decoder(seconds: float) -> None:
    """Every JpegDecoder decode call takes ``seconds`` more (a sleep: the GIL released)."""
    from infclip.data.jpeg import JpegDecoder

    real = JpegDecoder._decode_resize

    def slow(self, rows):
        time.sleep(seconds)
        return real(self, rows)

    JpegDecoder._decode_resize = slow


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decode-s", type=float, default=0.05, help="seconds added to each decode call")
    p.add_argument("--run-dir", default=None, help="run directory (default: a fresh temporary one)")
    a, overrides = p.parse_known_args()
    if a.decode_s < 0:
        p.error(f"--decode-s must be >= 0, got {a.decode_s}")
    run_dir = a.run_dir or tempfile.mkdtemp(prefix="decode_schedule_")
    data = Path(run_dir) / "data"
    slow_decoder(a.decode_s)
    sys.argv = [str(ROOT / "train.py"), f"data.synthetic_root={data}", f"run_dir={Path(run_dir) / 'run'}",
                *DEFAULTS, *overrides]
    os.environ.setdefault("WANDB_MODE", "disabled")
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main()
