"""data.decode=device inside the real trainer: decoding is deterministic, so the gradient
cache's two passes, offload, prefetch depth, LiT streaming and kill-and-resume all train bit
for bit alike; the run matches data.decode=cpu up to one 8-bit level of resampling."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
from launch_testutils import losses_by_step, run, start_and_kill, step_records, train_cmd  # noqa: E402

from infclip.train.offload import InputStager  # noqa: E402
from infclip.train.pipeline import TensorFeed  # noqa: E402

STEPS = ["steps=4", "checkpoint.every_n_steps=2", "data.decode=device"]


def _train(tmp_path, name: str, *overrides: str) -> dict[int, list[float]]:
    run_dir = tmp_path / name
    given = {o.split("=")[0] for o in overrides}  # a key given twice is refused: overrides replace STEPS' own
    base = [s for s in STEPS if s.split("=")[0] not in given]
    proc = run(train_cmd(tmp_path / "data", run_dir, *base, *overrides), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return losses_by_step(run_dir)


def test_device_decode_is_deterministic_across_offload_and_prefetch_and_close_to_cpu(tmp_path):
    ref = _train(tmp_path, "resident", "memory.offload=false", "memory.prefetch_steps=0")
    assert sorted(ref) == [1, 2, 3, 4]
    # data.decode_reserved_sms moves the towers to a green-context stream on a GPU; on a CPU
    # device the startup line says why not, and nothing else changes
    # logging.decode_trace_step: the decoder's timeline of step 2, logged and written; the
    # losses below stay equal to the untraced run's
    proc = run(train_cmd(tmp_path / "data", tmp_path / "offload", *STEPS, "memory.offload=true",
                         "memory.prefetch_steps=2", "data.decode_reserved_sms=4",
                         "logging.decode_trace_step=2", "data.decode_ahead_from=first_pass"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "; towers on all SMs (not a CUDA device) (data.decode_reserved_sms=4)" in proc.stdout
    assert "data.decode_ahead_from=first_pass has no effect: the image tower trains" in proc.stdout
    assert proc.stdout.count("decode trace, step 2") == 1 and "decode trace, step 1" not in proc.stdout
    doc = json.loads((tmp_path / "offload" / "decode_trace" / "step_2_rank_0.json").read_text())
    phases = {p["name"]: p for p in doc["phases"]}
    assert {"cache_pass", "loss", "replay", "step"} <= set(phases), list(phases)
    assert doc["trace"]["spans"] and 0.0 < phases["step"]["busy"] <= phases["step"]["wall"]
    recs = step_records(tmp_path / "offload")
    busy = [r["decode_busy_pct"] for r in recs]
    assert len(busy) == 4 and all(0.0 < b < 150.0 for b in busy), busy  # the decoder's share of each step
    # and of the cache pass: step 1 decodes there; later steps' micro-batches were mostly
    # decoded ahead during the previous replay (counted there), so theirs may be 0
    first = [r["decode_busy_first_pct"] for r in recs]
    assert first[0] > 0.0 and all(0.0 <= f < 150.0 for f in first), first
    assert "note: the GPU JPEG decoder" not in proc.stdout  # a reserve is set
    assert losses_by_step(tmp_path / "offload") == ref
    cpu = _train(tmp_path, "cpu", "data.decode=cpu")
    for step in ref:  # same crops, pixels within one level: the same training up to noise
        assert abs(cpu[step][0] - ref[step][0]) < 0.02 * abs(ref[step][0]), (step, cpu[step], ref[step])
    assert cpu != ref  # and the option did change the decoder


def _handed_at(run_dir: Path, step: int) -> list[str]:
    """The phases in which step ``step`` handed the next step's images to the decode-ahead."""
    doc = json.loads((run_dir / "decode_trace" / f"step_{step}_rank_0.json").read_text())
    trace, phases = doc["trace"], [p for p in doc["phases"] if p["name"] != "step"]
    rel = [t - trace["origin"] for t in trace["queued"]]
    return [next(p["name"] for p in phases if p["start"] <= t < p["end"]) for t in rel]


