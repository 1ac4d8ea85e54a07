"""kind=contrastive (open_clip's --val-data): held-out training-format shards scored with the
run's contrastive loss at a stated batch and with retrieval recall.

The loss is checked against a float64 full-matrix computation on the same embeddings, the
recall against the retrieval task reading the same samples as a clip_benchmark wds split."""

import io
import os
import tarfile

import pytest
import torch
import torch.nn.functional as F
from evalutils import number_tokenizer, png, to_tensor
from torch import nn

from infclip.data.writer import ShardWriter
from infclip.eval import EvalConfig, EvalConfigError, EvalTaskConfig, check_tasks, run_evals, validate_eval
from infclip.eval.data import DataError

DIM = 8


class LinearModel(nn.Module):
    """A CLIP-shaped stand-in with distinct, non-trivial embeddings: image = MLP of the mean
    colour (the PNGs' red/green encode the sample), text = a table row per caption number."""

    def __init__(self, bias: bool = False, scale: float = 7.0):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.img = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, DIM))
        for p in self.img.parameters():
            p.data = torch.randn(p.shape, generator=g)
        self.table = nn.Parameter(torch.randn(64, DIM, generator=g))
        self.logit_scale = nn.Parameter(torch.tensor(float(scale)).log())
        self.logit_bias = nn.Parameter(torch.tensor(-2.0)) if bias else None

    def encode_image(self, x, normalize=False):
        f = self.img(x.mean((2, 3)) * 10)
        return F.normalize(f, dim=-1) if normalize else f

    def encode_text(self, tokens, normalize=False):
        f = self.table[tokens[:, 0] % 64]
        return F.normalize(f, dim=-1) if normalize else f


def _samples(n):
    # image i: red encodes i % 32, green i itself; caption i names a number of its own
    return [(f"k{i:05d}", png(i % 32, 37 * i), f"item {(5 * i + 3) % 64}") for i in range(n)]


def write_val_shards(folder, n, per_shard=7):
    """Training-format shards (ShardWriter: {key}.png + {key}.txt + {key}.json)."""
    with ShardWriter(str(folder), max_samples=per_shard) as w:
        for key, image, caption in _samples(n):
            w.write(key, image, caption, ext="png")
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".tar"))


def write_retrieval_wds(root, n):
    """The same samples as a clip_benchmark retrieval split root/test/0.tar."""
    os.makedirs(os.path.join(root, "test"), exist_ok=True)
    with tarfile.open(os.path.join(root, "test", "0.tar"), "w") as tar:
        for key, image, caption in _samples(n):
            for name, payload in ((f"{key}.png", image), (f"{key}.txt", caption.encode())):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))


def direct_embeddings(model, n):
    imgs, caps = [], []
    from PIL import Image

    for _, image, caption in _samples(n):
        imgs.append(to_tensor(Image.open(io.BytesIO(image)).convert("RGB")))
        caps.append(caption)
    with torch.no_grad():
        img = F.normalize(model.encode_image(torch.stack(imgs)).double(), dim=-1)
        txt = F.normalize(model.encode_text(number_tokenizer(caps)).double(), dim=-1)
    return img, txt


def clip_loss64(img, txt, scale):
    logits = scale * img @ txt.T  # the full b x b matrix, float64
    diag = logits.diagonal()
    return 0.5 * ((logits.logsumexp(1) - diag).mean() + (logits.logsumexp(0) - diag).mean())


def siglip_loss64(img, txt, scale, bias):
    logits = scale * img @ txt.T + bias
    labels = 2 * torch.eye(img.shape[0], dtype=torch.float64) - 1
    return -F.logsigmoid(labels * logits).sum() / img.shape[0]


def _run(model, task, **kw):
    cfg = EvalConfig(tasks=[task], batch_size=5, workers=0, chunk_size=6)
    return run_evals(model, number_tokenizer, to_tensor, cfg, step=0, final=True, device="cpu", **kw)


@pytest.mark.parametrize("batch", [2, 8, 11, 22])
def test_loss_is_the_mean_over_full_batches_of_the_float64_loss(tmp_path, batch):
    n = 22
    write_val_shards(tmp_path / "val", n)  # 4 shards of 7, 7, 7, 1: batches straddle shards
    model = LinearModel()
    root = str(tmp_path / "val" / "{00000..00003}.tar")
    out = _run(model, EvalTaskConfig(name="val", kind="contrastive", root=root, batch=batch))
    img, txt = direct_embeddings(model, n)
    scale = torch.tensor(7.0, dtype=torch.float64)
    want = torch.stack([clip_loss64(img[a:a + batch], txt[a:a + batch], scale)
                        for a in range(0, n - batch + 1, batch)]).mean()  # last partial batch dropped
    assert out["eval/val/num_loss_batches"] == n // batch
    assert out["eval/val/loss"] == pytest.approx(float(want), rel=1e-5, abs=1e-6)
    assert out["eval/val/logit_scale"] == pytest.approx(7.0)
    assert out["eval/val/num_images"] == out["eval/val/num_texts"] == n


def test_siglip_model_uses_its_scale_and_bias(tmp_path):
    n, batch = 15, 6
    write_val_shards(tmp_path / "val", n)
    model = LinearModel(bias=True, scale=3.0)
    out = _run(model, EvalTaskConfig(name="val", kind="contrastive", root=str(tmp_path / "val"), batch=batch))
    img, txt = direct_embeddings(model, n)
    s, b = torch.tensor(3.0, dtype=torch.float64), torch.tensor(-2.0, dtype=torch.float64)
    want = (siglip_loss64(img[:6], txt[:6], s, b) + siglip_loss64(img[6:12], txt[6:12], s, b)) / 2
    assert out["eval/val/loss"] == pytest.approx(float(want), rel=1e-5)


