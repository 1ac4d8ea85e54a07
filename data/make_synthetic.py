"""Write the synthetic captioned-shapes dataset (the quickstart's embedded default).

    python data/make_synthetic.py --out /tmp/shapes [--train 8192 --eval 512 --size 64 --seed 0]

Without --out the dataset goes where the trainer looks for it (~/.cache/infclip/...).
"""

from __future__ import annotations

import argparse
import time

from infclip.data.config import DataConfig
from infclip.data.synthetic import ensure_synthetic


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="dataset root (default: the trainer's cache folder)")
    p.add_argument("--train", type=int, default=8192, help="training samples")
    p.add_argument("--eval", type=int, default=512, help="held-out eval images")
    p.add_argument("--size", type=int, default=64, help="image side in pixels")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    cfg = DataConfig(synthetic_root=a.out, synthetic_train=a.train, synthetic_eval=a.eval,
                     synthetic_image_size=a.size, synthetic_seed=a.seed)
    t0 = time.time()
    ds = ensure_synthetic(cfg)
    print(f"synthetic dataset at {ds.root} ({time.time() - t0:.1f}s)")
    print(f"  train: {ds.num_train} samples in {ds.num_train_shards} shards: {ds.train_shards}")
    print(f"  eval : {ds.num_eval} images; zero-shot {ds.zeroshot_root} ({len(ds.classnames)} classes), "
          f"retrieval {ds.retrieval_annotations}")


if __name__ == "__main__":
    main()
