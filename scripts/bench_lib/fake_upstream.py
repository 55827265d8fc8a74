"""A miner stand-in that streams on a fixed clock, so any extra time seen through a proxy is the proxy's.

Serves the validator->miner contract (OpenAI SSE, role prelude, one chunk per token, finish chunk,
usage chunk, ``[DONE]``, slots with 429 when full, ``GET /health``) on several loopback ports, one
miner hotkey per port. A request carrying btauth headers is verified with ``bt.http_auth.verify``
exactly as the reference miner does (401/403 on failure); an unsigned request is served only with
``--allow-unsigned`` (the nginx / LiteLLM / direct paths cannot sign). ``/health`` counts both, so the
benchmark can prove the gateway's requests were really signed and verified.

Run it in its own process (it prints ``READY {json}`` with ports and hotkeys, then serves until killed,
until its parent dies, or until ``--max-seconds``)::

    python scripts/bench_lib/fake_upstream.py --ports 4 --ttft-ms 50 --tokens 32 --interval-ms 20 \
        --trusted 5F... --allow-unsigned
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from dataclasses import dataclass, field

import bittensor as bt
from aiohttp import web
from bittensor.sp_core import Keypair

PATH = "/v1/chat/completions"


def miner_keypair(i: int) -> Keypair:
    """The deterministic hotkey of fake miner ``i`` (dev URI, never a real key)."""
    return Keypair.create_from_uri(f"//tensorgate-bench-miner-{i}")


def validator_keypair() -> Keypair:
    """The deterministic hotkey the benchmark's gateway signs with."""
    return Keypair.create_from_uri("//tensorgate-bench-validator")


@dataclass(frozen=True, slots=True)
class Schedule:
    """First token ``ttft_s`` after the request arrives, then one token every ``interval_s``."""

    ttft_s: float = 0.05
    tokens: int = 32
    interval_s: float = 0.02


@dataclass(slots=True)
class Counters:
    served: int = 0
    verified: int = 0
    unsigned: int = 0
    rejected: int = 0
    busy: int = 0


