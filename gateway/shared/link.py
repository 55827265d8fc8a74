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

import time
from collections.abc import Callable

import redis.asyncio as aioredis
from loguru import logger
from redis.exceptions import RedisError

__all__ = ["RedisError", "RedisLink"]


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
        """A call failed: down (logged once) until ``retry_s`` from now."""
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
