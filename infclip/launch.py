"""``python -m infclip.launch``: torchrun whose requested stop ends as the trainer's does.

    python -m infclip.launch --standalone --nproc_per_node=8 train.py experiment=vit_b32_laion ...

It takes torchrun's arguments (``torch.distributed.run``: every option, the same meaning) and
runs torchrun's elastic agent. One thing differs: a stop signal to the launcher (Ctrl-C:
SIGINT; a scheduler or ``kill``: SIGTERM; a closed terminal: SIGHUP) is passed on once to
every worker, which stops after its current step with a checkpoint
(``infclip.train.signals``); the launcher waits for the workers and exits with their status:
0 when every rank stopped with its checkpoint, as ``python train.py`` alone does. torchrun
itself raises ``SignalException`` in its agent instead: once the workers have stopped it
prints that traceback and exits 1, and it SIGKILLs a worker still saving its checkpoint
after ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (30 s by default). Here nothing bounds the wait
but the workers themselves (``dist.stop_grace_s`` for a rank stuck in a collective) and
the scheduler's own kill.

A second Ctrl-C ends the workers at once (status 130, no checkpoint: the newest complete one
stays), as it ends a single process. Once a stop was requested no worker is restarted
(``--max_restarts``): a rank that exits non-zero then ends the launch with one line and that
rank's status (128 + signal for a rank ended by a signal) instead of torchrun's report. A
stop before the workers started ends the launch with status 128 + signal. A failure without
a stop request is torchrun's, reported as torchrun reports it.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, Optional

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Stop:
    """What the signal handler and the agent share: the agent, the first stop signal and
    the number of Ctrl-Cs."""

    agent: Any = None
    signal: int = 0
    interrupts: int = 0


def _agent_class(base: type) -> type:
    """torchrun's local agent, made known to the signal handler (its workers' pids, its
    restart budget)."""

    class StoppableAgent(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            _Stop.agent = self

    return StoppableAgent


def _worker_pids() -> list[int]:
    """The pids of the running workers (each leads a session of its own: torchrun starts
    them with ``start_new_session``)."""
    if _Stop.agent is None:
        return []
    try:
        return [w.id for w in _Stop.agent.get_worker_group().workers if isinstance(w.id, int) and w.id > 0]
    except Exception:  # no worker group yet
        return []


def _forward(signum: int, pids: list[int]) -> None:
    """The signal to each worker's process group, as torchrun's own shutdown sends it (the
    loader workers in it ignore stop signals; the trainer decides)."""
    for pid in pids:
        try:
            os.killpg(pid, signum)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, signum)
            except (ProcessLookupError, PermissionError):
                pass


def _on_signal(signum: int, frame: Optional[Any]) -> None:
    """A stop signal: passed on to the workers, restarts off. A second SIGINT, or a stop
    before any worker runs, takes torchrun's own path (``SignalException``: the agent sends
    the signal to the workers and ends the launch)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    if signum not in STOP_SIGNALS:  # SIGQUIT: torchrun's handling
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))
    if signum == signal.SIGINT:
        _Stop.interrupts += 1
    pids = _worker_pids()
    if not pids or _Stop.interrupts > 1:
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))
    if not _Stop.signal:
        _Stop.signal = signum
        # a rank that exits non-zero after a requested stop must not be started again:
        # the restart would resume training the user asked to stop
        if hasattr(_Stop.agent, "_remaining_restarts"):
            _Stop.agent._remaining_restarts = 0
    _forward(signum, pids)


def _status(exitcode: int) -> int:
    """A process's exit status as a shell reports it (128 + signal for a signal)."""
    return 128 - exitcode if exitcode < 0 else exitcode


def _run(torchrun: Any, args: Any) -> None:
    """torchrun's ``run``; after a requested stop a failed rank is one line and its status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun.run(args)
    except ChildFailedError as err:
        if not _Stop.signal:
            raise
        rank, failure = err.get_first_failure()
        status = _status(failure.exitcode)
        print(f"launch: rank {rank} exited with status {status} after {signal.Signals(_Stop.signal).name}; "
              "the newest complete checkpoint stays; run the same command to resume", file=sys.stderr, flush=True)
        raise SystemExit(status) from None


def main(argv: Optional[list[str]] = None) -> None:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import api as mp_api
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher import api as launcher_api

    parser = torchrun.get_args_parser()
    parser.prog = "python -m infclip.launch"
    parser.description = "torchrun (the same arguments) whose requested stop ends with every rank's checkpoint and status 0"
    args = parser.parse_args(argv)
    launcher_api.LocalElasticAgent = _agent_class(launcher_api.LocalElasticAgent)
    # torchrun installs its handler for SIGTERM, SIGINT, SIGHUP and SIGQUIT when it starts the
    # workers, by this module-level name: this launcher's takes its place
    mp_api._terminate_process_handler = _on_signal
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_signal)
    try:
        record(_run)(torchrun, args)
    except SignalException as err:
        if not _Stop.signal:  # before any worker ran (a second Ctrl-C: the workers said it)
            print(f"launch: stopped by {err.sigval.name} before training started: nothing was trained or saved",
                  file=sys.stderr, flush=True)
        sys.exit(_status(-int(err.sigval)))


if __name__ == "__main__":
    main()
