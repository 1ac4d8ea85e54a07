"""data.decode_reserved_sms: the towers' green-context stream (infclip/train/sm_partition.py).

CPU: the SM arithmetic, the driver call sequence (against a stand-in for cuda-bindings'
driver module), the fallbacks and what the startup line says, the loss's grid budget. CUDA: a
step on the partitioned stream gives bit-identical results and leaves the caller's stream as
it was (the speed: scripts/bench/bench_decode.py)."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch

from infclip.kernels import launching
from infclip.train import sm_partition as smp


@pytest.mark.parametrize("total, reserve, granule, towers", [
    (132, 4, 8, 128),  # H100 / H200 SXM: 4 free
    (132, 1, 8, 128),  # rounded down to the granule: at least the reserve stays free
    (132, 12, 8, 120),
    (114, 4, 8, 104),  # H100 PCIe
    (108, 3, 2, 104),  # A100: granule 2
    (132, 4, 16, 128),
    (132, 12, 16, 112),
    (8, 4, 8, 0),  # nothing left for the towers
])
def test_towers_keep_whole_granules_and_at_least_the_reserve_stays_free(total, reserve, granule, towers):
    got = smp.tower_sm_count(total, reserve, granule)
    assert got == towers
    assert total - got >= reserve or got == 0
    assert got % granule == 0


def test_no_reserve_or_no_cuda_device_leaves_the_towers_on_every_sm():
    off = smp.tower_stream("cpu", 0)
    assert off.stream is None and off.describe() == "towers on all SMs"
    cpu = smp.tower_stream("cpu", 4)
    assert cpu.stream is None and cpu.describe() == "towers on all SMs (not a CUDA device)"
    with smp.running_on(cpu):  # unpartitioned: the block runs as it would without it
        assert torch.ones(2).sum().item() == 2.0


class _FakeDriver(ModuleType):
    """cuda.bindings.driver's calls as tower_stream uses them: (CUresult, *values) tuples."""

    def __init__(self, sms: int = 132, granule: int = 8, short: int = 0):
        super().__init__("cuda.bindings.driver")
        self.calls: list[tuple] = []
        self.sms, self.granule, self.short = sms, granule, short
        self.CUdevResourceType = SimpleNamespace(CU_DEV_RESOURCE_TYPE_SM="SM")
        self.CUgreenCtxCreate_flags = SimpleNamespace(CU_GREEN_CTX_DEFAULT_STREAM="DEFAULT_STREAM")
        self.CUstream_flags = SimpleNamespace(CU_STREAM_NON_BLOCKING="NON_BLOCKING")

    def _res(self, n: int):
        return SimpleNamespace(sm=SimpleNamespace(smCount=n, minSmPartitionSize=self.granule,
                                                  smCoscheduledAlignment=self.granule))

    def __getattr__(self, name):
        if not name.startswith("cu"):
            raise AttributeError(name)

        def call(*args):
            self.calls.append((name, *args))
            if name == "cuInit":
                return (0,)
            if name == "cuDeviceGet":
                return 0, f"dev{args[0]}"
            if name == "cuDeviceGetDevResource":
                return 0, self._res(self.sms)
            if name == "cuDevSmResourceSplitByCount":
                n = args[3] - self.short
                return 0, [self._res(n)], 1, self._res(self.sms - n)
            return 0, {"cuDevResourceGenerateDesc": "desc", "cuGreenCtxCreate": "green",
                       "cuGreenCtxStreamCreate": 0xBEEF}[name]
        return call


@pytest.fixture
def fake_gpu(monkeypatch):
    """A 132-SM device 0 behind a stand-in driver module; a fresh partition cache and budget."""
    def install(**kw):
        driver = _FakeDriver(**kw)
        bindings = ModuleType("cuda.bindings")
        bindings.driver = driver
        monkeypatch.setitem(sys.modules, "cuda", ModuleType("cuda"))
        monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
        monkeypatch.setitem(sys.modules, "cuda.bindings.driver", driver)
        monkeypatch.setattr(torch.cuda, "init", lambda: None)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda i: SimpleNamespace(multi_processor_count=driver.sms, major=9))
        monkeypatch.setattr(torch.cuda, "ExternalStream", lambda handle, device: ("stream", handle, str(device)))
        monkeypatch.setattr(smp, "_ALIVE", {})
        monkeypatch.setattr(launching, "_SM_BUDGET", {})
        launching.sm_count.cache_clear()
        return driver

    yield install
    launching.sm_count.cache_clear()


def test_the_driver_builds_a_green_stream_once_and_the_loss_grids_follow_it(fake_gpu):
    driver = fake_gpu()
    part = smp.tower_stream("cuda:0", 4)
    assert part.stream == ("stream", 0xBEEF, "cuda:0")
    assert (part.tower_sms, part.total_sms) == (128, 132)
    assert part.describe() == ("towers confined to 128 of 132 SMs (CUDA green context), "
                               "4 kept free for the decoders' kernels")
    names = [c[0] for c in driver.calls]
    assert names == ["cuInit", "cuDeviceGet", "cuDeviceGetDevResource", "cuDevSmResourceSplitByCount",
                     "cuDevResourceGenerateDesc", "cuGreenCtxCreate", "cuGreenCtxStreamCreate"]
    split = driver.calls[3]
    assert split[1] == 1 and split[3:] == (0, 128)  # one group of at least 128 SMs
    assert driver.calls[5][2:] == ("dev0", "DEFAULT_STREAM") and driver.calls[6][2:] == ("NON_BLOCKING", 0)
    assert launching.sm_count(torch.device("cuda", 0)) == 128  # persistent grids for the partition
    again = smp.tower_stream("cuda:0", 1)  # 1 rounds to the same 128: the same partition, kept
    assert again is part and [c[0] for c in driver.calls].count("cuGreenCtxCreate") == 1


