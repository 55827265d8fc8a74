"""Items sharing one load value, drawn by weight in O(log n): the router's buckets.

The router keeps its miners in buckets by load (least-in-flight picks from the least loaded one); acquire and release
move one miner between buckets on every request. A Fenwick tree over stable positions (swap-remove keeps them dense)
makes add, remove and a weighted pick O(log n) each, instead of rebuilding a cumulative sum of the whole bucket
after every move; an exact rebuild now and then sheds floating-point drift.

Example::

    b = WeightedBucket[Miner]()
    b.add(miner_a, 0.9); b.add(miner_b, 0.3)
    b.pick(random.Random(7))        # miner_a about 75 % of the time
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from itertools import accumulate
from typing import Generic, Protocol, TypeVar


class HasUid(Protocol):
    @property
    def uid(self) -> int: ...


T = TypeVar("T", bound=HasUid)


class WeightedBucket(Generic[T]):
    """Miners sharing one load value, sampled by score through a Fenwick tree.

    Acquire and release move one miner between buckets; a Fenwick tree over stable positions
    (swap-remove keeps them dense) makes add, remove and a weighted pick O(log n) each, instead of
    rebuilding a cumulative sum of the whole bucket after every move.
    """

    __slots__ = ("order", "positive", "_pos", "_w", "_tree", "_cap", "_top", "_total", "_updates")

    def __init__(self) -> None:
        self.order: list[T] = []
        self.positive = 0  # members with a positive weight (exact, unlike the float total)
        self._pos: dict[int, int] = {}
        self._w: list[float] = []
        self._cap = 0
        self._top = 0
        self._tree: list[float] = [0.0]
        self._total = 0.0
        self._updates = 0

    def __len__(self) -> int:
        return len(self.order)

    def holds(self, m: T) -> bool:
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

    def add(self, m: T, weight: float) -> None:
        i = len(self.order)
        self.order.append(m)
        self._pos[m.uid] = i
        self._w.append(weight)
        self.positive += weight > 0.0
        if i + 1 > self._cap or self._updates > 100_000:
            self._rebuild(self._cap * 2 if i + 1 > self._cap else self._cap)
            return
        self._add_at(i, weight)
        self._total += weight
        self._updates += 1

    def remove(self, m: T) -> None:
        i = self._pos.pop(m.uid)
        last = len(self.order) - 1
        wi = self._w[i]
        self.positive -= wi > 0.0
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

    def pick(self, rng: random.Random) -> T:
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
        return weighted_choice(self.order, self._w, rng)


def weighted_choice(items: list[T], weights: list[float], rng: random.Random) -> T:
    """Exact weighted choice; uniform when no weight is positive."""
    cum = list(accumulate(weights))
    total = cum[-1]  # not sum(): on 3.12+ sum() is compensated and can exceed cum[-1] (IndexError)
    if total <= 0.0:
        return items[rng.randrange(len(items))]
    return items[bisect_right(cum, rng.random() * total)]
