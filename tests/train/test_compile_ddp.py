"""model.compile_ddp_split on 2 gloo ranks: what dynamo compiles for the replay's DDP forward.

The cache pass runs the unwrapped towers (no DDP, no grad); the replay runs them through DDP with
grad. With torch's optimize_ddp dynamo splits each compiled tower at DDP's gradient buckets;
model.compile_ddp_split=false keeps each tower one graph, as on one GPU, and the gradients are
the same."""

from __future__ import annotations

import torch
import open_clip
from engine_testutils import CTX, IMG, VOCAB, spawn_ranks

from infclip.config import TrainConfig
from infclip.model import compile_towers
from infclip.train.build import _compile_under_ddp
from infclip.train.distributed import DistInfo

WORLD, LOCAL = 2, 3


def _towers_of_several_buckets() -> torch.nn.Module:
    """Two 4-layer towers of width 256: ~3 MB of fp32 weights a layer, several 1 MB buckets each."""
    torch.manual_seed(0)
    vision = dict(image_size=IMG, patch_size=8, width=256, layers=4, head_width=64)
    text = dict(context_length=CTX, vocab_size=VOCAB, width=256, heads=4, layers=4)
    return open_clip.CLIP(embed_dim=32, vision_cfg=vision, text_cfg=text)


def _graphs_and_grads(split: bool, images, tokens) -> tuple[int, int, list]:
    """(graphs of the no-grad unwrapped pass, graphs added by the DDP forwards with grad, the
    gradients after one local and one all-reduced backward); each rank has its own rows."""
    import torch._dynamo as dynamo
    from torch.nn.parallel import DistributedDataParallel as DDP

    dynamo.reset()
    compiled = []
    cfg = TrainConfig()
    cfg.model.compile_ddp_split = split
    _compile_under_ddp(cfg, DistInfo(rank=torch.distributed.get_rank(), world_size=WORLD, local_rank=0,
                                     device=torch.device("cpu")))
    model = _towers_of_several_buckets()
    compile_towers(model, backend=lambda gm, _: compiled.append(gm) or gm.forward)
    ddp = DDP(model, bucket_cap_mb=1)  # dynamo's split needs buckets >= DDP's 1 MB first one
    images = images.float() / 255  # the test batch is uint8, as the loader's
    with torch.no_grad():
        model(images, tokens)
    cache_pass = len(compiled)
    with ddp.no_sync():  # a replay micro-batch before the last: gradients stay local
        img, txt, _ = ddp(images, tokens)
        (img.square().sum() + txt.square().sum()).backward()
    img, txt, _ = ddp(images.flip(0), tokens.flip(0))  # the last one: its backward all-reduces
    (img.square().sum() + txt.square().sum()).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    gathered = [torch.cat([g.flatten() for g in grads]) for _ in range(WORLD)]
    torch.distributed.all_gather(gathered, gathered[0].clone())
    torch.testing.assert_close(gathered[0], gathered[1])  # the ranks agree: the all-reduce ran
    return cache_pass, len(compiled) - cache_pass, grads


def _worker(images, tokens) -> dict:
    return {split: _graphs_and_grads(split, images, tokens) for split in (True, False)}


def test_the_replay_compiles_each_tower_whole_unless_asked_to_split(tmp_path, capsys):
    out = spawn_ranks(_worker, tmp_path, WORLD, LOCAL)
    split_pass, split_replay, split_grads = out[True]
    whole_pass, whole_replay, whole_grads = out[False]
    assert split_pass == whole_pass == 2  # the two towers, unwrapped: never split
    assert whole_replay == 2  # model.compile_ddp_split=false (default): one graph per tower, as on one GPU
    assert split_replay > 2  # torch's optimize_ddp: the towers cut at the buckets
    assert len(split_grads) == len(whole_grads)
    for a, b in zip(split_grads, whole_grads):
        torch.testing.assert_close(a, b)


def test_one_process_leaves_torch_s_setting_and_prints_nothing(capsys):
    import torch._dynamo as dynamo

    before = dynamo.config.optimize_ddp
    _compile_under_ddp(TrainConfig(), DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    assert dynamo.config.optimize_ddp == before and capsys.readouterr().out == ""
