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
``max_head_bytes`` (refused when reached, never buffered), an HTTP/1.1 request without ``Host``, control
characters in header values. It keeps the body of an ``Upgrade: h2c`` request. The app refuses
HTTP/0.9; ``Expect: 100-continue`` (stray whitespace too) is answered here, when the app first asks for
the body.

A write to a client that has left raises :class:`~gateway.asgi.ClientGone` to the app (counted as a
disconnect), never an error aiohttp would log with a traceback for every such client.

A client that half-closes its side after sending a request is treated as gone: the server cannot tell a
half-close from a close until it writes, and a client that really left must free its miner's slot at
once (nginx's proxy does the same by default).

A malformed request is the client's: aiohttp answers it 400 and would log a traceback at ERROR for
each one, a log any client could fill; :class:`_QuietBadRequests` drops those records (the gateway
counts refusals it sees; these never reach it).

Connections are capped (``max_connections``): past the cap a new connection gets ``503`` with
``Retry-After`` and is closed at once, before anything is read, so a flood of idle sockets cannot use
up the process's file descriptors (the miners' connections need them too: issue 15 saw ~1,020 idle
sockets block every client and get healthy miners booked ``connect``). A new connection must finish
the head of its first request within ``header_timeout`` (10 s) or it is closed: a client trickling
one header byte at a time cannot hold a connection for the whole ``keepalive_timeout``.

The adapter maps ASGI messages onto a ``StreamResponse``: ``http.response.start`` keeps status and
headers, the first ``http.response.body`` sends them with its bytes, the last one ends the response.

Example::

    server = HttpServer(app, host="127.0.0.1", port=0)
    await server.start()
    print(server.port)
    await server.stop()
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from loguru import logger

from ..asgi import ClientGone


class _QuietBadRequests(logging.Filter):
    """Drops aiohttp's ERROR record (with traceback) for each malformed client request."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, BadHttpMessage)


logging.getLogger("aiohttp.server").addFilter(_QuietBadRequests())


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    """A listening TCP socket whose ``proto`` is ``IPPROTO_TCP``.

    asyncio turns Nagle off (``TCP_NODELAY``) only on sockets whose ``proto`` says TCP; one made by
    ``socket.create_server`` says 0, its accepted connections keep Nagle, and each stream's last
    write then waits for the client's delayed ACK: 40 ms on every keep-alive request, measured.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


_FULL_BODY = b'{"error":{"message":"too many connections; retry shortly","type":"server_error","param":null,' \
             b'"code":"too_many_connections"}}'
_FULL = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: application/json\r\n"
         b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(_FULL_BODY)) + _FULL_BODY


