"""One request's life: lease a miner, open the signed stream, relay it, retry before the first byte, release.

A request holds exactly one router lease at a time, released in ``finally`` on every path. Until the
first content chunk has arrived nothing is sent to the client, so a miner that is busy (429), dead,
slow to start or broken is released and another is tried (``exclude`` = the miners tried), up to
``max_retries`` times. From the first content chunk on, the request belongs to that miner: a
failure ends the stream with an error event and ``[DONE]`` — never a hang, never a second miner's
tokens spliced in. A client that disconnects cancels its handler (:mod:`gateway.http.server`), so the
upstream request is cancelled at once and the miner's slot freed.

The relay writes once per miner read, not once per chunk: frames decoded from one read (and the
headers with the first of them, the usage chunk and ``[DONE]`` with the last) leave in one ``write``,
each content frame built from cached bytes (:class:`gateway.protocol.sse.ChunkFramer`). Once the first
write is out, the stream is *pushed*: each miner read is framed and written to the client's socket from
the read callback itself (one HTTP chunk per read), with no task switch per token; a client that falls
behind (more than :data:`PUSH_HIGH_WATER` unsent) is served by the awaited path instead.

Example::

    relay = Relay(RelayConfig(max_retries=2), router, upstream, outcomes=Counter())
    await relay.dispatch(resp, parse_chat_request(body, limits))   # resp: gateway.http.server.Response
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, NamedTuple

from scoring.measurement import FailureReason

from .http.server import Response
from .protocol.errors import GatewayError, bad_gateway, gateway_timeout, no_capacity
from .protocol.openai import ChatRequest
from .protocol.sse import DONE_FRAME, ChunkFramer, ChunkInfo, frame
from .router import Router
from .upstream import Upstream, UpstreamError, UpstreamStream, UpstreamTimeouts

PUSH_HIGH_WATER = 64 * 1024  # bytes unsent to a client before its stream leaves the push path
_IDS = random.Random()  # response ids need to be unique, not secret: no urandom syscall per request


def _completion_id() -> str:
    return f"chatcmpl-{_IDS.getrandbits(128):032x}"


class _RelayStart(NamedTuple):
    """What a streamed answer needs that does not depend on the miner's first token."""

    headers: dict[str, str]
    out: ChunkFramer


@dataclass(frozen=True, slots=True)
class RelayConfig:
    max_retries: int = 2  # extra miners tried before the client has seen a byte
    timeouts: UpstreamTimeouts | None = None  # None: the Upstream's own
    served_by_header: str = "X-Tensorgate-Miner-Uid"


