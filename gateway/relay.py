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

A request for ``n`` answers (``n`` > 1) is served by ``n`` such lives at once, each its own miner, its own
measurement and its own audit, merged into one response (:class:`Reply`): ``choices[i]`` for answer ``i``,
the head with the first answer's first frames, ``[DONE]`` after the last. Once the client has bytes, one
answer failing ends the response with an error event and the others are stopped.

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
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.protocol.measurement import FailureReason

from .asgi import Send, send_json
from .protocol.errors import (
    GatewayError,
    bad_request,
    overloaded,
    shutting_down,
)
from .protocol.miner_request import choice_request
from .protocol.openai import ChatRequest
from .protocol.sse import DONE_FRAME, ChunkFramer, ChunkInfo, fold_tool_calls, frame
from .reply import Reply, exhausted, mid_stream_error
from .router import Lease, Router, request_work
from .upstream import Upstream, UpstreamError, UpstreamStream, UpstreamTimeouts

if TYPE_CHECKING:
    from .shared.leases import SharedLeases

_IDS = random.Random()  # response ids need to be unique, not secret: no urandom syscall per request


def _completion_id(req: ChatRequest) -> str:
    return f"{'cmpl' if req.completion else 'chatcmpl'}-{_IDS.getrandbits(128):032x}"


MIN_ATTEMPT_S = 1.0  # a retry is not started with less of the first-byte budget left than this
FULL_POLL_S = 0.02  # every miner's slots held by other gateway processes: look again this often


@dataclass(frozen=True, slots=True)
class RelayConfig:
    max_retries: int = 2  # extra miners tried before the client has seen a byte
    timeouts: UpstreamTimeouts | None = None  # None: the Upstream's own
    served_by_header: str = "X-Tensorgate-Miner-Uid"
    # The whole wait for a first byte, across retries: each attempt gets what is left of it (at most its own
    # first_token deadline). Without it three miners that stall before their first byte cost a client
    # 3 x 30 s before a 504.
    first_byte_budget_s: float = 30.0
    # With several gateway processes: how long a request that finds every miner's declared slots held by the others
    # waits for room (the gateway's queue time)
    full_wait_s: float = 10.0


class _Broken(Exception):
    """An answer failed after the client had bytes: the response ends with this error frame and ``[DONE]``;
    ``delivered``: the tokens of it the client got (what it is charged)."""

    def __init__(self, error: GatewayError, delivered: int) -> None:
        super().__init__(str(error))
        self.error = error
        self.delivered = delivered


