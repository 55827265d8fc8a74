"""The scorer's routing view, published for every gateway process to route by.

The scorer process owns what decides where requests go: the metagraph's routable miners, the scores of the last
round, the quarantine of failed audits, and what each miner declared it serves (its signed ``/health``). It
publishes them as one JSON document (:func:`publish`) whenever one changes; each gateway process reads it every
``every_s`` and applies it when it changed (:class:`RoutingFollower`), so all of them route by the same view a
fraction of a second apart. What each process learns from its own answers (slots, the sampler header) stays its
own, as it is with one process; a miner new to a process starts from what the scorer knows of it.

Redis down: each process keeps routing by the last view it read.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from loguru import logger

from ..router import Candidate, Router
from .link import RedisError, RedisLink

KEY = "routing"


def view(router: Router) -> str:
    """What the gateways need of the scorer's router, as JSON."""
    miners = [{"uid": m.uid, "hotkey": m.hotkey, "endpoint": m.endpoint, "slots": m.slots, "score": m.score,
               "share": m.share, "quarantined": m.quarantined, "models": sorted(m.models),
               "features": sorted(m.features), "sampler": m.declares_sampler} for m in router.miners()]
    return json.dumps({"miners": miners}, separators=(",", ":"))


def apply(router: Router, data: dict[str, Any]) -> None:
    """Make ``router`` route by the published view ``data``."""
    miners = data["miners"]
    router.sync(Candidate(uid=int(d["uid"]), hotkey=str(d["hotkey"]), endpoint=str(d["endpoint"]),
                          slots=int(d["slots"])) for d in miners)
    router.set_scores({str(d["hotkey"]): float(d["score"]) for d in miners if d["score"] is not None},
                      {str(d["hotkey"]): float(d.get("share", 1.0)) for d in miners})
    router.set_quarantined({str(d["hotkey"]) for d in miners if d["quarantined"]})
    for d in miners:
        m = router.get(int(d["uid"]))
        if m is None:
            continue
        if m.served == 0 and m.in_flight == 0:  # new here: what the scorer learnt (then its own answers say)
            m.declares_sampler = bool(d["sampler"])
        router.learn_offer(m, frozenset(d["models"]), frozenset(d["features"]))


async def publish(link: RedisLink, routing: str) -> bool:
    """Publish the scorer router's :func:`view`; False while Redis is down (then publish it again later)."""
    if not link.usable():
        return False
    try:
        await link.redis.set(link.key(KEY), routing)
    except (RedisError, OSError) as e:
        link.failed(e)
        return False
    link.worked()
    return True


class RoutingFollower:
    """A gateway process's copy of the view: read every ``every_s``, applied when it changed."""

    def __init__(self, link: RedisLink, router: Router, *, every_s: float = 0.5) -> None:
        self.link = link
        self.router = router
        self.every_s = every_s
        self._seen: bytes | str | None = None
        self.applied = 0

    async def follow_once(self) -> bool:
        """Read the view; True when a new one was applied."""
        if not self.link.usable():
            return False
        try:
            raw = await self.link.redis.get(self.link.key(KEY))
        except (RedisError, OSError) as e:
            self.link.failed(e)
            return False
        self.link.worked()
        if raw is None or raw == self._seen:
            return False
        try:
            apply(self.router, json.loads(raw))
        except (ValueError, KeyError, TypeError) as e:
            logger.error("the published routing view is unreadable ({!r}); routing by the last one", e)
            self._seen = raw
            return False
        self._seen = raw
        self.applied += 1
        return True

    async def run(self) -> None:
        while True:
            await self.follow_once()
            await asyncio.sleep(self.every_s)
