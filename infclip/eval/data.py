"""Evaluation datasets: indexed (map-style) image lists, class names, prompts and captions.

Every image source is turned into an :class:`ImageList` -- a map-style dataset whose item
``i`` is ``(image tensor, label, i)`` -- so any subset of indices (one rank's shard) can be
read in any order and the results are put back in global order by index. Webdataset tar
shards are read by byte offset (one header scan at open), so they shard by sample, not by
file, and give the same samples on any number of ranks.
"""

from __future__ import annotations

import io
import json
import os
import re
import stat
import tarfile
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import open_clip
from PIL import Image
from torch.utils.data import Dataset

from infclip.data.shards import IMAGE_EXTS, expand, is_local, split_name
from infclip.eval.config import EvalConfigError, EvalTaskConfig

TarRef = tuple[str, int, int]  # (shard path, byte offset of the member's data, size)
ImageRef = Union[str, TarRef]  # a file path or a member of a tar shard


class DataError(EvalConfigError):
    """A dataset named by an eval task is missing, empty or inconsistent."""


def _where(task: EvalTaskConfig, index: Optional[int], key: str) -> str:
    at = f"eval.tasks[{index}]" if index is not None else "eval task"
    return f"{at}.{key} (task {task.name!r})"


class NotARegularFile(OSError):
    """An image path names a FIFO, device or socket: opening it could block forever."""


def is_regular(path: str) -> bool:
    """True for a regular file (after links): the only kind of path an eval image is read from."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _read_image(ref: ImageRef, handles: dict) -> Image.Image:
    if isinstance(ref, str):
        if not is_regular(ref):  # checked before open(): a FIFO's open() blocks
            raise NotARegularFile(f"{ref!r} is not a regular file")
        with Image.open(ref) as im:
            return im.convert("RGB")
    path, offset, size = ref
    key = (os.getpid(), path)  # one handle per process: DataLoader workers fork
    if key not in handles:
        handles[key] = open(path, "rb")
    f = handles[key]
    f.seek(offset)
    with Image.open(io.BytesIO(f.read(size))) as im:
        return im.convert("RGB")


# What a damaged, truncated or non-image file raises from PIL (UnidentifiedImageError and
# DecompressionBombError are OSError / ValueError subclasses; broken headers raise SyntaxError).
UNDECODABLE = (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)


class ImageList(Dataset):
    """Map-style dataset over image references; item i = (transform(image_i), label_i, i).

    Labels are -1 for retrieval images. ``transform`` maps a PIL RGB image to a tensor. An
    image that cannot be read or decoded (or is not a regular file) gives ``None`` in place
    of the tensor: the caller skips and counts it (:func:`infclip.eval.embed.encode_images`).
    """

    def __init__(self, refs: Sequence[ImageRef], labels: Sequence[int], transform: Callable):
        assert len(refs) == len(labels)
        self.refs, self.labels, self.transform = list(refs), list(labels), transform
        self._handles: dict = {}

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, i: int):
        try:
            image = _read_image(self.refs[i], self._handles)
        except UNDECODABLE:
            return None, self.labels[i], i
        return self.transform(image), self.labels[i], i

    def __getstate__(self):  # file handles do not cross process boundaries
        return {**self.__dict__, "_handles": {}}


# -- zero-shot sources -------------------------------------------------------------------------


def _shard_paths(task: EvalTaskConfig, index: Optional[int]) -> list[str]:
    split_dir = os.path.join(task.root, task.split)
    if not os.path.isdir(split_dir):
        raise DataError(f"{_where(task, index, 'root')}={task.root!r}: no split folder {split_dir!r}; "
                        "point root at a clip_benchmark wds dataset (root/<split>/*.tar) or fix split")
    nshards_file = os.path.join(split_dir, "nshards.txt")
    if os.path.isfile(nshards_file):
        with open(nshards_file) as f:
            paths = [os.path.join(split_dir, f"{i}.tar") for i in range(int(f.read().strip()))]
    else:
        names = [n for n in os.listdir(split_dir) if n.endswith(".tar")]
        paths = [os.path.join(split_dir, n) for n in sorted(names, key=_natural_key)]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise DataError(f"{_where(task, index, 'root')}: shard {missing[0]!r} listed in nshards.txt is missing")
    return paths


def _natural_key(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def scan_tar(path: str, payload_ext: str = "cls") -> list[tuple[TarRef, str]]:
    """(image ref, text of the ``payload_ext`` member) for every key of one shard holding both:
    ``cls`` = the integer label (classification), ``txt`` = captions, one per line (retrieval)."""
    images: dict[str, TarRef] = {}
    payloads: dict[str, str] = {}
    order: list[str] = []
    with tarfile.open(path, "r:") as tar:
        for m in tar:
            if not m.isfile():
                continue
            key, ext = split_name(m.name)
            if ext in IMAGE_EXTS and key not in images:
                images[key] = (path, m.offset_data, m.size)
                order.append(key)
            elif ext == payload_ext:
                payloads[key] = tar.extractfile(m).read().decode()
    return [(images[k], payloads[k]) for k in order if k in payloads]


def wds_samples(task: EvalTaskConfig, index: Optional[int] = None) -> tuple[list[TarRef], list[int]]:
    """Image refs and integer labels of a clip_benchmark wds split, in shard order."""
    refs, labels = [], []
    for path in _shard_paths(task, index):
        if task.max_samples is not None and len(refs) >= task.max_samples:
            break  # no need to scan the remaining shards
        for ref, label in scan_tar(path):
            refs.append(ref)
            labels.append(int(label.strip()))
    return refs, labels


def imagefolder_samples(task: EvalTaskConfig, index: Optional[int] = None) -> tuple[list[str], list[int], list[str]]:
    """(paths, labels, folder names) of an ImageFolder tree; labels follow sorted folder names."""
    from torchvision.datasets import ImageFolder

    if not os.path.isdir(task.root):
        raise DataError(f"{_where(task, index, 'root')}={task.root!r} is not a folder of class folders")
    try:
        tree = ImageFolder(task.root, allow_empty=True, is_valid_file=_is_image_file)
    except (FileNotFoundError, OSError) as e:  # "Couldn't find any class folder in <root>"
        raise DataError(f"{_where(task, index, 'root')}={task.root!r} holds no class folder ({e}); an image-folder "
                        "task needs root/<class name>/<image files>") from None
    paths, labels = [p for p, _ in tree.samples], [y for _, y in tree.samples]
    return paths, labels, list(tree.classes)


def _is_image_file(path: str) -> bool:
    """torchvision's image extensions, regular files only (a FIFO named x.jpg would block)."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    return path.lower().endswith(IMG_EXTENSIONS) and is_regular(path)


