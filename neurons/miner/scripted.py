"""A scripted miner: the validator-to-miner wire contract served with a chosen behaviour, for tests and benchmarks.

The reference miner (:mod:`neurons.miner.server`) is what operators run; this one exists to misbehave
on purpose (hang, stall, drop, send garbage, NaN, too many tokens, no ``[DONE]``) and to stream on an
exact clock, so a test can assert what the gateway books for each fault and a benchmark can attribute
every extra millisecond to the proxy in front. There is one of it, used by ``tests/`` and
``scripts/bench_lib/fake_upstream.py`` alike; it frames chunks and errors with the same code the
gateway uses (:mod:`gateway.protocol`), so the two cannot drift apart.

Timing is absolute from the request's arrival (first token at ``first_token_delay``, then one every
``token_delay``), so timer jitter does not accumulate over a stream.

Example::

    miner = FakeMiner(Keypair.create_from_uri("//Bob"), trusted={alice.ss58_address},
                      script=Script("drop_after", tokens=8, after=3))
    await miner.start()
    miner.endpoint      # "127.0.0.1:PORT"
    await miner.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import bittensor as bt
from aiohttp import web

from gateway.offers import SIGNATURE_HEADER, signed_health
from gateway.protocol.errors import error_body
from gateway.protocol.openai import CHAT_PATH, SAMPLER_HEADER, SLOTS_HEADER, SUBNET_SAMPLER, requested_max_tokens
from gateway.protocol.sse import DONE_FRAME, ChunkFramer, frame

from .runtimes.features import (
    SIMULATED_FEATURES,
    as_json,
    call_frames,
    logprobs_of,
    pieces,
    tool_to_call,
    wants_json,
)

BEHAVIORS = (
    "ok",  # prelude, tokens, finish, usage, [DONE]
    "gated",  # prelude + first token, then waits for .gate before the rest
    "busy",  # always 429, declaring as many slots as the caller already uses (a miner that is really full)
    "refuse",  # always 429 while declaring its slots free (booked as a refusal)
    "http500",  # always 500
    "too_long",  # always 400 context_length_exceeded: the runtime says the request is the client's fault
    "hang_headers",  # never sends response headers
    "hang_first",  # headers + role prelude, then nothing
    "stall_after",  # ``after`` tokens, then nothing
    "drop_after",  # ``after`` tokens, then the connection is cut
    "garbage",  # invalid JSON as the first event
    "nan",  # a chunk containing NaN
    "invalid_utf8",  # bytes that are not UTF-8
    "long_line",  # one enormous line without a newline
    "wrong_shape",  # valid JSON, not a chunk
    "deep_json",  # a chunk with a field nested 5,000 levels deep (past the decoder's recursion limit)
    "overlong",  # ignores max_tokens: sends ``tokens`` regardless
    "empty",  # prelude, finish, [DONE], no content
    "no_done",  # finish + usage, then closes without [DONE]
    "gzip",  # 200 with Content-Encoding: gzip, then holds the stream open (a head the gateway refuses)
    "not_sse",  # 200 as application/json, then holds the response open (a head the gateway refuses)
)
_FAULT_FRAMES = {
    "garbage": b"data: {not json at all\n\n",
    "nan": b'data: {"object": "chat.completion.chunk", "choices": [{"index": 0, '
           b'"delta": {"content": "x"}, "finish_reason": null}], "x": NaN}\n\n',
    "invalid_utf8": b'data: {"choices": [{"delta": {"content": "\xff\xfe"}}]}\n\n',
    "long_line": b"data: " + b"a" * (256 * 1024),
    "wrong_shape": b'data: {"choices": "nope"}\n\n',
    "deep_json": b'data: {"choices": [], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}\n\n",
}
HANG_S = 60.0  # "forever" for a misbehaving miner: far past any deadline a test or benchmark sets


@dataclass
class Script:
    behavior: str = "ok"
    tokens: int = 8  # tokens to send (capped by the request's max_tokens unless "overlong")
    after: int = 2  # for stall_after / drop_after
    token_delay: float = 0.0  # between tokens
    headers_delay: float = 0.0  # before response headers
    first_token_delay: float = 0.0  # after the headers and role chunk, before the first token (prefill)
    ids_per_token: int = 0  # > 0: each content chunk names this many token ids (choice.token_ids), as audits ask
    token_chars: int = 0  # > 0: each token's text is this many characters (a miner inflating what is held)

    def __post_init__(self) -> None:
        if self.behavior not in BEHAVIORS:
            raise ValueError(f"unknown behavior {self.behavior!r}")


@dataclass
class Counters:
    """What the miner saw: both sides of every assertion a test or benchmark makes."""

    requests: int = 0  # requests that passed auth (busy ones included)
    verified: int = 0  # btauth signatures checked and accepted
    unsigned: int = 0  # served without btauth (only with allow_unsigned)
    auth_failures: int = 0
    busy_refusals: int = 0
    finished: int = 0  # responses completed normally
    cancelled: int = 0  # handlers cancelled or cut off (the caller went away)
    max_active: int = 0
    connections: int = 0


class FakeMiner:
    """One scripted miner on a loopback port."""

    def __init__(self, keypair: Any, *, trusted: Iterable[str] = (), script: Script | None = None, slots: int = 4,
                 tag: str = "m", allow_unsigned: bool = False, keep_bodies: bool = True,
                 models: Iterable[str] = (), features: Iterable[str] = SIMULATED_FEATURES) -> None:
        self.keypair = keypair
        self.hotkey = str(keypair.ss58_address)
        self.trusted = frozenset(trusted)
        self.script = script or Script()
        self.slots = slots
        self.sampler: str | None = SUBNET_SAMPLER  # declared on answers (SAMPLER_HEADER); None: declares none
        self.models = tuple(models)  # declared in the signed /health (gateway.offers); none: the subnet's model
        self.features = frozenset(features)
        self.raw_health: bytes | None = None  # served (signed) in place of the /health this miner would write
        self.tag = tag
        self.allow_unsigned = allow_unsigned
        self.keep_bodies = keep_bodies
        self.counters = Counters()
        self.active = 0
        self.bodies: list[dict[str, Any]] = []
        self.gate = asyncio.Event()
        self.started = asyncio.Event()  # set when a streaming response begins
        self._nonces = bt.http_auth.InMemoryNonceStore()
        self._runner: web.AppRunner | None = None
        self.port = 0

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        app = web.Application(client_max_size=1 << 20)
        app.router.add_post(CHAT_PATH, self._handle)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5,
                                     handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, backlog=1024)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        self.gate.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    # the counters tests read most, by name
    requests = property(lambda self: self.counters.requests)
    finished = property(lambda self: self.counters.finished)
    cancelled = property(lambda self: self.counters.cancelled)
    auth_failures = property(lambda self: self.counters.auth_failures)
    busy_refusals = property(lambda self: self.counters.busy_refusals)
    max_active = property(lambda self: self.counters.max_active)

    def token(self, i: int) -> str:
        return f"{self.tag}{i} "

    # -- the contract ------------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        if self.raw_health is not None:  # whatever bytes a hostile miner signs
            sig = {SIGNATURE_HEADER: "0x" + bytes(self.keypair.sign(self.raw_health)).hex()}
            return web.Response(body=self.raw_health, content_type="application/json", headers=sig)
        c = self.counters
        body, headers = signed_health(self.keypair, {
            "status": "ok", "slots": self.slots, "busy": self.active, "models": list(self.models),
            "sampler": self.sampler or "own",
            "features": sorted(self.features), "served": c.finished, "verified": c.verified, "unsigned": c.unsigned,
            "rejected": c.auth_failures, "busy_refusals": c.busy_refusals})
        return web.Response(body=body, content_type="application/json", headers=headers)

    def _refuse_caller(self, request: web.Request, raw: bytes) -> web.Response | None:
        if self.allow_unsigned and bt.http_auth.HEADER_SIGNATURE not in request.headers:
            self.counters.unsigned += 1
            return None
        try:
            caller = bt.http_auth.verify(request.headers, raw, method="POST", path=request.path_qs,
                                         self_hotkey_ss58=self.hotkey, nonce_store=self._nonces)
        except bt.http_auth.WrongReceiver as e:
            self.counters.auth_failures += 1
            return _error(403, f"wrong receiver: {e}", "permission_error", "wrong_receiver")
        except bt.http_auth.AuthError as e:
            self.counters.auth_failures += 1
            return _error(401, str(e), "authentication_error", type(e).__name__)
        if self.trusted and caller.hotkey_ss58 not in self.trusted:
            self.counters.auth_failures += 1
            return _error(403, "caller hotkey is not trusted", "permission_error", "untrusted_caller")
        self.counters.verified += 1
        return None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        arrived = asyncio.get_running_loop().time()
        raw = await request.read()
        refused = self._refuse_caller(request, raw)
        if refused is not None:
            return refused
        try:
            body = json.loads(raw)
        except ValueError:
            return _error(400, "request body is not valid JSON", "invalid_request_error", "invalid_json")
        c = self.counters
        c.requests += 1
        if self.keep_bodies:
            self.bodies.append(body)
        if self.script.behavior in ("busy", "refuse") or self.active >= self.slots:
            c.busy_refusals += 1
            declared = max(1, self.active) if self.script.behavior == "busy" else self.slots
            return _error(429, "busy", "busy", "busy", headers={"Retry-After": "0", SLOTS_HEADER: str(declared)})
        self.active += 1
        c.max_active = max(c.max_active, self.active)
        try:
            resp = await self._respond(request, body, arrived)
            c.finished += 1
            return resp
        except asyncio.CancelledError:
            c.cancelled += 1
            raise
        except ConnectionError:  # the caller hung up while we were writing
            c.cancelled += 1
            return web.Response(status=499)
        finally:
            self.active -= 1

    async def _respond(self, request: web.Request, body: dict[str, Any], arrived: float) -> web.StreamResponse:
        s = self.script
        loop = asyncio.get_running_loop()

        async def until(offset: float) -> None:
            await asyncio.sleep(max(0.0, arrived + offset - loop.time()))

        if s.behavior == "http500":
            return _error(500, "internal error", "server_error", "internal_error")
        if s.behavior == "too_long":
            return _error(400, "this model's maximum context length is 2048 tokens", "invalid_request_error",
                          "context_length_exceeded")
        if s.behavior == "hang_headers":
            await asyncio.sleep(HANG_S)
        await until(s.headers_delay)
        resp = await self._head(request)
        if s.behavior in ("gzip", "not_sse"):  # the slot stays held until the gateway closes the connection
            await resp.write(b"\x1f\x8b" if s.behavior == "gzip" else b"{")
            await asyncio.sleep(HANG_S)
            return resp
        self.started.set()
        model = body.get("model") if isinstance(body.get("model"), str) else "fake"
        out = ChunkFramer(f"chatcmpl-{self.tag}", int(time.time()), str(model))
        prelude = frame(out.chunk({"role": "assistant"}, None))
        if s.behavior == "hang_first":
            await resp.write(prelude)
            await asyncio.sleep(HANG_S)
        fault = _FAULT_FRAMES.get(s.behavior)
        if fault is not None:
            await resp.write(prelude + fault)
            await asyncio.sleep(HANG_S)  # the gateway must stop reading on its own
            return resp
        max_tokens = requested_max_tokens(body, s.tokens)
        n = 0 if s.behavior == "empty" else s.tokens if s.behavior == "overlong" else min(s.tokens, max_tokens)
        tool = tool_to_call(body) if s.behavior == "ok" else None
        if tool is not None:  # a tool call in place of text, as a runtime's tool parser streams it
            await until(s.headers_delay + s.first_token_delay)
            await resp.write(prelude + self._call(out, tool, n))
            await resp.write_eof()
            return resp
        texts = [self.token(i) if not s.token_chars else "x" * s.token_chars for i in range(n)]
        if wants_json(body) and n:
            texts = pieces(as_json("".join(texts), body), n)
        logprobs = body.get("logprobs") is True
        pending = prelude
        for i in range(n):
            if s.behavior in ("stall_after", "drop_after") and i == s.after:
                await self._cut(request, resp, pending)
                return resp
            await until(s.headers_delay + s.first_token_delay + i * s.token_delay)
            await resp.write(pending + self._chunk(out, texts[i], i, logprobs=logprobs))
            pending = b""
            if s.behavior == "gated" and i == 0:
                await self.gate.wait()
        with contextlib.suppress(ConnectionError):
            await resp.write(pending + self._tail(out, body, n, finish="length" if n >= max_tokens else "stop"))
            await resp.write_eof()
        return resp

    def _chunk(self, out: ChunkFramer, text: str, i: int, *, logprobs: bool) -> bytes:
        """Token ``i``'s chunk: with logprobs when asked, else naming ``ids_per_token`` ids (or none)."""
        if logprobs:
            return frame(out.chunk({"content": text}, None, logprobs_of(text, -0.5 - i / 100)))
        ids = self.script.ids_per_token
        return out.tokens(text, [100 + i] * ids) if ids else out.content(text)

    async def _cut(self, request: web.Request, resp: web.StreamResponse, pending: bytes) -> None:
        """End the stream mid-answer with no terminating chunk (``stall_after`` hangs first)."""
        if pending:
            await resp.write(pending)
        if self.script.behavior == "stall_after":
            await asyncio.sleep(HANG_S)
        assert request.transport is not None
        request.transport.abort()

    def _call(self, out: ChunkFramer, tool: str, n: int) -> bytes:
        """A call of ``tool`` in ``n`` pieces, its finish chunk and ``[DONE]``."""
        frames = call_frames(out, [(tool, json.dumps({"q": self.token(0).strip()}))], None, f"call_{self.tag}",
                             pieces_per_call=max(1, n - 1))
        return b"".join(frames) + frame(out.chunk({}, "tool_calls")) + DONE_FRAME

    async def _head(self, request: web.Request) -> web.StreamResponse:
        """The answer's head, as the script has it (its slots, its sampler, a wrong encoding or content type)."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           SLOTS_HEADER: str(self.slots)})
        if self.sampler:
            resp.headers[SAMPLER_HEADER] = self.sampler
        if self.script.behavior == "gzip":
            resp.headers["Content-Encoding"] = "gzip"
        elif self.script.behavior == "not_sse":
            resp.headers["Content-Type"] = "application/json"
        await resp.prepare(request)
        return resp

    def _tail(self, out: ChunkFramer, body: dict[str, Any], n: int, *, finish: str) -> bytes:
        """The finish chunk, the usage chunk when asked for, and ``[DONE]`` (left out by the ``no_done`` script)."""
        tail = [frame(out.chunk({}, finish))]
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage") is True:
            tail.append(out.usage({"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}))
        if self.script.behavior != "no_done":
            tail.append(DONE_FRAME)
        return b"".join(tail)


def _error(status: int, message: str, type: str, code: str | None,
           headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, text=json.dumps(error_body(message, type=type, code=code)),
                        content_type="application/json", headers=headers)
