"""An image folder of class subfolders -> clip_benchmark's zero-shot webdataset layout.

    python -m infclip.eval.wds_export my_images --out my_wds [--templates my_templates.txt] [--shard-size N]

``my_images/<class name>/*.jpg|png|webp`` (classes in sorted folder order, as torchvision's
ImageFolder and ``infclip.eval``'s ``format: imagefolder`` number them) becomes

    my_wds/classnames.txt                          one class name per line (the folder names)
    my_wds/zeroshot_classification_templates.txt   one template per line, {c} = the class name
    my_wds/test/0.tar, 1.tar, ...                  {key}.{ext} (the file's own bytes) + {key}.cls (label)
    my_wds/test/nshards.txt

which both ``clip_benchmark eval --dataset wds/<name> --dataset_root my_wds`` and
``python -m infclip.eval "tasks=[{..., format: wds, root: my_wds}]"`` read. Images are copied
byte for byte (none is re-encoded); a file that is not an image by extension is left out and
counted. Each file is written under a temporary name and renamed, ``nshards.txt`` last: a
folder without it is incomplete.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import webdataset

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
DEFAULT_TEMPLATES = ("a photo of a {c}.", "a photo of the {c}.", "a picture of a {c}.")


def list_classes(root: str) -> list[tuple[str, list[str]]]:
    """(class name, sorted image paths) per class subfolder, classes in sorted order."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{root!r} is not a folder (expected <root>/<class name>/<image files>)")
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)) and not d.startswith("."))
    if not classes:
        raise ValueError(f"{root!r} has no class subfolders (expected <root>/<class name>/<image files>)")
    out = []
    for c in classes:
        folder = os.path.join(root, c)
        out.append((c, sorted(os.path.join(folder, f) for f in os.listdir(folder) if not f.startswith("."))))
    return out


def _atomic_text(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


MIN_SHARDS = 8  # clip_benchmark's loader fails on fewer shards than its workers (4 by default)


def default_shard_size(n: int) -> int:
    """At most 1,000 images per tar, and at least MIN_SHARDS tars when there are that many images."""
    return max(1, min(1000, -(-n // MIN_SHARDS)))


def export(root: str, out: str, templates: Optional[Sequence[str]] = None, shard_size: Optional[int] = None,
           split: str = "test") -> dict[str, int]:
    """Write the layout (module docstring); returns counts: images, classes, shards, skipped."""
    classes = list_classes(root)
    samples, skipped = [], 0
    for label, (_, paths) in enumerate(classes):
        for p in paths:
            ext = os.path.splitext(p)[1].lower().lstrip(".")
            if ext in IMAGE_EXTS and os.path.isfile(p):
                samples.append((p, "jpg" if ext == "jpeg" else ext, label))
            else:
                skipped += 1
    os.makedirs(os.path.join(out, split), exist_ok=True)
    _atomic_text(os.path.join(out, "classnames.txt"), "".join(f"{c}\n" for c, _ in classes))
    _atomic_text(os.path.join(out, "zeroshot_classification_templates.txt"),
                 "".join(f"{t}\n" for t in (templates or DEFAULT_TEMPLATES)))
    shard_size = shard_size or default_shard_size(len(samples))
    shards = max(1, -(-len(samples) // shard_size))
    for s in range(shards):
        path = os.path.join(out, split, f"{s}.tar")
        with open(path + ".tmp", "wb") as f, webdataset.TarWriter(f) as tar:  # bytes written as given
            for i in range(s * shard_size, min((s + 1) * shard_size, len(samples))):
                src, ext, label = samples[i]
                with open(src, "rb") as img:
                    tar.write({"__key__": f"s{i:08d}", ext: img.read(), "cls": str(label).encode()})
        os.replace(path + ".tmp", path)
    _atomic_text(os.path.join(out, split, "nshards.txt"), f"{shards}\n")
    return {"images": len(samples), "classes": len(classes), "shards": shards, "skipped": skipped}


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", help="image folder: <root>/<class name>/<images>")
    p.add_argument("--out", required=True, help="output folder (clip_benchmark wds layout)")
    p.add_argument("--templates", default=None, help="a text file, one template per line, {c} for the class name")
    p.add_argument("--shard-size", type=int, default=None,
                   help=f"images per tar (default: at most 1000, and at least {MIN_SHARDS} tars: clip_benchmark's "
                        "loader needs a tar per worker)")
    a = p.parse_args(argv)
    templates = None
    if a.templates:
        with open(a.templates) as f:
            templates = [t.strip() for t in f if t.strip()]
        if not templates or any("{c}" not in t for t in templates):  # clip_benchmark: template.format(c=name)
            print(f"error: {a.templates}: every template needs {{c}} where the class name goes "
                  f"(clip_benchmark fills it with format(c=...))", file=sys.stderr)
            sys.exit(2)
    try:
        n = export(a.root, a.out, templates, a.shard_size)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    name = os.path.basename(os.path.normpath(a.out))
    print(f"wrote {n['images']} images of {n['classes']} classes in {n['shards']} shards to {a.out} "
          f"(skipped {n['skipped']} files that are no images)")
    workers = "" if n["shards"] >= 4 else f" --num_workers {n['shards']}"  # one tar per loader worker at least
    # --no_amp: fp32 encoders, as python -m infclip.eval's default precision=fp32 (its autocast
    # default moves accuracies in the third decimal)
    print(f"clip_benchmark eval --dataset wds/{name} --dataset_root {a.out} --task zeroshot_classification "
          f"--model local-dir:<checkpoint folder> --pretrained none --no_amp{workers}")


if __name__ == "__main__":
    main()
