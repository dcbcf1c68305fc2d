"""One log format for every Iris process, with a level on every line.

`INFO 11-27 12:16:18 scheduler iris.scheduler: ready ...`: level, date and time,
the process (the launcher and HTTP server are `server`; children carry their
`multiprocessing` names: `tokenizer-0`, `scheduler`, `scheduler-rank1`, ...), the
logger, the message. vLLM's lines open the same way (level, then `MM-DD HH:MM:SS`), so
a reader of one reads the other. uvicorn's own loggers go through it too (the launcher
gives uvicorn no logging config of its own).
"""

from __future__ import annotations

import logging
import multiprocessing

LOG_FORMAT = "%(levelname)s %(asctime)s %(processName)s %(name)s: %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"


def configure_logging(level: str, process_name: str | None = None) -> None:
    """Sets this process's root logger to Iris's format at `level` (a name such as
    "info"); `process_name` renames the process in the lines (the main process's
    default, `MainProcess`, says nothing)."""
    if process_name is not None:
        multiprocessing.current_process().name = process_name
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, datefmt=DATE_FORMAT, force=True)
