"""train.py with a contrastive validation task (open_clip's --val-data): eval/<name>/loss and
recall are logged at the requested steps, with the value the saved weights give."""

import io

import pytest
import torch
from PIL import Image
from test_train_cli import metrics, run_train

from infclip.data.writer import ShardWriter


def write_val_shards(folder, n=20, per_shard=8):
    g = torch.Generator().manual_seed(1)
    with ShardWriter(str(folder), max_samples=per_shard) as w:
        for i in range(n):
            pixels = torch.randint(0, 256, (32, 32, 3), generator=g, dtype=torch.uint8)
            buf = io.BytesIO()
            Image.fromarray(pixels.numpy()).save(buf, format="JPEG", quality=90)
            w.write(f"v{i:05d}", buf.getvalue(), f"a photo of thing number {i}")
    return str(folder / "{00000..00002}.tar")


def _task(root, batch=8, every=2):
    return f"eval.tasks=[{{name:val,kind:contrastive,format:wds,root:'{root}',batch:{batch},every_n_steps:{every}}}]"


def test_val_loss_logged_at_requested_steps_and_matches_the_checkpoint(tmp_path):
    root = write_val_shards(tmp_path / "val")
    run_dir = tmp_path / "run"
    run_train(tmp_path, f"run_dir={run_dir}", "steps=4", "checkpoint.every_n_steps=2", _task(root))
    logged = {m["step"]: m for m in metrics(run_dir) if "eval/val/loss" in m}
    assert sorted(logged) == [2, 4]
    for m in logged.values():
        assert m["eval/val/num_loss_batches"] == 2 and 0 < m["eval/val/loss"] < 20
        assert all(0 <= m[f"eval/val/{d}_r{k}"] <= 1 for d in ("i2t", "t2i") for k in (1, 5, 10))
    assert logged[2]["eval/val/loss"] != logged[4]["eval/val/loss"]  # the weights moved

    import open_clip

    import infclip.model  # noqa: F401  (registers infclip-micro)
    from infclip.eval import EvalConfig, EvalTaskConfig, run_evals

    model, _, preprocess = open_clip.create_model_and_transforms(
        "infclip-micro", pretrained=str(run_dir / "checkpoints" / "step_00000004" / "model.pt"))
    cfg = EvalConfig(tasks=[EvalTaskConfig(name="val", kind="contrastive", root=root, batch=8)], workers=0)
    again = run_evals(model, open_clip.get_tokenizer("infclip-micro"), preprocess, cfg, step=4, final=True,
                      device="cpu")
    assert again["eval/val/loss"] == pytest.approx(logged[4]["eval/val/loss"], rel=1e-4)
    assert again["eval/val/t2i_r5"] == pytest.approx(logged[4]["eval/val/t2i_r5"])


def test_siglip_run_logs_its_own_loss(tmp_path):
    root = write_val_shards(tmp_path / "val")
    run_dir = tmp_path / "run"
    run_train(tmp_path, f"run_dir={run_dir}", "steps=2", "loss=siglip", "checkpoint.every_n_steps=2",
              _task(root, batch=10, every=1))
    logged = {m["step"]: m["eval/val/loss"] for m in metrics(run_dir) if "eval/val/loss" in m}
    assert sorted(logged) == [1, 2] and all(v == v for v in logged.values())

    import open_clip

    import infclip.model  # noqa: F401
    from infclip.eval import EvalConfig, EvalTaskConfig, run_evals
    from infclip.loss import clip_loss, siglip_loss

    model, _, preprocess = open_clip.create_model_and_transforms(
        "infclip-micro", init_logit_bias=-10.0,
        pretrained=str(run_dir / "checkpoints" / "step_00000002" / "model.pt"))
    cfg = EvalConfig(tasks=[EvalTaskConfig(name="val", kind="contrastive", root=root, batch=10)], workers=0)
    tok = open_clip.get_tokenizer("infclip-micro")
    fns = {"siglip": siglip_loss, "clip": lambda i, t, s, b: clip_loss(i, t, s)}
    with_loss = {name: run_evals(model, tok, preprocess, cfg, step=2, final=True, device="cpu", loss_fn=fn)
                 ["eval/val/loss"] for name, fn in fns.items()}
    assert with_loss["siglip"] == pytest.approx(logged[2], rel=1e-4)
    assert with_loss["clip"] != pytest.approx(logged[2], rel=1e-2)
