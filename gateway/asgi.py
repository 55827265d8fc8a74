"""The ASGI edge the gateway speaks: types, a JSON answer, and noticing that a client left.

Kept small and framework-free so the front door runs on any ASGI server. Noticing a client that
left matters for money, not tidiness: a stream nobody reads still holds a miner's slot, so the
moment the server reports ``http.disconnect`` the request's handler is cancelled, which closes the
miner connection and frees the slot (:meth:`client_watch`).

Example::

    async with client_watch(receive) as watch:
        await relay(...)            # cancelled at once if the client goes away
    watch.gone                      # True when that is how it ended (the handler returns normally)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class ClientGone(Exception):
    """The client disconnected before its request was read; there is nobody to answer."""


def header_list(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


async def send_json(send: Send, status: int, obj: Any, *, headers: Mapping[str, str] | None = None,
                    close: bool = False) -> None:
    """A whole JSON answer; ``close`` asks the server to close the connection after it."""
    body = json.dumps(obj, separators=(",", ":")).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    head += header_list(headers or {})
    if close:
        head.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class ClientWatch:
    """Set by :func:`client_watch`: whether the watched handler ended because its client left."""

    def __init__(self) -> None:
        self.gone = False
        self.done = False  # the handler finished its answer: a disconnect from now on changes nothing


@asynccontextmanager
async def client_watch(receive: Receive) -> AsyncIterator[ClientWatch]:
    """Cancel the enclosing task when the client disconnects; swallow that cancellation (only that one)."""
    task = asyncio.current_task()
    assert task is not None
    watch = ClientWatch()

    async def wait_for_disconnect() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not watch.done:
                    watch.gone = True
                    task.cancel()
                return

    watcher = asyncio.create_task(wait_for_disconnect(), name="client-watch")
    try:
        yield watch
    except asyncio.CancelledError:
        if watch.gone and task.uncancel() == 0:
            return  # our own cancellation: the client left, the handler ends normally
        raise
    finally:
        watch.done = True
        watcher.cancel()
