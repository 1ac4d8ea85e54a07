"""The synthetic captioned-shapes dataset: determinism, layouts, atomic first-use generation."""

import json
import multiprocessing as mp
import os
import tarfile
import time

import pytest

from infclip.data.config import DataConfig
from infclip.data.synthetic import CLASSNAMES, COLORS, SHAPES, ensure_synthetic, generate


def _files(root):
    out = {}
    for folder, _, names in os.walk(root):
        for n in names:
            p = os.path.join(folder, n)
            out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


def _small(tmp_path, name="syn", **kw):
    args = dict(synthetic_root=str(tmp_path / name), synthetic_train=96, synthetic_eval=24,
                synthetic_image_size=32, synthetic_seed=3)
    args.update(kw)
    return DataConfig(**args)


def test_generation_is_deterministic_and_seed_dependent(tmp_path):
    a = _files(ensure_synthetic(_small(tmp_path, "a")).root)
    b = _files(ensure_synthetic(_small(tmp_path, "b")).root)
    c = _files(ensure_synthetic(_small(tmp_path, "c", synthetic_seed=4)).root)
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a)
    assert a["train/00000.tar"] != c["train/00000.tar"]


def test_train_shards_have_img2dataset_layout(tmp_path):
    ds = ensure_synthetic(_small(tmp_path))
    assert ds.num_train == 96 and ds.num_train_shards == 16 and ds.train_shards.endswith("{00000..00015}.tar")
    first = ds.train_shards.replace("{00000..00015}", "00000")
    names = tarfile.open(first).getnames()
    # members sorted by extension within a sample: what img2dataset (webdataset's TarWriter) writes
    assert names[:3] == ["train0000000.jpg", "train0000000.json", "train0000000.txt"]
    assert len(names) == 3 * 6
    tar = tarfile.open(first)
    for key in ("train0000000", "train0000005"):
        caption = tar.extractfile(f"{key}.txt").read().decode()
        meta = json.loads(tar.extractfile(f"{key}.json").read())
        assert meta["color"] in caption and meta["shape"] in caption  # captions name colour + shape
        assert meta["caption"] == caption and caption in meta["captions"]
        assert CLASSNAMES[meta["label"]] == f"{meta['color']} {meta['shape']}"
    train_dir = os.path.dirname(ds.train_shards)
    assert json.load(open(os.path.join(train_dir, "sizes.json"))) == {f"{i:05d}.tar": 6 for i in range(16)}
    assert json.load(open(os.path.join(train_dir, "00003_stats.json")))["successes"] == 6


def test_eval_layouts(tmp_path):
    ds = ensure_synthetic(_small(tmp_path))
    zs = ds.zeroshot_root
    classes = open(os.path.join(zs, "classnames.txt")).read().split("\n")[:-1]
    assert classes == list(CLASSNAMES) and len(classes) == len(COLORS) * len(SHAPES)
    templates = open(os.path.join(zs, "zeroshot_classification_templates.txt")).read().split("\n")[:-1]
    assert templates and all("{c}" in t for t in templates)
    assert open(os.path.join(zs, "test", "nshards.txt")).read().strip() == "1"
    tar = tarfile.open(os.path.join(zs, "test", "0.tar"))
    names = tar.getnames()
    assert len(names) == 2 * 24 and names[0].endswith(".cls") and names[1].endswith(".jpg")  # sorted
    records = json.load(open(ds.retrieval_annotations))
    assert len(records) == 24
    for rec, cls, jpg in zip(records, names[0::2], names[1::2]):
        assert len(set(rec["caption"])) == 5
        assert open(os.path.join(ds.retrieval_root, rec["image"]), "rb").read() == tar.extractfile(jpg).read()
        label = int(tar.extractfile(cls).read())
        assert all(CLASSNAMES[label].split()[1] in c for c in rec["caption"])  # shape in every caption
    tasks = ds.eval_tasks()
    assert {t.kind for t in tasks} == {"zeroshot", "retrieval"}


def test_default_size_generates_fast(tmp_path):
    t0 = time.perf_counter()
    ds = ensure_synthetic(DataConfig(synthetic_root=str(tmp_path / "d")))
    assert time.perf_counter() - t0 < 30
    assert (ds.num_train, ds.num_eval, ds.num_train_shards) == (8192, 512, 16)
    assert ds.train_shards.endswith("{00000..00015}.tar")


def test_ensure_reuses_existing_and_rejects_foreign_folder(tmp_path):
    cfg = _small(tmp_path)
    ds = ensure_synthetic(cfg)
    stamp = os.stat(os.path.join(ds.root, "manifest.json")).st_mtime_ns
    assert ensure_synthetic(cfg).train_shards == ds.train_shards
    assert os.stat(os.path.join(ds.root, "manifest.json")).st_mtime_ns == stamp
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "x.txt").write_text("not a dataset")
    with pytest.raises(FileExistsError, match="no manifest.json"):
        ensure_synthetic(_small(tmp_path, "foreign"))
    with pytest.raises(FileExistsError):
        generate(ds.root, 4, 4, 32, 0)  # never overwrites


def _ensure_in_child(root, queue):
    cfg = DataConfig(synthetic_root=root, synthetic_train=200, synthetic_eval=8, synthetic_image_size=32)
    queue.put(ensure_synthetic(cfg).train_shards)


def test_concurrent_first_use_is_safe(tmp_path):
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_ensure_in_child, args=(str(tmp_path / "shared"), queue)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    assert len({queue.get(timeout=5) for _ in procs}) == 1
    leftovers = [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    assert leftovers == []


def test_default_root_depends_on_parameters(monkeypatch, tmp_path):
    from infclip.data.synthetic import default_root

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    a, b = default_root(DataConfig()), default_root(DataConfig(synthetic_seed=1))
    assert a != b and a.startswith(str(tmp_path / "infclip" / "synthetic-"))


def test_interrupted_generation_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    import infclip.data.synthetic as syn

    def boom(*a, **k):
        raise KeyboardInterrupt

    cfg = _small(tmp_path)
    monkeypatch.setattr(syn, "write_eval", boom)
    with pytest.raises(KeyboardInterrupt):
        ensure_synthetic(cfg)
    assert not os.path.exists(cfg.synthetic_root)
    os.makedirs(tmp_path / ".syn.tmp-999-dead")  # a killed run's leftover
    monkeypatch.undo()
    ds = ensure_synthetic(cfg)
    assert os.path.exists(os.path.join(ds.root, "manifest.json"))
    assert sorted(os.listdir(tmp_path)) == ["syn", "syn.lock"]