class Relay:
    """One request's life, from router lease to the client's last byte; counts outcomes into ``outcomes``."""

    def __init__(self, config: RelayConfig, router: Router, upstream: Upstream, outcomes: Counter[str], *,
                 leases: SharedLeases | None = None) -> None:
        self.config = config
        self.router = router
        self.upstream = upstream
        self.outcomes = outcomes
        self.stopping = False  # set by cut(): no new miner is tried, streams in progress end
        self._live: set[UpstreamStream] = set()
        # Several gateway processes (gateway.shared): each lease is held subnet-wide too, and a request that finds
        # every miner's declared slots held by the others waits for room at most ``config.full_wait_s``. None: one
        # process.
        self.leases = leases

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
            if req.n == 1:
                return await self.dispatch(req, send)
            return await self._serve_many(req, send)
        except asyncio.CancelledError:
            self.outcomes["client_disconnect"] += 1
            raise

    async def dispatch(self, req: ChatRequest, send: Send) -> int:
        """Serve a one-answer ``req``; raises :class:`GatewayError` when no miner produced a byte."""
        cid, created = _completion_id(req), int(time.time())
        if req.stream:
            reply = Reply(send, self.config.served_by_header, 1)
            out = ChunkFramer(cid, created, req.model, completion=req.completion)
            held = [b""]

            async def relay(s: UpstreamStream) -> None:
                held[0] = await self._relay(reply, req, s, out)

            try:
                stream = await self._answer(req, 0, relay)
            except _Broken as e:
                self.outcomes["stream_error"] += 1
                await reply.write(frame(e.error.body()) + DONE_FRAME, 0, last=True)
                return e.delivered
            tail = [out.usage(self._usage(req, [stream]))] if req.include_usage else []
            # an answer that came whole before the first write leaves in one message, head to [DONE]
            await reply.write(b"".join([held[0], *tail, DONE_FRAME]), stream.uid, last=True)
            self.outcomes["200"] += 1
            return stream.tokens
        choices: list[dict[str, Any]] = [{}]
        stream = await self._answer(req, 0, lambda s: self._assemble(req, s, choices, 0))
        await self._send_whole(send, req, cid, created, choices, [stream])
        return stream.tokens

    async def _serve_many(self, req: ChatRequest, send: Send) -> int:
        """``n`` answers at once, each from its own miner, merged into one response (the module's docstring)."""
        cid, created = _completion_id(req), int(time.time())
        if not req.stream:
            streams: list[UpstreamStream | None] = [None] * req.n
            choices: list[dict[str, Any]] = [{} for _ in range(req.n)]

            async def whole(i: int) -> None:
                streams[i] = await self._answer(req, i, lambda s: self._assemble(req, s, choices, i))

            await _all(whole(i) for i in range(req.n))
            done = self._streams_of(streams)
            await self._send_whole(send, req, cid, created, choices, done)
            return sum(s.tokens for s in done)
        reply = Reply(send, self.config.served_by_header, req.n)
        outs = [ChunkFramer(cid, created, req.model, index=i, completion=req.completion) for i in range(req.n)]
        # each answer's latest stream: what it delivered, and once every answer is in, the streams that made them
        opened: list[UpstreamStream | None] = [None] * req.n

        async def relay(i: int, s: UpstreamStream) -> None:
            opened[i] = s
            rest = await self._relay(reply, req, s, outs[i])
            if rest:
                await reply.write(rest, s.uid)

        async def streamed(i: int) -> None:
            await self._answer(req, i, lambda s: relay(i, s))

        try:
            await _all(streamed(i) for i in range(req.n))
        except (_Broken, GatewayError) as e:
            if not reply.started:
                raise  # no answer reached the client: an error response of its own
            self.outcomes["stream_error"] += 1
            error = e.error if isinstance(e, _Broken) else e
            await reply.write(frame(error.body()) + DONE_FRAME, 0, last=True)
            return sum(s.tokens for s in self._streams_of(opened))
        done = self._streams_of(opened)
        tail = [outs[0].usage(self._usage(req, done))] if req.include_usage else []
        await reply.write(b"".join([*tail, DONE_FRAME]), done[0].uid, last=True)
        self.outcomes["200"] += 1
        return sum(s.tokens for s in done)

    @staticmethod
    def _streams_of(streams: list[UpstreamStream | None]) -> list[UpstreamStream]:
        return [s for s in streams if s is not None]

    async def _answer(self, req: ChatRequest, index: int,
                      consume: Callable[[UpstreamStream], Awaitable[None]]) -> UpstreamStream:
        """Answer ``index`` of ``req`` from the first miner whose stream ``consume`` takes, trying others while
        ``consume`` raises :class:`UpstreamError` (it does only before the client has a byte of this answer).

        Raises :class:`GatewayError` when no miner produced a byte, :class:`_Broken` when the stream failed after.
        """
        request = choice_request(req, index)
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
            lease = await self._acquire(req, tried, min(budget_ends, loop.time() + self.config.full_wait_s))
            if lease is None:
                break
            tried.add(lease.miner.uid)
            served = False
            stream: UpstreamStream | None = None
            try:
                try:
                    stream = await self.upstream.open(lease, request, timeouts=timeouts, held=not req.stream)
                except UpstreamError as e:
                    self._raise_if_ours(e)
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
                        await consume(stream)
                    except UpstreamError as e:  # raised only while the client has seen no byte: try another
                        self._raise_if_ours(e)
                        failures.append(e)
                        continue
                    served = stream.ok
                    return stream
            finally:
                if stream is not None:
                    self._live.discard(stream)
                self.router.release(lease, served=served)
        if rejected and not failures:
            raise self._rejected(rejected)  # no other miner was there to say otherwise
        raise exhausted(failures)

    def _raise_if_ours(self, e: UpstreamError) -> None:
        """A failure of the gateway's own resources (its memory for answers): every other miner would fail the same
        way, so the client gets the 503 now."""
        if e.reason == FailureReason.LOCAL_RESOURCES:
            self.outcomes["503"] += 1
            raise overloaded() from None

    async def _acquire(self, req: ChatRequest, tried: set[int], wait_until: float) -> Lease | None:
        """A lease on a miner for ``req`` not yet ``tried``; with shared leases, held subnet-wide too.

        A miner whose declared slots the other processes hold is passed over (the router now knows); when every
        one is, the request waits for room until ``wait_until``, as the admission queue does for this process's own.
        """
        full: set[int] = set()
        loop = asyncio.get_running_loop()
        while True:
            lease = self.router.acquire(exclude=tried | full if full else tried, model=req.model, needs=req.needs,
                                        sampled=req.sampled, work=request_work(req.max_tokens, req.prompt_tokens))
            if self.leases is None:
                return lease
            if lease is None:
                if not full:
                    return None
                while True:  # no Redis call until a release shows (the leases' refresh), and one round a poll
                    if loop.time() + FULL_POLL_S > wait_until or self.stopping:
                        return None
                    await asyncio.sleep(FULL_POLL_S)
                    if self.router.has_room():
                        break
                full.clear()
                continue
            if await self.leases.hold(lease):
                return lease
            self.router.release(lease)
            full.add(lease.miner.uid)

    def _rejected(self, rejected: list[UpstreamError]) -> GatewayError:
        self.outcomes["400"] += 1
        return bad_request(f"the model cannot serve this request: {rejected[-1].detail}",
                           code="context_length_exceeded")

    def _served_by(self, stream: UpstreamStream) -> dict[str, Any]:
        return {"miner_uid": stream.uid, "miner_hotkey": stream.hotkey}

    def _usage(self, req: ChatRequest, streams: list[UpstreamStream]) -> dict[str, int]:
        """Completion tokens are the gateway's own count (what the key is charged), summed over the answers. The
        prompt, read once for all of them, is what the gateway counted for the key's limits (``req.prompt_tokens``):
        a miner's own count would make the usage disagree with what was charged."""
        completion = sum(s.tokens for s in streams)
        return {"prompt_tokens": req.prompt_tokens, "completion_tokens": completion,
                "total_tokens": req.prompt_tokens + completion}

    async def _relay(self, reply: Reply, req: ChatRequest, stream: UpstreamStream, out: ChunkFramer) -> bytes:
        """Stream one answer; raises UpstreamError only while the client has seen nothing of it (try another miner),
        :class:`_Broken` when it fails after. Returns the frames not written yet (the caller's last write takes them).

        Reads before the first content are held back; the read that brings it sends (with the head, for the first
        answer) every frame so far in one go. From then on each miner read is one body message.
        """
        head: list[ChunkInfo] = []
        while not _has_content(head):
            batch = await stream.next_batch()  # raises when it failed before any content: another miner is tried
            if not batch:
                break
            head += batch
        parts: list[bytes] = []
        self._frames(out, head, parts, first=True, stream=stream)  # committed: no other miner may follow
        if stream.finished:  # the whole answer came before the first write: the caller's write ends it
            return b"".join(parts)
        await reply.write(b"".join(parts), stream.uid)
        parts.clear()
        try:
            while batch := await stream.next_batch():
                self._frames(out, batch, parts)
                if parts:
                    await reply.write(b"".join(parts), stream.uid)
                    parts.clear()
        except UpstreamError as e:
            raise _Broken(mid_stream_error(e), stream.tokens) from None
        return b"".join(parts)

    def _frames(self, out: ChunkFramer, chunks: list[ChunkInfo], parts: list[bytes], *, first: bool = False,
                stream: UpstreamStream | None = None) -> None:
        """Append the client frames for ``chunks``; the first frame of an answer names role and miner."""
        for ch in chunks:
            if not first and ch.role is None and ch.finish_reason is None and ch.tool_calls is None \
                    and ch.logprobs is None:
                if ch.content:
                    parts.append(out.content(ch.content))  # the hot path: one token
                continue  # usage or empty keep-alive chunk: the gateway sends its own usage
            delta: dict[str, Any] = {}
            if ch.role:
                delta["role"] = ch.role
            if ch.content or ch.role:
                delta["content"] = ch.content
            if ch.tool_calls is not None:
                delta["tool_calls"] = list(ch.tool_calls)
            if not delta and ch.finish_reason is None and ch.logprobs is None:
                continue
            if first:
                assert stream is not None
                delta.setdefault("role", "assistant")
                parts.append(frame(out.chunk(delta, ch.finish_reason, ch.logprobs,
                                             tensorgate=self._served_by(stream))))
                first = False
            else:
                parts.append(frame(out.chunk(delta, ch.finish_reason, ch.logprobs)))

    async def _assemble(self, req: ChatRequest, stream: UpstreamStream, choices: list[dict[str, Any]],
                        index: int) -> None:
        """Read one whole answer into ``choices[index]`` (the client sees nothing until every answer is in)."""
        parts: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        logprobs: list[dict[str, Any]] | None = None
        while batch := await stream.next_batch():  # UpstreamError: the caller tries another miner
            for ch in batch:
                parts.append(ch.content)
                if ch.tool_calls is not None:
                    fold_tool_calls(calls, ch.tool_calls)
                if ch.logprobs is not None:
                    logprobs = (logprobs or []) + ch.logprobs["content"]
        content = "".join(parts)
        finish = stream.finish_reason or "stop"
        if req.completion:
            choices[index] = {"text": content, "index": index, "logprobs": None, "finish_reason": finish}
            return
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            message["tool_calls"] = [calls[k] for k in sorted(calls)]
        choices[index] = {"index": index, "message": message,
                          "logprobs": None if logprobs is None else {"content": logprobs}, "finish_reason": finish,
                          "tensorgate": self._served_by(stream)}

    async def _send_whole(self, send: Send, req: ChatRequest, cid: str, created: int, choices: list[dict[str, Any]],
                          streams: list[UpstreamStream]) -> None:
        body: dict[str, Any] = {"id": cid, "object": "text_completion" if req.completion else "chat.completion",
                                "created": created, "model": req.model, "choices": choices,
                                "usage": self._usage(req, streams)}
        if len(streams) == 1:
            choices[0].pop("tensorgate", None)
            body["tensorgate"] = self._served_by(streams[0])
        self.outcomes["200"] += 1
        await send_json(send, 200, body, headers={self.config.served_by_header: str(streams[0].uid)})


async def _all(coros: Iterable[Coroutine[Any, Any, None]]) -> None:
    """Run ``coros`` together; the first to raise cancels the others (and is raised once they have ended)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _has_content(chunks: list[ChunkInfo]) -> bool:
    """Whether these chunks commit a stream to its miner: nothing is sent before content (or a finish)."""
    return any(ch.content or ch.tool_calls or ch.finish_reason is not None for ch in chunks)
