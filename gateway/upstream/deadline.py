"""The one deadline timer of a stream: the first token within ``first_token`` of dispatch, then each read within
``stall`` of the last event, all within ``total``.

One timer a stream instead of a timeout a read (17 a request here): events only move the deadline (a float), and
the timer catches up when it fires, once a stall period at most. It only ends a read while one is pending
(``waiting``): time the validator spends on a slow *client* is never the miner's stall, and silence counts from
the last event or from when the reader came back for more, whichever is later.

Example::

    d = StreamDeadline(loop, t0, timeouts, meter, expire=resp.close)
    d.arm()                      # before each read
    d.waiting = True; data = await resp.content.readany(); d.waiting = False
    if d.passed: ...             # the read ended because the deadline passed
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from .config import UpstreamTimeouts


class Progress(Protocol):
    """What the deadline reads of a stream's meter."""

    @property
    def content_started(self) -> bool: ...

    @property
    def last_event_at(self) -> float: ...


class StreamDeadline:
    def __init__(self, loop: asyncio.AbstractEventLoop, t0: float, timeouts: UpstreamTimeouts, progress: Progress,
                 expire: Callable[[], None]) -> None:
        self._loop = loop
        self.t0 = t0
        self._tmo = timeouts
        self._progress = progress
        self._expire = expire  # ends the pending read (closes the miner's connection)
        self._timer: asyncio.TimerHandle | None = None
        self.passed = False
        self.waiting = False  # a read from the miner is pending: only then may the deadline end the stream
        self.wait_from = t0  # when the reader last came back for more

    def at(self) -> float:
        """The deadline now, in loop time."""
        t = self._tmo
        p = self._progress
        if p.content_started:
            deadline = max(p.last_event_at, self.wait_from) + t.stall
        else:
            deadline = self.t0 + t.first_token
        return min(deadline, self.t0 + t.total)

    def arm(self) -> None:
        """Make sure the timer runs (before a read)."""
        if self._timer is None:
            self._timer = self._loop.call_at(self.at(), self._fire)

    def close(self) -> None:
        """The stream ended: no timer, and no reference back to it. ``expire`` is the stream's own method, so
        holding it after the end would leave a cycle (stream, deadline, method) for the garbage collector to find
        with everything the stream held, about 40 objects a request that refcounting frees at once instead."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._expire = _ended

    def _fire(self) -> None:
        self._timer = None
        if not self.waiting:
            return  # not reading now: the next read re-arms the timer from its own start
        deadline = self.at()
        if self._loop.time() < deadline:
            self._timer = self._loop.call_at(deadline, self._fire)
            return
        self.passed = True
        self._expire()


def _ended() -> None:
    """What a closed deadline would end: nothing."""
