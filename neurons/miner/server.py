"""The reference miner: a signed, slot-limited OpenAI chat-completions endpoint in front of one runtime.

Validators call ``POST /v1/chat/completions`` signed with their hotkey (``bt.http_auth``, btauth/1,
receiver = this miner's hotkey). The miner checks, in order: body size (413), signature, freshness,
replay (401) and receiver (403), that the caller is trusted (403: validator-permit hotkeys from the
metagraph, or an allow-list locally), the JSON (400), then claims one of the caller's slots or
answers 429 at once: a miner that queues would hide its load from the validator's router and get
its TTFT measured worse. Every caller gets ``slots`` streams of its own (a validator books a 429 that
leaves its declared slots free as a refusal), within ``contexts`` streams in all when the runtime has a
fixed number (llama.cpp: one context each; ``/health`` says how many): past that a caller gets a 429 at
once rather than a wait behind another validator's streams. Slots are freed on completion, error and
client disconnect.

Example::

    runner, port = await start_miner(dev_keypair("Bob"), SimulatedRuntime(PROFILES["rtx5090"]),
                                     slots=4, trust=AllowList({validator_ss58}))
    ...                                 # POST http://127.0.0.1:{port}/v1/chat/completions, signed
    await runner.cleanup()
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import Counter
from typing import Any

import bittensor as bt
from aiohttp import web
from loguru import logger

from gateway.offers import signed_health
from gateway.protocol.errors import error_body
from gateway.protocol.openai import CHAT_PATH, SAMPLER_HEADER, SLOTS_HEADER
from gateway.protocol.sse import DONE_FRAME, frame

from .runtimes.base import Runtime, RuntimeFailure
from .trust import Trust

DEFAULT_MAX_BODY = 1024 * 1024


class RestartSafeNonces:
    """Replay protection that survives a restart: nonces signed before this miner started are refused.

    A btauth nonce is the signer's ``time_ns()``; the SDK's store remembers accepted ones in memory only,
    so after a restart a request captured in the last seconds before it (still inside the 10 s freshness
    window) could be replayed. Anything signed before the store was created is refused instead: the
    price is that a validator whose clock lags ours has its requests of the first second or two after a
    restart refused (it tries another miner), and no state has to be kept on disk.
    """

    def __init__(self, inner: bt.http_auth.NonceStore | None = None, *, started_ns: int | None = None) -> None:
        self._inner = inner if inner is not None else bt.http_auth.InMemoryNonceStore(retention=60.0)
        self.started_ns = time.time_ns() if started_ns is None else started_ns

    def check_and_store(self, hotkey_ss58: str, nonce_ns: int) -> bool:
        if nonce_ns < self.started_ns:
            return False
        return self._inner.check_and_store(hotkey_ss58, nonce_ns)


def error_response(status: int, message: str, *, type: str, code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    """OpenAI's error shape, so any client (and the gateway) parses refusals the same way."""
    return web.Response(status=status, text=json.dumps(error_body(message, type=type, param=param, code=code)),
                        content_type="application/json", headers=headers)


def _sse_error(message: str, type: str, code: str | None) -> bytes:
    return frame(error_body(message, type=type, code=code))


