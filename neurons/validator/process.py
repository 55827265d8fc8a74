"""What every validator process shares, the validator's and its gateway workers' (``--gateway.workers``): its logs
(dated text lines, or JSON lines for a shipper), its open-files limit, and a stop on SIGTERM that runs every
``finally`` on the way out. Both entry points (:mod:`.cli`, :mod:`.worker`) import it; neither imports the other's
internals.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import signal
import sys
import traceback
from collections.abc import Coroutine
from typing import Any

from loguru import logger

from ..logs import to_stderr


def log_format(record: Any) -> str:
    """Date and time, level, the request id of a line written while serving a request, the message."""
    rid = "[{extra[request_id]}] " if "request_id" in record["extra"] else ""
    who = "[{extra[validator]}] " if "validator" in record["extra"] else ""  # several on the local subnet
    return ("<green>{time:YYYY-MM-DD HH:mm:ss}</green> <level>{level: <7}</level> " + who + rid
            + "{message}\n{exception}")


def json_line(message: Any) -> None:
    """One JSON object a line on stderr (``--log.format json``), for a log shipper: time (UTC, ISO 8601), level,
    message, the request id when the line is about a request, and the exception's text when there is one."""
    record = message.record
    line: dict[str, Any] = {"time": record["time"].astimezone(datetime.UTC).isoformat(timespec="milliseconds"),
                            "level": record["level"].name, "message": record["message"]}
    for key in ("request_id", "validator"):
        if key in record["extra"]:
            line[key] = record["extra"][key]
    if record["exception"] is not None:
        line["exception"] = "".join(traceback.format_exception(*record["exception"]))
    sys.stderr.write(json.dumps(line, ensure_ascii=False) + "\n")


def configure_logging(level: str, fmt: str = "text") -> None:
    if fmt == "json":
        logger.remove()
        logger.add(json_line, level=level.upper())
    else:
        to_stderr(level, log_format)


def raise_open_files_limit() -> tuple[int, int]:
    """Raise the soft open-files limit to the hard one; returns (before, after).

    The common soft limit of 1,024 is a few hundred clients and their miner connections: past it every
    new connection fails (issue 15 measured it), while the hard limit is usually far higher and free to take.
    """
    try:
        import resource
    except ImportError:  # not on this platform
        return (0, 0)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return (soft, soft)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as e:
        logger.warning("could not raise the open-files limit from {} to {}: {}", soft, target, e)
        return (soft, soft)
    logger.debug("open-files limit raised from {} to {}", soft, target)
    return (soft, target)


async def until_stopped(coro: Coroutine[Any, Any, int]) -> int:
    """Run ``coro``; SIGTERM (what systemd, docker and pm2 send) stops it as Ctrl-C does.

    The signal cancels the run, so every ``finally`` on the way out runs: the gateway stops accepting and
    gives streams in progress its drain time (``shutdown_timeout``), miners and the chain are closed, and
    the process exits 0. Without this handler SIGTERM killed the validator at once, mid-stream.
    """
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    stopped_by_term = False

    def on_term() -> None:
        nonlocal stopped_by_term
        stopped_by_term = True
        logger.info("SIGTERM: stopping (streams in progress get the drain time)")
        task.cancel()

    with contextlib.suppress(NotImplementedError):  # no signal handlers on some platforms
        loop.add_signal_handler(signal.SIGTERM, on_term)
    try:
        return await coro
    except asyncio.CancelledError:
        if not stopped_by_term:
            raise  # Ctrl-C: asyncio.run turns it into KeyboardInterrupt, handled below
        logger.info("stopped")
        return 0
