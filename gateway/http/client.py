"""A lean HTTP/1.1 client for miner streams: pooled keep-alive connections, one callback per network read.

Why not ``aiohttp.ClientSession`` on this path: the relay is Python work per request and per token,
and the gateway benchmark showed aiohttp's client layers (request and response objects, connector,
stream reader, payload writer) as a large share of it. Here a response is parsed by ``httptools``
(llhttp, the parser Node.js uses) straight inside ``data_received``; the dispatcher gets one call per
read with the new body bytes, and nothing else runs in between. The SDK and the rest of the
validator keep using aiohttp.

Scope, on purpose: one request at a time per connection (no pipelining), identity bodies
(``Content-Length``, chunked or read-to-close, never compressed: no ``Accept-Encoding`` is sent),
response heads capped at :data:`MAX_HEAD_BYTES`. A connection goes back to the pool only after its
response ended cleanly and both sides allow keep-alive; a response abandoned mid-body is closed,
which is also what frees the miner's slot at once.

Example::

    async with MinerPool() as pool:
        conn = await pool.connect("127.0.0.1:8091", connect_timeout=3.0)
        conn.send(b"POST /v1/chat/completions HTTP/1.1\\r\\n...", listener)   # listener.on_read(conn)
        ...
        pool.release(conn)          # after conn.complete; or conn.close() to drop it
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Mapping
from typing import Protocol, cast

import httptools

from .wire import header_fields

MAX_HEAD_BYTES = 64 * 1024  # status line and headers of one response


class MinerHTTPError(Exception):
    """The miner's bytes are not a valid HTTP/1.1 response (or its head is too large)."""


class ReadListener(Protocol):
    def on_read(self, conn: MinerConnection) -> None:
        """New state on ``conn`` (head, body bytes, end, or failure): called once per network read."""


