"""Stop signals: SIGTERM (a user's scancel), SIGINT (Ctrl-C), SIGHUP (a closed terminal) and
SIGUSR1 (Slurm's warning before the time limit) end training after the current step, with a
checkpoint and exit status 0.

SIGINT and SIGHUP are recorded as SIGTERM (a user's stop: never a requeue); the first stop signal is
announced in one line, by the main rank only (every rank of a torchrun job receives a
terminal's Ctrl-C), saying that the same command resumes; a second SIGINT ends the process at once (status 130, no checkpoint: the newest one stays the
last complete one, and the ``.step_N.tmp`` an interrupted save may leave is removed at the
next start).

The handler only records the signal (``state.signal_received``); the loop acts on it after
the step, once every rank agreed (``_agree_on_stop`` in ``infclip.train.loop``). The handlers
stay installed until training (final checkpoint and final eval included) has returned, so a
signal landing in the final save or eval never kills the process half way (its line says that
those finish first). Once training has
returned, ``train.py`` makes a stop signal end the process with status 0
(``exit_zero_on_stop``): everything is saved, and a scheduler must not count the finished run
as failed (nor requeue it) because its stop signal came in the process's last moments. (Only
the interpreter's own finalization, after it resets its signal handlers, is left uncovered.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from typing import Any, Callable, Iterator, Optional

# SIGHUP (a closed terminal or SSH session) is a user's stop like SIGTERM
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
INTERRUPTED_EXIT = 130  # a second Ctrl-C: the shell's status for "ended by SIGINT"
RESUME_HINT = "run the same command to resume"


def install_signal_handlers(state: Any) -> dict:
    """Records SIGTERM / SIGUSR1 / SIGINT / SIGHUP in ``state.signal_received`` (the largest number
    wins: SIGTERM 15 over SIGUSR1 10; SIGINT and SIGHUP count as SIGTERM). A second SIGINT exits at once.
    Returns the previous handlers, for ``restore_signal_handlers``.

    The signal is recorded before anything else, with no function call between reading and
    storing ``state.signal_received``: a second stop signal (``timeout`` signals its child,
    then the child's process group) can re-enter the handler at a call, and must find the
    first one recorded, so the run is told once."""

    def handler(signum, frame):
        previous = state.signal_received
        stop = signal.SIGTERM if signum in (signal.SIGINT, signal.SIGHUP) else signum
        if stop > previous:
            state.signal_received = stop
        if signum == signal.SIGINT:
            _interrupt(state)
        elif not previous:
            _say(f"{signal.Signals(signum).name}: {_what_happens(state)}")

    return {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}


def _interrupt(state: Any) -> None:
    """First SIGINT: say what happens (os.write: a print could be re-entered); second: exit now."""
    state.interrupts = getattr(state, "interrupts", 0) + 1
    if state.interrupts == 1:
        _say(f"interrupted: {_what_happens(state)} (interrupt again to exit at once)")
        return
    _say("interrupted again: exiting now without a checkpoint (the newest complete one stays)")
    os._exit(INTERRUPTED_EXIT)  # at once: no finally blocks, no waiting on loader workers


def _what_happens(state: Any) -> str:
    """What a first stop signal does now: ends training after the current step, or, once the
    steps are over (``state.finishing`` names what is left, e.g. "the final eval"), lets
    that finish."""
    finishing = getattr(state, "finishing", "")
    if finishing:
        return f"training is over; finishing {finishing} first, then exiting with status 0"
    return f"stopping after this step with a checkpoint; {RESUME_HINT}"


def _say(line: str) -> None:
    """One line on stderr from the main rank only: every rank of a torchrun job gets the
    terminal's Ctrl-C, and the run is told once."""
    if os.environ.get("RANK", "0") != "0":
        return
    try:
        os.write(2, f"{line}\n".encode())
    except OSError:
        pass


def restore_signal_handlers(previous: dict) -> None:
    """Puts back the handlers ``install_signal_handlers`` replaced: a signal from here on
    acts as it did before training (SIGTERM ends the process)."""
    for sig, handler in previous.items():
        signal.signal(sig, handler)


@contextlib.contextmanager
def signals_handled(state: Any, grace_s: float = 0.0, pending: Optional[Callable[[], bool]] = None) -> Iterator[None]:
    """Stop signals are recorded in ``state`` inside the block, restored when it exits
    (also on an exception). With ``grace_s`` > 0, a process still ``pending()`` (default: no
    stop agreed yet, ``not state.stop_requested``) ``grace_s`` seconds after a stop signal
    exits with status 128 + signal and one paragraph (:class:`GraceWatch`)."""
    previous = install_signal_handlers(state)
    watch = GraceWatch(grace_s, pending or (lambda: not state.stop_requested)) if grace_s > 0 else None
    try:
        yield
    finally:
        if watch is not None:
            watch.close()
        restore_signal_handlers(previous)


class GraceWatch:
    """Honours a stop signal when the main thread cannot: a step blocked in a collective (a
    peer rank that died, or runs another configuration) never returns to the Python code that
    acts on the signal, until torch's collective timeout (30 minutes).

    Python's C-level handler writes every caught signal's number to the wakeup fd even while
    the main thread is blocked; a thread reads it and, if the process is still ``pending()``
    ``grace_s`` later, prints one paragraph and exits at once (no checkpoint: the newest
    complete one stays; a ``.step_N.tmp`` is removed at the next start).
    """

    def __init__(self, grace_s: float, pending: Callable[[], bool]):
        self.grace_s, self.pending = grace_s, pending
        self._closed = threading.Event()
        self._read, write = socket.socketpair()
        write.setblocking(False)
        self._write = write
        self._previous_fd = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._run, name="stop-grace", daemon=True).start()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                data = self._read.recv(64)
            except OSError:
                break
            stops = [b for b in data if b in STOP_SIGNALS]
            if stops and not self._closed.wait(self.grace_s) and self.pending():
                _say(f"error: stop signal {signal.Signals(stops[0]).name} received {self.grace_s:g} s ago, but the "
                     "step has not finished: this process waits in a collective for ranks that are gone (or "
                     "another stall). Exiting now without a checkpoint (the newest complete one stays; "
                     "dist.stop_grace_s sets how long to wait)")
                os._exit(128 + stops[0])
        self._read.close()

    def close(self) -> None:
        """Stops watching and puts the previous wakeup fd back (main thread only)."""
        self._closed.set()
        signal.set_wakeup_fd(self._previous_fd)
        try:
            self._write.send(b"\0")  # wakes the thread, which then closes its end
        except OSError:
            pass
        self._write.close()


def exit_zero_on_stop() -> None:
    """From now on SIGTERM / SIGUSR1 / SIGINT end the process with status 0 (``SystemExit(0)``): for
    the time after a run finished, when nothing is left to save."""

    def handler(signum, frame):
        raise SystemExit(0)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
