"""The routers a soak run compares, and the slot learning the capacity-aware proposal needs.

* ``project``: :class:`gateway.router.Router` wired exactly as ``neurons.validator`` wires it today
  (candidates carry no slot count, so every miner has ``slots=1`` and load is raw in-flight).
* ``deterministic``: the known-bad baseline, fewest in flight, then highest score, then lowest uid.
  When requests never overlap every miner has 0 in flight and the top-scored card gets everything.
* ``slots``: the project router with slot counts learned from each miner's ``GET /health``, so load
  is ``in_flight / slots`` (the proposal for the ``capacity`` scenario).

Example::

    r = make_router("deterministic", random.Random(1))
    r.sync([Candidate(1, "a", "127.0.0.1:1"), Candidate(2, "b", "127.0.0.1:2")])
    r.set_scores({"a": 0.9, "b": 0.95})
    r.acquire().miner.uid          # 2, every time
"""

from __future__ import annotations

import random

import aiohttp

from gateway.router import MinerState, Router

ROUTERS = ("project", "deterministic", "slots")
MAX_LEARNED_SLOTS = 64  # /health is advisory: a miner claiming 10**6 slots must not soak up all traffic


class DeterministicRouter(Router):
    """Least in flight with a deterministic tie-break on score: the design the project replaced."""

    def pick(self, exclude: frozenset[int] | set[int] = frozenset()) -> MinerState | None:
        best: MinerState | None = None
        best_key: tuple[int, float, int] | None = None
        for m in self.miners():
            if m.uid in exclude:
                continue
            key = (m.in_flight, -self._weight(m), m.uid)
            if best_key is None or key < best_key:
                best, best_key = m, key
        return best


def make_router(kind: str, rng: random.Random) -> Router:
    if kind == "deterministic":
        return DeterministicRouter(rng=rng)
    if kind in ("project", "slots"):
        return Router(rng=rng)
    raise ValueError(f"unknown router {kind!r}; known: {', '.join(ROUTERS)}")


async def learn_slots(session: aiohttp.ClientSession, endpoint: str, timeout_s: float = 2.0) -> int:
    """The slot count a miner advertises on ``/health``, clamped to [1, 64]; 1 when it cannot be read."""
    try:
        async with session.get(f"http://{endpoint}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                return 1
            body = await r.json()
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return 1
    slots = body.get("slots") if isinstance(body, dict) else None
    if not isinstance(slots, int) or isinstance(slots, bool):
        return 1
    return max(1, min(MAX_LEARNED_SLOTS, slots))
