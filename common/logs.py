"""One log format for every Iris process, with a level on every line:
`INFO 11-27 12:16:18 scheduler iris.scheduler: ready ...` (level, date and time, the
process's `multiprocessing` name, `server` for the launcher and HTTP server, the logger,
the message), opening as vLLM's lines do. uvicorn's own loggers go through it too.

A child process also takes its name as its command name (`/proc/self/comm`, 15 characters
at most), so `ps -o comm`, `top` and a log line's process name agree: `tokenizer-0`,
`scheduler`, `scheduler-rank1`.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
from pathlib import Path

LOG_FORMAT = "%(levelname)s %(asctime)s %(processName)s %(name)s: %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"


def configure_logging(level: str, process_name: str | None = None) -> None:
    """Sets this process's root logger to Iris's format at `level` (a name such as "info");
    `process_name` renames the process in the lines (the default `MainProcess` says nothing)."""
    if process_name is not None:
        multiprocessing.current_process().name = process_name
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, datefmt=DATE_FORMAT, force=True)
    if multiprocessing.parent_process() is not None:
        _name_os_process(multiprocessing.current_process().name)


def _name_os_process(name: str) -> None:
    """The kernel's name of this process (Linux; elsewhere nothing changes)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(name[:15])
