"""Serving the gateway's ASGI app on aiohttp's low-level server (``aiohttp.web.Server``), on a socket we bind.

Why: the gateway used to run on ~500 lines of its own HTTP over ``httptools``, written to chase an
nginx-relative latency target that was withdrawn. Two well-kept servers were put in its place and
measured side by side with it (``scripts/bench_gateway.py``, 64 streams, 5 interleaved repetitions,
the same run): added TTFT p50 over signed direct 1.91 ms on aiohttp, 2.34 ms on uvicorn's h11
protocol, 1.05 ms on the old server; CPU 2.75 / 3.02 / 1.64 ms a request. uvicorn's faster httptools
protocol buffers an endless header line without limit and drops the body of an ``Upgrade: h2c``
request. aiohttp is already the project's HTTP library, parses with llhttp (C), and cancels a handler
when its client disconnects, so no task per request has to watch for that.

What it refuses by itself, each with a test in ``tests/test_front_door.py``: a header line longer than
``max_head_bytes`` (refused when reached, never buffered), HTTP/0.9. It keeps the body of an
``Upgrade: h2c`` request. The app refuses an HTTP/1.1 request without ``Host`` and control characters in
header values; ``Expect: 100-continue`` (stray whitespace too) is answered here, when the app first asks
for the body.

A write to a client that has left raises :class:`~gateway.asgi.ClientGone` to the app (counted as a
disconnect), never an error aiohttp would log with a traceback for every such client.

A client that half-closes its side after sending a request is treated as gone: the server cannot tell a
half-close from a close until it writes, and a client that really left must free its miner's slot at
once (nginx's proxy does the same by default).

A malformed request is the client's: aiohttp answers it 400 and would log a traceback at ERROR for
each one, a log any client could fill; :class:`_QuietBadRequests` drops those records (the gateway
counts refusals it sees; these never reach it).

Connections are capped (``max_connections``) and every one holds a deadline except while its request
is served (:mod:`gateway.http.deadlines`): a head within ``header_timeout`` (10 s, the first one and each
one after on a kept-alive connection), a body within ``body_timeout`` of when the app asks for it (408 and
closed otherwise), idle between requests for at most ``keepalive_timeout``, no write to the client pending
for ``write_timeout`` (one watchdog a request checks every half of it). At the cap the longest-idle
connection is closed to make room; with none idle, a new connection gets ``503`` with ``Retry-After`` and
is closed at once, before anything is read, so a flood of sockets cannot use up the process's file
descriptors (the miners' connections need them too: issue 15 saw ~1,020 idle sockets block every client
and get healthy miners booked ``connect``).

A malformed request gets an OpenAI-shaped JSON error, never aiohttp's plain text echoing the client's
bytes back: ``431`` for a head over the limits (a header line over ``max_head_bytes``, more than
``max_headers`` fields), ``400`` otherwise; an HTTP/0.9 request gets a valid ``HTTP/1.1 400`` status line.

The adapter (:class:`gateway.http.exchange.AsgiExchange`, one a request) maps ASGI messages onto a
``StreamResponse``: ``http.response.start`` keeps status and headers, the first ``http.response.body`` sends them
with its bytes, the last one ends the response.

Example::

    server = HttpServer(app, host="127.0.0.1", port=0)
    await server.start()
    print(server.port)
    await server.stop()
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import itertools
import json
import logging
import socket
from typing import Any

from aiohttp import web
from aiohttp.http import RawRequestMessage
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from loguru import logger

from ..asgi import MalformedBody
from ..protocol.errors import error_body
from .deadlines import ConnectionDeadlines
from .exchange import AsgiExchange


class _QuietBadRequests(logging.Filter):
    """Drops aiohttp's ERROR record (with traceback) for each malformed client request."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, BadHttpMessage)


logging.getLogger("aiohttp.server").addFilter(_QuietBadRequests())


