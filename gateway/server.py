"""The OpenAI-compatible HTTP front door: authenticate, validate, route, relay, retry, account.

A request holds exactly one router lease at a time, released in ``finally`` on every path. Until the
first content chunk has arrived nothing is sent to the client, so a miner that is busy (429), dead,
slow to start or broken is released and another is tried (``exclude`` = the miners tried), up to
``max_retries`` times. From the first content chunk on, the request belongs to that miner: a
failure ends the stream with an error event and ``[DONE]`` — never a hang, never a second miner's
tokens spliced in. A client that disconnects cancels its handler (:mod:`gateway.http_server`), so the
upstream request is cancelled at once and the miner's slot freed.

The relay writes once per miner read, not once per chunk: frames decoded from one read (and the
headers with the first of them, the usage chunk and ``[DONE]`` with the last) leave in one ``write``,
each content frame built from cached bytes (:class:`gateway.sse.ChunkFramer`). Once the first write is
out, the stream is *pushed*: each miner read is framed and written to the client's socket from the read
callback itself (one HTTP chunk per read), with no task switch per token; a client that falls behind
(more than :data:`PUSH_HIGH_WATER` unsent) is served by the awaited path instead.

Example::

    cfg = GatewayConfig.from_sources(port=0, models=["tensorgate/sim-5090"], keys=["sk-local"])
    gw = Gateway(cfg, router, Upstream(MinerPool(), RequestSigner(keypair), sink))
    await gw.start()
    print(f"http://127.0.0.1:{gw.port}/v1")   # base_url for the official openai client
    await gw.stop()
"""

from __future__ import annotations

import gc
import json
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from loguru import logger

from .auth import ApiKeyAuth, load_key_hashes
from .errors import (
    GatewayError,
    bad_gateway,
    gateway_timeout,
    invalid_json,
    no_capacity,
    unauthorized,
)
from .http_server import HttpServer, Refusal, Request, Response
from .measurement import FAIL_BUSY, FAIL_TIMEOUT
from .openai_schema import ChatRequest, SchemaLimits, parse_chat_request
from .router import Router
from .sse import DONE_FRAME, ChunkFramer, ChunkInfo, frame
from .upstream import Upstream, UpstreamError, UpstreamStream, UpstreamTimeouts

DEFAULT_MODELS = ("tensorgate/sim-5090",)
PUSH_HIGH_WATER = 64 * 1024  # bytes unsent to a client before its stream leaves the push path
_IDS = random.Random()  # response ids need to be unique, not secret: no urandom syscall per request


def _completion_id() -> str:
    return f"chatcmpl-{_IDS.getrandbits(128):032x}"


class _RelayStart(NamedTuple):
    """What a streamed answer needs that does not depend on the miner's first token."""

    headers: dict[str, str]
    out: ChunkFramer


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: an ephemeral port, read it back from Gateway.port
    api_key_hashes: frozenset[str] = frozenset()
    models: tuple[str, ...] = DEFAULT_MODELS
    max_body_bytes: int = 1 << 20
    keepalive_timeout: float = 75.0  # an idle client connection is closed after this long
    max_retries: int = 2  # extra miners tried before the client has seen a byte
    default_max_tokens: int = 256
    max_tokens_cap: int = 4096
    timeouts: UpstreamTimeouts | None = None  # None: the Upstream's own
    served_by_header: str = "X-Tensorgate-Miner-Uid"
    shutdown_timeout: float = 5.0
    # Once listening, what the process allocated so far (the SDK, imports, the metagraph) lives as long as it
    # does: gc.freeze() takes it out of full collections, each of which would otherwise scan it while every
    # stream waits (one took 66 ms under load). Off in tests, which start many gateways in one process.
    freeze_heap: bool = True

    @classmethod
    def from_sources(
        cls,
        *,
        keys_file: str | Path | None = None,
        keys: Iterable[str] | None = None,
        env: Mapping[str, str] | None = None,
        models: Iterable[str] | None = None,
        **kwargs: Any,
    ) -> GatewayConfig:
        """A config whose API keys come from a file, a list and ``TENSORGATE_API_KEYS`` (hashed)."""
        hashes = load_key_hashes(keys_file=keys_file, keys=keys, env=env)
        if not hashes:
            logger.warning("gateway has no API keys configured: every /v1 request will get 401")
        if models is not None:
            kwargs["models"] = tuple(models)
        return cls(api_key_hashes=hashes, **kwargs)


Route = Callable[[Request, Response], Awaitable[None]]


