"""A long step's sign of life: ``logging.heartbeat_s``.

At a million samples per step one optimizer step lasts minutes, and the progress line comes
only after it. While a step runs longer than ``every_s`` seconds, the main rank prints one line
every ``every_s`` seconds: the step, how long it has run, its phase and micro-batches done, and
when it should end at the rate so far::

    step 1/3 running 2m00s: replay 310 of 4,096 micro-batches; about 4m51s left

Between the passes (the cache pass's last micro-batch done, the replay's first not yet) the line
names the loss and how long ago the cache pass ended, since on several ranks that stretch also
holds the wait for the slowest rank's cache pass and can last minutes at a million samples::

    step 1/1 running 4m00s: loss, 39s since the cache pass's 1,024 micro-batches; then the replay, about 2m10s

Invariants:

- nothing is printed for a step shorter than ``every_s`` (the usual case: no noise);
- the counts are the host's: under CUDA's asynchronous launches they may run ahead of the GPU
  by the launch queue, never behind it;
- "left" in the replay is the replay's own rate, timed from the end of its first micro-batch (the
  loss step and a first-call compile before it would otherwise stretch the rate many-fold while
  few micro-batches are done); after one micro-batch only, the cache pass's rate times the
  replay's weight (below) stands in for it. In the cache pass it is the cache pass's
  rate plus the replay's predicted time: the cache pass's time times the last finished step's
  measured ratio of replay to cache pass, or before any step finished, ``replay_weight`` replayed
  micro-batches per cache-pass one (3: the replay runs the forward again and the backward, about
  two forwards, when every tower is trained). With ``replay_weight=None`` (a locked tower runs in
  the cache pass only, so no fixed ratio holds) the first step's cache pass says no time left;
- the beat never blocks the step: the engine's callback stores a few numbers and reads the clock
  at the end of the cache pass.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

REPLAY_WEIGHT = 3.0  # a replayed micro-batch of trained towers: forward + backward (~2 forwards) against one forward


def clock_text(seconds: float) -> str:
    """``42s``, ``2m05s``, ``1h03m``."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class StepHeartbeat:
    """``begin`` / ``end`` bracket each step; the engine calls ``micro(phase, done, total)``
    after each micro-batch; ``beat()`` returns the line that is due now, or None. ``start()``
    runs a daemon thread that hands due lines to ``say``."""

    def __init__(self, every_s: float, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic,
                 replay_weight: Optional[float] = REPLAY_WEIGHT):
        if every_s <= 0:
            raise ValueError("logging.heartbeat_s must be > 0 for a heartbeat (0 turns it off)")
        self.every_s, self.say, self.clock = float(every_s), say, clock
        self.replay_weight = replay_weight  # replay / cache-pass time per micro-batch until a step measures it
        self._step: Optional[tuple[int, int]] = None
        self._t0 = self._next = 0.0
        self._phase: Optional[tuple[str, int, int]] = None
        self._cache: Optional[tuple[float, int]] = None  # (when this step's cache pass ended, its micro-batches)
        self._replay1: Optional[float] = None  # when this step's first replayed micro-batch ended
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def begin(self, step: int, steps: int) -> None:
        self._phase, self._cache, self._replay1 = None, None, None
        self._t0 = self.clock()
        self._next = self._t0 + self.every_s
        self._step = (step, steps)

    def micro(self, phase: str, done: int, total: int) -> None:
        self._phase = (phase, done, total)
        if phase == "cache pass" and done == total:
            self._cache = (self.clock(), total)
        elif phase == "replay" and done == 1:
            self._replay1 = self.clock()

    def end(self) -> None:
        """Closes the step; one with both passes seen measures the replay's weight for the next."""
        phase, cache = self._phase, self._cache
        if cache is not None and phase is not None and phase[0] == "replay" and phase[1] == phase[2]:
            cache_s, replay_s = cache[0] - self._t0, self.clock() - cache[0]
            if cache_s > 0 and replay_s > 0:
                self.replay_weight = (replay_s / phase[2]) / (cache_s / cache[1])
        self._step = None

    def beat(self) -> Optional[str]:
        step, now = self._step, self.clock()
        if step is None or now < self._next:
            return None
        self._next = now + self.every_s
        return self._line(step, now, self._phase)

    def _line(self, step: tuple[int, int], now: float, phase: Optional[tuple[str, int, int]]) -> str:
        head = f"step {step[0]}/{step[1]} running {clock_text(now - self._t0)}"
        if phase is None:
            return head + ": waiting for its first micro-batch"
        name, done, total = phase
        if name == "cache pass" and done == total and self._cache is not None:
            return self._loss_line(head, now)
        left = self._left(name, done, total, now)
        tail = f"; about {clock_text(left)} left" if left is not None else ""
        return f"{head}: {name} {done:,} of {total:,} micro-batches{tail}"

    def _predicted_replay(self) -> Optional[float]:
        """The whole replay's predicted seconds once the cache pass ended: its time times
        ``replay_weight`` (None without a weight: a locked tower's first step)."""
        if self._cache is None or self.replay_weight is None:
            return None
        return self.replay_weight * (self._cache[0] - self._t0)

    def _loss_line(self, head: str, now: float) -> str:
        """The line between the passes (the loss, and on several ranks the wait for the others)."""
        cache_end, n = self._cache
        line = f"{head}: loss, {clock_text(now - cache_end)} since the cache pass's {n:,} micro-batches"
        replay = self._predicted_replay()
        return line if replay is None else line + f"; then the replay, about {clock_text(replay)}"

    def _left(self, name: str, done: int, total: int, now: float) -> Optional[float]:
        """Seconds left in the step at the rates so far (None: no rate to go by yet)."""
        if done == 0:
            return None
        if name == "replay" and self._replay1 is not None and done > 1:
            return (now - self._replay1) / (done - 1) * (total - done)
        if name == "replay" and self._cache is not None:
            cache_end, cache_n = self._cache
            if done == 1 and self.replay_weight is not None:
                return self._predicted_replay() / cache_n * (total - done)
            return (now - cache_end) / done * (total - done)
        if self.replay_weight is None:
            return None
        if name == "cache pass":
            per_cache = (now - self._t0) / done
            return per_cache * (total - done) + self.replay_weight * per_cache * total
        # a replay whose cache pass was not reported: work in cache-pass micro-batches
        work = total + self.replay_weight * done
        return (now - self._t0) * ((1 + self.replay_weight) * total - work) / work

    # -------------------------------------------------------------------- thread
    def start(self) -> "StepHeartbeat":
        self._thread = threading.Thread(target=self._run, name="step-heartbeat", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.every_s / 4)):
            line = self.beat()
            if line is not None:
                self.say(line)
