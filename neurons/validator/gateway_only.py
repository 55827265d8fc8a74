"""A gateway process and nothing else: serves, routes and measures, while one validator scores and sets weights.

``--gateway.workers N`` starts N-1 of these beside the validator, on its port (``SO_REUSEPORT``: the kernel spreads
new connections among them); ``--gateway.only`` runs one on another machine. Each is built by the same wiring as
the validator's own gateway (:func:`neurons.validator.build.build_parts`), and shares through ``--redis.url``
(:mod:`gateway.shared`): it routes by the view the validator publishes (members, scores, quarantine, offers), holds
each request's place among the miner's declared slots subnet-wide, admits API keys against limits summed over every
process, and sends every measurement, with the answers kept for audit, to the validator's scorer. It needs no chain
and holds no state of its own: killed, it loses only its requests in flight, whose leases expire.

Run with the validator's own flags (the same model, audit and key settings) plus ``--gateway.only``::

    python -m neurons.validator --netuid 7 --gateway.model org/model --audit.model packaged \\
        --wallet.name vali --redis.url redis://10.0.0.5:6379/0 --gateway.only
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from loguru import logger

from gateway.shared.routing import RoutingFollower

from ..supervise import supervise
from .build import build_parts
from .config import ValidatorConfig

FIRST_VIEW_S = 10.0  # at start, wait this long at most for the validator's routing view before serving anyway


async def run_gateway(cfg: ValidatorConfig, keypair: Any, *, api_keys: list[str] | None = None,
                      on_ready: Callable[[int], None] | None = None) -> int:
    """Serve until cancelled (SIGTERM: streams in progress get the drain time, measurements are sent)."""
    parts = build_parts(cfg, keypair, api_keys=api_keys)
    shared = parts.shared
    if shared is None:
        raise ValueError("a gateway-only process needs --redis.url (where the validator publishes its routing)")
    follower = RoutingFollower(shared.link, parts.router)
    loop = asyncio.get_running_loop()
    ends = loop.time() + FIRST_VIEW_S
    while not await follower.follow_once() and loop.time() < ends:  # noqa: ASYNC110 - polls Redis, not a task
        await asyncio.sleep(0.2)
    if not follower.applied:
        logger.warning("no routing view in {} yet (is the validator running with the same --redis.url, --netuid "
                       "and hotkey?): serving, /ready says not ready until it comes", cfg.redis_url)
    restarts: dict[str, int] = {}
    tasks = [supervise(name, fn, restarts=restarts)
             for name, fn in {**shared.loops(), "routing-follow": follower.run}.items()]
    try:
        await parts.gateway.start()
        logger.info("gateway process on http://{}:{} routing {} miners by {}", cfg.gateway_host, parts.gateway.port,
                    len(parts.router), cfg.redis_url)
        if on_ready is not None:
            on_ready(parts.gateway.port)
        await asyncio.Event().wait()
    finally:
        await parts.aclose(keep_link=True)  # drains streams, then sends the last measurements and settlements
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await shared.link.aclose()
    return 0
