"""Run by the tests in place of train.py (same command line, also under torchrun): trains through
train.py's own main while every loader batch a rank takes is appended to
``$SAMPLE_TRACE/rank<RANK>.jsonl`` as ``{"index": global batch number, "keys": sample keys}``
(prefetched batches included: the test keeps those below the checkpoint's position)."""

import json
import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from infclip.data import pipeline  # noqa: E402

_advance = pipeline.TrainData._advance


def _recording(self, info: dict) -> None:
    _advance(self, info)
    path = Path(os.environ["SAMPLE_TRACE"]) / f"rank{os.environ.get('RANK', '0')}.jsonl"
    with open(path, "a") as f:
        f.write(json.dumps({"index": info["index"], "keys": info["keys"]}) + "\n")


pipeline.TrainData._advance = _recording

if __name__ == "__main__":
    sys.argv[0] = str(ROOT / "train.py")
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
