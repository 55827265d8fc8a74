"""The OpenAI-compatible front door: an ASGI app for routes, API keys and request validation.

This module decides *whether* to serve and where a request goes; each route is a module of
:mod:`gateway.routes` (completions, handed to :class:`gateway.relay.Relay`, which owns the request's life from
router lease to last byte; models; the operator's health, readiness, metrics and status). Every refusal is an
OpenAI-shaped error (:mod:`gateway.protocol.errors`), counted in ``outcomes`` with the relay's own stream
outcomes, so the status page shows one ledger. What the process around it plugs in (:mod:`gateway.hooks`) is
given before it starts and frozen while it serves.

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
import functools
import gc
import os
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loguru import logger
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector

from .admission import AdmissionQueue
from .asgi import ClientGone, Message, Receive, Scope, Send, send_json
from .auth import ApiKeyAuth, load_keys
from .client_metrics import ClientSeries
from .hooks import GatewayHooks
from .http.server import HttpServer
from .metrics import METRICS_KEY_ENV, GatewayCollector
from .protocol.errors import GatewayError, unauthorized
from .protocol.openai import CHAT_PATH, COMPLETIONS_PATH, DEFAULT_MAX_TOKENS, SchemaLimits
from .protocol.request_id import request_id
from .protocol.tokens import PromptCounter
from .quota import KeyPolicy, QuotaBook
from .relay import Relay, RelayConfig
from .router import Router
from .routes import completions, models, operator
from .routes.models import MODEL_PATH
from .upstream import Upstream, UpstreamTimeouts

if TYPE_CHECKING:
    from .shared.leases import SharedLeases

DEFAULT_MODELS = ("tensorgate/sim-5090",)
_CLOSE_AFTER = frozenset({400, 401, 408, 413, 417, 503})  # refusals after which the connection is not worth keeping
_CTL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # control characters (tab allowed) in a header value
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")  # line breaks and controls a decoded path may hold


def _loggable(path: str) -> str:
    """The decoded path with its control characters escaped: a client's ``%0A`` must not forge a log line."""
    return _UNPRINTABLE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                            else f"\\u{ord(m.group()):04x}", path)


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
                           served_by_header=self.served_by_header, first_byte_budget_s=self.first_byte_budget_s,
                           full_wait_s=self.queue_s)


Route = Callable[[Scope, dict[str, str], Receive, Send], Awaitable[None]]


class Gateway:
    """Serves the client API (:mod:`gateway.routes.completions`, :mod:`gateway.routes.models`) and the operator's
    endpoints (:mod:`gateway.routes.operator`); ``self`` is the ASGI app."""

    def __init__(self, config: GatewayConfig, router: Router, upstream: Upstream, *,
                 counter: PromptCounter | None = None, leases: SharedLeases | None = None) -> None:
        """``leases``: with several gateway processes, the miners' slots held subnet-wide (:mod:`gateway.shared`)."""
        self.config = config
        self.counter = counter  # a limited key's prompt tokens, counted as the model counts them (None: estimated)
        self.router = router
        self.upstream = upstream
        self.admission = AdmissionQueue(router, wait_s=config.queue_s)
        router.on_room = self.admission.wake  # a freed slot lets a waiting request go
        router.default_model = config.models[0]  # what a miner that declares no models serves: the subnet's model
        self.auth = ApiKeyAuth(config.api_keys)
        self.quota = QuotaBook()  # usage and limits per key name
        self.hooks = GatewayHooks()  # what the owner plugs in (plug(), before start())
        self.limits = SchemaLimits(models=tuple(config.models), default_max_tokens=config.default_max_tokens,
                                   max_tokens_cap=config.max_tokens_cap)
        self.outcomes: Counter[str] = Counter()  # per HTTP status / stream outcome, for tests and status
        self.clients = ClientSeries()  # what clients saw, per model and key (organic only)
        self.relay = Relay(config.relay_config(), router, upstream, self.outcomes, leases=leases)
        self.routes: dict[str, dict[str, Route]] = {
            CHAT_PATH: {"POST": functools.partial(completions.chat, self)},
            COMPLETIONS_PATH: {"POST": functools.partial(completions.completions, self)},
            "/v1/models": {"GET": functools.partial(models.models, self)},
            "/v1/status": {"GET": functools.partial(operator.status, self)},
            "/health": {"GET": functools.partial(operator.health, self)},
            "/ready": {"GET": functools.partial(operator.ready, self)},
            "/metrics": {"GET": functools.partial(operator.metrics, self)},
        }
        self._model_route: Route = functools.partial(models.model, self)
        self.metrics = GatewayCollector(self)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.metrics)
        ProcessCollector(registry=self.registry)  # process_* (CPU, memory, file descriptors), as exporters name them
        GCCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self._server: HttpServer | None = None
        self.stopping = False  # stop() began: new completion requests get 503 shutting_down
        self._serving = 0  # completion requests admitted and not yet answered
        self._all_served = asyncio.Event()
        self._all_served.set()

    def plug(self, **hooks: Any) -> None:
        """Add hooks (:class:`~gateway.hooks.GatewayHooks` fields; ``metrics`` adds to those plugged before) before
        :meth:`start`; a gateway that serves has them frozen."""
        if self._server is not None:
            raise RuntimeError("a gateway's hooks are plugged before it starts")
        if "metrics" in hooks:
            hooks["metrics"] = (*self.hooks.metrics, *hooks["metrics"])
        self.hooks = dataclasses.replace(self.hooks, **hooks)

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        c = self.config
        for families in self.hooks.metrics:
            self.metrics.add(families)
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

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """One completion request admitted and not yet answered: a stop waits for these to finish."""
        self._serving += 1
        self._all_served.clear()
        try:
            yield
        finally:
            self._serving -= 1
            if not self._serving:
                self._all_served.set()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("gateway not started")
        return self._server.port

    def authorize(self, headers: dict[str, str]) -> KeyPolicy:
        policy = self.auth.identify(headers.get("authorization"))
        if policy is None:
            raise unauthorized()
        return policy

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
        methods = self.routes.get(scope["path"])
        raw = scope.get("raw_path")
        if methods is None and scope["path"].startswith(MODEL_PATH):
            # a model id holds "/" (org/name), which clients percent-encode
            methods, raw = {"GET": self._model_route}, None
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


def _headers(scope: Scope) -> dict[str, str]:
    """Request headers by name (the last of repeated ones), as text. ASGI servers send names lower-cased
    (the adapter in :mod:`gateway.http.server` does), so they are not lowered again here."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
