"""One request served to the ASGI app over aiohttp's request and ``StreamResponse``.

``http.response.start`` keeps the status and headers; the first ``http.response.body`` sends them with its bytes,
the last one ends the response. The body's deadline starts when the app first asks for it (and ``Expect:
100-continue`` is answered then); a write the client does not take within ``write_timeout`` closes its connection
(:class:`_WriteWatchdog`); a write to a client that has left raises :class:`~gateway.asgi.ClientGone` to the app.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web

from ..asgi import BodyTimeout, ClientGone


class _WriteWatchdog:
    """One timer a request, not a timeout a write (4 us each, ~17 writes a stream): a write pending for
    ``timeout`` means a client that stopped reading, which would hold a miner's slot; its connection is closed,
    and the pending write fails as a client that left.

    An object rather than a closure that schedules itself: such a closure refers to itself through its own cell,
    a cycle that kept each request's objects (about 40) for the garbage collector to find, where refcounting frees
    them as the request ends. Here the only cycle is the pending timer's, and :meth:`stop` cancels it."""

    __slots__ = ("_loop", "_timeout", "_request", "_since", "_timer")

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float, request: web.BaseRequest) -> None:
        self._loop = loop
        self._timeout = timeout
        self._request = request
        self._since: float | None = None  # when the write in progress began
        self._timer: asyncio.TimerHandle | None = None

    def writing(self) -> None:
        if self._timer is None:
            self._timer = self._loop.call_later(self._timeout / 2, self._check)
        self._since = self._loop.time()

    def written(self) -> None:
        self._since = None

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        since = self._since
        if since is not None and self._loop.time() - since >= self._timeout:
            if self._request.transport is not None:
                self._request.transport.abort()  # close() would wait for the buffer the client never reads
            self._request.protocol.force_close()
            return
        self._timer = self._loop.call_later(self._timeout / 2, self._check)


class AsgiExchange:
    """The ASGI ``scope``, ``receive`` and ``send`` of one aiohttp request."""

    __slots__ = ("_request", "_body_timeout", "_loop", "_response", "_start", "_body_by", "_watchdog", "_waiting")

    def __init__(self, request: web.BaseRequest, *, body_timeout: float, write_timeout: float,
                 waiting: Callable[[bool], None] | None = None) -> None:
        """``waiting``: told True while a read of the body waits for bytes, False once it has them (the server's
        connection cap may then close a stalled one)."""
        self._request = request
        self._waiting = waiting
        self._body_timeout = body_timeout
        self._loop = asyncio.get_running_loop()
        self._response: web.StreamResponse | None = None
        self._start: dict[str, Any] | None = None
        self._body_by: float | None = None
        self._watchdog = _WriteWatchdog(self._loop, write_timeout, request)

    def scope(self) -> dict[str, Any]:
        request, v = self._request, self._request.version
        return {
            "type": "http",
            "http_version": f"{v.major}.{v.minor}",
            "method": request.method,
            "path": request.path,
            "raw_path": request.raw_path.partition("?")[0].encode("latin-1", "replace"),
            "client": (request.remote or "", 0),
            "headers": [(k.lower(), val) for k, val in request.raw_headers],
        }

    async def run(self, app: Any) -> web.StreamResponse:
        try:
            await app(self.scope(), self.receive, self.send)
        finally:
            self._watchdog.stop()
        if self._response is None:  # the app sent nothing (a bug): aiohttp still needs an answer
            return web.Response(status=500)
        return self._response

    async def receive(self) -> dict[str, Any]:
        request = self._request
        if request.content.at_eof() and self._body_by is not None:
            await asyncio.Event().wait()  # nothing more to say: a disconnect cancels the handler instead
        if self._body_by is None:  # the app asks for the body: its deadline starts now
            self._body_by = self._loop.time() + self._body_timeout
            expect = request.headers.get("Expect", "").strip().lower()
            if expect == "100-continue" and request.version >= (1, 1) and request.writer is not None:
                await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        waiting = self._waiting  # said around every read: one that finds bytes buffered returns without a wait
        if waiting is not None:
            waiting(True)
        try:
            async with asyncio.timeout_at(self._body_by):
                chunk = await request.content.readany()
        except TimeoutError:
            raise BodyTimeout(self._body_timeout) from None
        finally:
            if waiting is not None:
                waiting(False)
        return {"type": "http.request", "body": chunk, "more_body": not request.content.at_eof()}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self._start = message
            return
        self._watchdog.writing()
        try:
            await self._write(message)
        except ConnectionResetError:  # aiohttp's ClientConnectionResetError too: the client left mid-write
            raise ClientGone from None
        finally:
            self._watchdog.written()

    async def _write(self, message: dict[str, Any]) -> None:
        response = self._response
        if response is None:
            response = self._response = self._head()
            await response.prepare(self._request)
        body = message.get("body", b"")
        if body and self._request.method != "HEAD":  # a HEAD answer has the GET's head and no body
            await response.write(body)
        if not message.get("more_body", False):
            await response.write_eof()

    def _head(self) -> web.StreamResponse:
        """The response's head, as the app's ``http.response.start`` gave it (``Connection: close`` closes)."""
        start = self._start
        assert start is not None, "http.response.body before http.response.start"
        response = web.StreamResponse(status=start["status"])
        close = False
        for name, value in start.get("headers", ()):
            if name.lower() == b"connection" and value.lower() == b"close":
                close = True
                continue
            response.headers.add(name.decode("latin-1"), value.decode("latin-1"))
        if close:
            response.force_close()
        return response
