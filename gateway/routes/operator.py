"""The operator's routes: ``/health`` (the process answers), ``/ready`` (it should get traffic), ``/metrics``
(Prometheus) and ``/v1/status`` (miners, outcomes and the caller's own key)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..asgi import Receive, Scope, Send, send_json
from ..auth import bearer_matches
from ..http.server import is_loopback
from ..protocol.errors import GatewayError, unauthorized

if TYPE_CHECKING:
    from ..app import Gateway


async def health(gw: Gateway, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> None:
    await send_json(send, 200, {"status": "ok", "miners": len(gw.router), "in_flight": gw.router.total_in_flight(),
                                "pid": os.getpid()})  # which gateway process answered (--gateway.workers)


def not_ready(gw: Gateway) -> str | None:
    """The first reason the service should not get traffic now, or None."""
    if gw.stopping:
        return "the gateway is shutting down"
    if gw.hooks.readiness is not None:
        return gw.hooks.readiness()
    if not gw.router.routable():
        return "no miner is routable"
    if not gw.upstream.answering(gw.router.miners()):
        return "no routable miner is answering (the last request to each failed to connect, timed out or broke)"
    return None


async def ready(gw: Gateway, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> None:
    """200 when the service should get traffic; 503 with the first reason it should not (no key: for load
    balancers and orchestrators, like ``/health``, which only says the process answers)."""
    reason = not_ready(gw)
    if reason is None:
        await send_json(send, 200, {"status": "ready"})
    else:
        await send_json(send, 503, {"status": "not ready", "reason": reason}, headers={"Retry-After": "5"})


async def metrics(gw: Gateway, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> None:
    """Prometheus' text format. The operator's: a bearer key of its own, or loopback clients only."""
    key = gw.config.metrics_key
    if key is not None:
        if not bearer_matches(headers.get("authorization"), key):
            raise unauthorized("/metrics needs the metrics key (TENSORGATE_METRICS_KEY)")
    elif not is_loopback((scope.get("client") or ("",))[0]):
        raise GatewayError(403, "/metrics is served to loopback clients only unless TENSORGATE_METRICS_KEY is set",
                           type="permission_error", code="forbidden")
    body = generate_latest(gw.registry)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode()),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _miner(gw: Gateway, m: Any) -> dict[str, Any]:
    st = gw.upstream.stats.get(m.uid)
    return {
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
        "models": sorted(m.models) or [gw.config.models[0]],
        "features": sorted(m.features),
        "ttft_p50_s": st.ttft_p50() if st else None,
    }


async def status(gw: Gateway, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> None:
    policy = gw.authorize(headers)
    usage = gw.quota.usage.get(policy.name)
    counted_by = gw.counter.name if gw.counter is not None else "estimate (4 characters a token)"
    # the caller's own key only: other keys' names and usage are not its business
    key: dict[str, Any] = {
        "name": policy.name, "tokens_counted_by": counted_by,
        "limits": {"rpm": policy.rpm, "tpm": policy.tpm, "tpd": policy.tpd, "streams": policy.streams},
        "day": usage.day if usage else None, "requests_today": usage.requests if usage else 0,
        "tokens_today": usage.tokens if usage else 0, "in_flight": usage.in_flight if usage else 0}
    shared = gw.hooks.key_limits
    if shared is not None and policy.limited:  # every gateway process's use, from Redis
        shared_use = await shared.usage(policy.name)
        if shared_use is not None:
            key.update(shared_use)
    await send_json(send, 200, {"audits": "on" if gw.config.audits else "off: answers are paid unverified",
                                "in_flight": gw.router.total_in_flight(), "dispatched": gw.upstream.dispatched,
                                "outcomes": dict(gw.outcomes), "miners": [_miner(gw, m) for m in gw.router.miners()],
                                "key": key})
