"""A small HTTP/1.1 server on ``httptools`` (llhttp): the gateway's front door, without a framework's cost.

Why not aiohttp's web server: the gateway serves four routes and one streaming shape, and on its hot
path a framework's per-request machinery (request object, middleware chain, response writer) cost
more than the gateway's own work. Measured side by side on 2 vCPUs at 64 streams (two runs), the same
do-nothing relay added 0.68–0.80 ms p50 TTFT and 1.44 ms CPU per request behind aiohttp's server, and
0.29–0.47 ms and 0.90 ms on a bare asyncio protocol (``scripts/bench_lib/bare_relay.py``). It also
gives the relay a supported way to write from a read callback (:meth:`Response.push`).

What it does, and nothing more:

* keep-alive (HTTP/1.1 by default, HTTP/1.0 only when asked), pipelined requests answered in order;
* request bodies by ``Content-Length`` or chunked, capped at ``max_body_bytes`` (413), heads capped
  at ``max_head_bytes`` (431), malformed requests refused (400), each as OpenAI-shaped JSON followed
  by a lingering close so the client can still read it; an ``Upgrade`` is ignored (served as HTTP,
  then the connection closes);
* ``Expect: 100-continue`` answered once the body is acceptable (417 for any other expectation);
* a connection idle for ``keepalive_timeout`` is closed (408 first if a request was half sent);
* ``check_head`` can refuse a request from its head alone, before its body is read (the gateway's
  API key check: an unauthenticated client cannot make it buffer a body);
* ``on_refusal`` hears the status of every answer the server gives without the handler (400, 408,
  413, 417, 431 and ``check_head``'s), so an operator's counts include the requests no handler saw;
* a client that goes away cancels its handler at once (so the miner request is cancelled too);
* writes are flow-controlled (:meth:`Response.write` waits while the client is behind);
* :meth:`HttpServer.stop` stops accepting, lets running handlers finish for ``shutdown_timeout``,
  then cancels them.

A handler gets the whole :class:`Request` (body read) and answers through its :class:`Response`:
either whole (:meth:`Response.send`) or as a stream (:meth:`Response.start`, then :meth:`~Response.write`
or, from a callback, :meth:`~Response.push`, and :meth:`~Response.end`). Streams are chunked for
HTTP/1.1 clients and close-delimited for HTTP/1.0 ones.

Example::

    async def hello(req: Request, resp: Response) -> None:
        resp.send_json(200, {"path": req.path})

    server = HttpServer(hello, host="127.0.0.1", port=0)
    await server.start()
    print(f"http://127.0.0.1:{server.port}/")
    await server.stop()
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, cast

import httptools
from loguru import logger

from ..protocol.errors import error_body
from .wire import header_fields

Handler = Callable[["Request", "Response"], Awaitable[None]]

MAX_QUEUED = 4  # complete requests buffered behind a running one before reading pauses
LINGER_S = 2.0  # after a refusal, input is read and dropped this long so the client can read the answer


@dataclass(slots=True)
class Request:
    """One parsed request, body included. Header names are lower-case; repeated ones are comma-joined."""

    method: str
    path: str
    query: str
    version: tuple[int, int]
    headers: dict[str, str]
    body: bytes
    keep_alive: bool


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request answered without its body being read (malformed, too big, ...); the connection then closes."""

    status: int
    message: str
    code: str
    type: str = "invalid_request_error"
    headers: dict[str, str] = field(default_factory=dict)


HeadCheck = Callable[[str, str, dict[str, str]], "Refusal | None"]


def _date_header() -> bytes:
    now = int(time.time())
    if now != _DATE[0]:
        _DATE[0], _DATE[1] = now, b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
    return _DATE[1]


_DATE: list[Any] = [0, b""]
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


def _head(version: tuple[int, int], status: int, headers: dict[str, str], framing: bytes) -> bytes:
    return b"".join((b"HTTP/1.%d %d %s\r\n" % (version[1], status, _REASONS.get(status, b"Unknown")),
                     _date_header(), b"Server: tensorgate\r\n", header_fields(headers), framing, b"\r\n"))


