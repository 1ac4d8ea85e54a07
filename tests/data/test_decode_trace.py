"""logging.decode_trace_step's timeline: the summary's arithmetic on a hand-made trace, and
the decoder recording its calls (by thread), the training thread's waits, kept-pixel hits and
the engine's phase ends, for exactly the traced interval."""

from __future__ import annotations

import io
import json
import time

import numpy as np
import pytest
import torch
from PIL import Image

from infclip.data.decode_trace import MIN_GAP_S, DecodeTrace, format_summary, phase_bounds, summarize, write_trace
from infclip.data.jpeg import JpegDecoder, JpegPacker, PackedJpegs

S = 32


def _trace() -> DecodeTrace:
    """Step from t = 100: cache pass to +4, loss to +4.5, replay to +8, the rest to +8.5.
    Decode spans (two overlapping) with idle stretches of 1.0 s (+0..+1), 0.5 s (+3.5..+4,
    the phase's end), 0.002 s (under MIN_GAP_S) and the loss and rest phases idle."""
    t = 100.0
    tr = DecodeTrace(t)
    tr.spans = [(t + 1.0, t + 2.0, "prefetch", 8), (t + 1.5, t + 2.5, "ahead", 8),
                (t + 2.502, t + 3.5, "prefetch", 8), (t + 4.5, t + 7.0, "ahead", 16)]
    tr.waits = [(t + 0.2, t + 1.1), (t + 7.5, t + 7.6)]
    tr.marks = [(t + 4.5, "loss"), (t + 4.0, "cache_pass"), (t + 8.0, "replay")]  # any order
    tr.hits, tr.end = 3, t + 8.5
    return tr


def test_phases_follow_the_marks_in_time_order_and_end_at_the_trace_end():
    assert phase_bounds(_trace()) == [("cache_pass", 0.0, 4.0), ("loss", 4.0, 4.5), ("replay", 4.5, 8.0),
                                      ("rest", 8.0, 8.5)]


def test_summary_busy_gaps_calls_and_waits_per_phase():
    got = {p.name: p for p in summarize(_trace())}
    cache = got["cache_pass"]
    assert cache.busy == pytest.approx(1.5 + 0.998)  # the union: 1.0..2.5 and 2.502..3.5
    assert [(round(t, 6), round(g, 6)) for t, g in cache.gaps] == [(0.0, 1.0), (3.5, 0.5)]  # longest first
    assert cache.calls == {"prefetch": 2, "ahead": 1} and cache.wait == pytest.approx(0.9)
    assert got["loss"].busy == 0.0 and got["loss"].gaps == [(4.0, 0.5)] and got["loss"].calls == {}
    replay = got["replay"]
    assert replay.busy == pytest.approx(2.5) and replay.gaps[0] == pytest.approx((7.0, 1.0))
    assert replay.calls == {"ahead": 1} and replay.wait == pytest.approx(0.1)
    step = got["step"]
    assert (step.start, step.end) == (0.0, 8.5) and step.busy == pytest.approx(cache.busy + replay.busy)
    assert step.wall - step.busy == pytest.approx(sum(g for _, g in step.gaps) + 0.002)  # the one under MIN_GAP_S
    assert all(g >= MIN_GAP_S for _, g in step.gaps)
    text = format_summary(7, _trace())
    assert "decode trace, step 7" in text and "3 micro-batch reads found their pixels decoded already" in text
    assert "1.000 s at +0.000" in text and "calls: ahead 1 prefetch 2" in text
    assert "handed to the decode-ahead" not in text  # no hand-off recorded


def test_the_summary_names_when_and_in_which_phase_the_next_step_was_handed_over():
    tr = _trace()
    tr.queued = [tr.origin + 2.25]
    head = format_summary(7, tr).splitlines()[0]
    assert head.endswith("; the next step's images handed to the decode-ahead at +2.250 s (in cache_pass)):"), head
    tr.queued = [tr.origin + 4.5]  # at the loss's end: the replay's first instant
    assert "at +4.500 s (in replay)" in format_summary(7, tr).splitlines()[0]


def test_the_timeline_is_written_atomically_as_json(tmp_path):
    path = write_trace(tmp_path / "decode_trace" / "step_7_rank_0.json", 7, _trace())
    doc = json.loads(path.read_text())
    assert doc["step"] == 7 and len(doc["trace"]["spans"]) == 4
    assert [p["name"] for p in doc["phases"]] == ["cache_pass", "loss", "replay", "rest", "step"]
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left
    assert path.stat().st_mode & 0o777 == 0o644


