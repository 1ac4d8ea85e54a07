"""Synthetic captioned-shapes dataset: the embedded default that the quickstart trains on.

Each image is a coloured shape (circle, square, triangle, star, diamond, cross) of some
size at some position on a plain background; 30% of training images carry a second, small
object. Captions are templated in several phrasings and always name the main object's
colour and shape; size, position, background and the second object are extras. Everything
is a pure function of (seed, split, index), so a dataset is reproducible byte for byte.

Layout under the root (see :class:`SyntheticDataset`)::

    train/00000.tar ...                 img2dataset layout, written by ShardWriter
    eval/zeroshot/classnames.txt        "red circle" ... (colour x shape), one per line
    eval/zeroshot/zeroshot_classification_templates.txt
    eval/zeroshot/test/{0..n-1}.tar     {key}.jpg + {key}.cls (clip_benchmark wds layout)
    eval/zeroshot/test/nshards.txt
    eval/retrieval/images/<key>.jpg
    eval/retrieval/test.json            [{"image": "images/<key>.jpg", "caption": [5 captions]}]
    manifest.json                       written last: its presence marks a complete dataset
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import math
import os
import random
import shutil
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Optional

from PIL import Image, ImageDraw

from infclip.data.config import DataConfig
from infclip.data.writer import ShardWriter, tar_writer

GENERATOR_VERSION = 1  # bump when the images or captions change: it is part of the cache key

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "orange": (245, 140, 20), "yellow": (240, 220, 30),
    "green": (40, 170, 60), "blue": (35, 80, 220), "purple": (135, 50, 180),
    "pink": (250, 130, 190), "cyan": (40, 210, 220),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "diamond", "cross")
# Neutral backgrounds never collide with an object colour.
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (245, 245, 245), "light gray": (190, 190, 190),
    "dark gray": (70, 70, 70), "black": (15, 15, 15),
}
SIZES: dict[str, float] = {"small": 0.13, "medium": 0.2, "large": 0.3}  # radius / image side
POSITIONS: dict[str, tuple[float, float]] = {
    "top left": (0.25, 0.25), "top": (0.5, 0.25), "top right": (0.75, 0.25),
    "left": (0.25, 0.5), "center": (0.5, 0.5), "right": (0.75, 0.5),
    "bottom left": (0.25, 0.75), "bottom": (0.5, 0.75), "bottom right": (0.75, 0.75),
}
CLASSNAMES: tuple[str, ...] = tuple(f"{c} {s}" for c in COLORS for s in SHAPES)
ZEROSHOT_TEMPLATES: tuple[str, ...] = (
    "a photo of a {c}.", "a {c}.", "a drawing of a {c}.", "an image of a {c}.",
    "a {c} on a plain background.",
)
# Caption templates; {obj} is "<colour> <shape>", {sobj} adds the size word.
CAPTION_TEMPLATES: tuple[str, ...] = (
    "{a_obj}", "{a_sobj}", "a photo of {a_obj}", "{a_obj} {pos}", "{a_sobj} on a {bg} background",
    "an image of {a_obj} on {bg}", "{obj}, {size}, {pos_word}", "there is {a_sobj} {pos}",
    "a drawing of {a_obj} on a {bg} background", "a picture showing {a_sobj}", "the {shape} is {color}",
    "{a_sobj} {pos} on a {bg} background",
)
SECOND_OBJECT_PROB = 0.3
TRAIN_SHARD_SIZE = 512  # at most; 16 shards for the default 8192
MIN_TRAIN_SHARDS = 16  # small datasets get smaller shards: epoch mode needs >= ranks x workers
EVAL_SHARD_SIZE = 1024


@dataclass
class ShapeSpec:
    """One drawn object."""

    color: str
    shape: str
    size: str
    position: str


@dataclass
class SceneSpec:
    """One image: a main object, an optional small second object and a background."""

    main: ShapeSpec
    background: str
    second: Optional[ShapeSpec] = None

    @property
    def label(self) -> int:
        return CLASSNAMES.index(f"{self.main.color} {self.main.shape}")


@dataclass
class SyntheticDataset:
    """Paths and counts of a generated dataset (all paths absolute)."""

    root: str
    train_shards: str  # brace spec, e.g. <root>/train/{00000..00015}.tar
    num_train: int
    num_train_shards: int
    num_eval: int
    zeroshot_root: str  # clip_benchmark wds layout (classnames.txt, templates, test/*.tar)
    retrieval_root: str  # images/ + test.json
    retrieval_annotations: str  # <retrieval_root>/test.json
    classnames: list[str] = field(default_factory=list)
    templates: list[str] = field(default_factory=list)

    def eval_tasks(self) -> list[Any]:
        """EvalTaskConfig entries for the held-out split (zero-shot top-1 and retrieval)."""
        from infclip.eval.config import EvalTaskConfig

        zs = EvalTaskConfig(
            name="synthetic_zeroshot", kind="zeroshot", root=self.zeroshot_root, format="wds",
            classnames=os.path.join(self.zeroshot_root, "classnames.txt"),
            templates=os.path.join(self.zeroshot_root, "zeroshot_classification_templates.txt"))
        rt = EvalTaskConfig(name="synthetic_retrieval", kind="retrieval", root=self.retrieval_root,
                            format="flat", annotations=self.retrieval_annotations)
        return [zs, rt]


# -- scene sampling and drawing ---------------------------------------------------------------


def sample_scene(rng: random.Random, second_prob: float) -> SceneSpec:
    """Draw a scene; the second object differs from the main one in shape, colour and cell."""
    main = ShapeSpec(rng.choice(list(COLORS)), rng.choice(SHAPES), rng.choice(list(SIZES)),
                     rng.choice(list(POSITIONS)))
    second = None
    if rng.random() < second_prob:
        second = ShapeSpec(
            rng.choice([c for c in COLORS if c != main.color]),
            rng.choice([s for s in SHAPES if s != main.shape]), "small",
            rng.choice([p for p in POSITIONS if p != main.position]))
    return SceneSpec(main, rng.choice(list(BACKGROUNDS)), second)


def _polygon(shape: str, cx: float, cy: float, r: float, rot: float) -> list[tuple[float, float]]:
    if shape == "square":
        pts = [(r * math.cos(a), r * math.sin(a)) for a in (math.pi / 4 * (2 * k + 1) for k in range(4))]
    elif shape == "diamond":
        pts = [(0.75 * r * math.cos(a), r * math.sin(a)) for a in (math.pi / 2 * k for k in range(4))]
    elif shape == "triangle":
        pts = [(r * math.cos(a), r * math.sin(a)) for a in (-math.pi / 2 + 2 * math.pi / 3 * k for k in range(3))]
    elif shape == "star":
        pts = [((r if k % 2 == 0 else 0.45 * r) * math.cos(-math.pi / 2 + math.pi / 5 * k),
                (r if k % 2 == 0 else 0.45 * r) * math.sin(-math.pi / 2 + math.pi / 5 * k)) for k in range(10)]
    elif shape == "cross":
        w = 0.33 * r
        pts = [(-w, -r), (w, -r), (w, -w), (r, -w), (r, w), (w, w), (w, r), (-w, r), (-w, w), (-r, w),
               (-r, -w), (-w, -w)]
    else:
        raise ValueError(f"unknown shape {shape!r}")
    c, s = math.cos(rot), math.sin(rot)
    return [(cx + x * c - y * s, cy + x * s + y * c) for x, y in pts]


def _draw(draw: ImageDraw.ImageDraw, spec: ShapeSpec, side: int, rng: random.Random) -> None:
    r = SIZES[spec.size] * side * rng.uniform(0.9, 1.1)
    px, py = POSITIONS[spec.position]
    cx = min(max(px * side + rng.uniform(-0.05, 0.05) * side, r), side - r)
    cy = min(max(py * side + rng.uniform(-0.05, 0.05) * side, r), side - r)
    color = COLORS[spec.color]
    if spec.shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=color)
    else:
        draw.polygon(_polygon(spec.shape, cx, cy, r, math.radians(rng.uniform(-15, 15))), fill=color)


def render(scene: SceneSpec, side: int, rng: random.Random) -> bytes:
    """JPEG bytes of the scene at ``side`` x ``side`` pixels (the small second object on top)."""
    img = Image.new("RGB", (side, side), BACKGROUNDS[scene.background])
    draw = ImageDraw.Draw(img)
    for spec in [scene.main] + ([scene.second] if scene.second else []):
        _draw(draw, spec, side, rng)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


# -- captions ---------------------------------------------------------------------------------


def _a(phrase: str) -> str:
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def caption(scene: SceneSpec, template: str, rng: random.Random) -> str:
    """Fill one caption template; a second object is mentioned with an extra clause."""
    m = scene.main
    obj, sobj = f"{m.color} {m.shape}", f"{m.size} {m.color} {m.shape}"
    pos = "in the center" if m.position == "center" else f"in the {m.position}"
    if m.position in ("top", "bottom", "left", "right"):
        pos = f"at the {m.position}"
    text = template.format(obj=obj, a_obj=_a(obj), a_sobj=_a(sobj), pos=pos, pos_word=m.position,
                           bg=scene.background, size=m.size, shape=m.shape, color=m.color)
    if scene.second is not None:
        s = scene.second
        link = rng.choice((" and ", " next to ", " with "))
        text += link + _a(f"small {s.color} {s.shape}")
    return text


def _scene_rng(seed: int, split: str, index: int) -> random.Random:
    return random.Random(f"infclip-shapes-{seed}-{split}-{index}")  # str seeds hash stably


def iter_split(seed: int, split: str, n: int, side: int, second_prob: float,
               ncaptions: int = 1) -> Iterator[tuple[str, bytes, list[str], SceneSpec]]:
    """Yield (key, jpeg bytes, captions, scene) for samples 0..n-1 of a split."""
    for i in range(n):
        rng = _scene_rng(seed, split, i)
        scene = sample_scene(rng, second_prob)
        image = render(scene, side, rng)
        templates = rng.sample(CAPTION_TEMPLATES, ncaptions)
        yield f"{split}{i:07d}", image, [caption(scene, t, rng) for t in templates], scene


# -- writing a dataset ------------------------------------------------------------------------


def _scene_meta(scene: SceneSpec) -> dict[str, Any]:
    return {"label": scene.label, "background": scene.background, **asdict(scene.main),
            "second": asdict(scene.second) if scene.second else None}


def write_train(out_dir: str, n: int, side: int, seed: int) -> tuple[str, int, int]:
    """Training shards (img2dataset layout); json carries 3 alternative captions under "captions"."""
    per_shard = max(1, min(TRAIN_SHARD_SIZE, -(-n // MIN_TRAIN_SHARDS)))
    with ShardWriter(out_dir, max_samples=per_shard) as writer:
        for key, image, caps, scene in iter_split(seed, "train", n, side, SECOND_OBJECT_PROB, 3):
            meta = {**_scene_meta(scene), "captions": caps, "width": side, "height": side}
            writer.write(key, image, caps[0], meta)
    stats = writer.stats
    return stats.brace_spec(os.path.abspath(out_dir)), stats.num_samples, stats.num_shards


def write_eval(out_dir: str, n: int, side: int, seed: int) -> None:
    """Held-out single-object images in the zero-shot (wds) and retrieval (flat JSON) layouts."""
    zs, rt = os.path.join(out_dir, "zeroshot"), os.path.join(out_dir, "retrieval")
    os.makedirs(os.path.join(zs, "test"))
    os.makedirs(os.path.join(rt, "images"))
    with open(os.path.join(zs, "classnames.txt"), "w") as f:
        f.write("\n".join(CLASSNAMES) + "\n")
    with open(os.path.join(zs, "zeroshot_classification_templates.txt"), "w") as f:
        f.write("\n".join(ZEROSHOT_TEMPLATES) + "\n")
    records, tar, nshards = [], None, 0
    for i, (key, image, caps, scene) in enumerate(iter_split(seed, "eval", n, side, 0.0, 5)):
        if i % EVAL_SHARD_SIZE == 0:
            if tar is not None:
                tar.close()
            tar = tar_writer(os.path.join(zs, "test", f"{nshards}.tar"))
            nshards += 1
        tar.write({"__key__": key, "jpg": image, "cls": str(scene.label).encode()})
        with open(os.path.join(rt, "images", f"{key}.jpg"), "wb") as f:
            f.write(image)
        records.append({"image": f"images/{key}.jpg", "caption": caps, "label": scene.label})
    if tar is not None:
        tar.close()
    with open(os.path.join(zs, "test", "nshards.txt"), "w") as f:
        f.write(f"{nshards}\n")
    with open(os.path.join(rt, "test.json"), "w") as f:
        json.dump(records, f, indent=0)


def generate(root: str, num_train: int, num_eval: int, side: int, seed: int) -> SyntheticDataset:
    """Write a complete dataset into ``root`` (which must not exist yet) and its manifest."""
    os.makedirs(root)
    spec, count, nshards = write_train(os.path.join(root, "train"), num_train, side, seed)
    write_eval(os.path.join(root, "eval"), num_eval, side, seed)
    manifest = {"version": GENERATOR_VERSION, "train_shards": os.path.relpath(os.path.dirname(spec), root),
                "train_spec": os.path.basename(spec), "num_train": count, "num_train_shards": nshards,
                "num_eval": num_eval, "image_size": side, "seed": seed}
    with open(os.path.join(root, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    return load(root)


def load(root: str) -> SyntheticDataset:
    """Read a complete dataset's manifest; paths are resolved against ``root`` (relocatable)."""
    root = os.path.abspath(root)
    with open(os.path.join(root, "manifest.json")) as f:
        m = json.load(f)
    ret = os.path.join(root, "eval", "retrieval")
    return SyntheticDataset(
        root=root, train_shards=os.path.join(root, m["train_shards"], m["train_spec"]),
        num_train=m["num_train"], num_train_shards=m["num_train_shards"], num_eval=m["num_eval"],
        zeroshot_root=os.path.join(root, "eval", "zeroshot"), retrieval_root=ret,
        retrieval_annotations=os.path.join(ret, "test.json"),
        classnames=list(CLASSNAMES), templates=list(ZEROSHOT_TEMPLATES))


