"""A uniform random sample of the last requests, of bounded size: what probes are drawn from.

Both samples of organic traffic (:class:`~neurons.validator.shapes.ShapeSample`, shapes only, and
:class:`~neurons.validator.replays.ReplaySample`, whole requests) keep a reservoir: after ``seen`` offers
each one is held with probability ``capacity / seen``, in O(1) per offer, so the sample follows recent
traffic without growing with it.

Example::

    r: Reservoir[int] = Reservoir(capacity=2, rng=random.Random(0))
    for i in range(10):
        r.offer(lambda i=i: i)     # built only when it is kept
    r.draw()                         # one of the kept items; r.take() also removes it
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Reservoir(Generic[T]):
    def __init__(self, capacity: int, rng: random.Random | None = None) -> None:
        self.capacity = max(1, capacity)
        self._rng = rng if rng is not None else random.Random()
        self._items: list[T] = []
        self.seen = 0

    def offer(self, make: Callable[[], T]) -> None:
        """Count one more item and keep it (``make()``) with the reservoir's probability."""
        self.seen += 1
        if len(self._items) < self.capacity:
            self._items.append(make())
            return
        i = self._rng.randrange(self.seen)
        if i < self.capacity:
            self._items[i] = make()

    def draw(self) -> T | None:
        """A kept item, left in the sample; None when empty."""
        return self._rng.choice(self._items) if self._items else None

    def take(self) -> T | None:
        """A kept item, removed from the sample; None when empty."""
        if not self._items:
            return None
        i = self._rng.randrange(len(self._items))
        item = self._items[i]
        self._items[i] = self._items[-1]
        self._items.pop()
        return item

    def __len__(self) -> int:
        return len(self._items)
