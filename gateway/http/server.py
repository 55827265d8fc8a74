"""Serving an ASGI app with uvicorn inside the validator's own event loop, on a socket we bind.

Why uvicorn, and which of its HTTP/1.1 protocols: the gateway used to run on ~500 lines of its own
HTTP over ``httptools``, written to chase an nginx-relative latency target that was withdrawn. Probed
byte by byte (``tests/test_front_door.py``), uvicorn's ``h11`` protocol refuses what the old server
let through: an endless header line (refused at ``max_head_bytes`` instead of buffered), HTTP/0.9, an
HTTP/1.1 request without ``Host``; it keeps the body of an ``Upgrade: h2c`` request, answers a client
that half-closed after sending, and honours ``Expect: 100-continue`` with stray whitespace. uvicorn's
``httptools`` protocol is faster but buffers an endless header line without limit, drops the body of an
``Upgrade: h2c`` request and ignores that ``Expect``: it is offered, not the default. Control characters
in header values, which h11 lets through, are refused by the app itself (:mod:`gateway.app`).

A client that half-closes its side after sending a request is treated as gone, as uvicorn (and nginx's
proxy, by default) treat it: the server cannot tell a half-close from a close until it writes, and a
client that really left must free its miner's slot at once, not at the first token or a stall
deadline. Quick answers (``/health``, refusals) still reach a half-closed client.

Embedding, not ``uvicorn.run``: the validator owns its signals, its loop and its other tasks, so the
server gets a socket bound here (port 0 works, errors surface as ``OSError``), uvicorn's ``startup``,
its once-a-tenth-of-a-second ``main_loop`` (the ``Date`` header), and ``shutdown`` with a grace period
in which streams in progress may finish; after it they are cancelled.

Example::

    server = HttpServer(app, host="127.0.0.1", port=0)
    await server.start()
    print(server.port)
    await server.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any, Literal

import uvicorn

Protocol = Literal["h11", "httptools"]


class HttpServer:
    """One listening socket serving ``app``."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0, protocol: Protocol = "h11",
                 keepalive_timeout: float = 75.0, max_head_bytes: int = 16 * 1024, shutdown_timeout: float = 5.0,
                 backlog: int = 2048) -> None:
        self.app = app
        self.host = host
        self.requested_port = port
        self.protocol: Protocol = protocol
        self.keepalive_timeout = keepalive_timeout
        self.max_head_bytes = max_head_bytes
        self.shutdown_timeout = shutdown_timeout
        self.backlog = backlog
        self._server: uvicorn.Server | None = None
        self._socket: socket.socket | None = None
        self._ticker: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Bind and serve; raises ``OSError`` when the address cannot be bound."""
        config = uvicorn.Config(
            self.app,
            http=self.protocol,
            lifespan="off",
            log_config=None,
            access_log=False,
            server_header=False,
            timeout_keep_alive=int(max(1, self.keepalive_timeout)),
            timeout_graceful_shutdown=int(max(0, self.shutdown_timeout)),
            h11_max_incomplete_event_size=self.max_head_bytes,
            backlog=self.backlog,
        )
        config.load()
        # uvicorn logs every refused request at WARNING: one line per malformed client request is a
        # log an attacker can fill; the app counts refusals instead.
        logging.getLogger("uvicorn.error").setLevel(logging.ERROR)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.create_server((self.host, self.requested_port), family=family, backlog=self.backlog)
        sock.setblocking(False)
        server = uvicorn.Server(config)
        # What Server.serve() does before startup(), without its signal capture: the validator owns
        # SIGINT/SIGTERM (a stop drains streams and persists the round; the server is one part of it).
        server.lifespan = config.lifespan_class(config)
        try:
            await server.startup(sockets=[sock])
        except BaseException:
            sock.close()
            raise
        self._server, self._socket = server, sock
        self._ticker = asyncio.create_task(server.main_loop(), name="http-server-tick")

    @property
    def port(self) -> int:
        if self._socket is None:
            raise RuntimeError("server not started")
        return int(self._socket.getsockname()[1])

    async def stop(self) -> None:
        """Stop accepting, let streams in progress finish for ``shutdown_timeout``, then cancel them."""
        server, self._server = self._server, None
        if server is None:
            return
        server.should_exit = True
        if self._ticker is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
            self._ticker = None
        await server.shutdown()
        if self._socket is not None:
            self._socket.close()
            self._socket = None
