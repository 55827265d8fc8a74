"""Supervised asyncio tasks: one process, many loops, none of which may die silently.

The validator runs the gateway, probes, rounds, metagraph sync and weight setting as tasks on one
event loop. A bug or a transient error in one must be logged with context and the task restarted
(with a capped backoff), never swallowed, and never take the others down.

Example::

    async def tick():
        ...
    task = supervise("metagraph-sync", tick_forever)   # restarts tick_forever on exceptions
    ...
    task.cancel()
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable

from loguru import logger


def supervise(
    name: str,
    factory: Callable[[], Awaitable[None]],
    *,
    min_backoff_s: float = 1.0,
    max_backoff_s: float = 60.0,
    restarts: dict[str, int] | None = None,
) -> asyncio.Task[None]:
    """Run ``factory()`` forever as a named task; restart it with backoff if it raises or returns."""

    async def runner() -> None:
        backoff = min_backoff_s
        while True:
            started = asyncio.get_running_loop().time()
            try:
                await factory()
                stop_if_cancelling()
                logger.warning("task {} returned; restarting in {:.1f}s", name, backoff)
            except asyncio.CancelledError:
                raise
            except Exception:
                task = asyncio.current_task()
                if task is not None and task.cancelling():  # asked to stop while a library turned it into an error
                    raise asyncio.CancelledError from None
                logger.opt(exception=True).error("task {} crashed; restarting in {:.1f}s", name, backoff)
            if restarts is not None:
                restarts[name] = restarts.get(name, 0) + 1
            await asyncio.sleep(backoff)
            ran = asyncio.get_running_loop().time() - started
            # A task that ran a long time before failing starts again from the short backoff.
            backoff = min_backoff_s if ran > 10 * max_backoff_s else min(max_backoff_s, backoff * 2)

    return asyncio.create_task(runner(), name=name)


async def every(interval_s: float, step: Callable[[], Awaitable[None]], *, first_delay_s: float = 0.0) -> None:
    """Call ``step`` every ``interval_s`` seconds (fixed rate, no drift); exceptions propagate to the supervisor."""
    loop = asyncio.get_running_loop()
    if first_delay_s > 0:
        await asyncio.sleep(first_delay_s)
    next_at = loop.time()
    while True:
        await step()
        stop_if_cancelling()
        next_at += interval_s
        now = loop.time()
        if next_at < now:  # fell behind (a slow step): skip missed ticks instead of bursting
            next_at = now
        await asyncio.sleep(next_at - now)


def stop_if_cancelling() -> None:
    """Raise ``CancelledError`` when this task was asked to stop but the request never surfaced as one.

    A library can swallow a cancellation that lands inside its call (the Redis client's connection handling does:
    the call returns or raises its own error) while the task stays marked as cancelling; asyncio delivers a cancel
    once, so a loop that went on would never stop, and the validator's stop would wait on it for ever.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def until_stop_signal() -> None:
    """Return when the process gets SIGINT or SIGTERM (what Ctrl-C, systemd, docker and pm2 send).

    For the long-running servers (miner, reference service): after it returns they clean up and exit 0.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # no signal handlers on some platforms
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
