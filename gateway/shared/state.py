"""One process's handle on the shared state: the link, its leases, key limits and measurement publisher.

Built by the validator's wiring (:func:`neurons.validator.build.build_parts`) when ``--redis.url`` is set; its
``loops`` are run supervised by whoever runs the process (the validator, or a gateway-only process), and
``aclose`` sends what measurements the buffer still holds before the link closes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

from loguru import logger
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .leases import SharedLeases
from .limits import SharedLimits
from .link import RedisLink
from .measurements import MeasurementPublisher


@dataclass
class SharedState:
    link: RedisLink
    leases: SharedLeases
    limits: SharedLimits
    publisher: MeasurementPublisher

    def families(self) -> Iterator[Metric]:
        """Prometheus families of the shared state (added to the gateway's ``/metrics``): is Redis there, and what
        waits or was given up while it was not."""
        yield GaugeMetricFamily("tensorgate_redis_up", "1 while this process reaches the shared Redis",
                                value=1.0 if self.link.up else 0.0)
        yield CounterMetricFamily("tensorgate_redis_outages", "Times the shared Redis became unreachable",
                                  value=self.link.outages)
        yield CounterMetricFamily("tensorgate_redis_failures", "Calls to the shared Redis that failed",
                                  value=self.link.failures)
        yield GaugeMetricFamily("tensorgate_shared_measurements_buffered", "Measurements waiting to be sent to Redis",
                                value=len(self.publisher))
        yield CounterMetricFamily("tensorgate_shared_measurements_dropped",
                                  "Measurements dropped from a full buffer while Redis was away",
                                  value=self.publisher.dropped)
        yield CounterMetricFamily("tensorgate_shared_leases_refused",
                                  "Dispatches passed over because other processes held the miner's slots",
                                  value=self.leases.refused)
        yield CounterMetricFamily("tensorgate_shared_limit_fallbacks",
                                  "Limited keys admitted on this process's share of their limits (Redis away)",
                                  value=self.limits.fallbacks)

    def loops(self) -> dict[str, Callable[[], Coroutine[Any, Any, None]]]:
        """The background loops, by name, for the process's supervisor."""
        return {"shared-leases": self.leases.run, "shared-limits": self.limits.run,
                "shared-measurements": self.publisher.run}

    async def aclose(self, within_s: float = 5.0, *, keep_link: bool = False) -> None:
        """Send what is still buffered and settled (for at most ``within_s``), then close the link (unless
        ``keep_link``: the validator still reads the stream for the round it saves at stop)."""
        try:
            async with asyncio.timeout(within_s):
                await self.limits.flush()
                await self.leases.flush()
                await self.publisher.send()
        except Exception as e:  # Redis away at stop: leases and stream holds expire by themselves
            if len(self.publisher):
                logger.error("stopping with {} measurements not sent to Redis ({!r}): they are lost",
                             len(self.publisher), e)
        if not keep_link:
            await self.link.aclose()
