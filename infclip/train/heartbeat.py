"""A long step's sign of life: ``logging.heartbeat_s``.

At a million samples per step one optimizer step lasts minutes, and the progress line comes
only after it. While a step runs longer than ``every_s`` seconds, the main rank prints one line
every ``every_s`` seconds: the step, how long it has run, its phase and micro-batches done, and
when it should end at the rate so far::

    step 1/3 running 2m00s: replay 310 of 4,096 micro-batches; about 4m51s left

Invariants:

- nothing is printed for a step shorter than ``every_s`` (the usual case: no noise);
- the counts are the host's: under CUDA's asynchronous launches they may run ahead of the GPU
  by the launch queue, never behind it;
- "left" weighs a replayed micro-batch as three cache-pass micro-batches (the replay runs the
  forward again and the backward, about two forwards), and is omitted until one is done;
- the beat never blocks the step: the engine's callback only stores three numbers.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

REPLAY_WEIGHT = 3.0  # a replayed micro-batch: forward + backward (~2 forwards) against one no-grad forward


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

    def __init__(self, every_s: float, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic):
        if every_s <= 0:
            raise ValueError("logging.heartbeat_s must be > 0 for a heartbeat (0 turns it off)")
        self.every_s, self.say, self.clock = float(every_s), say, clock
        self._step: Optional[tuple[int, int]] = None
        self._t0 = self._next = 0.0
        self._phase: Optional[tuple[str, int, int]] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def begin(self, step: int, steps: int) -> None:
        self._phase = None
        self._t0 = self.clock()
        self._next = self._t0 + self.every_s
        self._step = (step, steps)

    def micro(self, phase: str, done: int, total: int) -> None:
        self._phase = (phase, done, total)

    def end(self) -> None:
        self._step = None

    def beat(self) -> Optional[str]:
        step, now = self._step, self.clock()
        if step is None or now < self._next:
            return None
        self._next = now + self.every_s
        return self._line(step, now - self._t0, self._phase)

    @staticmethod
    def _line(step: tuple[int, int], elapsed: float, phase: Optional[tuple[str, int, int]]) -> str:
        head = f"step {step[0]}/{step[1]} running {clock_text(elapsed)}"
        if phase is None:
            return head + ": waiting for its first micro-batch"
        name, done, total = phase
        # work done, in cache-pass micro-batches, of total * (1 + REPLAY_WEIGHT)
        work = done if name == "cache pass" else total + REPLAY_WEIGHT * done
        left = elapsed * ((1 + REPLAY_WEIGHT) * total - work) / work if work else None
        tail = f"; about {clock_text(left)} left" if left is not None else ""
        return f"{head}: {name} {done:,} of {total:,} micro-batches{tail}"

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
