"""Stop signals: each is recorded and announced once, by the main rank; after a finished run
``exit_zero_on_stop`` turns SIGTERM / SIGUSR1 into exit 0."""

import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

CHILD = """
import os, signal, sys, time
from infclip.train.signals import exit_zero_on_stop
if sys.argv[1] == "installed":
    exit_zero_on_stop()
os.kill(os.getpid(), int(sys.argv[2]))
time.sleep(30)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_stop_signal_after_a_finished_run_exits_zero(sig):
    run = lambda mode: subprocess.run([sys.executable, "-c", CHILD, mode, str(int(sig))], timeout=60)  # noqa: E731
    assert run("installed").returncode == 0
    assert run("default").returncode == -int(sig)  # without it the signal kills the process


def test_a_stop_signal_is_announced_once_by_the_main_rank_with_how_to_resume(capfd, monkeypatch):
    """Every rank of a torchrun job receives a terminal's Ctrl-C: only rank 0 says so, once,
    and the line says that the same command resumes."""
    from infclip.train.signals import signals_handled

    for rank, said in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        state = SimpleNamespace(signal_received=0, interrupts=0)
        with signals_handled(state):
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGINT)
        err = capfd.readouterr().err
        assert state.signal_received == signal.SIGTERM and state.interrupts == 1
        lines = err.strip().splitlines()
        assert lines == ([] if not said else [
            "SIGTERM: stopping after this step with a checkpoint; run the same command to resume",
            "interrupted: stopping after this step with a checkpoint; run the same command to resume (interrupt "
            "again to exit at once)"])


def test_sighup_is_a_stop_signal_like_sigterm_and_announced(capfd, monkeypatch):
    """A closed terminal or SSH session (SIGHUP) stops after the step with a checkpoint, like
    SIGTERM (never a requeue), instead of ending the run at once; the run's log says why
    (stderr may be gone then: the write's error is ignored)."""
    from infclip.train.signals import signals_handled

    monkeypatch.setenv("RANK", "0")
    state = SimpleNamespace(signal_received=0, stop_requested=False, interrupts=0)
    with signals_handled(state):
        os.kill(os.getpid(), signal.SIGHUP)  # the handler runs before the next line
    assert state.signal_received == signal.SIGTERM
    assert capfd.readouterr().err.strip().splitlines() == [
        "SIGHUP: stopping after this step with a checkpoint; run the same command to resume"]


@pytest.mark.parametrize("first, line", [
    (signal.SIGTERM, "SIGTERM: stopping after this step with a checkpoint; run the same command to resume"),
    (signal.SIGINT, "interrupted: stopping after this step with a checkpoint; run the same command to resume "
                    "(interrupt again to exit at once)")], ids=["sigterm", "ctrl-c"])
def test_a_sigterm_landing_while_the_first_signal_is_announced_adds_no_second_line(monkeypatch, first, line):
    """``timeout`` sends SIGTERM to its child and then to the child's process group; a scheduler's
    SIGTERM can follow a Ctrl-C. The second signal can land while the first one's line is written
    and re-enter the handler there: the first was recorded before, so the run is told once."""
    from infclip.train import signals

    said = []

    def say(text):  # the SIGTERM lands inside the first signal's write
        said.append(text)
        if len(said) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(1000))  # a call: the re-entered handler runs here

    monkeypatch.setattr(signals, "_say", say)
    state = SimpleNamespace(signal_received=0, stop_requested=False, interrupts=0)
    with signals.signals_handled(state):
        os.kill(os.getpid(), first)
    assert state.signal_received == signal.SIGTERM and state.interrupts == (first == signal.SIGINT)
    assert said == [line]


def test_after_the_steps_a_stop_signal_says_what_is_left_instead_of_stopping_after_a_step(capfd, monkeypatch):
    """Once training's steps are over (``state.finishing``), the first stop signal's line
    names what finishes first and that the run then exits with status 0."""
    from infclip.train.signals import signals_handled

    monkeypatch.setenv("RANK", "0")
    for sig, start in ((signal.SIGTERM, "SIGTERM: "), (signal.SIGINT, "interrupted: ")):
        state = SimpleNamespace(signal_received=0, interrupts=0, finishing="the final eval")
        with signals_handled(state):
            os.kill(os.getpid(), sig)
        assert state.signal_received == signal.SIGTERM
        line = capfd.readouterr().err.strip()
        assert line.startswith(start + "training is over; finishing the final eval first, then exiting with "
                               "status 0"), line
