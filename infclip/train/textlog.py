"""``<run_dir>/out.log``: the run's text log (open_clip's ``out.log``), on the main rank.

Everything the process prints to stdout and stderr from the start of ``train`` — startup
lines, notes and warnings, resume and stop messages, progress and eval lines, the summary,
an error that ends the run — is also appended to the run folder's ``out.log``. Invariants:

- nothing is written into the run folder before the start is accepted (a refused start
  leaves it as it was): lines printed before ``open`` are held in memory and written first;
- a resumed run appends (each process start begins with one ``== start`` line);
- the terminal sees exactly what it saw without the log; progress-bar redraws (``\\r``)
  are not logged, only the text after the last carriage return of a line.
"""

from __future__ import annotations

import contextlib
import io
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Optional, TextIO

LOG_NAME = "out.log"


class _Tee(io.TextIOBase):
    """A text stream that writes to ``stream`` and hands each complete line to ``sink``."""

    def __init__(self, stream: TextIO, sink: "TextLog"):
        self.stream, self.sink, self._part = stream, sink, ""
        self._lock = threading.Lock()  # the step pipeline's thread prints too

    def write(self, text: str) -> int:
        n = self.stream.write(text)
        with self._lock:
            self._part += text
            *lines, self._part = self._part.split("\n")
            for line in lines:
                self.sink.line(line.rsplit("\r", 1)[-1])
        return n if n is not None else len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.stream, "encoding", "utf-8")

    def __getattr__(self, name: str):  # buffer, reconfigure, ...: the stream's own (not logged)
        return getattr(self.stream, name)


class TextLog:
    """Lines held until ``open(run_dir)``, then appended to ``run_dir/out.log``."""

    def __init__(self) -> None:
        self.held: list[str] = []
        self.file: Optional[TextIO] = None

    def line(self, text: str) -> None:
        if self.file is None:
            self.held.append(text)
            return
        self.file.write(text + "\n")
        self.file.flush()

    def open(self, run_dir: Path) -> None:
        """The start is accepted: write the held lines, then every line as it comes."""
        if self.file is not None:
            return
        self.file = open(Path(run_dir) / LOG_NAME, "a", encoding="utf-8")
        self.file.write(f"== start {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(sys.argv)}\n")
        for text in self.held:
            self.line(text)
        self.held = []

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


@contextlib.contextmanager
def text_log(enabled: bool) -> Iterator[TextLog]:
    """Tees stdout and stderr into a :class:`TextLog` for the block (``enabled``: the main
    rank; elsewhere the log only holds nothing). An exception that ends the block is logged
    as the one line ``error (Type): message`` when the file is open."""
    log = TextLog()
    if not enabled:
        yield log
        return
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Tee(saved[0], log), _Tee(saved[1], log)
    try:
        yield log
    except BaseException as e:
        if log.file is not None and not isinstance(e, (KeyboardInterrupt, SystemExit)):
            log.line(f"error ({type(e).__name__}): {str(e).strip()}")
        raise
    finally:
        for tee in (sys.stdout, sys.stderr):
            if isinstance(tee, _Tee) and tee._part:
                log.line(tee._part.rsplit("\r", 1)[-1])
        sys.stdout, sys.stderr = saved
        log.close()
