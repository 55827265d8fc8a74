"""Every client connection holds a deadline in every phase but one: while its request is being served.

Why: a connection the server keeps open costs a file descriptor and a place under the connection cap.
Issue 24 found two phases without a deadline of their own: a request *body* (an authenticated head with
``Content-Length`` and no body was held > 95 s; 8 such sockets shut out every new client), and the idle
time between requests on a kept-alive connection (40 sockets that each made one ``GET /health`` held a cap
of 40 for the whole 75 s keep-alive). The phases and their clocks:

* ``HEAD``: from the connection's first byte of a head (or its opening) until the head is complete:
  ``head_s``. A kept-alive connection that starts a new head gets the same deadline for it.
* ``BODY``: the body is read against its own deadline where it is read (:mod:`gateway.http.server`'s
  ``receive``), so it is ``ACTIVE`` here.
* ``ACTIVE``: the request is being served. No deadline here: the miner's side has its own
  (:class:`gateway.upstream.UpstreamTimeouts`), and each write to the client its own (the server's
  ``write_timeout``: a client that stops reading would otherwise hold a miner's slot for ever).
* ``IDLE``: between requests: ``idle_s``. And at the connection cap the longest-idle connection is closed to
  make room for a new one, so idle sockets can never shut a new client out (a client must expect a kept-alive
  connection to close between requests; HTTP says so).
* A request *waiting for its body* (the app asked for it and nothing has come for ``stall_s``) is closed to make room
  too, after the idle ones, longest-waiting first: eight authenticated heads with ``Content-Length`` and no body held
  a cap of 8 for the body deadline (30 s), and fresh clients got 503 for 25 s of every 30 (issue 56). Such a request
  has asked no miner yet, and a client's body in flight arrives in milliseconds: only a stalled one is evicted.

Pure bookkeeping over opaque connection objects: the server tells it what happened, it calls ``expire`` with
a connection to close.

Example::

    clock = ConnectionDeadlines(loop, head_s=10, idle_s=75, expire=lambda c: c.force_close())
    clock.opened(conn)            # HEAD
    clock.request_started(conn)   # ACTIVE
    clock.request_done(conn)      # IDLE
    clock.evict_idle()            # closes the longest-idle connection, if there is one
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

C = TypeVar("C", bound=Hashable)  # a connection: aiohttp's handler in the server, anything hashable in tests


class Phase(enum.Enum):
    HEAD = "head"
    ACTIVE = "active"
    IDLE = "idle"


class ConnectionDeadlines(Generic[C]):
    """The phase and deadline timer of every open client connection."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, head_s: float, idle_s: float,
                 expire: Callable[[C], None], stall_s: float = 1.0) -> None:
        self._loop = loop
        self.head_s = head_s
        self.idle_s = idle_s
        self.stall_s = stall_s
        self._expire = expire
        self._stalled: dict[C, float] = {}  # waiting for a body since (loop time), the longest first
        self._phase: dict[C, Phase] = {}
        self._timers: dict[C, asyncio.TimerHandle] = {}
        self._idle: dict[C, None] = {}  # insertion-ordered: the longest idle first
        self.expired = 0  # connections closed at a deadline
        self.evicted = 0  # idle connections closed to make room at the cap

    def __len__(self) -> int:
        return len(self._phase)

    def phase(self, conn: C) -> Phase | None:
        return self._phase.get(conn)

    def opened(self, conn: C) -> None:
        self._enter(conn, Phase.HEAD, self.head_s)

    def bytes_arrived(self, conn: C) -> None:
        """Bytes on an idle connection start a new head, with the head's deadline."""
        if conn in self._idle:
            self._enter(conn, Phase.HEAD, self.head_s)

    def request_started(self, conn: C) -> None:
        if conn in self._phase:
            self._enter(conn, Phase.ACTIVE, None)

    def request_done(self, conn: C) -> None:
        if conn in self._phase:  # a connection that closed meanwhile is not brought back
            self._enter(conn, Phase.IDLE, self.idle_s)

    def waiting_for_body(self, conn: C, waiting: bool) -> None:
        """The request on ``conn`` waits for body bytes (True) or has them (False)."""
        if not waiting:
            self._stalled.pop(conn, None)
        elif conn in self._phase:
            self._stalled.setdefault(conn, self._loop.time())

    def closed(self, conn: C) -> None:
        self._phase.pop(conn, None)
        self._idle.pop(conn, None)
        self._stalled.pop(conn, None)
        timer = self._timers.pop(conn, None)
        if timer is not None:
            timer.cancel()

    def evict_idle(self) -> bool:
        """Close the longest-idle connection, or else the request longest stalled on its body (for ``stall_s`` at
        least); False when there is neither."""
        conn = next(iter(self._idle), None)
        if conn is None:
            since = next(iter(self._stalled.items()), None)
            if since is None or self._loop.time() - since[1] < self.stall_s:
                return False
            conn = since[0]
        self.closed(conn)
        self.evicted += 1
        self._expire(conn)
        return True

    def _enter(self, conn: C, phase: Phase, within_s: float | None) -> None:
        self._phase[conn] = phase
        self._stalled.pop(conn, None)
        if phase is Phase.IDLE:
            self._idle[conn] = None
        else:
            self._idle.pop(conn, None)
        timer = self._timers.pop(conn, None)
        if timer is not None:
            timer.cancel()
        if within_s is not None:
            self._timers[conn] = self._loop.call_later(within_s, self._on_deadline, conn, phase)

    def _on_deadline(self, conn: C, phase: Phase) -> None:
        self._timers.pop(conn, None)
        if self._phase.get(conn) is not phase:
            return
        self.closed(conn)
        self.expired += 1
        self._expire(conn)
