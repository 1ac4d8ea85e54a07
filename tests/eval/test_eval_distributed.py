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


def _probe(tmp_path, *overrides) -> tuple[str, list]:
    """(stdout, [(before, after)] per rank) of the eval command's ``evaluate`` on 2 torchrun
    ranks through ``tests/_native_threads_probe.py``."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    probe = Path(__file__).resolve().parents[1] / "_native_threads_probe.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(probe),
           *overrides]
    env = {**os.environ, "PROBE_TARGET": "eval", "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = [(int(a), int(b)) for a, b in re.findall(r"native threads: before=(\d+) after=(\d+)", proc.stdout)]
    assert len(counts) == 2, proc.stdout[-3000:]
    return proc.stdout, counts


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)")
def test_the_eval_command_joins_its_group_threads_when_done_and_on_error(tmp_path, synthetic, micro):
    """Under torchrun the eval command destroys its gloo group and joins its threads whether it
    finishes or stops with a configuration error (the group had stayed alive after an error:
    gloo's workers then met the interpreter's exit, where they can abort the process, SIGABRT,
    instead of its exit status 2)."""
    run = tmp_path / "run" / "checkpoints" / "step_00000001"
    run.mkdir(parents=True)
    torch.save(micro[0].state_dict(), run / "model.pt")
    common = [f"checkpoint={run / 'model.pt'}", f"model={MODEL}", f"synthetic_root={synthetic.root}", "eval.workers=0",
              "eval.batch_size=16", f"output={tmp_path / 'results.json'}"]
    out, counts = _probe(tmp_path, *common, "tasks=[synthetic_zeroshot]")
    assert "top1" in out and all(after <= before for before, after in counts), counts
    out, counts = _probe(tmp_path, *common, "tasks=[no_such_task]")
    assert out.count("eval error caught") == 2 and all(after <= before for before, after in counts), counts
