"""A scripted fake miner for the gateway's fault cases: real HTTP on loopback, real btauth checks.

Each behaviour is one way a miner can fail (or succeed); the fake counts what it saw so tests can
assert both sides (the gateway's books and the miner's slot).

Example::

    miner = FakeMiner(Keypair.create_from_uri("//Bob"), trusted=alice.ss58_address,
                      script=Script("drop_after", tokens=8, after=3), tag="bob")
    await miner.start()
    miner.endpoint      # "127.0.0.1:PORT"
    await miner.stop()
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import bittensor as bt
from aiohttp import web

PATH = "/v1/chat/completions"
MODEL = "tensorgate/sim-5090"

BEHAVIORS = (
    "ok",  # prelude, tokens, finish, usage, [DONE]
    "gated",  # prelude + first token, then waits for .gate before the rest
    "busy",  # always 429
    "http500",  # always 500
    "hang_headers",  # never sends response headers
    "hang_first",  # headers + role prelude, then nothing
    "stall_after",  # ``after`` tokens, then nothing
    "drop_after",  # ``after`` tokens, then the connection is cut
    "garbage",  # invalid JSON as the first event
    "nan",  # a chunk containing NaN
    "invalid_utf8",  # bytes that are not UTF-8
    "long_line",  # one enormous line without a newline
    "wrong_shape",  # valid JSON, not a chunk
    "overlong",  # ignores max_tokens: sends ``tokens`` regardless
    "empty",  # prelude, finish, [DONE], no content
    "no_done",  # finish + usage, then closes without [DONE]
)


class LoopbackMiner:
    """What the router needs of a test miner: its hotkey and its loopback endpoint."""

    keypair: Any
    port: int

    @property
    def hotkey(self) -> str:
        return str(self.keypair.ss58_address)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class Script:
    behavior: str = "ok"
    tokens: int = 8  # tokens to send (capped by the request's max_tokens unless "overlong")
    after: int = 2  # for stall_after / drop_after
    token_delay: float = 0.0
    headers_delay: float = 0.0  # before response headers (ok behaviour)
    first_token_delay: float = 0.0  # after the headers and role chunk, before the first token (prefill)

    def __post_init__(self) -> None:
        if self.behavior not in BEHAVIORS:
            raise ValueError(f"unknown behavior {self.behavior!r}")


@dataclass
class FakeMiner(LoopbackMiner):
    keypair: Any
    trusted: str  # the validator hotkey allowed to call
    script: Script = field(default_factory=Script)
    slots: int = 4
    tag: str = "m"
    requests: int = 0  # requests that passed auth (busy ones included)
    active: int = 0
    max_active: int = 0
    finished: int = 0  # responses completed normally
    cancelled: int = 0  # handlers cancelled (client gone)
    auth_failures: int = 0
    busy_refusals: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.gate = asyncio.Event()
        self.started = asyncio.Event()  # set when a streaming response begins
        self._nonces = bt.http_auth.InMemoryNonceStore()
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post(PATH, self._handle)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        self.gate.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def token(self, i: int) -> str:
        return f"{self.tag}{i} "

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            caller = bt.http_auth.verify(request.headers, raw, method="POST", path=request.path_qs,
                                         self_hotkey_ss58=self.hotkey, nonce_store=self._nonces)
        except bt.http_auth.WrongReceiver:
            self.auth_failures += 1
            return _error(403, "wrong receiver")
        except bt.http_auth.AuthError as e:
            self.auth_failures += 1
            return _error(401, str(e))
        if caller.hotkey_ss58 != self.trusted:
            self.auth_failures += 1
            return _error(403, "caller not trusted")
        self.requests += 1
        body = json.loads(raw)
        self.bodies.append(body)
        s = self.script
        if s.behavior == "busy" or self.active >= self.slots:
            self.busy_refusals += 1
            return _error(429, "busy", headers={"Retry-After": "0"}, type="busy")
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            resp = await self._respond(request, body)
            self.finished += 1
            return resp
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        except ConnectionError:  # the gateway hung up while we were writing
            self.cancelled += 1
            return web.Response(status=499)
        finally:
            self.active -= 1

    async def _respond(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        s = self.script
        if s.behavior == "http500":
            return _error(500, "internal error")
        if s.behavior == "hang_headers":
            await asyncio.sleep(60)
        if s.headers_delay:
            await asyncio.sleep(s.headers_delay)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Miner-Slots": str(self.slots)})
        await resp.prepare(request)
        self.started.set()
        cid, created, model = f"chatcmpl-{self.tag}", int(time.time()), body.get("model", "")

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        await resp.write(chunk({"role": "assistant"}))
        if s.behavior == "hang_first":
            await asyncio.sleep(60)
        if s.behavior == "garbage":
            await resp.write(b"data: {not json at all\n\n")
        elif s.behavior == "nan":
            await resp.write(b'data: {"object": "chat.completion.chunk", "choices": [{"index": 0, '
                             b'"delta": {"content": "x"}, "finish_reason": null}], "x": NaN}\n\n')
        elif s.behavior == "invalid_utf8":
            await resp.write(b'data: {"choices": [{"delta": {"content": "\xff\xfe"}}]}\n\n')
        elif s.behavior == "long_line":
            await resp.write(b"data: " + b"a" * (256 * 1024))
        elif s.behavior == "wrong_shape":
            await resp.write(b'data: {"choices": "nope"}\n\n')
        if s.behavior in ("garbage", "nan", "invalid_utf8", "long_line", "wrong_shape"):
            await asyncio.sleep(60)  # the gateway must stop reading on its own
            return resp

        max_tokens = int(body.get("max_tokens") or 16)
        n = s.tokens if s.behavior == "overlong" else min(s.tokens, max_tokens)
        if s.behavior == "empty":
            n = 0
        for i in range(n):
            if s.behavior in ("stall_after", "drop_after") and i == s.after:
                if s.behavior == "stall_after":
                    await asyncio.sleep(60)
                assert request.transport is not None
                request.transport.abort()  # cut mid-stream: no terminating chunk
                return resp
            if s.token_delay and i > 0:
                await asyncio.sleep(s.token_delay)
            elif s.first_token_delay and i == 0:
                await asyncio.sleep(s.first_token_delay)
            await resp.write(chunk({"content": self.token(i)}))
            if s.behavior == "gated" and i == 0:
                await self.gate.wait()
        await resp.write(chunk({}, "length" if n >= max_tokens else "stop"))
        usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
        await resp.write(b"data: " + json.dumps({"id": cid, "object": "chat.completion.chunk", "created": created,
                                                 "model": model, "choices": [], "usage": usage}).encode() + b"\n\n")
        if s.behavior != "no_done":
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _error(status: int, message: str, headers: dict[str, str] | None = None, type: str = "error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": type, "param": None, "code": None}},
                             status=status, headers=headers)


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class DeadMiner(LoopbackMiner):
    """A registered miner whose endpoint refuses connections."""

    keypair: Any
    tag: str = "dead"
    requests: int = 0
    active: int = 0

    def __post_init__(self) -> None:
        self.port = closed_port()


# -- client-side helpers -----------------------------------------------------------------------


def body(stream: bool = True, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "say something"}], "stream": stream,
            "max_tokens": max_tokens, **extra}


async def read_sse(resp: aiohttp.ClientResponse) -> list[Any]:
    """All data payloads of an SSE response (JSON decoded, "[DONE]" kept as a string)."""
    events: list[Any] = []
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data: "):
            data = line[6:].decode()
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def error_of(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    assert resp.content_type == "application/json"
    err = (await resp.json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def contents(events: list[Any]) -> list[str]:
    out = []
    for e in events:
        if isinstance(e, dict) and e.get("choices"):
            c = e["choices"][0]["delta"].get("content")
            if c:
                out.append(c)
    return out


async def eventually(cond: Callable[[], bool], within_s: float = 5.0) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + within_s
    while not cond():
        if loop.time() > end:
            return False
        await asyncio.sleep(0.01)
    return True