class Gateway:
    """Serves ``/v1/chat/completions``, ``/v1/models``, ``/v1/status`` and ``/health``."""

    def __init__(self, config: GatewayConfig, router: Router, upstream: Upstream) -> None:
        self.config = config
        self.router = router
        self.upstream = upstream
        self.auth = ApiKeyAuth(config.api_key_hashes)
        self.limits = SchemaLimits(models=tuple(config.models), default_max_tokens=config.default_max_tokens,
                                   max_tokens_cap=config.max_tokens_cap)
        self.outcomes: Counter[str] = Counter()  # per HTTP status / stream outcome, for tests and status
        self._routes: dict[str, dict[str, Route]] = {
            "/v1/chat/completions": {"POST": self._chat},
            "/v1/models": {"GET": self._models},
            "/v1/status": {"GET": self._status},
            "/health": {"GET": self._health},
        }
        self._server: HttpServer | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        server = HttpServer(self._handle, host=self.config.host, port=self.config.port,
                            max_body_bytes=self.config.max_body_bytes,
                            keepalive_timeout=self.config.keepalive_timeout,
                            shutdown_timeout=self.config.shutdown_timeout, check_head=self._check_head,
                            on_refusal=self._count_refusal)
        await server.start()
        self._server = server
        if self.config.freeze_heap:
            gc.collect()
            gc.freeze()
        logger.info("gateway listening on http://{}:{}", self.config.host, server.port)

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop()
            self._server = None

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("gateway not started")
        return self._server.port

    # -- routing and small routes ----------------------------------------------------------------

    async def _handle(self, request: Request, resp: Response) -> None:
        """Route by path and method; a refusal (``GatewayError``) becomes its OpenAI-shaped JSON answer."""
        try:
            methods = self._routes.get(request.path)
            if methods is None:
                raise GatewayError(404, "Not Found", code="not_found")
            route = methods.get("GET" if request.method == "HEAD" else request.method)
            if route is None:
                allow = ", ".join([*methods, "HEAD"] if "GET" in methods else methods)
                raise GatewayError(405, "Method Not Allowed", code="method_not_allowed", headers={"Allow": allow})
            await route(request, resp)
        except GatewayError as e:
            if resp.started:  # refusals all come before the first byte; this would be a bug
                raise
            self.outcomes[str(e.status)] += 1
            resp.send_json(e.status, e.body(), headers=e.headers)

    def _check_head(self, method: str, path: str, headers: dict[str, str]) -> Refusal | None:
        """A completion request without a valid API key is refused before its body is read."""
        if path != "/v1/chat/completions" or self.auth.check(headers.get("authorization")):
            return None
        e = unauthorized()
        return Refusal(e.status, e.message, e.code or "", type=e.type, headers=e.headers)

    def _count_refusal(self, status: int) -> None:
        self.outcomes[str(status)] += 1

    def _authorize(self, request: Request) -> None:
        if not self.auth.check(request.headers.get("authorization")):
            raise unauthorized()

    async def _health(self, request: Request, resp: Response) -> None:
        resp.send_json(200, {"status": "ok", "miners": len(self.router), "in_flight": self.router.total_in_flight()})

    async def _models(self, request: Request, resp: Response) -> None:
        self._authorize(request)
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "tensorgate"} for m in self.config.models]
        resp.send_json(200, {"object": "list", "data": data})

    async def _status(self, request: Request, resp: Response) -> None:
        self._authorize(request)
        miners = []
        for m in self.router.miners():
            st = self.upstream.stats.get(m.uid)
            miners.append({
                "uid": m.uid,
                "hotkey": m.hotkey,
                "endpoint": m.endpoint,
                "slots": m.slots,
                "in_flight": m.in_flight,
                "score": m.score,  # None: not measured yet, routed at the prior
                "served": m.served,
                "requests": st.requests if st else 0,
                "ok": st.ok if st else 0,
                "failures": dict(st.failures) if st else {},
                "ttft_p50_s": st.ttft_p50() if st else None,
            })
        resp.send_json(200, {"in_flight": self.router.total_in_flight(), "dispatched": self.upstream.dispatched,
                             "outcomes": dict(self.outcomes), "miners": miners})

    # -- chat completions ------------------------------------------------------------------------

    async def _chat(self, request: Request, resp: Response) -> None:
        self._authorize(request)  # the body is already read, within max_body_bytes (else the server said 413)
        try:
            body = json.loads(request.body)
        except (ValueError, RecursionError):
            raise invalid_json() from None
        req = parse_chat_request(body, self.limits)
        await self._dispatch(resp, req)

    async def _dispatch(self, resp: Response, req: ChatRequest) -> None:
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
    real = [f for f in failures if f.reason != FAIL_BUSY]
    if not real:
        return no_capacity(f"all {len(failures)} miners tried are busy; retry shortly")
    last = real[-1]
    if last.reason == FAIL_TIMEOUT:
        return gateway_timeout(f"the miner did not answer in time ({len(failures)} tried)")
    return bad_gateway(f"the miner failed before answering: {last.reason} ({len(failures)} tried)")


def _mid_stream_error(e: UpstreamError) -> GatewayError:
    if e.reason == FAIL_TIMEOUT:
        return gateway_timeout("the miner stalled mid-answer")
    return bad_gateway(f"the miner failed mid-answer: {e.reason}", code="upstream_failed_mid_stream")