def _read_lines(path: str) -> list[str]:
    with open(path) as f:
        return [line.strip() for line in f if line.strip()]


_WNID = re.compile(r"^n\d{8}$")


def load_classnames(task: EvalTaskConfig, index: Optional[int], folder_names: Optional[list[str]]) -> list[str]:
    """Class names in label order: open_clip's ImageNet list, a file, a JSON mapping
    {folder: name} (image folders), <root>/classnames.txt, or the folder names.

    Image folders (labels = sorted folder names): a plain list must hold exactly the folder
    names (any order; each folder keeps its own name), ``imagenet`` needs 1000 wnid folders,
    a mapping must name every folder. Anything else raises DataError naming both sizes.
    """
    spec = task.classnames
    if spec == "imagenet":
        names = list(open_clip.IMAGENET_CLASSNAMES)
        if folder_names is not None:
            _check_imagenet_folders(task, index, folder_names)
        return names
    if spec is None and folder_names is not None:
        return list(folder_names)
    path = _in_root(task, spec or "classnames.txt")
    if not os.path.isfile(path):
        raise DataError(f"{_where(task, index, 'classnames')}: class-name file {path!r} not found; "
                        "set classnames to 'imagenet' or a file with one class name per line")
    if path.endswith(".json"):
        return _mapped_names(task, index, path, folder_names)
    names = _read_lines(path)
    if folder_names is not None:
        return _folder_names_from_list(task, index, path, names, folder_names)
    return names


def _mismatch(task: EvalTaskConfig, index: Optional[int], what: str, fix: str) -> DataError:
    return DataError(f"{_where(task, index, 'classnames')}: {what}; {fix}")


_FOLDER_FIX = ("fix: classnames=null (the folder names), or a JSON file mapping every folder to its name "
               "(classnames=names.json holding {\"<folder>\": \"<name>\", ...})")


def _check_imagenet_folders(task: EvalTaskConfig, index: Optional[int], folders: list[str]) -> None:
    """ImageNet's names are in sorted-wnid order: only a tree of the 1000 wnid folders fits them."""
    if len(folders) != len(open_clip.IMAGENET_CLASSNAMES) or not all(_WNID.match(f) for f in folders):
        raise _mismatch(task, index, f"'imagenet' gives {len(open_clip.IMAGENET_CLASSNAMES)} class names in "
                        f"ImageNet's wnid order, but {task.root!r} holds {len(folders)} class folders"
                        f"{'' if all(_WNID.match(f) for f in folders) else ' that are not wnids'}", _FOLDER_FIX)


