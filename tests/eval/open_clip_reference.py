"""An evaluation written with open_clip, torch and PIL only -- it never imports infclip -- for
the parity test: the same metrics as ``python -m infclip.eval``, computed the plain way.

    python open_clip_reference.py CHECKPOINT_FOLDER DATA_ROOT OUT.json

DATA_ROOT is the digits set of tests/eval/digits.py. Zero-shot: class embedding =
normalize(mean_t normalize(text(t(c)))), prediction = argmax of image . class (top-5: the five
largest); retrieval: image->text hit at k if one of the image's captions is among the k most
similar captions, text->image if the caption's image is among the k most similar images.
"""

import io
import json
import os
import sys
import tarfile

import open_clip
import torch
import torch.nn.functional as F
from PIL import Image

BATCH = 64


def encode_images(model, preprocess, images):
    out = []
    for i in range(0, len(images), BATCH):
        x = torch.stack([preprocess(im.convert("RGB")) for im in images[i:i + BATCH]])
        out.append(F.normalize(model.encode_image(x), dim=-1))
    return torch.cat(out)


def encode_texts(model, tokenizer, texts):
    return torch.cat([F.normalize(model.encode_text(tokenizer(texts[i:i + BATCH])), dim=-1)
                      for i in range(0, len(texts), BATCH)])


def zeroshot(model, preprocess, tokenizer, images, labels, classnames, templates):
    weights = []
    for c in classnames:
        emb = encode_texts(model, tokenizer, [t.replace("{c}", c) for t in templates])
        weights.append(F.normalize(emb.mean(0), dim=-1))
    logits = encode_images(model, preprocess, images) @ torch.stack(weights).T
    labels = torch.tensor(labels)
    top5 = logits.topk(5, dim=1).indices
    top1 = top5[:, 0] == labels
    recalls = [_mean(top1[labels == c]) for c in range(len(classnames)) if (labels == c).any()]
    return {"top1": _mean(top1), "top5": _mean((top5 == labels[:, None]).any(1)),
            "mean_per_class_recall": sum(recalls) / len(recalls)}


def _mean(hits):
    """The fraction of True, as a Python float (exact: count / n)."""
    return int(hits.sum()) / len(hits)


def retrieval(model, preprocess, tokenizer, images, captions):
    texts = [c for caps in captions for c in caps]
    owner = torch.tensor([i for i, caps in enumerate(captions) for _ in caps])
    img = encode_images(model, preprocess, images)
    txt = encode_texts(model, tokenizer, texts)
    scores = img @ txt.T
    out = {}
    for k in (1, 5, 10):
        top_txt = scores.topk(k, dim=1).indices  # (N, k) caption indices
        out[f"i2t_r{k}"] = _mean((owner[top_txt] == torch.arange(len(images))[:, None]).any(1))
        top_img = scores.T.topk(k, dim=1).indices  # (M, k) image indices
        out[f"t2i_r{k}"] = _mean((top_img == owner[:, None]).any(1))
    return out


def read_tar(path, ext):
    """{key: (PIL image, payload text)} of one shard, in member order."""
    members = {}
    with tarfile.open(path) as tar:
        for m in tar:
            key, _, suffix = m.name.rpartition(".")
            members.setdefault(key, {})[suffix] = tar.extractfile(m).read()
    return [(Image.open(io.BytesIO(v["png"])), v[ext].decode()) for v in members.values()]


def main(folder, root, out):
    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{folder}")
    model.eval()
    templates = open(os.path.join(root, "templates.txt")).read().split("\n")[:-1]
    results = {}
    with torch.no_grad():
        tree = os.path.join(root, "imagefolder")
        classes = sorted(os.listdir(tree))  # labels follow the sorted folder names
        files = [(os.path.join(tree, c, f), y) for y, c in enumerate(classes)
                 for f in sorted(os.listdir(os.path.join(tree, c)))]
        results["digits_folder"] = zeroshot(model, preprocess, tokenizer, [Image.open(p) for p, _ in files],
                                            [y for _, y in files], classes, templates)
        wds = os.path.join(root, "wds_digits")
        samples = [s for i in range(2) for s in read_tar(os.path.join(wds, "test", f"{i}.tar"), "cls")]
        names = open(os.path.join(wds, "classnames.txt")).read().split("\n")[:-1]
        results["digits_wds"] = zeroshot(model, preprocess, tokenizer, [im for im, _ in samples],
                                         [int(y) for _, y in samples], names, templates)
        records = json.load(open(os.path.join(root, "retrieval", "test.json")))
        results["digits_flat"] = retrieval(model, preprocess, tokenizer,
                                           [Image.open(os.path.join(root, "retrieval", r["image"])) for r in records],
                                           [r["caption"] for r in records])
        samples = read_tar(os.path.join(root, "wds_digits_retrieval", "test", "0.tar"), "txt")
        results["digits_rwds"] = retrieval(model, preprocess, tokenizer, [im for im, _ in samples],
                                           [t.split("\n") for _, t in samples])
    results["infclip_imported"] = any(name.split(".")[0] == "infclip" for name in sys.modules)
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
