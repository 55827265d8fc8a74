"""The routers a soak run compares, and slot learning from ``/health``.

* ``project``: :class:`gateway.router.Router` wired exactly as ``neurons.validator`` wires it: two
  score-weighted draws, the less-served wins; zero scores last; slot counts learned from the miners'
  ``X-Miner-Slots`` answers, so load is ``in_flight / slots``.
* ``deterministic``: the known-bad baseline, fewest in flight, then highest score, then lowest uid.
  When requests never overlap every miner has 0 in flight and the top-scored card gets everything.
* ``slots``: the project router with slot counts also read from each miner's ``GET /health`` before
  the first request (what an up-front capacity probe would add).
* ``smooth``: a comparison: least in flight, then smooth weighted round robin (random phase) among the
  least loaded, zero scores last (O(n) per pick; the project router reaches the same shares with a
  random two-choice draw in O(log n)).
"""

from __future__ import annotations

import random
from collections.abc import Set as AbstractSet

import aiohttp

from gateway.router import MinerState, Router

ROUTERS = ("project", "deterministic", "slots", "smooth")
MAX_LEARNED_SLOTS = 64  # /health is advisory: a miner claiming 10**6 slots must not soak up all traffic


def _free_sampler(m: MinerState) -> bool:
    return m.declares_sampler and m.load < 1.0


class DeterministicRouter(Router):
    """Least in flight with a deterministic tie-break on score: the design the project replaced."""

    def pick(self, exclude: AbstractSet[int] = frozenset(), model: str | None = None,
             needs: frozenset[str] = frozenset(), *, free_sampler: bool = False) -> MinerState | None:
        best: MinerState | None = None
        best_key: tuple[int, float, int] | None = None
        for m in self.miners():
            if m.uid in exclude or not self.serves(m, model, needs) or (free_sampler and not _free_sampler(m)):
                continue
            key = (m.in_flight, -self._weight(m), m.uid)
            if best_key is None or key < best_key:
                best, best_key = m, key
        return best


class SmoothRouter(Router):
    """Least in flight, then smooth weighted round robin by score among the least loaded (O(n) per pick)."""

    def __init__(self, rng: random.Random | None = None, prior: float | None = None) -> None:
        super().__init__(rng=rng, prior=prior)
        self._current: dict[tuple[int, str], float] = {}

    def pick(self, exclude: AbstractSet[int] = frozenset(), model: str | None = None,
             needs: frozenset[str] = frozenset(), *, free_sampler: bool = False) -> MinerState | None:
        groups: dict[float, list[MinerState]] = {}
        for m in self.miners():
            if m.uid not in exclude and self.serves(m, model, needs) and (not free_sampler or _free_sampler(m)):
                groups.setdefault(m.load, []).append(m)
        if not groups:
            return None
        loads = sorted(groups)
        # the least-loaded group with a positive score; a zero-score miner only when nothing else is left
        group = next((groups[x] for x in loads if any(self._weight(m) > 0 for m in groups[x])), None)
        if group is None:
            first = groups[loads[0]]
            return first[self._rng.randrange(len(first))]
        members = [(m, self._weight(m)) for m in group if self._weight(m) > 0]
        total = sum(w for _, w in members)
        best: MinerState | None = None
        best_c = -float("inf")
        for m, w in members:
            key = (m.uid, m.hotkey)
            c = self._current.get(key)
            if c is None:
                c = self._rng.random() * w  # random phase: no miner goes first because of its uid
            c += w
            self._current[key] = c
            if c > best_c:
                best, best_c = m, c
        assert best is not None
        self._current[(best.uid, best.hotkey)] -= total
        return best


def make_router(kind: str, rng: random.Random) -> Router:
    if kind == "deterministic":
        return DeterministicRouter(rng=rng)
    if kind == "smooth":
        return SmoothRouter(rng=rng)
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
