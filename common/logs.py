"""One log format for every Iris process, with a level on every line:
`INFO 11-27 12:16:18 scheduler iris.scheduler: ready ...` (level, date and time, the
process's `multiprocessing` name, `server` for the launcher and HTTP server, the logger,
the message), opening as vLLM's lines do. uvicorn's own loggers go through it too.
"""

from __future__ import annotations

import logging
import multiprocessing

LOG_FORMAT = "%(levelname)s %(asctime)s %(processName)s %(name)s: %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"


def configure_logging(level: str, process_name: str | None = None) -> None:
    """Sets this process's root logger to Iris's format at `level` (a name such as "info");
    `process_name` renames the process in the lines (the default `MainProcess` says nothing)."""
    if process_name is not None:
        multiprocessing.current_process().name = process_name
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, datefmt=DATE_FORMAT, force=True)
