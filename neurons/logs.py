"""Where the project's programs log: standard error, the one it is when a line is written.

Why not ``logger.add(sys.stderr)``: that keeps the stream of the moment. Each program's ``main`` also runs inside
other processes (the tests call the calibrator's, the reference's, the miner's and the validator's), and a stream
captured for one test is closed after it; every line logged later failed inside loguru with "I/O operation on
closed file", a traceback a line, in the output of whichever test failed next (CI's log of 2026-12-07).

Example::

    to_stderr("info")                 # HH:mm:ss, level, message
    to_stderr("debug", fmt=my_format)  # a format string or function, as loguru takes them
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from loguru import logger

SHORT = "<green>{time:HH:mm:ss}</green> <level>{level: <7}</level> {message}"


def to_stderr(level: str, fmt: str | Callable[[Any], str] = SHORT) -> None:
    """Log at ``level`` and above to standard error, and nowhere else."""
    logger.remove()
    logger.add(_write, level=level.upper(), format=fmt, colorize=sys.stderr.isatty())


def _write(message: str) -> None:
    sys.stderr.write(message)