class Relay:
    """One request's life, from router lease to the client's last byte; counts outcomes into ``outcomes``."""

    def __init__(self, config: RelayConfig, router: Router, upstream: Upstream, outcomes: Counter[str]) -> None:
        self.config = config
        self.router = router
        self.upstream = upstream
        self.outcomes = outcomes

    async def dispatch(self, resp: Response, req: ChatRequest) -> None:
        """Serve ``req`` from the first miner that produces content, trying others before the first byte."""
        payload = req.upstream_payload()
        tried: set[int] = set()
        failures: list[UpstreamError] = []
        for _ in range(1 + max(0, self.config.max_retries)):
            lease = self.router.acquire(exclude=tried)
            if lease is None:
                break
            tried.add(lease.miner.uid)
            served = False
            try:
                try:
                    stream = await self.upstream.open(lease, payload, timeouts=self.config.timeouts)
                except UpstreamError as e:
                    failures.append(e)
                    continue
                async with stream:
                    try:
                        if req.stream:
                            await self._relay(resp, req, stream)
                        else:  # the client sees nothing until the whole answer is in
                            await self._assemble(resp, req, stream)
                    except UpstreamError as e:  # raised only while the client has seen no byte: try another
                        failures.append(e)
                        continue
                    served = stream.ok
                    return
            finally:
                self.router.release(lease, served=served)
        raise _exhausted(failures)

    def _served_by(self, stream: UpstreamStream) -> dict[str, Any]:
        return {"miner_uid": stream.uid, "miner_hotkey": stream.hotkey}

    def _usage(self, req: ChatRequest, stream: UpstreamStream) -> dict[str, int]:
        # completion tokens are the gateway's own count; the prompt size is the miner's (it tokenized it)
        # when it reported a sane one, else the gateway's estimate
        prompt = (stream.usage or {}).get("prompt_tokens", req.prompt_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": stream.tokens, "total_tokens": prompt + stream.tokens}

    def _relay_start(self, req: ChatRequest, stream: UpstreamStream) -> _RelayStart:
        headers = {
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            self.config.served_by_header: str(stream.uid),
        }
        return _RelayStart(headers, ChunkFramer(_completion_id(), int(time.time()), req.model))

    async def _relay(self, resp: Response, req: ChatRequest, stream: UpstreamStream) -> None:
        """Stream the answer; raises UpstreamError only while the client has seen nothing (try another miner).

        Reads before the first content are kept in ``head``. The read that brings it starts the answer
        from the read callback itself, and every later read is pushed the same way, until the stream
        ends or the client falls behind; the awaited loop below carries on from there.
        """
        start = self._relay_start(req, stream)  # built while the miner prefills
        out = start.out
        head: list[ChunkInfo] = []
        parts: list[bytes] = []

        def sink(batch: list[ChunkInfo]) -> bool:
            if resp.started:
                return self._push(resp, out, batch, stream, parts)
            head.extend(batch)
            if resp.client_gone:
                return False
            if stream.finished or not _has_content(batch):
                return True  # no content yet, or the stream ended in this read: the handler goes on below
            self._frames(out, head, parts, first=True, stream=stream)  # committed: no other miner may follow
            head.clear()
            resp.start(200, start.headers, b"".join(parts))
            parts.clear()
            return resp.unsent <= PUSH_HIGH_WATER

        stream.push_to(sink)
        await stream.wait_push()
        stream.push_to(None)
        if not resp.started:  # it ended before a write: take what it sent up to its first content
            while not _has_content(head):
                batch = await stream.next_batch()  # raises when it failed before any: another miner is tried
                if not batch:
                    break
                head += batch
            self._frames(out, head, parts, first=True, stream=stream)  # committed: content came
        try:
            try:
                while True:
                    if parts and not stream.ready:  # about to wait on the miner: send what we have
                        await resp.write(b"".join(parts))
                        parts.clear()
                    batch = await stream.next_batch()
                    if not batch:
                        break
                    self._frames(out, batch, parts)
            except UpstreamError as e:
                self.outcomes["stream_error"] += 1
                parts += (frame(_mid_stream_error(e).body()), DONE_FRAME)
                self._end(resp, start, parts)
                return
            if req.include_usage:
                parts.append(out.usage(self._usage(req, stream)))
            parts.append(DONE_FRAME)
            self._end(resp, start, parts)
            self.outcomes["200"] += 1
        except ConnectionError:
            # the client went away; closing the stream cancels the miner request (client_disconnect)
            self.outcomes["client_disconnect"] += 1
            stream.close()

    @staticmethod
    def _end(resp: Response, start: _RelayStart, parts: list[bytes]) -> None:
        if resp.started:
            resp.end(b"".join(parts))
        else:  # the whole answer came before the first write: head, frames and end in one go
            resp.start(200, start.headers, b"".join(parts))
            resp.end()

    def _push(self, resp: Response, out: ChunkFramer, batch: list[ChunkInfo], stream: UpstreamStream,
              tail: list[bytes]) -> bool:
        """Write one read's frames as one HTTP chunk, from the miner's read callback; False: stop pushing.

        The read that ended the stream is not written here: its frames go to ``tail``, to leave with
        the closing frames (usage, ``[DONE]`` or the error event) in the relay's last write.
        """
        if stream.finished:
            self._frames(out, batch, tail)
            return True
        if resp.client_gone:
            return False  # the handler is being cancelled
        parts: list[bytes] = []
        self._frames(out, batch, parts)
        resp.push(b"".join(parts))
        return resp.unsent <= PUSH_HIGH_WATER

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

    async def _assemble(self, resp: Response, req: ChatRequest, stream: UpstreamStream) -> None:
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
        resp.send_json(200, body, headers={self.config.served_by_header: str(stream.uid)})


def _has_content(chunks: list[ChunkInfo]) -> bool:
    """Whether these chunks commit a stream to its miner: nothing is sent before content (or a finish)."""
    return any(ch.content or ch.finish_reason is not None for ch in chunks)


def _exhausted(failures: list[UpstreamError]) -> GatewayError:
    """The answer when no miner produced a byte: 429 when none had room, else 504/502 by the last failure."""
    if not failures:
        return no_capacity("no miner is available for this request; retry shortly")
    real = [f for f in failures if f.reason != FailureReason.BUSY]
    if not real:
        return no_capacity(f"all {len(failures)} miners tried are busy; retry shortly")
    last = real[-1]
    if last.reason == FailureReason.TIMEOUT:
        return gateway_timeout(f"the miner did not answer in time ({len(failures)} tried)")
    return bad_gateway(f"the miner failed before answering: {last.reason} ({len(failures)} tried)")


def _mid_stream_error(e: UpstreamError) -> GatewayError:
    if e.reason == FailureReason.TIMEOUT:
        return gateway_timeout("the miner stalled mid-answer")
    return bad_gateway(f"the miner failed mid-answer: {e.reason}", code="upstream_failed_mid_stream")