class Response:
    """The answer to one request: :meth:`send` a whole body, or :meth:`start` a stream and :meth:`end` it."""

    __slots__ = ("_conn", "_request", "_chunked", "started", "finished", "close_after")

    def __init__(self, conn: _Connection, request: Request) -> None:
        self._conn = conn
        self._request = request
        self._chunked = request.version >= (1, 1)
        self.started = False
        self.finished = False
        self.close_after = not request.keep_alive  # the connection closes once this answer is out

    # -- whole answers -----------------------------------------------------------------------------

    def send(self, status: int, body: bytes, *, content_type: str = "application/json",
             headers: dict[str, str] | None = None) -> None:
        """The whole answer in one write (``HEAD``: the head only)."""
        hdrs = {"Content-Type": content_type, **(headers or {})}
        framing = b"Content-Length: %d\r\n" % len(body) + self._connection_header()
        data = _head(self._request.version, status, hdrs, framing)  # before _begin: a bad header is a 500
        self._begin()
        self._conn.write(data if self._request.method == "HEAD" else data + body)
        self.finished = True

    def send_json(self, status: int, obj: Any, *, headers: dict[str, str] | None = None) -> None:
        self.send(status, json.dumps(obj).encode(), headers=headers)

    # -- streams -----------------------------------------------------------------------------------

    def start(self, status: int, headers: dict[str, str], first: bytes = b"") -> None:
        """Send the head of a stream, with its first body bytes in the same write."""
        if not self._chunked:
            self.close_after = True  # HTTP/1.0: the body ends when the connection does
        framing = (b"Transfer-Encoding: chunked\r\n" if self._chunked else b"") + self._connection_header()
        head = _head(self._request.version, status, headers, framing)
        self._begin()
        self._conn.write(head + self._frame(first))

    def push(self, data: bytes) -> None:
        """Write now, from any callback (no waiting); see :attr:`unsent` for how far behind the client is."""
        if data:
            self._conn.write(self._frame(data))

    @property
    def unsent(self) -> int:
        """Bytes written but not yet taken by the client's socket."""
        return self._conn.buffered()

    async def write(self, data: bytes) -> None:
        """Write, then wait while the client is behind (raises ConnectionError once it is gone)."""
        if data:
            self._conn.write(self._frame(data))
        await self._conn.drain()

    def end(self, data: bytes = b"") -> None:
        """The last bytes of the stream."""
        if self.finished:
            return
        self.finished = True
        self._conn.write(self._frame(data) + (b"0\r\n\r\n" if self._chunked else b""))

    @property
    def client_gone(self) -> bool:
        return self._conn.closing

    # -- internals ---------------------------------------------------------------------------------

    def _begin(self) -> None:
        if self.started:
            raise RuntimeError("response already started")
        if self._conn.closing:
            raise ConnectionResetError("the client is gone")
        self.started = True

    def _connection_header(self) -> bytes:
        if self.close_after:
            return b"Connection: close\r\n" if self._request.version >= (1, 1) else b""
        return b"" if self._request.version >= (1, 1) else b"Connection: keep-alive\r\n"

    def _frame(self, data: bytes) -> bytes:
        if not data or not self._chunked:
            return data
        return b"%x\r\n%b\r\n" % (len(data), data)


