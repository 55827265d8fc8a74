"""The ASGI edge the gateway speaks: its types and a JSON answer, framework-free.

The front door is an ASGI callable so its answers can be tested as plain calls (``tests/test_app_asgi.py``).
The server underneath (:mod:`gateway.http.server`) must cancel a request's handler when its client
disconnects: a stream nobody reads still holds a miner's slot, and the cancellation is what closes
the miner connection and frees it. aiohttp's ``handler_cancellation`` does exactly that.

Example::

    await send_json(send, 404, {"error": {...}})
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class ClientGone(Exception):
    """The client disconnected before its request was read; there is nobody to answer."""


class BodyTimeout(Exception):
    """The request body did not arrive within the server's body deadline (``receive`` raises it)."""

    def __init__(self, within_s: float) -> None:
        super().__init__(f"request body not received within {within_s:g} s")
        self.within_s = within_s


class MalformedBody(Exception):
    """The request body broke its framing (a bad chunk size, a truncated chunk): ``receive`` raises it at once,
    where the body would otherwise never end and the client would wait for the body deadline's 408."""


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