def _err(status: int, message: str, type_: str, code: str | None = None,
         headers: dict[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return web.Response(status=status, text=json.dumps(body), content_type="application/json", headers=headers)


def _frame(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


@dataclass
class FakeMiner:
    """One port's miner: its hotkey, its slots, its nonce store, its counters."""

    keypair: Keypair
    schedule: Schedule
    trusted: frozenset[str]
    allow_unsigned: bool
    slots: int = 256
    busy_slots: int = 0
    counters: Counters = field(default_factory=Counters)
    nonces: bt.http_auth.InMemoryNonceStore = field(default_factory=bt.http_auth.InMemoryNonceStore)

    def __post_init__(self) -> None:
        self.hotkey = str(self.keypair.ss58_address)
        head = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0, "model": "bench"}
        self._prelude = _frame({**head, "choices": [{"index": 0, "delta": {"role": "assistant"},
                                                     "finish_reason": None}]})
        self._tokens = [_frame({**head, "choices": [{"index": 0, "delta": {"content": f"t{i} "},
                                                     "finish_reason": None}]}) for i in range(self.schedule.tokens)]
        self._head = head

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 20)
        app.router.add_post(PATH, self.chat)
        app.router.add_get("/health", self.health)
        return app

    async def health(self, request: web.Request) -> web.Response:
        c = self.counters
        return web.json_response({"status": "ok", "slots": self.slots, "busy": self.busy_slots,
                                  "runtime": "sim:fixed-schedule", "hotkey": self.hotkey, "served": c.served,
                                  "verified": c.verified, "unsigned": c.unsigned, "rejected": c.rejected,
                                  "busy_refusals": c.busy})

    def _authenticate(self, request: web.Request, raw: bytes) -> web.Response | None:
        if "X-Bittensor-Signature" not in request.headers:
            if self.allow_unsigned:
                self.counters.unsigned += 1
                return None
            self.counters.rejected += 1
            return _err(401, "missing btauth headers", "authentication_error", "unauthenticated")
        try:
            caller = bt.http_auth.verify(request.headers, raw, method="POST", path=request.path_qs,
                                         self_hotkey_ss58=self.hotkey, nonce_store=self.nonces)
        except bt.http_auth.WrongReceiver as e:
            self.counters.rejected += 1
            return _err(403, f"wrong receiver: {e}", "permission_error", "wrong_receiver")
        except bt.http_auth.AuthError as e:
            self.counters.rejected += 1
            return _err(401, str(e), "authentication_error", "bad_auth")
        if self.trusted and caller.hotkey_ss58 not in self.trusted:
            self.counters.rejected += 1
            return _err(403, "caller hotkey is not trusted", "permission_error", "untrusted")
        self.counters.verified += 1
        return None

    async def chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        refused = self._authenticate(request, raw)
        if refused is not None:
            return refused
        try:
            body = json.loads(raw)
            max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or self.schedule.tokens)
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
        except (ValueError, TypeError, AttributeError):
            return _err(400, "request body is not valid JSON", "invalid_request_error", "invalid_json")
        if self.busy_slots >= self.slots:
            self.counters.busy += 1
            return _err(429, "all slots are busy", "busy", "busy", headers={"Retry-After": "0"})
        self.busy_slots += 1
        try:
            return await self._stream(request, min(max_tokens, self.schedule.tokens), usage)
        finally:
            self.busy_slots -= 1

    async def _stream(self, request: web.Request, n: int, usage: bool) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                      "Cache-Control": "no-cache",
                                                      "X-Miner-Slots": str(self.slots)})
        await resp.prepare(request)
        s = self.schedule
        with contextlib.suppress(ConnectionResetError, asyncio.CancelledError):
            # Absolute deadlines, so timer jitter does not accumulate over the stream.
            await asyncio.sleep(max(0.0, t0 + s.ttft_s - loop.time()))
            await resp.write(self._prelude + self._tokens[0])
            for i in range(1, n):
                await asyncio.sleep(max(0.0, t0 + s.ttft_s + i * s.interval_s - loop.time()))
                await resp.write(self._tokens[i])
            tail = _frame({**self._head, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
            if usage:
                tail += _frame({**self._head, "choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": n,
                                                                       "total_tokens": n + 8}})
            await resp.write(tail + b"data: [DONE]\n\n")
            await resp.write_eof()
            self.counters.served += 1
        return resp


async def _watch_parent(parent: int, max_seconds: float) -> None:
    """Exit when the parent dies or the lifetime runs out: the upstream never outlives the benchmark."""
    loop = asyncio.get_running_loop()
    end = loop.time() + max_seconds
    while os.getppid() == parent and loop.time() < end:  # noqa: ASYNC110 - polling a process, not an event
        await asyncio.sleep(0.5)


async def serve(n_ports: int, schedule: Schedule, trusted: frozenset[str], allow_unsigned: bool,
                slots: int, max_seconds: float) -> None:
    parent = os.getppid()
    runners: list[web.AppRunner] = []
    ports, hotkeys = [], []
    try:
        for i in range(n_ports):
            miner = FakeMiner(miner_keypair(i), schedule, trusted, allow_unsigned, slots=slots)
            runner = web.AppRunner(miner.app(), access_log=None, handle_signals=False)
            await runner.setup()
            runners.append(runner)
            site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
            await site.start()
            ports.append(int(runner.addresses[0][1]))
            hotkeys.append(miner.hotkey)
        print("READY " + json.dumps({"ports": ports, "hotkeys": hotkeys, "pid": os.getpid()}), flush=True)
        await _watch_parent(parent, max_seconds)
    finally:
        for runner in runners:
            await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Fixed-schedule OpenAI-SSE fake miners on loopback ports.")
    p.add_argument("--ports", type=int, default=4, help="number of miner ports (one hotkey each)")
    p.add_argument("--ttft-ms", type=float, default=50.0, help="delay before the first token")
    p.add_argument("--tokens", type=int, default=32, help="tokens per completion (capped by max_tokens)")
    p.add_argument("--interval-ms", type=float, default=20.0, help="time between tokens")
    p.add_argument("--slots", type=int, default=256, help="concurrent slots per miner; 429 beyond")
    p.add_argument("--trusted", action="append", default=[], help="ss58 of a caller hotkey to accept (repeatable)")
    p.add_argument("--allow-unsigned", action="store_true", help="serve requests without btauth headers")
    p.add_argument("--max-seconds", type=float, default=3600.0, help="exit after this long regardless")
    a = p.parse_args(argv)
    schedule = Schedule(a.ttft_ms / 1000.0, a.tokens, a.interval_ms / 1000.0)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(a.ports, schedule, frozenset(a.trusted), a.allow_unsigned, a.slots, a.max_seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