class HttpServer:
    """Serves ``handler`` on ``host:port`` (0: an ephemeral port, read back from :attr:`port`)."""

    def __init__(self, handler: Handler, *, host: str = "127.0.0.1", port: int = 0,
                 max_body_bytes: int = 1 << 20, max_head_bytes: int = 64 * 1024,
                 keepalive_timeout: float = 75.0, shutdown_timeout: float = 5.0,
                 check_head: HeadCheck | None = None, on_refusal: Callable[[int], None] | None = None) -> None:
        self.handler = handler
        self.check_head = check_head  # (method, path, headers) once a head is in; a Refusal skips the body
        self.on_refusal = on_refusal  # (status) for each refusal answered
        self.host = host
        self._port = port
        self.max_body_bytes = max_body_bytes
        self.max_head_bytes = max_head_bytes
        self.keepalive_timeout = keepalive_timeout
        self.shutdown_timeout = shutdown_timeout
        self.connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), self.host, self._port)
        self._port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Stop accepting, close idle connections, give running handlers ``shutdown_timeout``, cancel the rest."""
        if self._server is None:
            return
        self._server.close()
        self._server = None
        for c in list(self.connections):
            c.shutting_down = True
            if c.task is None:
                c.close()
        busy = [c.task for c in self.connections if c.task is not None]
        if busy:
            _, pending = await asyncio.wait(busy, timeout=self.shutdown_timeout)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        for c in list(self.connections):
            c.close()

    @property
    def port(self) -> int:
        return self._port


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, runs their handlers one at a time, in order."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.task: asyncio.Task[None] | None = None
        self.closing = False
        self.shutting_down = False
        self._transport: asyncio.Transport | None = None
        self._parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self._queue: deque[Request | Refusal] = deque()
        self._paused_reading = False
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._in_message = False
        self._continue_due = False
        self._no_more = False  # no request follows the queued ones: close once they are answered
        self._reset_message()

    # -- asyncio.Protocol --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # a stream transport (uvloop's is no subclass)
        self.server.connections.add(self)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        if self._parser is None:
            return  # refused or closing: input is dropped
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # the Upgrade header is ignored (RFC 9110 lets a server do so) and the request served as HTTP;
            # what follows it would be another protocol, so the connection closes after the answer
            self._parser = None
            self._no_more = True
            self._next()
        except httptools.HttpParserError:
            if self._parser is not None:  # not already refused from a callback
                self._refuse(400, "malformed HTTP request", "bad_request")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self._parser = None
        self.server.connections.discard(self)
        if self._idle is not None:
            self._idle.cancel()
        if self.task is not None:
            self.task.cancel()  # the client is gone: its handler (and the miner request) stop now
        self._wake_drain(ConnectionResetError("the client is gone"))

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_drain(None)

    # -- httptools callbacks -----------------------------------------------------------------------

    def _reset_message(self) -> None:
        self._url = b""
        self._path, self._query = "/", ""
        self._headers: dict[str, str] = {}
        self._head_bytes = 0
        self._body = bytearray()

    def on_message_begin(self) -> None:
        self._in_message = True
        self._reset_message()

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        k, v = name.decode("latin-1").lower(), value.decode("latin-1")
        self._headers[k] = f"{self._headers[k]},{v}" if k in self._headers else v

    def on_headers_complete(self) -> None:
        if self._parser is None:
            return
        if self._url:  # the request target is whole once the head is: parsed once, here
            url = httptools.parse_url(self._url)
            self._path = (url.path or b"/").decode("latin-1")
            self._query = (url.query or b"").decode("latin-1")
        if self.server.check_head is not None:
            refusal = self.server.check_head(self._parser.get_method().decode("latin-1"), self._path, self._headers)
            if refusal is not None:
                self._refuse_with(refusal)
                return
        length = self._headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.server.max_body_bytes:
            self._refuse(413, f"request body exceeds {self.server.max_body_bytes} bytes", "payload_too_large")
            return
        expect = self._headers.get("expect")
        if expect is not None:
            if expect.lower() != "100-continue":
                self._refuse(417, f"unsupported expectation {expect!r}", "expectation_failed")
            elif self.task is None and not self._queue:
                self.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            else:
                self._continue_due = True  # after the answers ahead of it, never inside one

    def on_body(self, body: bytes) -> None:
        if self._parser is None:
            return
        if len(self._body) + len(body) > self.server.max_body_bytes:
            self._refuse(413, f"request body exceeds {self.server.max_body_bytes} bytes", "payload_too_large")
            return
        self._body += body

    def on_message_complete(self) -> None:
        if self._parser is None:
            return
        self._in_message = False
        p = self._parser
        major, _, minor = p.get_http_version().partition(".")
        version = (int(major or 1), int(minor or 1))
        self._queue.append(Request(
            method=p.get_method().decode("latin-1"),
            path=self._path,
            query=self._query,
            version=version,
            headers=self._headers,
            body=bytes(self._body),
            keep_alive=p.should_keep_alive(),
        ))
        self._reset_message()
        if len(self._queue) >= MAX_QUEUED and not self._paused_reading and self._transport is not None:
            self._paused_reading = True
            self._transport.pause_reading()
        self._next()

    # -- serving -----------------------------------------------------------------------------------

    def _count_head(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.server.max_head_bytes and self._parser is not None:
            self._refuse(431, f"request head exceeds {self.server.max_head_bytes} bytes", "head_too_large")

    def _refuse(self, status: int, message: str, code: str) -> None:
        self._refuse_with(Refusal(status, message, code))

    def _refuse_with(self, refusal: Refusal) -> None:
        """Stop parsing; the refusal is answered after the answers ahead of it, then the connection closes."""
        self._parser = None
        self._queue.append(refusal)
        self._next()

    def _next(self) -> None:
        if self.task is not None or self.closing:
            return
        if not self._queue:
            if self.shutting_down or self._no_more:
                self.close()
            else:
                self._arm_idle()
            return
        item = self._queue.popleft()
        if self._paused_reading and len(self._queue) < MAX_QUEUED and self._transport is not None:
            self._paused_reading = False
            self._transport.resume_reading()
        if isinstance(item, Refusal):
            self._answer_refusal(item)
            return
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        self.task = asyncio.get_running_loop().create_task(self._serve(item))

    async def _serve(self, req: Request) -> None:
        resp = Response(self, req)
        try:
            await self.server.handler(req, resp)
            if not resp.started:
                raise RuntimeError(f"handler for {req.method} {req.path} gave no answer")
        except asyncio.CancelledError:
            if not self.closing:  # cancelled by shutdown, not by the client leaving
                self.close()
            raise
        except Exception as e:
            if resp.started or self.closing:
                if not self.closing:
                    logger.opt(exception=e).error("handler failed mid-answer: {} {}", req.method, req.path)
                resp.close_after = True
            else:
                logger.opt(exception=e).error("handler failed: {} {}", req.method, req.path)
                resp.close_after = True
                resp.send_json(500, error_body("internal server error", type="server_error", code="internal_error"))
        finally:
            self.task = None
        if not resp.finished:
            resp.close_after = True  # a stream left open cannot be ended cleanly by anyone but its handler
        if resp.close_after or self.shutting_down:
            self.close()
            return
        if self._continue_due and not self._queue:
            self._continue_due = False
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self._next()

    def _answer_refusal(self, r: Refusal) -> None:
        if self.server.on_refusal is not None:
            self.server.on_refusal(r.status)
        body = json.dumps(error_body(r.message, type=r.type, code=r.code)).encode()
        self.write(_head((1, 1), r.status, {"Content-Type": "application/json", **r.headers},
                         b"Content-Length: %d\r\nConnection: close\r\n" % len(body)) + body)
        # keep reading (and dropping) for a moment: closing on unread input would reset the connection
        # and could destroy the answer before the client reads it
        if self._transport is not None:
            if self._paused_reading:
                self._paused_reading = False
                self._transport.resume_reading()
            if self._transport.can_write_eof():
                self._transport.write_eof()
        asyncio.get_running_loop().call_later(LINGER_S, self.close)

    def _arm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        self._idle = asyncio.get_running_loop().call_later(self.server.keepalive_timeout, self._on_idle)

    def _on_idle(self) -> None:
        self._idle = None
        if self.task is not None or self.closing:
            return
        if self._in_message and self._parser is not None:
            self._refuse(408, "request not completed in time", "request_timeout")
        else:
            self.close()

    # -- writing -----------------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if self._transport is not None and not self.closing:
            self._transport.write(data)

    def buffered(self) -> int:
        return self._transport.get_write_buffer_size() if self._transport is not None else 0

    async def drain(self) -> None:
        if self.closing:
            raise ConnectionResetError("the client is gone")
        if not self._write_paused:
            return
        self._drain_waiter = asyncio.get_running_loop().create_future()
        await self._drain_waiter

    def _wake_drain(self, exc: Exception | None) -> None:
        w, self._drain_waiter = self._drain_waiter, None
        if w is not None and not w.done():
            if exc is None:
                w.set_result(None)
            else:
                w.set_exception(exc)

    def close(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()
        self.closing = True
