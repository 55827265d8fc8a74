"""Capacity: how many honest cards' worth of decode a hotkey delivers when every miner is filled at once.

Routing shares traffic in proportion to routing credit, so a card registered as four hotkeys would
be sent four cards' traffic and, paid for work, earn four cards' pay whenever the traffic is light
enough that its one card keeps up. Nothing in one hotkey's own answers shows the sharing: its
siblings' streams look like load from other validators. It shows when they all run at once.

So once a round the validator fills every miner's declared slots but one at the same moment (the
*capacity check*, :class:`neurons.validator.probes.ProbeRunner`; the slot left free keeps users
served meanwhile) with ordinary probes, and measures what each hotkey delivers: the mean rate of its
check streams on the validator's clock (:func:`scoring.credit.on_time_rate`: holding the first token
back and sending the rest in one burst no longer reads as speed; a blamed failure counts 0, and no
stream counts faster than one stream of an honest card) times this validator's streams that were
delivering on it meanwhile (a stream left hanging is not load), against the aggregate an honest card
of the class sustains at that many streams. An honest card scores ~1, a miner with two cards behind
one hotkey ~2, each of four hotkeys sharing one card ~0.25.

Routing credit is multiplied by the hotkey's **median** ratio over the settlement window (issue 23: the
best of the window let one lucky or gamed check stand for twelve rounds), read in whole cards: under
:data:`SHARED_BELOW` it is taken as it is (a share of a card), above it is rounded to the nearest
whole number of cards, at least 1. Measured rates are noisy (the local subnet on 2 cores measured
honest cards between ~0.7 and ~1.3 when 16 streams start at once), and an honest card must route at
exactly 1, not at the luck of its checks. A hotkey never measured routes at :data:`UNMEASURED`, half
a card: a new hotkey, or one whose every check stream was a truthful 429, has shown nothing yet, and
registering hotkeys faster than checks measure them must not be worth a card each.

Example::

    book = CapacityBook(window=12)
    book.push("hk", capacity_ratio([75.0, 74.0, 76.0, 75.0], concurrency=4.0, cfg=CreditConfig()))  # 1.0
    book.multiplier("hk")        # 1.0; "never-checked" -> 0.5; a median of 0.27 -> 0.27; 1.8 -> 2.0
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence

from scoring.credit import CreditConfig, aggregate_rate

MAX_RATIO = 16.0  # no single endpoint is credited with more than 16 cards, whatever it delivers
SHARED_BELOW = 0.6  # a median ratio under this is a share of a card (two hotkeys on one card: 0.5 each)
UNMEASURED = 0.5  # the routing multiplier of a hotkey no capacity check has measured yet


def capacity_ratio(rates: Sequence[float], concurrency: float, cfg: CreditConfig) -> float | None:
    """Delivered aggregate / an honest card's aggregate at ``concurrency`` streams (this validator's, on
    that miner, while the check ran); None without a stream to judge."""
    good = [r if isinstance(r, int | float) and math.isfinite(r) and r > 0 else 0.0 for r in rates]
    if not good or not math.isfinite(concurrency):
        return None
    n = max(1.0, concurrency)
    return min(MAX_RATIO, sum(good) / len(good) * n / aggregate_rate(n, cfg))


class CapacityBook:
    """Each hotkey's capacity ratios over the last ``window`` checks; routing follows their median."""

    def __init__(self, window: int = 12) -> None:
        self.window = max(1, window)
        self._ratios: dict[str, deque[float]] = {}

    def push(self, hotkey: str, ratio: float) -> None:
        self._ratios.setdefault(hotkey, deque(maxlen=self.window)).append(ratio)

    def multiplier(self, hotkey: str) -> float:
        """The median recent ratio in whole cards (a share below :data:`SHARED_BELOW`); :data:`UNMEASURED`
        when not checked yet."""
        ratios = self._ratios.get(hotkey)
        if not ratios:
            return UNMEASURED
        mid = statistics.median(ratios)
        return mid if mid < SHARED_BELOW else float(max(1, round(mid)))

    def forget(self, keep: set[str]) -> None:
        """Drop hotkeys no longer scored (deregistered, settled out)."""
        for hk in [hk for hk in self._ratios if hk not in keep]:
            del self._ratios[hk]
