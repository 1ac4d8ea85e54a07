"""Shared fixtures for the engine / offload / LiT tests: tiny open_clip models, configs, references."""

from __future__ import annotations

import functools

import open_clip
import torch
from torch import nn

from infclip.config import TrainConfig
from infclip.loss import clip_loss
from infclip.train.engine import build_engine

IMG, CTX, VOCAB = 32, 16, 1000


def add_dropout(model: nn.Module, p: float) -> nn.Module:
    """Put a Dropout after every transformer MLP activation (open_clip blocks have none)."""
    for m in model.modules():
        mlp = getattr(m, "mlp", None)
        if isinstance(mlp, nn.Sequential) and hasattr(mlp, "gelu"):
            mlp.gelu = nn.Sequential(mlp.gelu, nn.Dropout(p))
    return model


def tiny_clip(seed: int = 0, dropout: float = 0.2, patch_dropout: float = 0.25, timm: bool = False,
              **clip_kw) -> nn.Module:
    torch.manual_seed(seed)
    if timm:
        vision = dict(timm_model_name="test_resnet", timm_model_pretrained=False, image_size=IMG,
                      timm_pool="avg", timm_proj="linear", timm_drop=dropout)
    else:
        vision = dict(image_size=IMG, patch_size=8, width=64, layers=2, head_width=32, patch_dropout=patch_dropout)
    text = dict(context_length=CTX, vocab_size=VOCAB, width=64, heads=2, layers=2)
    model = open_clip.CLIP(embed_dim=32, vision_cfg=vision, text_cfg=text, **clip_kw)
    return add_dropout(model, dropout) if dropout else model


def batch(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 3, IMG, IMG), dtype=torch.uint8, generator=g)
    tokens = torch.randint(1, VOCAB, (n, CTX), generator=g)
    return images, tokens


def normalize(images: torch.Tensor) -> torch.Tensor:
    return (images.float() / 255.0 - 0.5) / 0.25


def config(local: int, micro: int, *, world: int = 1, grad_cache: str = "auto", offload: bool = False,
           cache_dtype: str = "fp32", **model_kw) -> TrainConfig:
    cfg = TrainConfig()
    cfg.batch.global_size, cfg.batch.micro_size = local * world, micro
    cfg.memory.grad_cache, cfg.memory.offload, cfg.memory.cache_dtype = grad_cache, offload, cache_dtype
    for k, v in model_kw.items():
        setattr(cfg.model, k, v)
    return cfg


def engine_for(cfg: TrainConfig, model: nn.Module, *, scaler=None, group=None, world: int = 1, loss_fn=None):
    loss_fn = loss_fn or functools.partial(clip_loss, impl="torch", group=group)
    return build_engine(cfg, model, device=torch.device("cpu"), normalizer=normalize, loss_fn=loss_fn,
                        scaler=scaler, group=group, world_size=world)


def reference_grads(model: nn.Module, images, tokens, micro: int, loss_fn=None) -> tuple[torch.Tensor, dict]:
    """The full-batch step by definition: forward every micro-batch WITH grad (the same RNG
    draws, in the same order, as the engine's cache pass), one loss on the concatenated
    embeddings, one backward. Returns (loss, {name: grad})."""
    imgs, txts = [], []
    for k in range(0, images.shape[0], micro):
        img, txt, *extras = model(image=normalize(images[k:k + micro]), text=tokens[k:k + micro])
        imgs.append(img)
        txts.append(txt)
    loss_fn = loss_fn or functools.partial(clip_loss, impl="torch")
    loss = loss_fn(torch.cat(imgs), torch.cat(txts), *extras)
    loss.backward()
    return loss.detach(), grads_of(model)


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(a: dict, b: dict, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    assert a.keys() == b.keys(), f"different parameters got gradients: {a.keys() ^ b.keys()}"
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


def spawn_ranks(worker, tmp_dir, world: int, local: int) -> dict:
    """Runs ``worker(images, tokens) -> results`` on ``world`` gloo processes (one thread each),
    rank r with rows [r * local, (r + 1) * local) of ``batch(local * world)``; returns rank 0's
    results. The group is ``dist.group.WORLD``."""
    import torch.multiprocessing as mp

    out = tmp_dir / "rank0.pt"
    mp.spawn(_rank_main, args=(worker, world, local, str(tmp_dir / "init"), str(out)), nprocs=world, join=True)
    return torch.load(out)


def _rank_main(rank: int, worker, world: int, local: int, init_file: str, out_file: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    images, tokens = batch(local * world)
    mine = slice(rank * local, (rank + 1) * local)
    results = worker(images[mine], tokens[mine])
    if rank == 0:
        torch.save(results, out_file)
    dist.destroy_process_group()


def assert_replay_exact_and_cached_step_full(model: nn.Module, seed: int, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """On ``batch(8)``: the no-grad cache pass and the replay under its RNG state give the same
    embeddings bit for bit, and the engine's cached step (2 micro-batches of 4, seeded ``seed``)
    equals the full-batch step (``reference_grads``) within ``atol`` / ``rtol``."""
    import copy

    images, tokens = batch(8)
    x = normalize(images[:4])
    state = torch.get_rng_state()
    with torch.no_grad():
        cached = model(image=x, text=tokens[:4])
    torch.set_rng_state(state)
    replay = model(image=x, text=tokens[:4])
    assert torch.equal(cached[0], replay[0].detach()) and torch.equal(cached[1], replay[1].detach())
    ref = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    ref_loss, ref_grads = reference_grads(ref, images, tokens, 4)
    torch.manual_seed(seed)
    out = engine_for(config(8, 4, grad_cache="on"), model).step(images, tokens)
    torch.testing.assert_close(out.loss, ref_loss, atol=1e-6, rtol=1e-6)
    assert_grads_close(grads_of(model), ref_grads, atol=atol, rtol=rtol)
