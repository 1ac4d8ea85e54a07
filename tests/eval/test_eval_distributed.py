"""2-rank gloo evaluation (strided shards, gathered embeddings, summed hits) equals 1 rank."""

import json
import os

import open_clip
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from infclip.eval import EvalConfig, EvalTaskConfig, run_evals

MODEL = "infclip-micro"


def _config(tasks: list, all_ranks: bool) -> EvalConfig:
    return EvalConfig(tasks=[EvalTaskConfig(**t) for t in tasks], batch_size=8, workers=0, chunk_size=5,
                      all_ranks=all_ranks)


def _model(state_path: str):
    import infclip.model  # noqa: F401  registers infclip-micro in the child process

    model, _, preprocess = open_clip.create_model_and_transforms(MODEL, pretrained=state_path)
    return model, open_clip.get_tokenizer(MODEL), preprocess


def _worker(rank: int, world: int, init: str, state_path: str, tasks: list, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model, tokenizer, preprocess = _model(state_path)
        results = {}
        for all_ranks in (True, False):
            results[str(all_ranks)] = run_evals(
                model, tokenizer, preprocess, _config(tasks, all_ranks), step=0, final=True, device="cpu",
                rank=rank, world_size=world, group=dist.group.WORLD)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def _strip(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.endswith("/seconds")}


def test_two_rank_gloo_equals_one_rank(tmp_path, synthetic, micro):
    model = micro[0]
    state_path = str(tmp_path / "model.pt")
    torch.save(model.state_dict(), state_path)
    tasks = [{k: getattr(t, k) for k in ("name", "kind", "root", "format", "annotations", "classnames",
                                         "templates")} for t in synthetic.eval_tasks()]
    for t in tasks:
        t["max_samples"] = 21  # odd: rank shards of 11 and 10 images (and 53 / 52 captions)
    mp.start_processes(_worker, args=(2, f"file://{tmp_path}/rdzv", state_path, tasks, str(tmp_path)),
                       nprocs=2, start_method="spawn")
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in (0, 1))
    single = run_evals(*_model(state_path), _config(tasks, True), step=0, final=True, device="cpu")
    assert _strip(r0["True"]) == pytest.approx(_strip(single), abs=1e-9)
    assert _strip(r1["True"]) == pytest.approx(_strip(single), abs=1e-9)
    assert _strip(r0["False"]) == pytest.approx(_strip(single), abs=1e-9)  # rank 0 alone, whole data
    assert r1["False"] == {}
    assert single["eval/synthetic_zeroshot/num_samples"] == 21
