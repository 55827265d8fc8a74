"""The OpenAI-compatible front door: routes, API keys, request validation; one request becomes one dispatch.

This module decides *whether* and *what* to serve: ``/v1/chat/completions`` (validated by
:mod:`gateway.protocol.openai`, then handed to :class:`gateway.relay.Relay`, which owns the request's
life from router lease to last byte), ``/v1/models``, ``/v1/status`` and ``/health``. Every refusal is an
OpenAI-shaped error (:mod:`gateway.protocol.errors`), counted in ``outcomes`` with the relay's own
stream outcomes, so the status page shows one ledger.

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
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loguru import logger

from .auth import ApiKeyAuth, load_key_hashes
from .http.server import HttpServer, Refusal, Request, Response
from .protocol.errors import GatewayError, invalid_json, unauthorized
from .protocol.openai import DEFAULT_MAX_TOKENS, SchemaLimits, parse_chat_request
from .relay import Relay, RelayConfig
from .router import Router
from .upstream import Upstream, UpstreamTimeouts

DEFAULT_MODELS = ("tensorgate/sim-5090",)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: an ephemeral port, read it back from Gateway.port
    api_key_hashes: frozenset[str] = frozenset()
    models: tuple[str, ...] = DEFAULT_MODELS
    max_body_bytes: int = 1 << 20
    keepalive_timeout: float = 75.0  # an idle client connection is closed after this long
    max_retries: int = 2  # extra miners tried before the client has seen a byte
    default_max_tokens: int = DEFAULT_MAX_TOKENS
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

    def relay_config(self) -> RelayConfig:
        return RelayConfig(max_retries=self.max_retries, timeouts=self.timeouts,
                           served_by_header=self.served_by_header)


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
        self.relay = Relay(config.relay_config(), router, upstream, self.outcomes)
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

    async def _chat(self, request: Request, resp: Response) -> None:
        self._authorize(request)  # the body is already read, within max_body_bytes (else the server said 413)
        try:
            body = json.loads(request.body)
        except (ValueError, RecursionError):
            raise invalid_json() from None
        await self.relay.dispatch(resp, parse_chat_request(body, self.limits))
