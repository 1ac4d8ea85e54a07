"""Stop signals: SIGTERM (a user's scancel), SIGINT (Ctrl-C) and SIGUSR1 (Slurm's warning
before the time limit) end training after the current step, with a checkpoint and exit status 0.

SIGINT is recorded as SIGTERM (a user's stop: never a requeue); the first stop signal is
announced in one line, by the main rank only (every rank of a torchrun job receives a
terminal's Ctrl-C), saying that the same command resumes; a second SIGINT ends the process at once (status 130, no checkpoint: the newest one stays the
last complete one, and the ``.step_N.tmp`` an interrupted save may leave is removed at the
next start).

The handler only records the signal (``state.signal_received``); the loop acts on it after
the step, once every rank agreed (``_agree_on_stop`` in ``infclip.train.loop``). The handlers
stay installed until training (final checkpoint and final eval included) has returned, so a
signal landing in the final save or eval never kills the process half way. Once training has
returned, ``train.py`` makes a stop signal end the process with status 0
(``exit_zero_on_stop``): everything is saved, and a scheduler must not count the finished run
as failed (nor requeue it) because its stop signal came in the process's last moments. (Only
the interpreter's own finalization, after it resets its signal handlers, is left uncovered.)
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any, Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
INTERRUPTED_EXIT = 130  # a second Ctrl-C: the shell's status for "ended by SIGINT"
RESUME_HINT = "run the same command to resume"


def install_signal_handlers(state: Any) -> dict:
    """Records SIGTERM / SIGUSR1 / SIGINT in ``state.signal_received`` (the largest number wins:
    SIGTERM 15 over SIGUSR1 10; SIGINT counts as SIGTERM). A second SIGINT exits at once.
    Returns the previous handlers, for ``restore_signal_handlers``."""

    def handler(signum, frame):
        if signum == signal.SIGINT:
            _interrupt(state)
            signum = signal.SIGTERM
        elif not state.signal_received:
            _say(f"{signal.Signals(signum).name}: stopping after this step with a checkpoint; {RESUME_HINT}")
        state.signal_received = max(state.signal_received, signum)

    return {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}


def _interrupt(state: Any) -> None:
    """First SIGINT: say what happens (os.write: a print could be re-entered); second: exit now."""
    state.interrupts = getattr(state, "interrupts", 0) + 1
    if state.interrupts == 1:
        _say(f"interrupted: stopping after this step with a checkpoint; {RESUME_HINT} (interrupt again to "
             "exit at once)")
        return
    _say("interrupted again: exiting now without a checkpoint (the newest complete one stays)")
    os._exit(INTERRUPTED_EXIT)  # at once: no finally blocks, no waiting on loader workers


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
def signals_handled(state: Any) -> Iterator[None]:
    """Stop signals are recorded in ``state`` inside the block, restored when it exits
    (also on an exception)."""
    previous = install_signal_handlers(state)
    try:
        yield
    finally:
        restore_signal_handlers(previous)


def exit_zero_on_stop() -> None:
    """From now on SIGTERM / SIGUSR1 / SIGINT end the process with status 0 (``SystemExit(0)``): for
    the time after a run finished, when nothing is left to save."""

    def handler(signum, frame):
        raise SystemExit(0)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