def test_lit_streams_packed_jpegs_like_it_keeps_them_whenever_the_next_step_starts_decoding(tmp_path):
    """LiT: the ring or the whole step held, the next step's images handed to the decode-ahead
    after this step's loss (the default) or during its first pass: the same training. (When
    in the step the hand-off comes is checked without threads in test_decode_ahead_handoff;
    here the filler thread may or may not have begun the next feed by the first pass's
    micro-batches, so the early run may still hand over after its loss.)"""
    lit = ["model.lock_image=true", "memory.offload=true"]
    trace = ["logging.decode_trace_step=3", "memory.prefetch_steps=1"]
    streamed = _train(tmp_path, "stream", *lit, *trace, "memory.stream_once_inputs=true", "memory.stream_rows=16")
    assert _handed_at(tmp_path / "stream", 3) == ["replay"]  # as the replay begins
    early = _train(tmp_path, "early", *lit, *trace, "memory.stream_once_inputs=true", "memory.stream_rows=16",
                   "data.decode_ahead_from=first_pass")
    assert _handed_at(tmp_path / "early", 3) in (["cache_pass"], ["replay"])
    kept = _train(tmp_path, "keep", *lit, "memory.stream_once_inputs=false")
    assert streamed == kept == early and sorted(streamed) == [1, 2, 3, 4]


def test_sigkill_and_resume_with_device_decode_reproduce_the_run(tmp_path):
    ref = _train(tmp_path, "ref", "memory.offload=true")
    run_dir, log = tmp_path / "killed", tmp_path / "killed.log"
    cmd = train_cmd(tmp_path / "data", run_dir, *STEPS, "memory.offload=true", "memory.prefetch_steps=2")
    start_and_kill(cmd, run_dir, 3, tmp_path, log)
    second = run(cmd, cwd=tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    for step, values in losses_by_step(run_dir).items():
        assert all(v == ref[step][0] for v in values), (step, values, ref[step])


class _CountingFeed(TensorFeed):
    def __init__(self, inputs):
        super().__init__(inputs)
        self.releases: list[tuple[str, int]] = []

    def release(self, name, stop, event=None):
        self.releases.append((name, stop))
        super().release(name, stop, event)


def test_stager_hands_host_fields_over_uncopied_and_frees_them_after_their_last_read():
    rows = torch.arange(8 * 5, dtype=torch.uint8).view(8, 5)
    tokens = torch.arange(8 * 3).view(8, 3)
    for offload in (False, True):
        feed = _CountingFeed({"images": rows, "tokens": tokens})
        stager = InputStager(torch.device("cpu"), offload, host_fields=("images",))
        schedule = [(0, ("images", "tokens")), (1, ("images", "tokens")), (0, ("images",)), (1, ("images",))]
        seen = []
        for i, batch in enumerate(stager.stream(feed, 4, schedule)):
            k = schedule[i][0]
            img = batch["images"]
            assert img.data_ptr() == rows[4 * k].data_ptr()  # the host rows themselves, no copy
            assert batch.get("tokens") is None or batch["tokens"].data_ptr() != tokens[4 * k].data_ptr()
            seen.append([r for r in feed.releases if r[0] == "images"])
        # images rows are released only after pass 2's read of each micro-batch
        assert seen[0] == seen[1] == seen[2] == [], offload
        assert [r for r in feed.releases if r[0] == "images"] == [("images", 4), ("images", 8)], offload
        assert "images" not in stager.buffers, offload


SHARE = ["data.cpu_decode_share=0.5"]


def test_cpu_decode_share_trains_alike_whether_pixels_stay_on_the_device_or_are_re_read(tmp_path):
    """The workers' pixels ride in the host rows: the replay of a micro-batch the GPU pixel cache
    did not keep re-reads them, so caching changes nothing; kill-and-resume routes alike."""
    kept = _train(tmp_path, "kept", *SHARE, "memory.offload=true")
    again = _train(tmp_path, "again", *SHARE, "memory.offload=true", "data.decoded_keep_gb=0",
                   "memory.prefetch_steps=2")
    assert kept == again and sorted(kept) == [1, 2, 3, 4]
    device_only = _train(tmp_path, "device_only", "memory.offload=true")
    # half the samples took the CPU path's pixels: the same crops within a level of resampling
    # (here bit-identical: 32-px sources upscaled to 32 px, where PIL and the resize reference agree)
    for step in kept:
        assert abs(device_only[step][0] - kept[step][0]) < 0.02 * abs(kept[step][0]), step
    recs = step_records(tmp_path / "kept")
    assert any(r["loader_cpu_decoded_per_s"] > 0 for r in recs) and recs[-1]["cpu_decoded_samples"] > 0
    assert recs[-1]["decode_cpu_pixels"] > 0

    run_dir, out = tmp_path / "killed", tmp_path / "killed.log"
    cmd = train_cmd(tmp_path / "data", run_dir, *STEPS, *SHARE, "memory.offload=true")
    start_and_kill(cmd, run_dir, 3, tmp_path, out)
    second = run(cmd, cwd=tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "loader workers decode 50 % of the samples (data.cpu_decode_share=0.5" in second.stdout
    for step, values in losses_by_step(run_dir).items():
        assert all(v == kept[step][0] for v in values), (step, values, kept[step])