def test_the_driver_s_granule_sets_the_rounding(fake_gpu):
    fake_gpu(granule=16)
    assert smp.tower_stream("cuda:0", 12).tower_sms == 112


def test_a_split_smaller_than_asked_is_refused_with_the_reason(fake_gpu):
    driver = fake_gpu(short=8)
    part = smp.tower_stream("cuda:0", 4)
    assert part.stream is None and part.total_sms == 132
    assert part.describe() == "towers on all SMs (no green context: the driver split off 1 group(s) of 120 SMs for 128)"
    assert "cuGreenCtxCreate" not in [c[0] for c in driver.calls]
    assert launching._SM_BUDGET == {}  # the loss keeps its grids for every SM


def test_without_cuda_bindings_the_line_says_so(fake_gpu, monkeypatch):
    fake_gpu()
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # import fails as if not installed
    part = smp.tower_stream("cuda:0", 4)
    assert part.stream is None
    assert part.describe().startswith("towers on all SMs (no green context: ") and "cuda.bindings" in part.reason


def test_a_reserve_that_leaves_nothing_is_not_attempted(fake_gpu):
    driver = fake_gpu(sms=8)
    part = smp.tower_stream("cuda:0", 4)
    assert part.stream is None and "leave none of 8" in part.reason
    assert "cuDevSmResourceSplitByCount" not in [c[0] for c in driver.calls]


@pytest.fixture
def own_budget(monkeypatch):
    """The loss's grid budget set by this test only: later tests size grids for every SM."""
    monkeypatch.setattr(launching, "_SM_BUDGET", {})
    launching.sm_count.cache_clear()
    yield
    launching.sm_count.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_step_on_the_towers_stream_is_bit_identical_and_the_stream_is_restored(own_budget):
    part = smp.tower_stream("cuda", 4)
    if part.stream is None and importlib.util.find_spec("cuda.bindings") is None:
        pytest.skip(part.describe())  # no cuda-bindings here: nothing to compare
    assert part.stream is not None, part.describe()
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


@pytest.mark.parametrize("busy, reserved, step, says", [
    (94.0, 0, 2, True),  # decode-bound, no reserve: the note
    (smp.DECODE_BOUND_PCT, 0, 5, True),
    (89.9, 0, 3, False),  # the towers bound the step
    (97.0, 4, 3, False),  # a reserve is already kept
    (97.0, 0, 1, False),  # the first step: compile and warm-up
    (float("nan"), 0, 3, False),
])
def test_the_decode_bound_note_is_written_only_for_a_decode_bound_step_without_a_reserve(busy, reserved, step, says):
    msg = smp.decode_bound_hint(busy, reserved, step)
    assert (msg is not None) == says
    if says:
        assert f"data.decode_reserved_sms={smp.SUGGESTED_RESERVE}" in msg and f"{busy:.0f} %" in msg


def test_a_decode_bound_first_pass_counts_where_the_step_s_share_under_reads():
    """LiT decodes only in the cache pass: 61 % of the step can be ~100 % of that pass."""
    msg = smp.decode_bound_hint(61.0, 0, 2, first_pass_pct=96.0)
    assert msg is not None and "61 % of step 2 (96 % of its first pass)" in msg
    assert smp.decode_bound_hint(61.0, 0, 2, first_pass_pct=70.0) is None
    assert smp.decode_bound_hint(61.0, 8, 2, first_pass_pct=96.0) is None
    assert "first pass" not in smp.decode_bound_hint(95.0, 0, 2)


def test_the_trainer_writes_the_decode_bound_note_once_on_the_main_rank():
    from infclip.train import loop

    written = []
    parts = SimpleNamespace(logger=SimpleNamespace(write=written.append))
    cfg = SimpleNamespace(data=SimpleNamespace(decode_reserved_sms=0))
    state = loop.State(step=2)
    main, other = SimpleNamespace(is_main=True), SimpleNamespace(is_main=False)
    loop._hint_decode_bound(cfg, other, parts, state, {"decode_busy_pct": 95.0})
    loop._hint_decode_bound(cfg, main, parts, state, {"decode_busy_pct": 50.0})
    loop._hint_decode_bound(cfg, main, parts, state, {"loss": 1.0})  # no device decoder
    assert written == [] and not state.decode_hinted
    for step in (3, 4):
        state.step = step
        loop._hint_decode_bound(cfg, main, parts, state, {"decode_busy_pct": 95.0})
    assert len(written) == 1 and "step 3" in written[0] and state.decode_hinted
