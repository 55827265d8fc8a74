"""What the client gets: its one response (:class:`Reply`, shared by a request's ``n`` answers) and the error it is
told when miners fail (:func:`exhausted` before a byte, :func:`mid_stream_error` after)."""

from __future__ import annotations

import asyncio

from gateway.protocol.measurement import FailureReason

from .asgi import Send
from .protocol.errors import GatewayError, bad_gateway, gateway_timeout, no_capacity, overloaded, shutting_down
from .upstream import UpstreamError


class Reply:
    """The client's one response, shared by a request's answers: the head goes out with the first frames any
    answer commits, each answer writes its frames as they come, the usage and ``[DONE]`` go after the last."""

    def __init__(self, send: Send, served_by_header: str, n: int) -> None:
        self._send = send
        self._header = served_by_header.lower().encode("latin-1")
        self.started = False
        self._lock = asyncio.Lock() if n > 1 else None  # answers write whole messages, one at a time

    async def write(self, data: bytes, uid: int, *, last: bool = False) -> None:
        if self._lock is None:
            await self._write(data, uid, last)
            return
        async with self._lock:
            await self._write(data, uid, last)

    async def _write(self, data: bytes, uid: int, last: bool) -> None:
        if not self.started:
            self.started = True
            await self._send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no"), (self._header, str(uid).encode())]})
        await self._send({"type": "http.response.body", "body": data, "more_body": not last})


def exhausted(failures: list[UpstreamError]) -> GatewayError:
    """The answer when no miner produced a byte: 429 when none had room, else 504/502 by the last failure."""
    if not failures:
        return no_capacity("no miner is available for this request; retry shortly")
    real = [f for f in failures if f.reason not in (FailureReason.BUSY, FailureReason.REFUSED)]
    if not real:
        return no_capacity(f"all {len(failures)} miners tried are busy; retry shortly")
    last = real[-1]
    if last.reason == FailureReason.LOCAL_RESOURCES:
        return overloaded()
    if last.reason == FailureReason.TIMEOUT:
        return gateway_timeout(f"the miner did not answer in time ({len(failures)} tried)")
    return bad_gateway(f"the miner failed before answering: {last.reason} ({len(failures)} tried)")


def mid_stream_error(e: UpstreamError) -> GatewayError:
    """What the client is told when its answer's miner fails after the client had bytes of it."""
    if e.reason == FailureReason.SHUTDOWN:
        return shutting_down("the gateway is shutting down; the answer is cut here (retry for the rest)")
    if e.reason == FailureReason.TIMEOUT:
        return gateway_timeout("the miner stalled mid-answer")
    return bad_gateway(f"the miner failed mid-answer: {e.reason}", code="upstream_failed_mid_stream")
