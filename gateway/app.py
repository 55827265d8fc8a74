"""The OpenAI-compatible front door: an ASGI app for routes, API keys and request validation.

This module decides *whether* and *what* to serve: ``/v1/chat/completions`` (validated by
:mod:`gateway.protocol.openai`, then handed to :class:`gateway.relay.Relay`, which owns the request's
life from router lease to last byte), ``/v1/models``, ``/v1/status`` and ``/health``. Every refusal is
an OpenAI-shaped error (:mod:`gateway.protocol.errors`), counted in ``outcomes`` with the relay's own
stream outcomes, so the status page shows one ledger.

It is a raw ASGI callable, no framework, served by aiohttp (:mod:`gateway.http.server`) and testable as a
plain call; the refusals some servers let through are checked here, whatever the server: HTTP/0.9,
HTTP/1.1 without ``Host``, control characters in header values. A completion request is authorised
from its head, before its body is read, and a body over ``max_body_bytes`` is refused as soon as that
is known (``Content-Length``, or while reading a chunked one).

Example::

    cfg = GatewayConfig.from_sources(port=0, models=["tensorgate/sim-5090"], keys=["sk-local"])
    gw = Gateway(cfg, router, Upstream(MinerClient(), RequestSigner(keypair), sink))
    await gw.start()
    print(f"http://127.0.0.1:{gw.port}/v1")   # base_url for the official openai client
    await gw.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import os
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loguru import logger
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from .admission import AdmissionQueue
from .answer_headers import answer_headers
from .asgi import BodyTimeout, ClientGone, MalformedBody, Message, Receive, Scope, Send, send_json
from .auth import ApiKeyAuth, bearer_matches, load_keys
from .http.server import HttpServer, is_loopback
from .metrics import METRICS_KEY_ENV, GatewayCollector
from .protocol.errors import (
    GatewayError,
    bad_request,
    invalid_json,
    model_not_found,
    payload_too_large,
    rate_limited,
    shutting_down,
    unauthorized,
)
from .protocol.openai import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    DEFAULT_MAX_TOKENS,
    ChatRequest,
    SchemaLimits,
    parse_chat_request,
    parse_completion_request,
)
from .protocol.request_id import request_id
from .protocol.tokens import PromptCounter
from .quota import KeyPolicy, QuotaBook, Refusal, Ticket, ratelimit_headers
from .relay import Relay, RelayConfig
from .router import Router
from .upstream import Upstream, UpstreamTimeouts

if TYPE_CHECKING:
    from .shared.limits import SharedLimits

DEFAULT_MODELS = ("tensorgate/sim-5090",)
_CLOSE_AFTER = frozenset({400, 401, 408, 413, 417, 503})  # refusals after which the connection is not worth keeping
_CTL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # control characters (tab allowed) in a header value
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")  # line breaks and controls a decoded path may hold


def _loggable(path: str) -> str:
    """The decoded path with its control characters escaped: a client's ``%0A`` must not forge a log line."""
    return _UNPRINTABLE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                            else f"\\u{ord(m.group()):04x}", path)


MODEL_PATH = "/v1/models/"


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: an ephemeral port, read it back from Gateway.port
    api_keys: Mapping[str, KeyPolicy] = field(default_factory=dict)  # {sha256 of the key: its name and limits}
    models: tuple[str, ...] = DEFAULT_MODELS
    max_body_bytes: int = 1 << 20
    max_head_bytes: int = 16 * 1024  # request line and headers; longer is refused, never buffered
    keepalive_timeout: float = 75.0  # an idle client connection is closed after this long
    max_connections: int = 2048  # client connections at once; more get 503 and are closed (file descriptors)
    header_timeout: float = 10.0  # each request head must arrive within this of its first byte (or the connection)
    body_timeout: float = 30.0  # a request body must arrive within this of when it is read (408 otherwise)
    write_timeout: float = 30.0  # a client must take each write within this, or it is gone (its miner freed)
    max_retries: int = 2  # extra miners tried before the client has seen a byte
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_tokens_cap: int = 4096
    timeouts: UpstreamTimeouts | None = None  # None: the Upstream's own
    served_by_header: str = "X-Tensorgate-Miner-Uid"
    shutdown_timeout: float = 5.0
    first_byte_budget_s: float = 30.0  # the whole wait for a first byte, retries included
    audits: bool = True  # answers are verified by a reference (False: /v1/status says every answer is paid unverified)
    queue_s: float = 10.0  # how long a request may wait for a free slot when every miner's are busy (0: 429 at once)
    access_log: bool = False  # one INFO line per request (method, path, status, time; the request id rides along)
    metrics_key: str | None = None  # bearer key of GET /metrics (None: loopback clients only)
    # Once listening, what the process allocated so far (the SDK, imports, the metagraph) lives as long as it
    # does: gc.freeze() takes it out of full collections, each of which would otherwise scan it while every
    # stream waits (one took 66 ms under load). Off in tests, which start many gateways in one process.
    freeze_heap: bool = True
    reuse_port: bool = False  # one of several gateway processes on this port (SO_REUSEPORT)

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
        policies = load_keys(keys_file=keys_file, keys=keys, env=env)
        if not policies:
            logger.warning("gateway has no API keys configured: every /v1 request will get 401")
        limited = sum(1 for p in policies.values() if p.limited)
        if limited:
            logger.info("{} API keys, {} with limits", len(policies), limited)
        if models is not None:
            kwargs["models"] = tuple(models)
        kwargs.setdefault("metrics_key", (os.environ if env is None else env).get(METRICS_KEY_ENV) or None)
        return cls(api_keys=policies, **kwargs)

    def relay_config(self) -> RelayConfig:
        return RelayConfig(max_retries=self.max_retries, timeouts=self.timeouts,
                           served_by_header=self.served_by_header, first_byte_budget_s=self.first_byte_budget_s)


