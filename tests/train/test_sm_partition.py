"""data.decode_reserved_sms: the towers' green-context stream (infclip/train/sm_partition.py).

CPU: the SM arithmetic, the fallbacks and what the startup line says. CUDA: a step on the
partitioned stream gives bit-identical results and leaves the caller's stream as it was (the
speed is measured by scripts/check_sm_partition.py and scripts/bench_decode.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from infclip.train import sm_partition as smp


@pytest.mark.parametrize("total, reserve, major, towers", [
    (132, 4, 9, 128),  # H100 / H200 SXM: 4 free
    (132, 1, 9, 128),  # rounded down to the granule of 8: at least the reserve stays free
    (132, 12, 9, 120),
    (114, 4, 9, 104),  # H100 PCIe
    (108, 4, 8, 104),  # A100: granule 2
    (108, 3, 8, 104),
    (8, 4, 9, 0),  # nothing left for the towers
])
def test_towers_keep_whole_granules_and_at_least_the_reserve_stays_free(total, reserve, major, towers):
    got = smp.tower_sm_count(total, reserve, major)
    assert got == towers
    assert total - got >= reserve or got == 0
    assert got % smp.GRANULE[major] == 0


def test_no_reserve_or_no_cuda_device_leaves_the_towers_on_every_sm():
    off = smp.tower_stream("cpu", 0)
    assert off.stream is None and off.describe() == "towers on all SMs"
    cpu = smp.tower_stream("cpu", 4)
    assert cpu.stream is None and cpu.describe() == "towers on all SMs (not a CUDA device)"
    with smp.running_on(cpu):  # unpartitioned: the block runs as it would without it
        assert torch.ones(2).sum().item() == 2.0


def _fake_gpu(monkeypatch, sms: int = 132, major: int = 9):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(multi_processor_count=sms, major=major))


def test_when_no_green_context_can_be_made_the_reasons_are_named(monkeypatch):
    _fake_gpu(monkeypatch)

    def old_torch(idx, n):
        raise RuntimeError("this torch's GreenContext has no Stream()")

    def no_bindings(idx, n):
        raise ModuleNotFoundError("No module named 'cuda'")

    monkeypatch.setattr(smp, "_torch_green_stream", old_torch)
    monkeypatch.setattr(smp, "_driver_green_stream", no_bindings)
    part = smp.tower_stream("cuda:0", 4)
    assert part.stream is None and part.total_sms == 132
    assert "torch GreenContext: this torch's GreenContext has no Stream()" in part.reason
    assert "cuda-bindings: No module named 'cuda'" in part.reason
    assert part.describe().startswith("towers on all SMs (no green context: ")


def test_the_first_maker_that_works_is_taken_with_the_sms_it_gave(monkeypatch):
    _fake_gpu(monkeypatch)
    asked = []

    def fails(idx, n):
        asked.append(("torch", n))
        raise RuntimeError("refused")

    def works(idx, n):
        asked.append(("driver", n))
        return "stream", "ctx", n

    monkeypatch.setattr(smp, "_torch_green_stream", fails)
    monkeypatch.setattr(smp, "_driver_green_stream", works)
    part = smp.tower_stream("cuda:0", 12)
    assert asked == [("torch", 120), ("driver", 120)]
    assert (part.stream, part.tower_sms, part.total_sms) == ("stream", 120, 132)
    assert part.describe() == ("towers confined to 120 of 132 SMs (green context), "
                               "12 kept free for the decoders' kernels")


def test_a_reserve_that_leaves_nothing_is_not_attempted(monkeypatch):
    _fake_gpu(monkeypatch, sms=8)
    monkeypatch.setattr(smp, "_torch_green_stream", lambda *a: pytest.fail("must not be called"))
    part = smp.tower_stream("cuda:0", 4)
    assert part.stream is None and "leave none of 8" in part.reason


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_step_on_the_towers_stream_is_bit_identical_and_the_stream_is_restored():
    part = smp.tower_stream("cuda", 4)
    if part.stream is None:
        pytest.skip(part.describe())  # no green contexts on this machine: nothing to compare
    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 512, device="cuda")
    x = torch.randn(4096, 512, device="cuda")

    def step():
        lin.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = lin(x).float().logsumexp(1).mean()
        y.backward()
        return y.detach().clone(), lin.weight.grad.clone()

    ref = step()
    outer = torch.cuda.current_stream()
    with smp.running_on(part):
        assert torch.cuda.current_stream() == part.stream
        got = step()
    assert torch.cuda.current_stream() == outer
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