def _rows(k: int, seed: int) -> PackedJpegs:
    """k random-noise JPEGs, packed as a loader batch."""
    out = []
    for i in range(k):
        buf = io.BytesIO()
        rng = np.random.default_rng(seed + i)
        Image.fromarray(rng.integers(0, 256, (48, 56, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=90)
        torch.manual_seed(seed + i)
        out.append(JpegPacker(S)(buf.getvalue()))
    return PackedJpegs.collate(out)


def test_the_decoder_records_its_calls_waits_hits_and_marks_only_while_tracing():
    a, b, c = _rows(2, 0), _rows(3, 10), _rows(2, 20)
    dec = JpegDecoder(S, keep_bytes=1 << 20)
    dec(a)  # before the trace: not recorded
    assert dec.stop_trace() is None
    dec.start_trace()
    dec.mark_reread(a)
    dec(a)  # inline: decoded by the calling thread, kept for its re-read
    dec.prefetch(lambda: b)
    got_b = dec(b)  # the prefetch thread decoded it; this thread waited for it
    dec.mark_phase("cache_pass", dec._trace.origin + 10.0)
    dec(a)  # kept: a hit, no decode
    assert dec.decode_ahead([lambda: c]) is True
    dec._ahead_pool.shutdown(wait=True)
    tr = dec.stop_trace()
    assert len(tr.queued) == 1 and tr.origin + 10.0 > tr.queued[0] >= tr.origin  # when c was handed over
    dec(c)
    dec.mark_phase("replay", 0.0)  # after the trace: ignored
    assert [(s[2], s[3]) for s in tr.spans] == [("inline", 2), ("prefetch", 3), ("ahead", 2)]
    assert all(tr.origin <= s0 <= s1 <= tr.end for s0, s1, _, _ in tr.spans)
    assert len(tr.waits) == 3 and all(w0 <= w1 for w0, w1 in tr.waits)  # one per read of the training thread
    assert tr.hits == 1  # a's kept pixels (c's, decoded ahead, are taken after the stop: not counted)
    assert tr.marks == [(tr.origin + 10.0, "cache_pass")]
    assert torch.equal(got_b, JpegDecoder(S)(b))  # tracing changes no pixel


def _slow(dec: JpegDecoder, monkeypatch, seconds: float) -> None:
    real = dec._decode_resize

    def slow(rows):
        time.sleep(seconds)
        return real(rows)

    monkeypatch.setattr(dec, "_decode_resize", slow)


def _ahead_under_way(monkeypatch, rows: PackedJpegs, decode_s: float, sleep_s: float, before=None) -> JpegDecoder:
    """A decoder (each decode taking ``decode_s`` more) whose decode-ahead of ``rows`` has
    run for ``sleep_s``; ``before(decoder)`` runs just before the decode-ahead starts."""
    dec = JpegDecoder(S, keep_bytes=1 << 20)
    _slow(dec, monkeypatch, decode_s)
    if before is not None:
        before(dec)
    dec.decode_ahead([lambda: rows])
    time.sleep(sleep_s)
    return dec


def test_a_decode_under_way_at_the_stop_is_in_the_trace_up_to_the_stop(monkeypatch):
    """The next step's decode-ahead runs on past a step's end: the trace keeps it, else the
    step's end would read as idle."""
    dec = _ahead_under_way(monkeypatch, _rows(2, 40), 0.4, 0.2, before=JpegDecoder.start_trace)
    tr = dec.stop_trace()
    dec._ahead_pool.shutdown(wait=True)
    assert [(s[2], s[3]) for s in tr.spans] == [("ahead", 2)] and tr.spans[0][1] == tr.end
    assert summarize(tr)[-1].busy >= 0.1
    assert dec._running is None and dec.stop_trace() is None  # finished after the stop: not recorded again


def test_the_training_threads_wait_for_a_decode_ahead_is_a_wait_and_a_call_before_the_step_counts(monkeypatch):
    c = _rows(2, 50)
    dec = _ahead_under_way(monkeypatch, c, 0.4, 0.1)  # begun before the traced step
    dec.start_trace()
    dec(c)  # waits for the decode-ahead of the same rows
    tr = dec.stop_trace()
    dec._ahead_pool.shutdown(wait=True)
    assert tr.hits == 1 and tr.spans[0][0] < tr.origin  # decoded by the ahead thread, started before
    assert sum(w1 - w0 for w0, w1 in tr.waits) >= 0.15
    step = summarize(tr)[-1]
    assert step.calls == {"ahead": 1} and step.wait >= 0.15  # counted in the phase where the step began


def test_the_busy_time_of_a_decode_across_stats_calls_is_split_between_them(monkeypatch):
    """decode_busy_s counts a decode under way up to the stats() call, the rest in the next
    one: no step reads over 100 % for a decode that ended in it, and the parts add up."""
    dec = _ahead_under_way(monkeypatch, _rows(2, 60), 0.6, 0.3, before=JpegDecoder.stats)
    t_mid = time.perf_counter()
    first = dec.stats()["decode_busy_s"]
    dec._ahead_pool.shutdown(wait=True)
    second = dec.stats()["decode_busy_s"]
    assert 0.2 <= first <= 0.3 + (time.perf_counter() - t_mid)  # the part before the call
    assert first + second == pytest.approx(dec.decode_s, abs=1e-9) and second > 0.2


def test_the_schedule_keeps_a_slow_decoder_busy_on_the_cpu(tmp_path):
    """scripts/tools/simulate_decode_schedule.py: with each decode 50 ms (decoding bounds the LiT
    step), the decode-ahead and prefetch threads keep the decoder busy through the traced step,
    the LiT ring included (the 512-px GPU step's 15 % idle is not the schedule's)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "tools" / "simulate_decode_schedule.py"
    proc = subprocess.run([sys.executable, str(script), "--run-dir", str(tmp_path), "steps=3",
                           "logging.decode_trace_step=2", "memory.stream_rows=64"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    step = re.search(r"^  step .*decoder busy [\d.]+ s \((\d+) %\)", proc.stdout, re.M)
    assert step is not None, proc.stdout[-2000:]
    assert int(step.group(1)) >= 80, step.group(0)
    assert (tmp_path / "run" / "decode_trace" / "step_2_rank_0.json").exists()