def default_root(cfg: DataConfig) -> str:
    """``cfg.synthetic_root`` or ~/.cache/infclip/synthetic-<hash of the generator parameters>."""
    if cfg.synthetic_root:
        return os.path.abspath(os.path.expanduser(cfg.synthetic_root))
    params = [GENERATOR_VERSION, cfg.synthetic_train, cfg.synthetic_eval, cfg.synthetic_image_size,
              cfg.synthetic_seed]
    digest = hashlib.sha1(json.dumps(params).encode()).hexdigest()[:12]
    cache = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    return os.path.join(cache, "infclip", f"synthetic-{digest}")


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    """Advisory inter-process lock (so concurrent ranks do not all generate)."""
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_synthetic(cfg: DataConfig) -> SyntheticDataset:
    """Return the synthetic dataset for ``cfg``, generating it on first use.

    Safe under concurrency and interruption: a file lock makes one process generate while the
    others wait, and the data is written to a temporary folder that is renamed into place only
    when complete (a crash leaves no half-written dataset that looks complete).
    """
    root = default_root(cfg)
    if os.path.exists(os.path.join(root, "manifest.json")):
        return load(root)
    if os.path.isdir(root) and os.listdir(root):
        raise FileExistsError(
            f"{root} exists but holds no complete synthetic dataset (no manifest.json); "
            "remove it or point data.synthetic_root to an empty or new folder")
    parent = os.path.dirname(root) or "."
    os.makedirs(parent, exist_ok=True)
    with _file_lock(root + ".lock"):
        if os.path.exists(os.path.join(root, "manifest.json")):
            return load(root)  # another process generated it while we waited
        prefix = f".{os.path.basename(root)}.tmp-"
        for stale in (n for n in os.listdir(parent) if n.startswith(prefix)):
            shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)  # an interrupted run's
        tmp = os.path.join(parent, f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            generate(tmp, cfg.synthetic_train, cfg.synthetic_eval, cfg.synthetic_image_size,
                     cfg.synthetic_seed)
            if os.path.isdir(root):
                os.rmdir(root)  # an empty placeholder folder
            os.rename(tmp, root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return load(root)
