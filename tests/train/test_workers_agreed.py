"""data.workers=auto on ranks of machines of different sizes: every rank takes the fewest (the
default data.streams, ranks x workers, must be the same everywhere)."""

from types import SimpleNamespace

import torch


def _rank(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    import infclip.data.workers as workers
    from infclip.train.build import size_loader_agreed
    from infclip.train.distributed import DistInfo

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    cores = 32 if rank == 0 else 8  # rank 0's host: 16 device-path workers; rank 1's: 4
    workers.this_machine = lambda world: workers.Machine(cores, cores, 1, True, "one process")
    cfg = SimpleNamespace(data=SimpleNamespace(workers="auto", decode_threads="auto"))
    sizing = size_loader_agreed(cfg, DistInfo(rank, 2, 0, torch.device("cpu")), "device")
    torch.save({"workers": sizing.workers, "threads": sizing.decode_threads, "why": sizing.why}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_ranks_agree_on_the_fewest_auto_workers(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "sizing")
    mp.spawn(_rank, args=(str(tmp_path / "init"), out), nprocs=2, join=True)
    got = [torch.load(f"{out}.{r}") for r in range(2)]
    assert [g["workers"] for g in got] == [4, 4]
    assert [g["threads"] for g in got] == [2, 2]  # per rank: nothing to agree on
    assert "4, the fewest any rank chose" in got[0]["why"] and "fewest" not in got[1]["why"]
