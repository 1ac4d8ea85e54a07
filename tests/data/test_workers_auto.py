"""data.workers=auto / data.decode_threads=auto: sized from the cores a training process may use."""

import pytest

from infclip.data.workers import Machine, check_count, cores_per_rank, size_loader, this_machine


def _m(cores, local=1, all_cores=None, shared=True):
    return Machine(cores, all_cores or cores, local, shared, "LOCAL_WORLD_SIZE")


@pytest.mark.parametrize("machine,decode,workers", [
    (_m(32, local=2), "device", 8),   # the 2 x H200 host of the measurements: 16 cores a rank, half
    (_m(32, local=2), "cpu", 12),     # 16 - 2 = 14, rounded down to 12
    (_m(32), "device", 16),
    (_m(32), "cpu", 24),              # 30 -> 24
    (_m(128, local=8), "device", 8),
    (_m(16, local=1), "cpu", 12),     # 14 -> 12
    (_m(2), "cpu", 1),                # never 0: a worker always loads beside the trainer
    (_m(1), "device", 1),
    (_m(8, local=8, all_cores=64, shared=False), "cpu", 6),  # a per-task binding is this process's own
])
def test_auto_workers_per_rank(machine, decode, workers):
    assert size_loader(machine, decode).workers == workers


def test_explicit_numbers_are_honoured_and_said():
    sizing = size_loader(_m(32, local=2), "device", workers=14, decode_threads=3)
    assert (sizing.workers, sizing.decode_threads) == (14, 3)
    assert "data.workers=14 (as set; 16 cores: 32 in the affinity shared by 2 local ranks" in sizing.why
    assert "decode_threads=auto" not in sizing.why


def test_the_reason_names_the_cores_the_share_and_the_rounding():
    why = size_loader(_m(32, local=2), "device").why
    assert why.startswith("data.workers=auto: 8 per rank (half of them (the GPU decodes")
    assert "16 cores: 32 in the affinity shared by 2 local ranks (LOCAL_WORLD_SIZE)" in why
    assert "rounded down" in why and why.endswith("data.decode_threads=auto: 2")


@pytest.mark.parametrize("cores,local,threads", [(32, 2, 2), (16, 2, 2), (8, 2, 1), (4, 1, 1)])
def test_auto_decode_threads(cores, local, threads):
    assert size_loader(_m(cores, local=local), "device").decode_threads == threads


def test_local_ranks_come_from_torchrun_else_the_gpus_of_the_node():
    run = this_machine(4, env={"LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"})
    assert run.local_ranks == 2 and run.shared and run.source == "LOCAL_WORLD_SIZE"
    assert this_machine(4, env={}, gpus=8).local_ranks == 4  # one rank per GPU, at most the world
    assert this_machine(16, env={}, gpus=8).local_ranks == 8
    assert this_machine(4, env={}, gpus=0).local_ranks == 1
    assert this_machine(1, env={}, gpus=8).local_ranks == 1  # a single process has the machine
    assert cores_per_rank(_m(30, local=4)) == 7


@pytest.mark.parametrize("value", ["many", -1, True, 2.5])
def test_bad_counts_name_the_key_and_the_choices(value):
    with pytest.raises(ValueError, match=r"data.workers must be auto .* or a whole number >= 0"):
        check_count("data.workers", value, 0)