class MinerServer:
    """The HTTP side of one miner; ``runtime`` does the inference, ``trust`` says who may call."""

    def __init__(self, keypair: Any, runtime: Runtime, slots: int, trust: Trust, *,
                 max_body_bytes: int = DEFAULT_MAX_BODY, nonce_store: bt.http_auth.NonceStore | None = None,
                 contexts: int | None = None, models: tuple[str, ...] = ()) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if contexts is not None and contexts < 1:
            raise ValueError(f"contexts must be >= 1, got {contexts}")
        # Streams the runtime can run at once in all, whoever calls (None: as many as the callers' slots add up
        # to, e.g. vLLM batching). Past it a caller gets a 429 at once, never a wait behind another caller.
        self.contexts = contexts
        self.hotkey: str = keypair.ss58_address
        self._keypair = keypair  # signs /health: what it declares is this hotkey's (gateway.offers)
        self.models = models  # declared to validators; none: the subnet's model
        self.runtime = runtime
        self.slots = slots
        self.trust = trust
        self.max_body_bytes = max_body_bytes
        self._nonces = nonce_store if nonce_store is not None else RestartSafeNonces()
        self.busy = 0
        self._busy_by: Counter[str] = Counter()  # streams per caller: each validator gets ``slots`` of its own
        self.served = 0
        self.refused_busy = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes)
        app[MINER_KEY] = self
        app.router.add_post(CHAT_PATH, self._chat)
        app.router.add_get("/health", self._health)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        """``ok`` only while the runtime can serve: 503 with its reason otherwise (a load balancer reads the
        status). The hotkey is public (it is on chain with the axon); a local subnet registers by it."""
        h = self.runtime.health()
        body, headers = signed_health(self._keypair, {
            "status": "ok" if h.ok else "down", "slots": self.slots, "contexts": self.contexts, "busy": self.busy,
            "runtime": self.runtime.name, "sampler": self.runtime.sampler or "own", "models": list(self.models),
            "features": sorted(self.runtime.features), "runtime_state": h.detail})
        return web.Response(body=body, status=200 if h.ok else 503, content_type="application/json", headers=headers)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            return self._too_large()
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self._too_large()
        try:
            caller = bt.http_auth.verify(request.headers, raw, method=request.method, path=request.path_qs,
                                         self_hotkey_ss58=self.hotkey, nonce_store=self._nonces)
        except bt.http_auth.WrongReceiver as e:
            return error_response(403, str(e), type="permission_error", code="wrong_receiver")
        except bt.http_auth.AuthError as e:
            return error_response(401, str(e), type="authentication_error", code=type(e).__name__)
        if not self.trust.allows(caller.hotkey_ss58):
            return error_response(403, "caller hotkey is not a trusted validator", type="permission_error",
                                  code="untrusted_caller")
        try:
            payload = json.loads(raw)
        except (UnicodeDecodeError, ValueError):
            return error_response(400, "request body is not valid JSON", type="invalid_request_error",
                                  code="invalid_json")
        problem = _check_payload(payload)
        if problem is not None:
            return error_response(400, problem[1], type="invalid_request_error", code="invalid_value", param=problem[0])
        # Admission: check and claim with no await in between, so it is atomic on the event loop. Slots are
        # counted per caller: a validator pays a 429 it gets while its own streams leave slots free as a
        # refusal, so one validator's traffic must never use up another's.
        who = caller.hotkey_ss58
        if self._busy_by[who] >= self.slots or (self.contexts is not None and self.busy >= self.contexts):
            self.refused_busy += 1
            mine = self._busy_by[who] >= self.slots
            return error_response(429, f"all {self.slots} of your slots are busy" if mine else
                                  f"all {self.contexts} contexts are busy (other validators' streams)", type="busy",
                                  code="busy", headers={"Retry-After": "0", SLOTS_HEADER: str(self.slots)})
        self.busy += 1
        self._busy_by[who] += 1
        slot = _Slot(self, who)
        try:
            return await self._serve(request, payload, slot)
        finally:
            slot.free()

    def _free(self, who: str) -> None:
        self.busy -= 1
        self._busy_by[who] -= 1
        if not self._busy_by[who]:
            del self._busy_by[who]

    def _too_large(self) -> web.Response:
        return error_response(413, f"request body exceeds {self.max_body_bytes} bytes", type="invalid_request_error",
                              code="payload_too_large")

    async def _serve(self, request: web.Request, payload: dict[str, Any], slot: _Slot) -> web.StreamResponse:
        caller = slot.who
        async with contextlib.aclosing(self.runtime.stream(payload)) as frames:
            try:
                first = await anext(frames)
            except RuntimeFailure as e:
                return error_response(e.status, e.message, type=e.type, code=e.code, headers=e.headers or None)
            except StopAsyncIteration:
                return error_response(502, "runtime returned an empty stream", type="upstream_error",
                                      code="runtime_empty")
            except Exception:
                logger.exception("runtime failed before the first byte")
                return error_response(500, "runtime error", type="server_error", code="runtime_error")
            headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", SLOTS_HEADER: str(self.slots)}
            if self.runtime.sampler:
                headers[SAMPLER_HEADER] = self.runtime.sampler
            resp = web.StreamResponse(status=200, headers=headers)
            try:
                await resp.prepare(request)
                if DONE_FRAME in first:
                    slot.free()
                await resp.write(first)
                try:
                    async for chunk in frames:
                        if DONE_FRAME in chunk:
                            # free the slot before the caller reads [DONE]: it may send the next request at
                            # once, and a 429 with none of its streams here is booked as a refusal
                            slot.free()
                        await resp.write(chunk)
                except RuntimeFailure as e:
                    logger.warning("runtime failed mid-stream for {}: {}", caller[:10], e.message)
                    await resp.write(_sse_error(e.message, e.type, e.code))
                    return resp
                except ConnectionError:
                    raise
                except Exception:
                    logger.exception("runtime failed mid-stream")
                    await resp.write(_sse_error("runtime error", "server_error", "runtime_error"))
                    return resp
                await resp.write_eof()
            except ConnectionError:
                logger.debug("caller {} disconnected mid-stream", caller[:10])
                return resp
            self.served += 1
            return resp


class _Slot:
    """One caller's claimed slot; freed once, at ``[DONE]`` or when the handler ends, whichever is first."""

    __slots__ = ("_server", "who", "_held")

    def __init__(self, server: MinerServer, who: str) -> None:
        self._server, self.who, self._held = server, who, True

    def free(self) -> None:
        if self._held:
            self._held = False
            self._server._free(self.who)


MINER_KEY = web.AppKey("miner", MinerServer)  # runner.app[MINER_KEY] is the server (busy, served, ...)


def _check_payload(payload: Any) -> tuple[str | None, str] | None:
    """The few things a runtime cannot do without; everything else is the runtime's to judge."""
    if not isinstance(payload, dict):
        return None, "request body must be a JSON object"
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages", "messages must be a non-empty list"
    if payload.get("stream") is not True:
        return "stream", "this miner only serves streamed completions (stream: true)"
    return None


async def start_miner(keypair: Any, runtime: Runtime, *, slots: int = 4, trust: Trust, host: str = "127.0.0.1",
                      port: int = 0, max_body_bytes: int = DEFAULT_MAX_BODY,
                      contexts: int | None = None, models: tuple[str, ...] = ()) -> tuple[web.AppRunner, int]:
    """Serve a miner on ``host:port`` (port 0 picks a free one); returns the runner and the bound port.

    ``handler_cancellation`` makes a client disconnect cancel the handler at once, so a slot is freed
    even while the runtime is still before its first token.
    """
    server = MinerServer(keypair, runtime, slots, trust, max_body_bytes=max_body_bytes, contexts=contexts,
                         models=models)
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, runner.addresses[0][1]