def encode_request(method: str, path: str, host: str, headers: Mapping[str, str], body: bytes) -> bytes:
    """One request as bytes: a single ``write``, so a small request leaves in one packet."""
    start = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n".encode("latin-1")
    return start + header_fields(headers) + b"\r\n" + body


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` as (host, port)."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"endpoint {endpoint!r} is not host:port")
    return host.strip("[]"), int(port)


class MinerConnection(asyncio.Protocol):
    """One TCP connection to a miner, carrying one request/response at a time.

    State the listener reads: ``status`` and ``headers`` (lower-case names) once ``head_done``;
    ``take_body()`` for the body bytes received so far; ``complete`` when the response ended;
    ``error`` (an exception) when the connection failed or the bytes were not HTTP.
    """

    def __init__(self, pool: MinerPool, endpoint: str) -> None:
        self._pool = pool
        self.endpoint = endpoint
        self._transport: asyncio.Transport | None = None
        self._listener: ReadListener | None = None
        self._parser: httptools.HttpResponseParser | None = None
        self._body: list[bytes] = []
        self._head_bytes = 0
        self._paused = False
        self._header_items: list[tuple[bytes, bytes]] = []
        self.uses = 0  # requests sent on this connection: handed out with uses > 0, it came from the pool
        self.idle_since = 0.0
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.error: BaseException | None = None
        self._interim = False
        self._body.clear()
        self._head_bytes = 0
        self._header_items.clear()

    # -- the dispatcher's side -------------------------------------------------------------------

    def send(self, data: bytes, listener: ReadListener) -> None:
        """Write one request; ``listener.on_read(self)`` follows every read until the response ends."""
        if self._transport is None or self.closed:
            raise ConnectionResetError("connection is closed")
        self._reset()
        self.resume_reading()  # a new response is read whatever the last consumer left behind
        self._listener = listener
        self._parser = httptools.HttpResponseParser(self)
        self.uses += 1
        self._transport.write(data)

    def take_body(self) -> bytes:
        """The body bytes received since the last call."""
        if not self._body:
            return b""
        data = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body.clear()
        return data

    def pause_reading(self) -> None:
        """Stop reading from the miner (its TCP window fills and it waits): the consumer is behind."""
        if not self._paused and self._transport is not None and not self.closed:
            self._paused = True
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused and self._transport is not None and not self.closed:
            self._paused = False
            self._transport.resume_reading()

    def close(self) -> None:
        """Drop the connection now (the miner sees the client go, and frees its slot)."""
        self._listener = None
        if not self.closed:
            self.closed = True
            self._pool._forget(self)
            if self._transport is not None:
                self._transport.close()

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream transport, though not necessarily an asyncio.Transport subclass (uvloop's is not)
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._parser is None or self.complete:
            self._fail(MinerHTTPError("bytes from the miner outside a response"))
            return
        if not self.head_done:
            self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(MinerHTTPError("the miner asked for a protocol upgrade"))
            return
        except httptools.HttpParserError as e:
            self._fail(MinerHTTPError(f"bad HTTP from the miner: {e}"))
            return
        if not self.head_done and self._head_bytes > MAX_HEAD_BYTES:
            self._fail(MinerHTTPError(f"response head larger than {MAX_HEAD_BYTES} bytes"))
            return
        self._notify()

    def eof_received(self) -> bool:
        h = self.headers
        if self.head_done and not self.complete and self.error is None and "content-length" not in h \
                and "chunked" not in h.get("transfer-encoding", "").lower():
            self.complete = True  # a read-to-close body ends here (llhttp is never told of EOF)
            self.keep_alive = False
            self._notify()
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        was_closed = self.closed
        self.closed = True
        self._pool._forget(self)
        if was_closed:
            return
        if not self.complete and self.error is None and self._listener is not None:
            self.error = exc or ConnectionResetError("the miner closed the connection")
            self._notify()

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_items.append((name, value))

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self._header_items.clear()  # an interim answer (100 Continue, 103 Early Hints): the real one follows
            self._interim = True
            return
        self.status = status
        self.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in self._header_items}
        self._header_items.clear()
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        if self._listener is not None:  # a released connection only drains to the end of its response
            self._body.append(body)

    def on_message_complete(self) -> None:
        assert self._parser is not None
        if self._interim:
            self._interim = False
            return
        self.complete = True
        self.keep_alive = bool(self._parser.should_keep_alive())

    # -- internals -------------------------------------------------------------------------------

    def _fail(self, error: BaseException) -> None:
        self.error = error
        listener = self._listener
        self.close()
        if listener is not None:
            listener.on_read(self)

    def _notify(self) -> None:
        if self._listener is not None:
            self._listener.on_read(self)
        if self.complete and self._pool._draining(self):
            self._listener = None
            self._pool._park(self)


class MinerPool:
    """Keep-alive connections per miner endpoint, most recently used first.

    ``idle_timeout``: an idle connection older than this is closed, not reused; a sweep runs that often
    while any connection is idle, so a miner no longer routed to keeps no socket open. Servers also
    close idle keep-alive connections on their own clock (uvicorn after 5 s, aiohttp after 75 s), so a
    reused connection can still be found dead: the dispatcher retries that case once on a fresh one.
    """

    def __init__(self, *, max_idle_per_miner: int = 64, idle_timeout: float = 15.0,
                 drain_timeout: float = 5.0) -> None:
        self.max_idle_per_miner = max_idle_per_miner
        self.idle_timeout = idle_timeout
        self.drain_timeout = drain_timeout  # for the end of a response whose stream already finished
        self._idle: dict[str, deque[MinerConnection]] = {}
        self._draining_conns: set[MinerConnection] = set()
        self._all: set[MinerConnection] = set()
        self.opened = 0  # connections opened over the pool's life, for tests and benchmarks
        self._sweeper: asyncio.TimerHandle | None = None  # closes idle connections nobody came back for

    async def connect(self, endpoint: str, *, connect_timeout: float, fresh: bool = False) -> MinerConnection:
        """A pooled idle connection to ``endpoint`` (unless ``fresh``), else a new one.

        Raises ``TimeoutError`` or ``OSError`` (refused, unreachable), ``ValueError`` for a bad endpoint.
        """
        idle = None if fresh else self._idle.get(endpoint)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.closed:
                continue
            if now - conn.idle_since > self.idle_timeout:
                conn.close()
                continue
            return conn
        host, port = split_endpoint(endpoint)
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(connect_timeout):
            _, conn = await loop.create_connection(lambda: MinerConnection(self, endpoint), host, port)
        self._all.add(conn)
        self.opened += 1
        return conn

    def release(self, conn: MinerConnection) -> None:
        """Give back a connection whose response the caller is done with: reused if it ends cleanly."""
        if conn.closed:
            return
        if conn.error is not None or (conn.complete and not conn.keep_alive):
            conn.close()
        elif conn.complete:
            conn._listener = None
            self._park(conn)
        else:
            # the stream's last bytes (``[DONE]``) came before the HTTP message ended: wait for its end
            conn._listener = None
            self._draining_conns.add(conn)
            asyncio.get_running_loop().call_later(self.drain_timeout, self._drain_expired, conn)

    def idle_count(self, endpoint: str | None = None) -> int:
        if endpoint is not None:
            return len(self._idle.get(endpoint, ()))
        return sum(len(q) for q in self._idle.values())

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
        self._draining_conns.clear()
        await asyncio.sleep(0)  # let the transports run their close callbacks

    async def __aenter__(self) -> MinerPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- used by MinerConnection -----------------------------------------------------------------

    def _draining(self, conn: MinerConnection) -> bool:
        if conn in self._draining_conns:
            self._draining_conns.discard(conn)
            if conn.keep_alive and conn.error is None:
                return True
            conn.close()
        return False

    def _drain_expired(self, conn: MinerConnection) -> None:
        if conn in self._draining_conns:
            conn.close()

    def _park(self, conn: MinerConnection) -> None:
        idle = self._idle.setdefault(conn.endpoint, deque())
        if len(idle) >= self.max_idle_per_miner:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(self.idle_timeout, self._sweep)

    def _sweep(self) -> None:
        """Close the connections idle longer than ``idle_timeout`` (a miner no longer routed to keeps none)."""
        self._sweeper = None
        cutoff = time.monotonic() - self.idle_timeout
        for idle in list(self._idle.values()):
            for conn in [c for c in idle if c.idle_since <= cutoff]:
                conn.close()
        if any(self._idle.values()):
            self._sweeper = asyncio.get_running_loop().call_later(self.idle_timeout, self._sweep)

    def _forget(self, conn: MinerConnection) -> None:
        self._all.discard(conn)
        self._draining_conns.discard(conn)
        idle = self._idle.get(conn.endpoint)
        if idle and conn in idle:
            idle.remove(conn)
