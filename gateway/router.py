"""Weighted-random least-in-flight routing: pure logic, no I/O.

Among eligible miners keep those with the lowest load (this validator's requests in flight, divided
by the miner's slot count), then pick one at random with probability proportional to its routing
score. A deterministic tie-break is the bug this module exists to avoid: when requests never
overlap every miner has zero in flight, and "highest score wins" sends every request to one card,
whose TTFT then rises while it is paid less.

Example::

    import random
    r = Router(rng=random.Random(7))
    r.sync([Candidate(uid=1, hotkey="a", endpoint="127.0.0.1:8091"),
            Candidate(uid=2, hotkey="b", endpoint="127.0.0.1:8092")])
    r.set_scores({"a": 0.9, "b": 0.3})
    lease = r.acquire()          # uid 1 about 75 % of the time
    ...
    r.release(lease)             # exactly once, on every path

Loads are bucketed so a pick costs O(distinct loads + log n), not O(n): with 256 miners the choice
stays in the microseconds even though it runs on every request.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import accumulate


@dataclass(frozen=True, slots=True)
class Candidate:
    """A routable miner as the metagraph describes it."""

    uid: int
    hotkey: str
    endpoint: str
    slots: int = 1


@dataclass(slots=True, eq=False)
class MinerState:
    """Live routing state of one miner. Identity matters: a lease points at the exact object."""

    uid: int
    hotkey: str
    endpoint: str
    slots: int
    score: float | None = None  # None: not measured yet, routed at the prior
    in_flight: int = 0
    served: int = 0
    _bucket: float = field(default=0.0, repr=False)

    @property
    def load(self) -> float:
        return self.in_flight / self.slots


@dataclass(slots=True, eq=False)
class Lease:
    """Proof that one request holds one in-flight unit on ``miner``; release it exactly once."""

    miner: MinerState
    in_flight_at_dispatch: int
    released: bool = False


class _Bucket:
    """Miners sharing one load value, sampled by score through a Fenwick tree.

    Acquire and release move one miner between buckets; a Fenwick tree over stable positions
    (swap-remove keeps them dense) makes add, remove and a weighted pick O(log n) each, instead of
    rebuilding a cumulative sum of the whole bucket after every move.
    """

    __slots__ = ("order", "_pos", "_w", "_tree", "_cap", "_top", "_total", "_updates")

    def __init__(self) -> None:
        self.order: list[MinerState] = []
        self._pos: dict[int, int] = {}
        self._w: list[float] = []
        self._cap = 0
        self._top = 0
        self._tree: list[float] = [0.0]
        self._total = 0.0
        self._updates = 0

    def __len__(self) -> int:
        return len(self.order)

    def holds(self, m: MinerState) -> bool:
        i = self._pos.get(m.uid)
        return i is not None and self.order[i] is m

    def _rebuild(self, cap: int) -> None:
        """Exact O(n) rebuild: on growth, and now and then to shed floating-point drift."""
        cap = max(8, cap)
        tree = [0.0] * (cap + 1)
        tree[1 : len(self._w) + 1] = self._w
        for i in range(1, cap + 1):  # every node, also past n: the descent reads the top ones
            j = i + (i & -i)
            if j <= cap:
                tree[j] += tree[i]
        self._tree, self._cap = tree, cap
        self._top = 1 << (cap.bit_length() - 1)
        self._total = math.fsum(self._w)
        self._updates = 0

    def _add_at(self, i: int, delta: float) -> None:
        tree, cap = self._tree, self._cap
        i += 1
        while i <= cap:
            tree[i] += delta
            i += i & -i

    def add(self, m: MinerState, weight: float) -> None:
        i = len(self.order)
        self.order.append(m)
        self._pos[m.uid] = i
        self._w.append(weight)
        if i + 1 > self._cap or self._updates > 100_000:
            self._rebuild(self._cap * 2 if i + 1 > self._cap else self._cap)
            return
        self._add_at(i, weight)
        self._total += weight
        self._updates += 1

    def remove(self, m: MinerState) -> None:
        i = self._pos.pop(m.uid)
        last = len(self.order) - 1
        wi = self._w[i]
        if i != last:
            moved, wl = self.order[last], self._w[last]
            self.order[i], self._w[i] = moved, wl
            self._pos[moved.uid] = i
            self._add_at(i, wl - wi)
            self._add_at(last, -wl)
        else:
            self._add_at(i, -wi)
        self.order.pop()
        self._w.pop()
        self._total -= wi
        self._updates += 2

    def pick(self, rng: random.Random) -> MinerState:
        n = len(self.order)
        if self._total > 0.0:
            r = rng.random() * self._total
            tree, cap, idx, bit = self._tree, self._cap, 0, self._top
            while bit:
                nxt = idx + bit
                if nxt <= cap and tree[nxt] <= r:
                    idx = nxt
                    r -= tree[nxt]
                bit >>= 1
            if idx < n and self._w[idx] > 0.0:
                return self.order[idx]
        elif self._updates == 0:  # exact (just rebuilt) and no positive weight: uniform
            return self.order[rng.randrange(n)]
        # Drift put the draw on a zero-weight slot or hid the weight: rebuild exactly, then decide.
        self._rebuild(self._cap)
        return _weighted_choice(self.order, self._w, rng)


def _weighted_choice(miners: list[MinerState], weights: list[float], rng: random.Random) -> MinerState:
    """Exact weighted choice; uniform when no weight is positive."""
    cum = list(accumulate(weights))
    total = cum[-1]  # not sum(): on 3.12+ sum() is compensated and can exceed cum[-1] (IndexError)
    if total <= 0.0:
        return miners[rng.randrange(len(miners))]
    return miners[bisect_right(cum, rng.random() * total)]


def _clean_score(value: float) -> float:
    value = float(value)
    if math.isnan(value) or value < 0.0:
        return 0.0
    return min(value, 1e9)


class Router:
    """Chooses a miner per request; tracks this validator's in-flight requests exactly.

    ``prior`` is the routing score of a miner that has not been measured yet; by default the median
    of the known scores (1.0 when none is known), so a newcomer is treated as a typical card until
    probes have measured it.
    """

    def __init__(self, rng: random.Random | None = None, prior: float | None = None) -> None:
        self._rng = rng if rng is not None else random.Random()
        self._fixed_prior = prior
        self._prior = 1.0 if prior is None else _clean_score(prior)
        self._miners: dict[int, MinerState] = {}
        self._buckets: dict[float, _Bucket] = {}

    # -- membership and scores -------------------------------------------------------------------

    def sync(self, candidates: Iterable[Candidate]) -> None:
        """Replace the eligible set. A UID whose hotkey or endpoint changed starts from nothing.

        In-flight requests of a removed or replaced miner keep their lease; releasing it later
        touches only that old state object.
        """
        wanted = {c.uid: c for c in candidates}
        for uid in list(self._miners):
            c = wanted.get(uid)
            m = self._miners[uid]
            if c is None or c.hotkey != m.hotkey or c.endpoint != m.endpoint or c.slots != m.slots:
                self._unbucket(m)
                del self._miners[uid]
        for uid, c in wanted.items():
            if uid not in self._miners:
                m = MinerState(uid=c.uid, hotkey=c.hotkey, endpoint=c.endpoint, slots=max(1, int(c.slots)))
                self._miners[uid] = m
                self._bucket_in(m)

    def set_scores(self, scores: Mapping[str, float]) -> None:
        """Routing scores keyed by hotkey (so a re-registered UID cannot inherit a score)."""
        for m in self._miners.values():
            s = scores.get(m.hotkey)
            m.score = None if s is None else _clean_score(s)
        if self._fixed_prior is None:
            known = sorted(m.score for m in self._miners.values() if m.score is not None)
            self._prior = known[len(known) // 2] if known else 1.0
        for m in list(self._miners.values()):  # weights changed: re-bucket everyone (once a round)
            self._unbucket(m)
            self._bucket_in(m)

    def _weight(self, m: MinerState) -> float:
        return self._prior if m.score is None else m.score

    # -- choice ----------------------------------------------------------------------------------

    def pick(self, exclude: frozenset[int] | set[int] = frozenset()) -> MinerState | None:
        """The miner the next request should go to, or None when nothing is eligible."""
        for load in sorted(self._buckets):
            bucket = self._buckets[load]
            if not exclude:
                return bucket.pick(self._rng)
            rest = [m for m in bucket.order if m.uid not in exclude]
            if rest:
                return _weighted_choice(rest, [self._weight(m) for m in rest], self._rng)
        return None

    def acquire(self, exclude: frozenset[int] | set[int] = frozenset()) -> Lease | None:
        """Pick a miner and count one request in flight on it."""
        m = self.pick(exclude)
        return None if m is None else self.acquire_uid(m.uid)

    def acquire_uid(self, uid: int) -> Lease | None:
        """Count one request in flight on a specific miner (probes), so organic routing sees it too."""
        m = self._miners.get(uid)
        if m is None:
            return None
        lease = Lease(miner=m, in_flight_at_dispatch=m.in_flight)
        self._unbucket(m)
        m.in_flight += 1
        self._bucket_in(m)
        return lease

    def release(self, lease: Lease, served: bool = False) -> None:
        """Give the in-flight unit back. Idempotent, so a double release cannot corrupt counts."""
        if lease.released:
            return
        lease.released = True
        m = lease.miner
        live = self._miners.get(m.uid) is m
        if live:
            self._unbucket(m)
        m.in_flight -= 1
        if served:
            m.served += 1
        if live:
            self._bucket_in(m)

    # -- inspection ------------------------------------------------------------------------------

    def miners(self) -> list[MinerState]:
        return sorted(self._miners.values(), key=lambda m: m.uid)

    def get(self, uid: int) -> MinerState | None:
        return self._miners.get(uid)

    def total_in_flight(self) -> int:
        return sum(m.in_flight for m in self._miners.values())

    def __len__(self) -> int:
        return len(self._miners)

    # -- buckets ---------------------------------------------------------------------------------

    def _bucket_in(self, m: MinerState) -> None:
        load = m.load
        b = self._buckets.get(load)
        if b is None:
            b = self._buckets[load] = _Bucket()
        b.add(m, self._weight(m))
        m._bucket = load

    def _unbucket(self, m: MinerState) -> None:
        b = self._buckets.get(m._bucket)
        if b is None or not b.holds(m):
            return
        b.remove(m)
        if not len(b):
            del self._buckets[m._bucket]
