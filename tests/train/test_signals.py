"""Stop signals after a finished run: ``exit_zero_on_stop`` turns SIGTERM / SIGUSR1 into exit 0."""

import signal
import subprocess
import sys

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


def test_sighup_is_a_stop_signal_like_sigterm():
    """A closed terminal or SSH session (SIGHUP) stops after the step with a checkpoint, like
    SIGTERM (never a requeue), instead of ending the run at once."""
    import os
    from types import SimpleNamespace

    from infclip.train.signals import signals_handled

    state = SimpleNamespace(signal_received=0, stop_requested=False, interrupts=0)
    with signals_handled(state):
        os.kill(os.getpid(), signal.SIGHUP)  # the handler runs before the next line
    assert state.signal_received == signal.SIGTERM
