"""A real (tiny, random) open_clip model on the data generator's eval split, against a
straightforward full-matrix reference computed here; uint8+normalizer preprocessing."""

import io
import json
import os
import tarfile

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from infclip.data.transforms import Normalizer, val_transform
from infclip.eval import EvalConfig, run_evals


def _read_wds(root):
    """(PIL images, labels) of root/test/*.tar, in shard order."""
    images, labels = [], []
    n = int(open(os.path.join(root, "test", "nshards.txt")).read())
    for s in range(n):
        with tarfile.open(os.path.join(root, "test", f"{s}.tar")) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar}
        for name in sorted(k for k in members if k.endswith(".jpg")):
            images.append(Image.open(io.BytesIO(members[name])).convert("RGB"))
            labels.append(int(members[name[:-4] + ".cls"]))
    return images, torch.tensor(labels)


@torch.no_grad()
def reference_zeroshot(model, tokenizer, preprocess, root):
    images, labels = _read_wds(root)
    names = open(os.path.join(root, "classnames.txt")).read().split("\n")[:-1]
    templates = open(os.path.join(root, "zeroshot_classification_templates.txt")).read().split("\n")[:-1]
    img = model.encode_image(torch.stack([preprocess(im) for im in images]), normalize=True)
    classes = []
    for name in names:
        emb = model.encode_text(tokenizer([t.replace("{c}", name) for t in templates]), normalize=True)
        classes.append(F.normalize(emb.mean(0), dim=0))
    logits = img @ torch.stack(classes).T
    top5 = logits.topk(5, dim=1).indices
    correct1 = top5[:, 0] == labels
    per_class = [correct1[labels == c].float().mean() for c in labels.unique()]
    return {"top1": correct1.float().mean().item(), "top5": (top5 == labels[:, None]).any(1).float().mean().item(),
            "mean_per_class_recall": torch.stack(per_class).mean().item()}


@torch.no_grad()
def reference_retrieval(model, tokenizer, preprocess, root):
    records = json.load(open(os.path.join(root, "test.json")))
    img = model.encode_image(torch.stack([preprocess(Image.open(os.path.join(root, r["image"])).convert("RGB"))
                                          for r in records]), normalize=True)
    captions = [c for r in records for c in r["caption"]]
    txt2img = torch.tensor([i for i, r in enumerate(records) for _ in r["caption"]])
    sims = img @ model.encode_text(tokenizer(captions), normalize=True).T
    out = {}
    for k in (1, 5, 10):
        top = sims.topk(k, dim=1).indices
        out[f"i2t_r{k}"] = (txt2img[top] == torch.arange(len(records))[:, None]).any(1).float().mean().item()
        out[f"t2i_r{k}"] = (sims.T.topk(k, dim=1).indices == txt2img[:, None]).any(1).float().mean().item()
    return out


@pytest.fixture(scope="module")
def float_metrics(synthetic, micro):
    """run_evals with open_clip's float val transform (shared by the tests below)."""
    model, tokenizer, preprocess = micro
    cfg = EvalConfig(tasks=synthetic.eval_tasks(), batch_size=8, workers=0, chunk_size=7)
    return run_evals(model, tokenizer, preprocess, cfg, step=0, final=True, device="cpu")


def test_matches_full_matrix_reference(synthetic, micro, float_metrics):
    model, tokenizer, preprocess = micro
    got = float_metrics
    ref = {**{f"synthetic_zeroshot/{k}": v for k, v in reference_zeroshot(model, tokenizer, preprocess,
                                                                           synthetic.zeroshot_root).items()},
           **{f"synthetic_retrieval/{k}": v for k, v in reference_retrieval(model, tokenizer, preprocess,
                                                                             synthetic.retrieval_root).items()}}
    for key, value in ref.items():
        assert got[f"eval/{key}"] == pytest.approx(value, abs=1e-6), key
    assert got["eval/synthetic_zeroshot/num_samples"] == 37 and got["eval/synthetic_retrieval/num_texts"] == 185


def test_uint8_transform_with_device_normalizer(synthetic, micro, float_metrics):
    """The data package's (uint8 transform, Normalizer) pair gives the same metrics as open_clip's."""
    model, tokenizer, _ = micro
    pp = model.visual.preprocess_cfg
    pair = (val_transform(32, pp["mean"], pp["std"]), Normalizer(pp["mean"], pp["std"]))
    cfg = EvalConfig(tasks=synthetic.eval_tasks(), batch_size=16, workers=0)
    a = float_metrics
    b = run_evals(model, tokenizer, pair, cfg, step=0, final=True, device="cpu")
    assert {k: v for k, v in a.items() if "seconds" not in k} == pytest.approx(
        {k: v for k, v in b.items() if "seconds" not in k}, abs=1e-6)


def test_autocast_factory_wraps_the_encoders(synthetic, micro):
    """The given autocast factory is entered around every encoder pass (bf16 autocast itself is
    not exercised here: CPU bf16 kernels crash on CPUs without AVX512-BF16)."""
    import contextlib

    entered = []

    @contextlib.contextmanager
    def autocast():
        entered.append(1)
        yield

    model, tokenizer, preprocess = micro
    task = synthetic.eval_tasks()[1]
    task.max_samples = 10
    cfg = EvalConfig(tasks=[task], batch_size=16, workers=0)
    run_evals(model, tokenizer, preprocess, cfg, step=0, final=True, device="cpu", autocast=autocast)
    assert len(entered) == 1 + 4  # 10 images in one batch, 50 captions in 4


def test_max_samples_spreads_over_classes_in_an_imagefolder():
    from infclip.eval.data import _evenly_spaced

    labels = [c for c in range(10) for _ in range(5)]  # class-sorted, as an ImageFolder lists them
    picked = {labels[i] for i in _evenly_spaced(len(labels), 10)}
    assert picked == set(range(10))
    assert _evenly_spaced(7, None) == list(range(7)) and _evenly_spaced(7, 9) == list(range(7))