def _listen(host: str, port: int, backlog: int, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket whose ``proto`` is ``IPPROTO_TCP``; ``reuse_port``: one of several processes serving
    the port (``SO_REUSEPORT``: the kernel spreads new connections among them).

    asyncio turns Nagle off (``TCP_NODELAY``) only on sockets whose ``proto`` says TCP; one made by
    ``socket.create_server`` says 0, its accepted connections keep Nagle, and each stream's last
    write then waits for the client's delayed ACK: 40 ms on every keep-alive request, measured.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError as e:
        sock.close()
        raise ListenError(host, port, e) from None
    except BaseException:
        sock.close()
        raise
    return sock


class ListenError(OSError):
    """The gateway cannot listen where it was told to: one line for the operator, not a traceback."""

    def __init__(self, host: str, port: int, cause: OSError) -> None:
        why = {errno.EADDRINUSE: "the port is in use (another validator, or another service: pick --gateway.port)",
               errno.EACCES: "permission denied (ports below 1024 need privileges)",
               errno.EADDRNOTAVAIL: "no such address on this machine (check --gateway.host)"}.get(
            cause.errno or 0, cause.strerror or str(cause))
        self.message = f"cannot listen on {host}:{port}: {why}"
        super().__init__(cause.errno, self.message)

    def __str__(self) -> str:  # OSError's would start with "[Errno 98]"
        return self.message


# After refusing a request whose body it did not read (401, 408, 413), the server reads and drops what is still
# coming for this long before it closes, so the client is not reset before it reads the refusal; aiohttp's own
# default is 10 s, which a client that sends nothing turned into 10 s of holding the connection.
LINGER_S = 2.0


def raw_error(status: int, reason: str, message: str, code: str, *, headers: bytes = b"") -> bytes:
    """A whole ``HTTP/1.1`` JSON error answer that closes the connection, for refusals made below the app."""
    body = json.dumps(error_body(message, code=code, type="server_error" if status >= 500 else
                                 "invalid_request_error"), separators=(",", ":")).encode()
    return (b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nConnection: close\r\n%sContent-Length: %d\r\n\r\n"
            % (status, reason.encode(), headers, len(body))) + body


_FULL = raw_error(503, "Service Unavailable", "too many connections; retry shortly", "too_many_connections",
                  headers=b"Retry-After: 1\r\n")
_HTTP09 = raw_error(400, "Bad Request", "only HTTP/1.0 and HTTP/1.1 are served", "bad_request")


class _Full(asyncio.Protocol):
    """A connection over the cap: told 503 and closed before anything is read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(_FULL)
        transport.close()


class _Connection(web.RequestHandler):
    """aiohttp's handler of one client connection, telling the deadlines when bytes arrive and when it closes,
    and answering a malformed request in JSON (aiohttp's plain text echoes the client's bytes back)."""

    def __init__(self, manager: web.Server, clock: ConnectionDeadlines[Any], **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.clock = clock
        self._body: Any = None  # the payload of the last request parsed: a body still arriving, or done

    def data_received(self, data: bytes) -> None:
        """Bytes in; each request head that ends before the read does is parsed on its own first, so a malformed
        request pipelined behind a valid one cannot take it down with it (aiohttp's parser drops every message
        of a read that fails to parse: the valid request was never answered)."""
        self.clock.bytes_arrived(self)
        start = 0
        end = data.find(b"\r\n\r\n")
        while end != -1 and end + 4 < len(data):
            self._feed(data[start:end + 4])
            start = end + 4
            end = data.find(b"\r\n\r\n", start)
        self._feed(data[start:] if start else data)

    def _feed(self, data: bytes) -> None:
        """aiohttp queues a body that breaks its framing as a new malformed request, behind the one whose body it
        was, which then waits for the rest until the body deadline (a 408 after 30 s): end that body with the
        error at once, so the request is answered 400 now."""
        queued = len(self._messages)
        super().data_received(data)
        for msg, payload in itertools.islice(self._messages, queued, None):  # only what this read queued
            if isinstance(msg, RawRequestMessage):
                self._body = payload
            elif self._body is not None and not self._body.is_eof():
                self._body.set_exception(MalformedBody("malformed request body: its chunked framing is broken"))

    def connection_lost(self, exc: BaseException | None) -> None:
        self.clock.closed(self)
        super().connection_lost(exc)

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status == 400 and (isinstance(exc, LineTooLong) or "Too many headers" in str(exc)):
            status, text, code = 431, "request head too large (a header line or the number of headers)", \
                "header_fields_too_large"
        elif status == 400:
            text, code = "malformed HTTP request", "bad_request"
        else:
            text, code = "internal error", "internal_error"
            # a fault of ours, never the client's: said with its traceback (a 500 nothing logged hid issue 56's
            # Redis-down admission failure)
            logger.opt(exception=exc).error("internal error answering {} {!r}: {!r}", request.method,
                                            request.path, exc)  # repr: a client's %0A forges no log line
        body = json.dumps(error_body(text, code=code), separators=(",", ":"))
        resp = web.Response(status=status, text=body, content_type="application/json")
        resp.force_close()
        return resp


class _Server(web.Server):
    """aiohttp's low-level server, making :class:`_Connection` handlers."""

    def __init__(self, handler: Any, clock: ConnectionDeadlines[Any], **handler_args: Any) -> None:
        super().__init__(handler, handler_cancellation=True, **handler_args)
        self.clock = clock
        self.handler_args = handler_args

    def __call__(self) -> web.RequestHandler:
        return _Connection(self, self.clock, loop=asyncio.get_running_loop(), **self.handler_args)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is this machine only (a host name may resolve to anything)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def connection_cap(requested: int, open_files: int | None) -> int:
    """The client connections to allow: ``requested``, but at most half the process's open-files limit, so
    accepting clients never starves the miners' connections and the state file of descriptors (and asyncio
    never logs an accept error per client at the limit)."""
    if open_files is None or open_files <= 0:
        return max(1, requested)
    return max(1, min(requested, open_files // 2))


def _force_close(conn: Any) -> None:
    conn.force_close()  # closes its transport too


def _open_files_limit() -> int | None:
    try:
        import resource
    except ImportError:
        return None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else int(soft)


class HttpServer:
    """One listening socket serving an ASGI ``app`` through aiohttp."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0, keepalive_timeout: float = 75.0,
                 max_head_bytes: int = 16 * 1024, shutdown_timeout: float = 5.0, backlog: int = 2048,
                 max_connections: int = 2048, header_timeout: float = 10.0, body_timeout: float = 30.0,
                 max_headers: int = 128, write_timeout: float = 30.0, reuse_port: bool = False) -> None:
        self.app = app
        self.reuse_port = reuse_port
        self.write_timeout = write_timeout
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.max_connections = max(1, max_connections)
        self.refused_connections = 0
        self.host = host
        self.requested_port = port
        self.keepalive_timeout = keepalive_timeout
        self.max_head_bytes = max_head_bytes
        self.max_headers = max_headers
        self.shutdown_timeout = shutdown_timeout
        self.backlog = backlog
        self._server: _Server | None = None
        self._clock: ConnectionDeadlines[Any] | None = None
        self._listener: asyncio.Server | None = None
        self._port = 0

    @property
    def expired_connections(self) -> int:
        """Connections closed at a deadline (head, idle)."""
        return self._clock.expired if self._clock is not None else 0

    @property
    def evicted_connections(self) -> int:
        """Idle connections closed to make room for a new one at the cap."""
        return self._clock.evicted if self._clock is not None else 0

    async def start(self) -> None:
        cap = connection_cap(self.max_connections, _open_files_limit())
        if cap < self.max_connections:
            logger.warning("client connections capped at {} (half the open-files limit), not {}", cap,
                           self.max_connections)
            self.max_connections = cap
        sock = _listen(self.host, self.requested_port, self.backlog, self.reuse_port)
        loop = asyncio.get_running_loop()
        self._clock = ConnectionDeadlines(loop, head_s=self.header_timeout, idle_s=self.keepalive_timeout,
                                          expire=_force_close)
        # aiohttp's own keep-alive timer stays as a backstop, a little later than ours
        self._server = _Server(self._handle, self._clock, access_log=None,
                               keepalive_timeout=self.keepalive_timeout + 1.0, max_line_size=self.max_head_bytes,
                               max_field_size=self.max_head_bytes, max_headers=self.max_headers,
                               lingering_time=LINGER_S)
        try:
            self._listener = await loop.create_server(self._protocol, sock=sock)
        except BaseException:
            sock.close()
            raise
        self._port = int(sock.getsockname()[1])

    def _protocol(self) -> asyncio.BaseProtocol:
        """A handler for a new connection; past ``max_connections``, the longest-idle one is closed to make
        room, or with none idle the new one gets :class:`_Full`."""
        assert self._server is not None and self._clock is not None
        if len(self._clock) >= self.max_connections and not self._clock.evict_idle():
            self.refused_connections += 1
            return _Full()
        handler = self._server()
        self._clock.opened(handler)
        return handler

    @property
    def port(self) -> int:
        if self._listener is None:
            raise RuntimeError("server not started")
        return self._port

    def stop_accepting(self) -> None:
        """Close the listening socket (connections already open stay, until :meth:`stop`)."""
        if self._listener is not None:
            self._listener.close()

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop accepting, let requests in progress finish for ``grace_s`` (default ``shutdown_timeout``), then
        cancel them."""
        listener, self._listener = self._listener, None
        if listener is None or self._server is None:
            return
        listener.close()
        await self._server.shutdown(self.shutdown_timeout if grace_s is None else grace_s)
        await listener.wait_closed()

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        clock = self._clock
        assert clock is not None
        conn = request.protocol
        clock.request_started(conn)
        try:
            return await self._serve(request)
        finally:
            clock.request_done(conn)

    async def _serve(self, request: web.BaseRequest) -> web.StreamResponse:
        v = request.version
        if v < (1, 0):  # aiohttp would answer in the request's own version: an invalid "HTTP/0.9 400" line
            if request.transport is not None:
                request.transport.write(_HTTP09)
            conn = request.protocol
            conn.force_close()
            return web.Response(status=400)  # never written: the connection is closed
        clock, conn = self._clock, request.protocol
        assert clock is not None
        return await AsgiExchange(request, body_timeout=self.body_timeout, write_timeout=self.write_timeout,
                                  waiting=lambda on: clock.waiting_for_body(conn, on)).run(
            self.app)
