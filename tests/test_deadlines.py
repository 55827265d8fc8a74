"""The connection deadline bookkeeping alone (gateway.http.deadlines), on a real loop with short clocks."""

from __future__ import annotations

import asyncio

from gateway.http.deadlines import ConnectionDeadlines, Phase


async def test_phases_deadlines_and_eviction_order() -> None:
    closed: list[str] = []
    clock = ConnectionDeadlines(asyncio.get_running_loop(), head_s=0.2, idle_s=5.0, expire=closed.append)
    for c in ("a", "b", "c"):
        clock.opened(c)
    clock.request_started("a")
    clock.request_started("b")
    clock.request_done("b")  # b idle first
    clock.request_done("a")  # then a
    assert clock.phase("a") is Phase.IDLE and clock.phase("c") is Phase.HEAD
    assert clock.evict_idle() and closed == ["b"]  # the longest idle goes first
    clock.bytes_arrived("a")  # a starts a new head: no longer idle, so not evictable
    assert clock.phase("a") is Phase.HEAD and not clock.evict_idle()
    await asyncio.sleep(0.4)  # a and c pass their head deadline
    assert sorted(closed[1:]) == ["a", "c"] and clock.expired == 2 and clock.evicted == 1 and len(clock) == 0


async def test_a_connection_that_closed_is_not_brought_back_by_its_request_ending() -> None:
    closed: list[str] = []
    clock = ConnectionDeadlines(asyncio.get_running_loop(), head_s=0.05, idle_s=0.05, expire=closed.append)
    clock.opened("a")
    clock.request_started("a")
    await asyncio.sleep(0.1)  # active: no deadline runs
    assert closed == [] and clock.phase("a") is Phase.ACTIVE
    clock.closed("a")  # the client left mid-request
    clock.request_done("a")  # the handler's finally runs after
    assert clock.phase("a") is None and len(clock) == 0
    await asyncio.sleep(0.1)
    assert closed == []


async def test_a_request_stalled_on_its_body_is_evicted_after_the_idle_ones_once_stalled_long_enough() -> None:
    closed: list[str] = []
    clock = ConnectionDeadlines(asyncio.get_running_loop(), head_s=5.0, idle_s=5.0, expire=closed.append,
                                stall_s=0.1)
    for c in ("a", "b", "idle"):
        clock.opened(c)
        clock.request_started(c)
    clock.request_done("idle")
    clock.waiting_for_body("a", True)
    clock.waiting_for_body("b", True)
    assert clock.evict_idle() and closed == ["idle"]  # the idle one first, whatever the stalls
    assert not clock.evict_idle()  # a and b have waited under stall_s: a body in flight is not cut
    await asyncio.sleep(0.15)
    clock.waiting_for_body("b", False)  # b's bytes came
    clock.waiting_for_body("b", True)  # and it waits again: its stall starts over
    assert clock.evict_idle() and closed == ["idle", "a"]  # the longest stalled
    assert not clock.evict_idle()  # b: stalled under stall_s again
    clock.request_done("b")  # an answered request is idle, no longer stalled
    assert clock.evict_idle() and closed[-1] == "b" and clock.evicted == 3
