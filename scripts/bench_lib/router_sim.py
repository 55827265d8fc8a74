"""Requests arriving at the product router at random, each holding its miner for a while: the event loop the
router simulations share (``sim_routing_share.py``, ``bench_stock_sampler.py``), no I/O and no clock."""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterator

from gateway.router import Lease, Router


def arrivals(router: Router, *, rate: float, requests: int, rng: random.Random,
             acquire: Callable[[], Lease | None], hold: Callable[[], float]) -> Iterator[Lease | None]:
    """Yield what ``acquire`` picked for each of ``requests`` Poisson arrivals at ``rate`` (None: not served, the
    gateway would have queued it). A lease is held ``hold()`` time units after its arrival, released as the clock
    passes its end, and every lease still held is released when the arrivals are done."""
    now = 0.0
    ends: list[tuple[float, int, Lease]] = []  # (end time, tiebreak, lease)
    for i in range(requests):
        now += rng.expovariate(rate)
        while ends and ends[0][0] <= now:
            router.release(heapq.heappop(ends)[2], served=True)
        lease = acquire()
        yield lease
        if lease is not None:
            heapq.heappush(ends, (now + hold(), i, lease))
    for _, _, lease in ends:
        router.release(lease)
