"""What each miner serves: the models and request features it declares in its signed ``/health``.

A subnet can serve more than one model (two models, or a model change rolling out), and runtimes differ in
what they take beyond plain chat (tools, JSON mode, logprobs, ...). A miner says so in its ``/health``
(``models``, ``features``); the router sends a request only to miners that declared its model and every
feature it uses (:meth:`gateway.router.Router.serves`), and the gateway refuses by name what no routable miner
declared. A miner that declares no models serves the subnet's model (the first one the validator serves).

The body is signed with the miner's hotkey (``X-Miner-Signature``, hex, over the exact body bytes) and names
the hotkey: whoever answers at a miner's axon speaks for that hotkey only if it holds its key, so an endpoint
shared by several hotkeys, or a proxy in front of someone else's miner, cannot declare for them. An answer that
fails any check declares nothing (the miner is treated as undeclared), and the miner is never blamed for it: a
declaration is advice to the router, and what the miner then serves is measured and audited like any answer.

Declaring a feature earns nothing by itself: requests that use one are routed to the miners that declared it
and paid like any other, except where the audit cannot check them (:func:`gateway.protocol.auditable.audit_skip`),
which pay 0 where the
validator audits. So a miner gains nothing by declaring what it cannot serve: a request it mishandles fails it.

Example::

    body, headers = signed_health(keypair, {"status": "ok", "models": ["org/model"], "features": ["tools"]})
    offer = read_offer(body, headers[SIGNATURE_HEADER], keypair.ss58_address)   # Offer(models=..., features=...)
    offer = await fetch_offer(client, "127.0.0.1:8091", hotkey)               # over HTTP, bounded
    await refresh_offers(router, client)                                      # every miner, into the router
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp
from bittensor.sp_core import Keypair
from loguru import logger

from .http.client import MinerClient
from .protocol.openai import FEATURES
from .protocol.untrusted import UntrustedJSONError
from .protocol.untrusted import loads as untrusted_json
from .router import MinerState, Router
from .upstream import Upstream

SIGNATURE_HEADER = "X-Miner-Signature"
MAX_MODELS = 16
MAX_MODEL_CHARS = 128
MAX_HEALTH_BYTES = 16 * 1024


class OfferError(ValueError):
    """A miner's /health that declares nothing: unsigned, badly signed, for another hotkey, or malformed."""


@dataclass(frozen=True, slots=True)
class Offer:
    models: frozenset[str]  # empty: the subnet's model
    features: frozenset[str]
    sampler: str | None = None  # the sampler its runtime declares (gateway.protocol.openai.SAMPLER_HEADER's values)


UNDECLARED = Offer(frozenset(), frozenset())


def signed_health(keypair: Any, health: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    """The miner's side: ``health`` as JSON bytes with its hotkey, and the signature header over them."""
    body = json.dumps({**health, "hotkey": keypair.ss58_address}, separators=(",", ":")).encode()
    return body, {SIGNATURE_HEADER: "0x" + bytes(keypair.sign(body)).hex()}


def read_offer(body: bytes, signature: str | None, hotkey: str) -> Offer:
    """The validator's side: the offer in a signed /health body of ``hotkey``; raises :class:`OfferError`."""
    if not signature:
        raise OfferError("unsigned /health")
    try:
        sig = bytes.fromhex(signature.removeprefix("0x"))
        ok = Keypair(ss58_address=hotkey).verify(body, sig)
    except Exception as e:  # a malformed signature or address: the SDK raises its own errors
        raise OfferError(f"bad signature: {type(e).__name__}") from None
    if not ok:
        raise OfferError("signature does not verify with the miner's hotkey")
    try:
        obj = untrusted_json(body, max_bytes=MAX_HEALTH_BYTES)
    except UntrustedJSONError as e:
        raise OfferError(f"body is not JSON this validator reads ({e})") from None
    if not isinstance(obj, dict) or obj.get("hotkey") != hotkey:
        raise OfferError("the body names another hotkey")
    models = obj.get("models") or []
    if not isinstance(models, list) or len(models) > MAX_MODELS or not all(
            isinstance(m, str) and 0 < len(m) <= MAX_MODEL_CHARS and m.isprintable() for m in models):
        raise OfferError(f"models is not a list of at most {MAX_MODELS} names")
    features = obj.get("features") or []
    if not isinstance(features, list) or not all(isinstance(f, str) for f in features):
        raise OfferError("features is not a list of names")
    sampler = obj.get("sampler")
    return Offer(frozenset(models), frozenset(f for f in features if f in FEATURES),  # unknown ones: ignored
                 sampler if isinstance(sampler, str) else None)


async def fetch_offer(client: MinerClient, endpoint: str, hotkey: str, *, timeout_s: float = 5.0) -> Offer:
    """GET a miner's /health and read its offer; raises :class:`OfferError` (or the transport's errors)."""
    async with await client.get(endpoint, "/health", timeout_s=timeout_s) as r:
        body = await r.content.read(MAX_HEALTH_BYTES + 1)
        if len(body) > MAX_HEALTH_BYTES:
            raise OfferError(f"/health longer than {MAX_HEALTH_BYTES} bytes")
        return read_offer(body, r.headers.get(SIGNATURE_HEADER), hotkey)


async def refresh_offers(router: Router, client: MinerClient, *, concurrency: int = 16, timeout_s: float = 5.0,
                         miners: Iterable[MinerState] | None = None) -> dict[str, int]:
    """Read every miner's (or ``miners``') offer into the router, ``concurrency`` at a time; returns how many were
    read, kept
    (unreachable: the last offer stands, a miner restarting keeps its routes) and undeclared (an answer that
    failed a check: it serves the subnet's model, no features)."""
    gate = asyncio.Semaphore(concurrency)
    counts = {"read": 0, "kept": 0, "undeclared": 0}

    async def one(m: MinerState) -> None:
        async with gate:
            try:
                offer = await fetch_offer(client, m.endpoint, m.hotkey, timeout_s=timeout_s)
                counts["read"] += 1
                # the sampler too, so a miner's first sampled answer is not a free draw (its answers' header, the
                # live declaration, follows: gateway.upstream.dispatch.Upstream.learn_sampler)
                Upstream.learn_sampler(m, offer.sampler)
            except OfferError as e:
                logger.debug("uid {}: /health declares nothing ({})", m.uid, e)
                offer = UNDECLARED
                counts["undeclared"] += 1
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
                counts["kept"] += 1
                return
            except Exception as e:  # whatever one miner's answer raises is that miner's alone
                logger.warning("uid {}: reading its /health failed unexpectedly ({!r}); its offer is kept", m.uid, e)
                counts["kept"] += 1
                return
        router.learn_offer(m, offer.models, offer.features)

    await asyncio.gather(*(one(m) for m in (router.miners() if miners is None else miners)))
    return counts