Route = Callable[[Scope, dict[str, str], Receive, Send], Awaitable[None]]


class Gateway:
    """Serves ``/v1/chat/completions``, ``/v1/models``, ``/v1/status`` and ``/health``; ``self`` is the ASGI app."""

    def __init__(self, config: GatewayConfig, router: Router, upstream: Upstream, *,
                 counter: PromptCounter | None = None) -> None:
        self.config = config
        self.counter = counter  # a limited key's prompt tokens, counted as the model counts them (None: estimated)
        self.router = router
        self.upstream = upstream
        self.admission = AdmissionQueue(router, wait_s=config.queue_s)
        router.on_room = self.admission.wake  # a freed slot lets a waiting request go
        router.default_model = config.models[0]  # what a miner that declares no models serves: the subnet's model
        self.auth = ApiKeyAuth(config.api_keys)
        self.quota = QuotaBook()  # usage and limits per key name
        # Limits summed over every gateway process (gateway.shared.limits), wired by the validator's build when
        # gateways share Redis; None: this process's book alone.
        self.key_limits: SharedLimits | None = None
        # Called with every admitted request (the validator keeps its shape, never its text, for probes).
        self.on_request: Callable[[ChatRequest], None] | None = None
        # Writes a key's usage row (QuotaBook.mark_due) before its request is served; the validator saves it
        # to the state file. Failing to write never costs a client its answer (the round's close saves too).
        self.save_usage: Callable[[tuple[str, str, int, int]], Awaitable[None]] | None = None
        self.limits = SchemaLimits(models=tuple(config.models), default_max_tokens=config.default_max_tokens,
                                   max_tokens_cap=config.max_tokens_cap)
        self.outcomes: Counter[str] = Counter()  # per HTTP status / stream outcome, for tests and status
        self.relay = Relay(config.relay_config(), router, upstream, self.outcomes)
        self._routes: dict[str, dict[str, Route]] = {
            CHAT_PATH: {"POST": self._chat},
            COMPLETIONS_PATH: {"POST": self._completions},
            "/v1/models": {"GET": self._models},
            "/v1/status": {"GET": self._status},
            "/health": {"GET": self._health},
            "/ready": {"GET": self._ready},
            "/metrics": {"GET": self._metrics},
        }
        self.metrics = GatewayCollector(self)  # the validator adds its own families
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self.metrics)
        # Why the service should not get traffic now (None: ready); the validator sets it. Without it, ready
        # means some miner is routable.
        self.readiness: Callable[[], str | None] | None = None
        self._server: HttpServer | None = None
        self.stopping = False  # stop() began: new completion requests get 503 shutting_down
        self._serving = 0  # completion requests admitted and not yet answered
        self._all_served = asyncio.Event()
        self._all_served.set()

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        c = self.config
        if self.counter is not None:
            await self.counter.start()
            logger.info("API keys' token limits count prompts with the {}", self.counter.name)
        server = HttpServer(self, host=c.host, port=c.port, keepalive_timeout=c.keepalive_timeout,
                            max_head_bytes=c.max_head_bytes, shutdown_timeout=c.shutdown_timeout,
                            max_connections=c.max_connections, header_timeout=c.header_timeout,
                            body_timeout=c.body_timeout, write_timeout=c.write_timeout, reuse_port=c.reuse_port)
        await server.start()
        self._server = server
        if c.freeze_heap:
            gc.collect()
            gc.freeze()
        logger.info("gateway listening on http://{}:{}", c.host, server.port)

    async def stop(self) -> None:
        """Stop (SIGTERM): accept nothing new, give requests in progress ``shutdown_timeout`` to finish, then end
        the streams still running with an error event and ``[DONE]`` (:meth:`Relay.cut`), each client charged
        only what it received, before the server closes what is left."""
        server, self._server = self._server, None
        if server is not None:
            self.stopping = True
            server.stop_accepting()
            if self._serving:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.config.shutdown_timeout):
                        await self._all_served.wait()
            if self.relay.cut():
                logger.warning("stopping: streams still running after the {} s drain were cut with an error event",
                               self.config.shutdown_timeout)
            await server.stop(grace_s=1.0)  # a handler writing its error event has a second to finish it
        if self.counter is not None:
            await self.counter.aclose()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("gateway not started")
        return self._server.port

    # -- ASGI ------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # no websockets, no lifespan: the server is told not to send them
        headers = _headers(scope)
        rid = request_id(headers.get("x-request-id"))
        rid_header = (b"x-request-id", rid.encode("ascii"))
        status = [0]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
                message = {**message, "headers": [*message.get("headers", ()), rid_header]}
            await send(message)

        body_read = [False]  # the whole body arrived, framed: a 400 about its content may keep the connection

        async def receive_body() -> Message:
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                body_read[0] = True
            return message

        started = time.monotonic()
        with logger.contextualize(request_id=rid):
            try:
                route = self._route(scope, headers)
                await route(scope, headers, receive_body, send_with_id)
            except GatewayError as e:
                self.outcomes[str(e.status)] += 1
                body = e.body()
                body["error"]["request_id"] = rid
                close = e.status in _CLOSE_AFTER and not (e.status == 400 and body_read[0])
                await send_json(send_with_id, e.status, body, headers=e.headers, close=close)
            except ClientGone:
                self.outcomes["client_disconnect"] += 1
            finally:
                if self.config.access_log:
                    logger.info("{} {} {} {:.1f} ms", scope.get("method"), _loggable(scope.get("path", "")),
                                status[0] or "-", 1000 * (time.monotonic() - started))

    def _route(self, scope: Scope, headers: dict[str, str]) -> Route:
        if scope.get("http_version") not in ("1.0", "1.1"):
            raise GatewayError(400, "only HTTP/1.0 and HTTP/1.1 are served", code="bad_request")
        if scope["http_version"] == "1.1" and "host" not in headers:
            raise GatewayError(400, "an HTTP/1.1 request needs a Host header", code="bad_request")
        if any(_CTL.search(v) for _, v in scope["headers"]):
            raise GatewayError(400, "control character in a header value", code="bad_request")
        methods = self._routes.get(scope["path"])
        raw = scope.get("raw_path")
        if methods is None and scope["path"].startswith(MODEL_PATH):
            methods, raw = {"GET": self._model}, None  # a model id holds "/" (org/name), which clients percent-encode
        if methods is None or (raw is not None and raw.decode("latin-1") != scope["path"]):
            # matched on the path as sent: "/v1/chat%2Fcompletions" is not "/v1/chat/completions"
            raise GatewayError(404, "Not Found", code="not_found")
        expect = headers.get("expect")
        if expect is not None and expect.strip().lower() != "100-continue":
            raise GatewayError(417, f"Expect: {expect.strip()[:64]!r} is not supported (only 100-continue)",
                               code="expectation_failed")
        method = scope["method"]
        route = methods.get("GET" if method == "HEAD" else method)
        if route is None:
            allow = ", ".join([*methods, "HEAD"] if "GET" in methods else methods)
            raise GatewayError(405, "Method Not Allowed", code="method_not_allowed", headers={"Allow": allow})
        return route

    def _authorize(self, headers: dict[str, str]) -> KeyPolicy:
        policy = self.auth.identify(headers.get("authorization"))
        if policy is None:
            raise unauthorized()
        return policy

    async def _read_body(self, headers: dict[str, str], receive: Receive) -> bytes:
        """The request body, refused (413) as soon as it is known to exceed ``max_body_bytes``."""
        limit = self.config.max_body_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise payload_too_large(limit)
        parts: list[bytes] = []
        size = 0
        while True:
            try:
                message = await receive()
            except BodyTimeout as e:
                raise GatewayError(408, str(e), code="request_timeout") from None
            except MalformedBody as e:  # the framing broke: the connection closes after the 400
                raise GatewayError(400, str(e), code="bad_request") from None
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise payload_too_large(limit)
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _prompt_tokens(self, policy: KeyPolicy, req: ChatRequest) -> int:
        """The prompt's tokens as a key's token limits count them: the model's tokenizer where the gateway has one
        and the key has a token limit (the estimate undercounts digits, emoji and CJK up to 4x), else the
        estimate. A tokenizer failure falls back to the estimate: it never costs the client its answer."""
        if self.counter is None or (policy.tpm is None and policy.tpd is None):
            return req.prompt_tokens
        try:
            return await self.counter.count(req.messages)
        except Exception as e:
            logger.error("counting a prompt with the {} failed ({}); the estimate is used", self.counter.name, e)
            return req.prompt_tokens

    # -- routes ----------------------------------------------------------------------------------

    async def _health(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> None:
        await send_json(send, 200, {"status": "ok", "miners": len(self.router),
                                    "in_flight": self.router.total_in_flight(),
                                    "pid": os.getpid()})  # which gateway process answered (--gateway.workers)

    async def _ready(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> None:
        """200 when the service should get traffic; 503 with the first reason it should not (no key: for load
        balancers and orchestrators, like ``/health``, which only says the process answers)."""
        if self.stopping:
            reason: str | None = "the gateway is shutting down"
        elif self.readiness is not None:
            reason = self.readiness()
        elif not self.router.routable():
            reason = "no miner is routable"
        elif not self.upstream.answering(self.router.miners()):
            reason = "no routable miner is answering (the last request to each failed to connect, timed out or broke)"
        else:
            reason = None
        if reason is None:
            await send_json(send, 200, {"status": "ready"})
        else:
            await send_json(send, 503, {"status": "not ready", "reason": reason}, headers={"Retry-After": "5"})

    async def _metrics(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> None:
        """Prometheus' text format. The operator's: a bearer key of its own, or loopback clients only."""
        key = self.config.metrics_key
        if key is not None:
            if not bearer_matches(headers.get("authorization"), key):
                raise unauthorized("/metrics needs the metrics key (TENSORGATE_METRICS_KEY)")
        elif not is_loopback((scope.get("client") or ("",))[0]):
            raise GatewayError(403, "/metrics is served to loopback clients only unless TENSORGATE_METRICS_KEY is set",
                               type="permission_error", code="forbidden")
        body = generate_latest(self._registry)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode()),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def served_models(self) -> list[str]:
        """The configured models some routable miner serves now (all of them while no miner is routable: nothing
        is known yet, and a request then gets the relay's own 429/503, not a 404)."""
        if not self.router.routable():
            return list(self.config.models)
        offered = self.router.offered()
        return [m for m in self.config.models if m in offered]

    async def _models(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> None:
        self._authorize(headers)
        await send_json(send, 200, {"object": "list", "data": [_model_object(m) for m in self.served_models()]})

    async def _model(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> None:
        """``GET /v1/models/{id}`` (OpenAI's ``models.retrieve``): the model, or 404 ``model_not_found``."""
        self._authorize(headers)
        model = scope["path"][len(MODEL_PATH):]
        if model not in self.served_models():
            raise model_not_found(model)
        await send_json(send, 200, _model_object(model))

    def _check_servable(self, req: ChatRequest) -> None:
        """404 for a model no routable miner serves now, 400 naming the first field no miner serving the model
        declared (``tools``, ``logprobs``, ...): refused by name, never sent to a miner that would ignore it."""
        router = self.router
        if router.can_serve(req.model, req.needs):
            return  # the usual case, from a cache
        if not router.routable():
            return  # nothing known: the relay answers (429 or 503)
        if not router.can_serve(req.model):
            raise model_not_found(req.model)
        if req.needs and not router.can_serve(req.model, req.needs):
            field = next(f for f in sorted(req.needs) if not router.can_serve(req.model, {f}))
            raise bad_request(f"'{field}' is not served for {req.model} by any miner now", param=field,
                              code="unsupported_parameter")

    async def _status(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> None:
        policy = self._authorize(headers)
        miners = []
        for m in self.router.miners():
            st = self.upstream.stats.get(m.uid)
            miners.append({
                "uid": m.uid,
                "hotkey": m.hotkey,
                "endpoint": m.endpoint,
                "slots": m.slots,
                "in_flight": m.in_flight,
                "in_flight_elsewhere": m.elsewhere,  # the other gateway processes' (gateway.shared)
                "score": m.score,  # None: not measured yet, routed at the prior
                "quarantined": m.quarantined,  # failed its audits: probes only, paid 0
                "served": m.served,
                "requests": st.requests if st else 0,
                "ok": st.ok if st else 0,
                "failures": dict(st.failures) if st else {},
                "unaudited": dict(st.skipped) if st else {},  # answers no audit can check, by rule (not paid)
                "models": sorted(m.models) or [self.config.models[0]],
                "features": sorted(m.features),
                "ttft_p50_s": st.ttft_p50() if st else None,
            })
        usage = self.quota.usage.get(policy.name)
        counted_by = self.counter.name if self.counter is not None else "estimate (4 characters a token)"
        # the caller's own key only: other keys' names and usage are not its business
        key: dict[str, Any] = {
            "name": policy.name, "tokens_counted_by": counted_by,
            "limits": {"rpm": policy.rpm, "tpm": policy.tpm, "tpd": policy.tpd, "streams": policy.streams},
            "day": usage.day if usage else None, "requests_today": usage.requests if usage else 0,
            "tokens_today": usage.tokens if usage else 0, "in_flight": usage.in_flight if usage else 0}
        if self.key_limits is not None and policy.limited:  # every gateway process's use, from Redis
            shared_use = await self.key_limits.usage(policy.name)
            if shared_use is not None:
                key.update(shared_use)
        await send_json(send, 200, {"audits": "on" if self.config.audits else "off: answers are paid unverified",
                                    "in_flight": self.router.total_in_flight(),
                                    "dispatched": self.upstream.dispatched, "outcomes": dict(self.outcomes),
                                    "miners": miners, "key": key})

    async def _completions(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> None:
        await self._chat(scope, headers, receive, send, parse=parse_completion_request)

    async def _chat(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send,
                    parse: Callable[[Any, SchemaLimits], ChatRequest] = parse_chat_request) -> None:
        if self.stopping:  # a kept-alive connection asking during the drain: another replica should serve it
            raise shutting_down()
        policy = self._authorize(headers)  # from the head: an unauthenticated client cannot make us read its body
        raw = await self._read_body(headers, receive)
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            raise invalid_json() from None
        req = parse(body, self.limits)
        self._check_servable(req)
        if self.stopping:  # the body came in after the stop began
            raise shutting_down()
        prompt_tokens = await self._prompt_tokens(policy, req)
        if prompt_tokens != req.prompt_tokens:  # the usage a client reads is what its key was charged
            req = dataclasses.replace(req, prompt_tokens=prompt_tokens)
        reserve = prompt_tokens + req.n * req.max_tokens
        shared = self.key_limits
        ticket = (self.quota.admit(policy, reserve, time.time(), streams=req.n) if shared is None
                  else await shared.admit(policy, reserve, streams=req.n))
        if isinstance(ticket, Refusal):
            err = rate_limited(f"API key {policy.name!r} is over its {ticket.limit} limit: {ticket.detail}",
                               ticket.retry_after_s)
            err.headers.update(ratelimit_headers(policy, ticket.standing))
            raise err
        if self.on_request is not None:
            try:
                self.on_request(req)
            except Exception:  # an observer must never cost a client its answer
                logger.opt(exception=True).warning("request observer failed")
        used = ticket.reserved  # a client that leaves mid-answer is charged what it could have used
        self._serving += 1
        self._all_served.clear()
        try:
            row = self.quota.mark_due(policy, ticket) if isinstance(ticket, Ticket) else None
            if row is not None and self.save_usage is not None:
                try:
                    await self.save_usage(row)
                except Exception as e:
                    logger.error("could not save API key {!r}'s usage before serving it: {}", policy.name, e)
            await self.admission.admit(policy.name)  # every slot busy: a short wait, fair across keys, or the 429
            used = prompt_tokens + await self.relay.serve(req, answer_headers(send, req, ratelimit_headers(
                policy, ticket.standing)))
        except GatewayError:
            used = 0  # no miner answered: nothing was served
            raise
        finally:
            if shared is not None:
                shared.settle(ticket, used)
            else:
                assert isinstance(ticket, Ticket)
                self.quota.settle(ticket, used, time.time())
            self._serving -= 1
            if not self._serving:
                self._all_served.set()


def _model_object(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "tensorgate"}


def _headers(scope: Scope) -> dict[str, str]:
    """Request headers by name (the last of repeated ones), as text. ASGI servers send names lower-cased
    (the adapter in :mod:`gateway.http.server` does), so they are not lowered again here."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
