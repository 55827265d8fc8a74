"""One request's life: lease a miner, open the signed stream, relay it, retry before the first byte, release.

A request holds exactly one router lease at a time, released in ``finally`` on every path. Until the
first content chunk has arrived nothing is sent to the client, so a miner that is busy (429), dead,
slow to start or broken is released and another is tried (``exclude`` = the miners tried), up to
``max_retries`` times, all within one first-byte budget (``first_byte_budget_s``): each attempt waits
for its first token at most what is left of it. A miner that refuses the request as the client's
fault (the model's context is too small) is believed only when a second miner says the same, or when
no other miner could answer: one miner's word must not turn a client away. From the first content
chunk on, the request belongs to that miner: a failure ends the stream with an error event and
``[DONE]`` — never a hang, never a second miner's tokens spliced in. A client that disconnects has its
handler cancelled by the server (:mod:`gateway.asgi`), so the upstream request is cancelled at once
and the miner's slot freed.

The relay writes once per miner read, not once per chunk: frames decoded from one read (and the
headers with the first of them, the usage chunk and ``[DONE]`` with the last) leave in one body
message, each content frame built from cached bytes (:class:`gateway.protocol.sse.ChunkFramer`). It
reads from the miner only when the client took the last write (ASGI ``send`` applies the client
socket's back-pressure), so a slow client slows the miner's TCP stream instead of filling memory, and
no miner deadline runs while the relay waits on the client.

Example::

    relay = Relay(RelayConfig(max_retries=2), router, upstream, outcomes=Counter())
    await relay.serve(parse_chat_request(body, limits), send)   # inside an ASGI app
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from scoring.measurement import FailureReason

from .asgi import Send, send_json
from .protocol.errors import (
    GatewayError,
    bad_gateway,
    bad_request,
    gateway_timeout,
    no_capacity,
    overloaded,
    shutting_down,
)
from .protocol.openai import ChatRequest
from .protocol.sse import DONE_FRAME, ChunkFramer, ChunkInfo, frame
from .router import Router
from .upstream import Upstream, UpstreamError, UpstreamStream, UpstreamTimeouts

_IDS = random.Random()  # response ids need to be unique, not secret: no urandom syscall per request


def _completion_id() -> str:
    return f"chatcmpl-{_IDS.getrandbits(128):032x}"


MIN_ATTEMPT_S = 1.0  # a retry is not started with less of the first-byte budget left than this


@dataclass(frozen=True, slots=True)
class RelayConfig:
    max_retries: int = 2  # extra miners tried before the client has seen a byte
    timeouts: UpstreamTimeouts | None = None  # None: the Upstream's own
    served_by_header: str = "X-Tensorgate-Miner-Uid"
    # The whole wait for a first byte, across retries: each attempt gets what is left of it (at most its own
    # first_token deadline). Without it three miners that stall before their first byte cost a client
    # 3 x 30 s before a 504.
    first_byte_budget_s: float = 30.0


class Relay:
    """One request's life, from router lease to the client's last byte; counts outcomes into ``outcomes``."""

    def __init__(self, config: RelayConfig, router: Router, upstream: Upstream, outcomes: Counter[str]) -> None:
        self.config = config
        self.router = router
        self.upstream = upstream
        self.outcomes = outcomes
        self.stopping = False  # set by cut(): no new miner is tried, streams in progress end
        self._live: set[UpstreamStream] = set()

    def cut(self) -> int:
        """End every stream still in progress (the gateway is stopping and the drain is over); returns how many.

        Each ends the way a failed miner's does once the client has bytes, an error event (``shutting_down``)
        and ``[DONE]``, so no client is left with a response that just stops; one that has seen nothing gets a
        503. The miner is not blamed (``shutdown``), and the client is charged what it received.
        """
        self.stopping = True
        live = list(self._live)
        for stream in live:
            stream.close(FailureReason.SHUTDOWN)
        return len(live)

    async def serve(self, req: ChatRequest, send: Send) -> int:
        """Answer ``req``; returns the completion tokens delivered (what the client's key is charged).

        The server cancels this when the client leaves, which frees the miner's slot.
        """
        try:
            return await self.dispatch(req, send)
        except asyncio.CancelledError:
            self.outcomes["client_disconnect"] += 1
            raise

    async def dispatch(self, req: ChatRequest, send: Send) -> int:
        """Serve ``req`` from the first miner that produces content, trying others before the first byte.

        Raises :class:`GatewayError` when no miner produced a byte (the client gets that error instead).
        """
        payload = req.upstream_payload()
        tried: set[int] = set()
        failures: list[UpstreamError] = []
        rejected: list[UpstreamError] = []  # miners that called the request the client's fault
        loop = asyncio.get_running_loop()
        budget_ends = loop.time() + self.config.first_byte_budget_s
        base = self.config.timeouts or self.upstream.timeouts
        for attempt in range(1 + max(0, self.config.max_retries)):
            left = budget_ends - loop.time()
            if attempt and left < MIN_ATTEMPT_S:
                break  # the client has waited its budget: answer now rather than try one more miner
            first_token = min(base.first_token, max(left, MIN_ATTEMPT_S))  # what is left of the budget
            timeouts = base if first_token == base.first_token else dataclasses.replace(base, first_token=first_token)
            if self.stopping:
                raise shutting_down()
            lease = self.router.acquire(exclude=tried)
            if lease is None:
                break
            tried.add(lease.miner.uid)
            served = False
            stream: UpstreamStream | None = None
            try:
                try:
                    stream = await self.upstream.open(lease, payload, timeouts=timeouts, held=not req.stream)
                except UpstreamError as e:
                    if e.reason == FailureReason.LOCAL_RESOURCES:  # every other miner would fail the same way
                        self.outcomes["503"] += 1
                        raise overloaded() from None
                    if e.reason == FailureReason.CLIENT_REJECTED:
                        rejected.append(e)
                        if len(rejected) >= 2:  # two miners agree: the client's 400
                            raise self._rejected(rejected) from None
                        continue  # one miner's word is not enough to refuse a client: ask another
                    failures.append(e)
                    continue
                self._live.add(stream)
                if self.stopping:  # its head came after the cut: it ends the same way
                    stream.close(FailureReason.SHUTDOWN)
                async with stream:
                    try:
                        if req.stream:
                            await self._relay(send, req, stream)
                        else:  # the client sees nothing until the whole answer is in
                            await self._assemble(send, req, stream)
                    except UpstreamError as e:  # raised only while the client has seen no byte: try another
                        if e.reason == FailureReason.LOCAL_RESOURCES:  # the gateway's memory, not the miner
                            self.outcomes["503"] += 1
                            raise overloaded() from None
                        failures.append(e)
                        continue
                    served = stream.ok
                    return stream.tokens
            finally:
                if stream is not None:
                    self._live.discard(stream)
                self.router.release(lease, served=served)
        if rejected and not failures:
            raise self._rejected(rejected)  # no other miner was there to say otherwise
        raise _exhausted(failures)

    def _rejected(self, rejected: list[UpstreamError]) -> GatewayError:
        self.outcomes["400"] += 1
        return bad_request(f"the model cannot serve this request: {rejected[-1].detail}",
                           code="context_length_exceeded")

    def _served_by(self, stream: UpstreamStream) -> dict[str, Any]:
        return {"miner_uid": stream.uid, "miner_hotkey": stream.hotkey}

    def _usage(self, req: ChatRequest, stream: UpstreamStream) -> dict[str, int]:
        # completion tokens are the gateway's own count; the prompt size is the miner's (it tokenized it)
        # when it reported a sane one, else the gateway's estimate
        prompt = (stream.usage or {}).get("prompt_tokens", req.prompt_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": stream.tokens, "total_tokens": prompt + stream.tokens}

    async def _relay(self, send: Send, req: ChatRequest, stream: UpstreamStream) -> None:
        """Stream the answer; raises UpstreamError only while the client has seen nothing (try another miner).

        Reads before the first content are held back; the read that brings it sends the head and every
        frame so far in one go. From then on each miner read is one body message.
        """
        out = ChunkFramer(_completion_id(), int(time.time()), req.model)  # built while the miner prefills
        head: list[ChunkInfo] = []
        while not _has_content(head):
            batch = await stream.next_batch()  # raises when it failed before any content: another miner is tried
            if not batch:
                break
            head += batch
        parts: list[bytes] = []
        self._frames(out, head, parts, first=True, stream=stream)  # committed: no other miner may follow
        start = {"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
            (self.config.served_by_header.lower().encode("latin-1"), str(stream.uid).encode())]}
        if stream.finished:  # the whole answer came before the first write: one write for all of it
            await send(start)
            await self._end(send, req, stream, out, parts)
            return
        await send(start)
        await send({"type": "http.response.body", "body": b"".join(parts), "more_body": True})
        parts.clear()
        try:
            while batch := await stream.next_batch():
                self._frames(out, batch, parts)
                if parts:
                    await send({"type": "http.response.body", "body": b"".join(parts), "more_body": True})
                    parts.clear()
        except UpstreamError as e:
            self.outcomes["stream_error"] += 1
            body = frame(_mid_stream_error(e).body()) + DONE_FRAME
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        await self._end(send, req, stream, out, parts)

    async def _end(self, send: Send, req: ChatRequest, stream: UpstreamStream, out: ChunkFramer,
                   parts: list[bytes]) -> None:
        if req.include_usage:
            parts.append(out.usage(self._usage(req, stream)))
        parts.append(DONE_FRAME)
        await send({"type": "http.response.body", "body": b"".join(parts), "more_body": False})
        self.outcomes["200"] += 1

    def _frames(self, out: ChunkFramer, chunks: list[ChunkInfo], parts: list[bytes], *, first: bool = False,
                stream: UpstreamStream | None = None) -> None:
        """Append the client frames for ``chunks``; the first frame of a response names role and miner."""
        for ch in chunks:
            if not first and ch.role is None and ch.finish_reason is None:
                if ch.content:
                    parts.append(out.content(ch.content))  # the hot path: one token
                continue  # usage or empty keep-alive chunk: the gateway sends its own usage
            delta: dict[str, Any] = {}
            if ch.role:
                delta["role"] = ch.role
            if ch.content or ch.role:
                delta["content"] = ch.content
            if not delta and ch.finish_reason is None:
                continue
            if first:
                assert stream is not None
                delta.setdefault("role", "assistant")
                parts.append(frame(out.chunk(delta, ch.finish_reason, tensorgate=self._served_by(stream))))
                first = False
            else:
                parts.append(frame(out.chunk(delta, ch.finish_reason)))

    async def _assemble(self, send: Send, req: ChatRequest, stream: UpstreamStream) -> None:
        parts: list[str] = []
        while batch := await stream.next_batch():  # UpstreamError: the caller tries another miner
            parts += [ch.content for ch in batch]
        body = {
            "id": _completion_id(),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(parts)},
                         "logprobs": None, "finish_reason": stream.finish_reason or "stop"}],
            "usage": self._usage(req, stream),
            "tensorgate": self._served_by(stream),
        }
        self.outcomes["200"] += 1
        await send_json(send, 200, body, headers={self.config.served_by_header: str(stream.uid)})


def _has_content(chunks: list[ChunkInfo]) -> bool:
    """Whether these chunks commit a stream to its miner: nothing is sent before content (or a finish)."""
    return any(ch.content or ch.finish_reason is not None for ch in chunks)


def _exhausted(failures: list[UpstreamError]) -> GatewayError:
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


def _mid_stream_error(e: UpstreamError) -> GatewayError:
    if e.reason == FailureReason.SHUTDOWN:
        return shutting_down("the gateway is shutting down; the answer is cut here (retry for the rest)")
    if e.reason == FailureReason.TIMEOUT:
        return gateway_timeout("the miner stalled mid-answer")
    return bad_gateway(f"the miner failed mid-answer: {e.reason}", code="upstream_failed_mid_stream")
