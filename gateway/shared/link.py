"""One connection to the shared Redis, and the one place that decides whether it is up.

Every caller asks :meth:`RedisLink.usable` before a call and reports a failure with :meth:`RedisLink.failed`.
After a failure the link stays down for ``retry_s`` without any I/O, so a dead Redis costs a request nothing
(no connect timeout per request), and the change is logged once each way, never once a request.

Example::

    link = RedisLink("redis://127.0.0.1:6379/0", namespace="tensorgate:5F..:1")
    if link.usable():
        try:
            await link.redis.incr(link.key("x"))
        except RedisError as e:
            link.failed(e)
        else:
            link.worked()
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from loguru import logger
from redis.exceptions import RedisError

__all__ = ["NOW_MS", "RENEW", "RedisError", "RedisLink", "interrupted", "stop_if_cancelled", "woken"]

# The Lua every expiring set's script starts with: ``now`` in milliseconds on Redis's own clock (``t``: TIME), so the
# gateways' clocks never decide when a lease or a key's stream expires.
NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: expiring sets; ARGV: ttl ms, "1" to add the members or "0" to renew only those still there (XX), then one
# member per key. Both the miners' leases and the keys' streams are renewed by it.
RENEW = NOW_MS + """
local ttl = tonumber(ARGV[1])
for i, k in ipairs(KEYS) do
  if ARGV[2] == '1' then redis.call('ZADD', k, now + ttl, ARGV[i + 2])
  else redis.call('ZADD', k, 'XX', now + ttl, ARGV[i + 2]) end
  redis.call('PEXPIRE', k, 2 * ttl)
end
return #KEYS
"""


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def interrupted(e: BaseException) -> bool:
    """Whether ``e`` (from a Redis call) is, or hides, this task's cancellation: what the call may have done in
    Redis must then be given back by the caller, and the cancellation go on."""
    return isinstance(e, asyncio.CancelledError) or _cancelling()


def stop_if_cancelled() -> None:
    """Raise ``CancelledError`` when this task was asked to stop: a background loop calls it each beat.

    A cancellation that lands inside a Redis call can come out of the client as an error (or not at all) while the
    task stays marked as cancelling; a loop that then went on would never stop (seen: a validator's stop waiting
    minutes for its lease loop, 3 runs in 5).
    """
    if _cancelling():
        raise asyncio.CancelledError


async def woken(event: asyncio.Event, within_s: float) -> None:
    """Return when ``event`` is set or ``within_s`` has passed, and clear it: the background loops' beat.

    A plain timer sets the event, so a stop (cancellation) is never taken for the beat: ``asyncio.timeout`` on
    Python 3.11 turned a cancellation that came as its timer fired into a ``TimeoutError``, and a loop that
    swallowed it never stopped (seen: a validator stuck in its stop for minutes, 1 run in 5).
    """
    stop_if_cancelled()
    timer = asyncio.get_running_loop().call_later(within_s, event.set)
    try:
        await event.wait()
    finally:
        timer.cancel()
    event.clear()


class RedisLink:
    """A redis client with short timeouts, a key namespace and an up/down state."""

    def __init__(self, url: str, namespace: str, *, timeout_s: float = 0.5, retry_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.url = url
        self.namespace = namespace
        self.redis = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                             health_check_interval=0, retry_on_timeout=False)
        self.retry_s = retry_s
        self._clock = clock
        self._down_since: float | None = None
        self._retry_at = 0.0
        self.failures = 0  # calls that failed (for /metrics and tests)
        self.outages = 0  # times it went down

    def key(self, *parts: str) -> str:
        """A key in this validator's namespace (two validators may share one Redis)."""
        return ":".join((self.namespace, *parts))

    @property
    def up(self) -> bool:
        return self._down_since is None

    def usable(self) -> bool:
        """Whether to try Redis now: it is up, or down long enough that one call may try again."""
        return self._down_since is None or self._clock() >= self._retry_at

    def failed(self, e: BaseException) -> None:
        """A call failed: down (logged once) until ``retry_s`` from now. A call that failed because its task was
        being cancelled (a client that left, a stop) says nothing about Redis: the cancellation goes on."""
        stop_if_cancelled()
        self.failures += 1
        now = self._clock()
        self._retry_at = now + self.retry_s
        if self._down_since is None:
            self._down_since = now
            self.outages += 1
            logger.error("Redis at {} is unreachable ({!r}): routing uses local counts, API key limits a local share, "
                         "measurements wait in a local buffer; retrying every {:g} s", self.url, e, self.retry_s)

    def worked(self) -> None:
        """A call succeeded: up again (logged once)."""
        if self._down_since is not None:
            logger.info("Redis at {} is back after {:.1f} s", self.url, self._clock() - self._down_since)
            self._down_since = None

    async def aclose(self) -> None:
        await self.redis.aclose()