class _Full(asyncio.Protocol):
    """A connection over the cap: told 503 and closed before anything is read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(_FULL)
        transport.close()


def connection_cap(requested: int, open_files: int | None) -> int:
    """The client connections to allow: ``requested``, but at most half the process's open-files limit, so
    accepting clients never starves the miners' connections and the state file of descriptors (and asyncio
    never logs an accept error per client at the limit)."""
    if open_files is None or open_files <= 0:
        return max(1, requested)
    return max(1, min(requested, open_files // 2))


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
                 max_connections: int = 2048, header_timeout: float = 10.0) -> None:
        self.app = app
        self.header_timeout = header_timeout
        self.expired_connections = 0
        # connections still waiting for their first request head, with the timer that closes them
        self._pending: dict[Any, asyncio.TimerHandle] = {}
        self.max_connections = max(1, max_connections)
        self.refused_connections = 0
        self.host = host
        self.requested_port = port
        self.keepalive_timeout = keepalive_timeout
        self.max_head_bytes = max_head_bytes
        self.shutdown_timeout = shutdown_timeout
        self.backlog = backlog
        self._server: web.Server | None = None
        self._listener: asyncio.Server | None = None
        self._port = 0

    async def start(self) -> None:
        cap = connection_cap(self.max_connections, _open_files_limit())
        if cap < self.max_connections:
            logger.warning("client connections capped at {} (half the open-files limit), not {}", cap,
                           self.max_connections)
            self.max_connections = cap
        sock = _listen(self.host, self.requested_port, self.backlog)
        self._server = web.Server(self._handle, handler_cancellation=True, access_log=None,
                                  keepalive_timeout=self.keepalive_timeout, max_line_size=self.max_head_bytes,
                                  max_field_size=self.max_head_bytes)
        try:
            self._listener = await asyncio.get_running_loop().create_server(self._protocol, sock=sock)
        except BaseException:
            sock.close()
            raise
        self._port = int(sock.getsockname()[1])

    def _protocol(self) -> asyncio.BaseProtocol:
        """A handler for a new connection, or :class:`_Full` past ``max_connections``."""
        assert self._server is not None
        if len(self._server.connections) >= self.max_connections:
            self.refused_connections += 1
            return _Full()
        if len(self._pending) > 2 * self.max_connections:  # connections that closed before any request: forget them
            for gone in [h for h in self._pending if h.transport is None]:
                self._pending.pop(gone).cancel()
        handler = self._server()
        self._pending[handler] = asyncio.get_running_loop().call_later(self.header_timeout, self._expire, handler)
        return handler

    def _expire(self, handler: Any) -> None:
        """Close a connection whose first request head did not arrive within ``header_timeout``."""
        if self._pending.pop(handler, None) is None:
            return
        if handler.transport is None:  # it closed by itself meanwhile
            return
        self.expired_connections += 1
        handler.force_close()  # closes its transport too

    @property
    def port(self) -> int:
        if self._listener is None:
            raise RuntimeError("server not started")
        return self._port

    async def stop(self) -> None:
        """Stop accepting, let requests in progress finish for ``shutdown_timeout``, then cancel them."""
        listener, self._listener = self._listener, None
        if listener is None or self._server is None:
            return
        listener.close()
        await self._server.shutdown(self.shutdown_timeout)
        await listener.wait_closed()

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        timer = self._pending.pop(request.protocol, None)
        if timer is not None:
            timer.cancel()
        v = request.version
        scope: dict[str, Any] = {
            "type": "http",
            "http_version": f"{v.major}.{v.minor}",
            "method": request.method,
            "path": request.path,
            "headers": [(k.lower(), val) for k, val in request.raw_headers],
        }
        state: dict[str, Any] = {"response": None, "start": None, "asked": False}

        async def receive() -> dict[str, Any]:
            if request.content.at_eof() and state["asked"]:
                await asyncio.Event().wait()  # nothing more to say: a disconnect cancels the handler instead
            if not state["asked"]:
                state["asked"] = True
                expect = request.headers.get("Expect", "").strip().lower()
                if expect == "100-continue" and v >= (1, 1) and request.writer is not None:
                    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            chunk = await request.content.readany()
            return {"type": "http.request", "body": chunk, "more_body": not request.content.at_eof()}

        async def send(message: dict[str, Any]) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                state["start"] = message
                return
            try:
                await _send(message)
            except ConnectionResetError:  # aiohttp's ClientConnectionResetError too: the client left mid-write
                raise ClientGone from None

        async def _send(message: dict[str, Any]) -> None:
            response: web.StreamResponse | None = state["response"]
            if response is None:
                start = state["start"]
                response = web.StreamResponse(status=start["status"])
                close = False
                for name, value in start.get("headers", ()):
                    if name.lower() == b"connection" and value.lower() == b"close":
                        close = True
                        continue
                    response.headers.add(name.decode("latin-1"), value.decode("latin-1"))
                if close:
                    response.force_close()
                state["response"] = response
                await response.prepare(request)
            body = message.get("body", b"")
            if body and request.method != "HEAD":  # a HEAD answer has the GET's head and no body
                await response.write(body)
            if not message.get("more_body", False):
                await response.write_eof()

        await self.app(scope, receive, send)
        response = state["response"]
        if response is None:  # the app sent nothing (a bug): aiohttp still needs an answer
            return web.Response(status=500)
        return response