def test_passed_loss_fn_is_used(tmp_path):
    """The trainer passes its own loss (loss.kind); here: NT-Xent-like stand-in via a spy."""
    write_val_shards(tmp_path / "val", 10)
    seen = []

    def spy(img, txt, scale, bias=None):
        seen.append((img.shape[0], float(scale), bias))
        return torch.tensor(1.5)

    out = _run(LinearModel(), EvalTaskConfig(name="v", kind="contrastive", root=str(tmp_path / "val"), batch=4),
               loss_fn=spy)
    assert seen == [(4, pytest.approx(7.0), None)] * 2 and out["eval/v/loss"] == 1.5


def test_recall_equals_the_retrieval_task_on_the_same_samples(tmp_path):
    n = 22
    write_val_shards(tmp_path / "val", n)
    write_retrieval_wds(str(tmp_path / "ret"), n)
    model = LinearModel()
    val = _run(model, EvalTaskConfig(name="val", kind="contrastive", root=str(tmp_path / "val"), batch=8))
    ret = _run(model, EvalTaskConfig(name="ret", kind="retrieval", format="wds", root=str(tmp_path / "ret")))
    keys = [f"{d}_r{k}" for d in ("i2t", "t2i") for k in (1, 5, 10)]
    assert {k: val[f"eval/val/{k}"] for k in keys} == {k: ret[f"eval/ret/{k}"] for k in keys}
    assert 0 < val["eval/val/i2t_r10"] < 1  # not a degenerate all-hit / no-hit case


def test_two_gloo_ranks_give_the_single_process_numbers(tmp_path):
    import torch.multiprocessing as mp

    write_val_shards(tmp_path / "val", 19)
    task = EvalTaskConfig(name="val", kind="contrastive", root=str(tmp_path / "val"), batch=4)
    single = _run(LinearModel(), task)
    mp.spawn(_rank_main, args=(2, str(tmp_path), task), nprocs=2, join=True)
    for r in range(2):
        got = torch.load(tmp_path / f"r{r}.pt")
        for k, v in single.items():
            if not k.endswith("seconds"):
                assert got[k] == pytest.approx(v, rel=1e-6), k


def _rank_main(rank, world, tmp, task):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=world)
    try:
        out = _run(LinearModel(), task, rank=rank, world_size=world)
        torch.save(out, os.path.join(tmp, f"r{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fields, key, hint", [
    (dict(kind="contrastive"), "eval.tasks[0].batch", "required"),
    (dict(kind="contrastive", batch=1), "eval.tasks[0].batch", ">= 2"),
    (dict(kind="contrastive", batch=0), "eval.tasks[0].batch", ">= 2"),
    (dict(kind="contrastive", batch=8, max_samples=4), "eval.tasks[0].max_samples", "lower batch"),
    (dict(kind="contrastive", batch=8, format="flat"), "eval.tasks[0].format", "['wds']"),
    (dict(kind="retrieval", format="flat", batch=8), "eval.tasks[0].batch", "only for kind=contrastive"),
])
def test_bad_values_are_refused_naming_the_key(fields, key, hint):
    with pytest.raises(EvalConfigError) as e:
        validate_eval(EvalConfig(tasks=[EvalTaskConfig(name="v", root="/x", **fields)]))
    assert key in str(e.value) and hint in str(e.value)


def test_bad_data_is_refused_at_startup(tmp_path):
    write_val_shards(tmp_path / "val", 10)
    too_big = EvalTaskConfig(name="v", kind="contrastive", root=str(tmp_path / "val"), batch=16)
    with pytest.raises(DataError, match=r"eval.tasks\[0\].batch.*holds 10 image-caption samples"):
        check_tasks(EvalConfig(tasks=[too_big]))
    missing = EvalTaskConfig(name="v", kind="contrastive", root=str(tmp_path / "val" / "{00000..00005}.tar"), batch=2)
    with pytest.raises(DataError, match=r"eval.tasks\[0\].root.*00002.tar' does not exist"):
        check_tasks(EvalConfig(tasks=[missing]))


def test_eval_command_reports_the_loss_as_a_number(tmp_path, micro):
    """``python -m infclip.eval`` with an inline contrastive task: CLIP's loss (no logit bias),
    equal to the in-process hook, printed as a loss (not a percentage)."""
    import json
    import subprocess
    import sys

    model, tokenizer, preprocess = micro
    write_val_shards(tmp_path / "val", 12)
    folder = tmp_path / "run" / "checkpoints" / "step_00000003"
    folder.mkdir(parents=True)
    torch.save(model.state_dict(), folder / "model.pt")
    out = tmp_path / "results.json"
    cmd = [sys.executable, "-m", "infclip.eval", f"checkpoint={tmp_path / 'run'}", "model=infclip-micro",
           "eval.workers=0", f"output={out}",
           f"tasks=[{{name: val, kind: contrastive, format: wds, root: '{tmp_path / 'val'}', batch: 5}}]"]
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())["metrics"]
    task = EvalTaskConfig(name="val", kind="contrastive", root=str(tmp_path / "val"), batch=5)
    want = run_evals(model, tokenizer, preprocess, EvalConfig(tasks=[task], workers=0), step=0, final=True,
                     device="cpu")
    assert got["eval/val/loss"] == pytest.approx(want["eval/val/loss"], rel=1e-6)
    assert got["eval/val/num_loss_batches"] == 2
    line = next(ln for ln in proc.stdout.splitlines() if ln.split()[:2] == ["val", "loss"])
    assert float(line.split()[2]) == pytest.approx(want["eval/val/loss"], abs=1e-4)