def _folder_names_from_list(task: EvalTaskConfig, index: Optional[int], path: str, names: list[str],
                            folders: list[str]) -> list[str]:
    """A plain list for an image folder must be the folder names themselves (labels follow the
    sorted folders, so a list of other names -- or in another order -- would mislabel)."""
    if len(names) != len(folders):
        raise _mismatch(task, index, f"{len(names)} class names in {path!r} but {len(folders)} class folders "
                        f"in {task.root!r}", _FOLDER_FIX)
    if sorted(names) != sorted(folders):
        other = sorted(set(names) - set(folders))[:3]
        raise _mismatch(task, index, f"the {len(names)} names in {path!r} are not the {len(folders)} folder names "
                        f"of {task.root!r} (e.g. {other}), so their order cannot be checked", _FOLDER_FIX)
    return list(folders)


def _mapped_names(task: EvalTaskConfig, index: Optional[int], path: str,
                  folders: Optional[list[str]]) -> list[str]:
    with open(path) as f:
        mapping = json.load(f)
    if folders is None or not isinstance(mapping, dict):
        raise _mismatch(task, index, f"{path!r} is a JSON file: a {{folder: name}} mapping is for image folders "
                        "(format=imagefolder)", "give a text file with one class name per label instead")
    if set(mapping) != set(folders):
        missing, extra = sorted(set(folders) - set(mapping))[:3], sorted(set(mapping) - set(folders))[:3]
        raise _mismatch(task, index, f"{len(mapping)} entries in {path!r} but {len(folders)} class folders in "
                        f"{task.root!r} (folders without a name: {missing}; names of no folder: {extra})",
                        "map every folder name to its class name")
    return [str(mapping[f]) for f in folders]


def _check_wds_names(task: EvalTaskConfig, index: Optional[int], names: list[str], labels: list[int]) -> None:
    """A wds dataset's own classnames.txt fixes its class count: other names must match it."""
    own = os.path.join(task.root, "classnames.txt")
    if task.classnames is not None and os.path.isfile(own):
        count = len(_read_lines(own))
        if count != len(names):
            raise _mismatch(task, index, f"{len(names)} class names ({task.classnames!r}) but the dataset's own "
                            f"{own!r} lists {count}", "fix: classnames=null (the dataset's classnames.txt), "
                            f"or a file with {count} names in label order")
    bad = [y for y in labels if not 0 <= y < len(names)]
    if bad:
        raise _mismatch(task, index, f"{len(names)} class names but label {bad[0]} occurs (labels must lie in "
                        f"[0, {len(names)}))", "use the class-name list of this dataset")


def load_templates(task: EvalTaskConfig, index: Optional[int]) -> list[Callable[[str], str]]:
    """Prompt templates as callables classname -> prompt (open_clip's or from a file)."""
    spec = task.templates
    default_file = os.path.abspath(os.path.join(task.root, "zeroshot_classification_templates.txt"))
    if spec is None:
        spec = default_file if os.path.isfile(default_file) else "openai_imagenet"
    if spec == "openai_imagenet":
        return list(open_clip.OPENAI_IMAGENET_TEMPLATES)
    if spec == "simple_imagenet":
        return list(open_clip.SIMPLE_IMAGENET_TEMPLATES)
    spec = _in_root(task, spec)
    if not os.path.isfile(spec):
        raise DataError(f"{_where(task, index, 'templates')}={spec!r} is not a file; use "
                        "'openai_imagenet', 'simple_imagenet' or a file with one template per line")
    lines = _read_lines(spec)
    if not lines or any("{c}" not in t and "{}" not in t for t in lines):
        raise DataError(f"{_where(task, index, 'templates')}: every template in {spec!r} needs a "
                        "'{c}' (or '{}') placeholder for the class name")
    return [(lambda c, t=t: t.replace("{c}", c).replace("{}", c)) for t in lines]


@dataclass
class ZeroShotData:
    """Images with integer labels in [0, len(classnames)) plus the prompts to classify them."""

    images: ImageList
    classnames: list[str]
    templates: list[Callable[[str], str]]


def _evenly_spaced(n: int, k: Optional[int]) -> list[int]:
    """Indices of ``k`` items spread over ``n`` (all when k is None or >= n): a class-sorted
    list keeps every class represented instead of only the first few."""
    if k is None or k >= n:
        return list(range(n))
    return [i * n // k for i in range(k)]


def load_zeroshot(task: EvalTaskConfig, transform: Callable, index: Optional[int] = None) -> ZeroShotData:
    """Open a zero-shot task's dataset (no image is decoded here)."""
    folder_names = None
    if task.format == "wds":
        if not os.path.isdir(task.root):
            raise DataError(f"{_where(task, index, 'root')}={task.root!r} does not exist")
        refs, labels = wds_samples(task, index)
        refs, labels = refs[: task.max_samples], labels[: task.max_samples]  # shards mix classes
    else:
        refs, labels, folder_names = imagefolder_samples(task, index)
        keep = _evenly_spaced(len(refs), task.max_samples)  # folders are sorted by class
        refs, labels = [refs[i] for i in keep], [labels[i] for i in keep]
    if not refs:
        raise DataError(f"{_where(task, index, 'root')}={task.root!r}: the dataset is empty "
                        f"(no image with a label in split {task.split!r})")
    names = load_classnames(task, index, folder_names)
    _check_wds_names(task, index, names, labels)
    return ZeroShotData(ImageList(refs, labels, transform), names, load_templates(task, index))


# -- retrieval sources -------------------------------------------------------------------------


@dataclass
class RetrievalData:
    """N images and M >= N captions; caption j describes image ``txt2img[j]``."""

    images: ImageList
    captions: list[str]
    txt2img: list[int]


def _in_root(task: EvalTaskConfig, path: str) -> str:
    """Relative annotation / class-name / template paths are relative to the task's root."""
    path = os.path.expanduser(path)
    return path if os.path.isabs(path) or not task.root else os.path.join(task.root, path)


def _annotation_path(task: EvalTaskConfig, index: Optional[int]) -> str:
    default = f"{task.split}.json" if task.format == "flat" else "dataset_coco.json"
    path = _in_root(task, task.annotations or default)
    if not os.path.isfile(path):
        raise DataError(f"{_where(task, index, 'annotations')}: annotation file {path!r} not found; "
                        "set annotations to the JSON file (or root to its folder)")
    return path


def _bad_annotations(path: str, what: str) -> DataError:
    return DataError(f"annotation file {path!r}: {what}; fix the file (flat: a list of "
                     "{\"image\": <path>, \"caption\": <text or list>}; karpathy: {\"images\": [...]})")


def _image_path(image_root: str, rel: str, path: str, k: int) -> str:
    """``image_root``/``rel``; a path that leaves the image root (absolute, or ``..`` past it) is
    refused: an annotation file must not make the evaluation read files elsewhere."""
    norm = os.path.normpath(rel)
    if os.path.isabs(rel) or norm == ".." or norm.startswith(".." + os.sep):
        raise _bad_annotations(path, f"record {k}'s image {rel!r} is not a path inside the image root "
                                     f"{image_root!r}")
    return os.path.join(image_root, norm)


def _flat_records(data: object, image_root: str, path: str = "") -> list[tuple[str, list[str]]]:
    if not isinstance(data, list):
        raise _bad_annotations(path, f"a flat annotation file holds a list of records, not a {type(data).__name__}")
    out = []
    for k, rec in enumerate(data):
        caps = rec.get("caption") if isinstance(rec, dict) else None
        if not isinstance(rec, dict) or not isinstance(rec.get("image"), str) or not (
                isinstance(caps, str) or (isinstance(caps, list) and all(isinstance(c, str) for c in caps))):
            raise _bad_annotations(path, f"record {k} is not {{\"image\": <path>, \"caption\": <text or list>}}")
        out.append((_image_path(image_root, rec["image"], path, k), [caps] if isinstance(caps, str) else list(caps)))
    return out


def _karpathy_records(data: object, image_root: str, split: str, path: str = "") -> list[tuple[str, list[str]]]:
    images = data.get("images") if isinstance(data, dict) else None
    if not isinstance(images, list):
        raise _bad_annotations(path, "a Karpathy-style file is an object with an \"images\" list")
    out = []
    for k, img in enumerate(images):
        try:
            if img.get("split") != split:
                continue
            rel = os.path.join(img.get("filepath", ""), img["filename"])
            captions = [s["raw"].strip() for s in img["sentences"]]
        except (AttributeError, KeyError, TypeError):
            raise _bad_annotations(path, f"image {k} lacks \"filename\" or \"sentences\" with \"raw\" "
                                         "captions") from None
        out.append((_image_path(image_root, rel, path, k), captions))
    return out


def _wds_records(task: EvalTaskConfig, index: Optional[int]) -> list[tuple[TarRef, list[str]]]:
    """(image ref, captions) of a clip_benchmark retrieval wds split (``.txt``: one caption per line)."""
    if not os.path.isdir(task.root):
        raise DataError(f"{_where(task, index, 'root')}={task.root!r} does not exist")
    records = []
    for path in _shard_paths(task, index):
        if task.max_samples is not None and len(records) >= task.max_samples:
            break
        records.extend((ref, [c.strip() for c in text.splitlines() if c.strip()]) for ref, text in
                       scan_tar(path, "txt"))
    return records


def load_retrieval(task: EvalTaskConfig, transform: Callable, index: Optional[int] = None) -> RetrievalData:
    """Open a retrieval task: flat LAVIS-style JSON, Karpathy's dataset_*.json or clip_benchmark wds."""
    if task.format == "wds":
        return _retrieval_data(task, index, _wds_records(task, index)[: task.max_samples], task.root, transform)
    path = _annotation_path(task, index)
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad_annotations(path, f"not readable as JSON ({e})") from None
    image_root = task.root or os.path.dirname(os.path.abspath(path))
    if task.format == "flat":
        records = _flat_records(data, image_root, path)
    else:
        records = _karpathy_records(data, image_root, task.split, path)
    records = records[: task.max_samples]
    if not records:
        raise DataError(f"{_where(task, index, 'annotations')}: {path!r} holds no images "
                        f"(split {task.split!r}); check the file and the split")
    if not os.path.isfile(records[0][0]):
        raise DataError(f"{_where(task, index, 'root')}={task.root!r}: image {records[0][0]!r} "
                        "not found; root must be the folder the annotation's image paths are relative to")
    return _retrieval_data(task, index, records, path, transform)


def _retrieval_data(task: EvalTaskConfig, index: Optional[int], records: list, source: str,
                    transform: Callable) -> RetrievalData:
    if not records:
        raise DataError(f"{_where(task, index, 'root')}: {source!r} holds no image with captions "
                        f"(split {task.split!r}); check the path and the split")
    empty = [p for p, caps in records if not caps]
    if empty:
        raise DataError(f"{_where(task, index, 'annotations')}: image {empty[0]!r} has no caption in {source!r}")
    captions, txt2img = [], []
    for i, (_, caps) in enumerate(records):
        captions.extend(caps)
        txt2img.extend([i] * len(caps))
    refs = [p for p, _ in records]
    return RetrievalData(ImageList(refs, [-1] * len(refs), transform), captions, txt2img)


# -- contrastive validation shards -------------------------------------------------------------


def contrastive_shards(task: EvalTaskConfig, index: Optional[int] = None) -> list[str]:
    """The local tar paths of a contrastive task: ``root`` is a training-format shard spec
    (brace range, ``::`` or comma list) or a folder whose ``*.tar`` are taken in natural order."""
    if os.path.isdir(task.root):
        names = sorted((n for n in os.listdir(task.root) if n.endswith(".tar")), key=_natural_key)
        paths = [os.path.join(task.root, n) for n in names]
    else:
        try:
            paths = [u for part in task.root.split(",") if part.strip() for u in expand(part)]
        except ValueError as e:
            raise DataError(f"{_where(task, index, 'root')}={task.root!r}: {e}") from None
    remote = [p for p in paths if not is_local(p)]
    if remote:
        raise DataError(f"{_where(task, index, 'root')}: {remote[0]!r} is not a local file; validation shards "
                        "are read by byte offset -- copy them to local disk")
    paths = [p[len("file://"):] if p.startswith("file://") else p for p in paths]
    missing = [p for p in paths if not os.path.isfile(p)]
    if not paths or missing:
        raise DataError(f"{_where(task, index, 'root')}={task.root!r}: "
                        f"{'no .tar shard' if not paths else f'shard {missing[0]!r} does not exist'}; "
                        "give the held-out shards as a brace spec, e.g. /data/val/{00000..00003}.tar")
    return paths


def load_contrastive(task: EvalTaskConfig, transform: Callable, index: Optional[int] = None) -> RetrievalData:
    """Open held-out training-format shards: sample i = image i and its caption (``{key}.txt``,
    the whole text as one caption, as training reads it), so ``txt2img`` is the identity."""
    records: list = []
    for path in contrastive_shards(task, index):
        if task.max_samples is not None and len(records) >= task.max_samples:
            break
        records.extend((ref, [text.strip()]) for ref, text in scan_tar(path, "txt") if text.strip())
    records = records[: task.max_samples]
    if task.batch is not None and len(records) < task.batch:
        raise DataError(f"{_where(task, index, 'batch')}={task.batch} but {task.root!r} holds {len(records)} "
                        "image-caption samples: no full loss batch; lower batch or add shards")
    return _retrieval_data(task, index, records, task.root, transform)
