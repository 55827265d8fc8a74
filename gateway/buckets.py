"""Counts of observations by upper bound: what a Prometheus histogram exports, kept where the numbers arise.

One ``observe`` is a bisection and two additions (done once per finished request, never per token), so the
gateway can export per-miner TTFT and decode-rate distributions without keeping samples. The counts are
cumulative over the process's life, as Prometheus expects; ``rate()`` and ``histogram_quantile()`` window them.

Example::

    ttft = Buckets(TTFT_BOUNDS_S)
    ttft.observe(0.42)
    ttft.cumulative()      # [("0.05", 0), ..., ("0.5", 1), ..., ("+Inf", 1)]
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field

TTFT_BOUNDS_S = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
DECODE_BOUNDS_TOK_S = (5.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 150.0, 200.0, 300.0, 500.0)


@dataclass(slots=True)
class Buckets:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, the last one +Inf
    total: float = 0.0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(self.bounds):
            raise ValueError("bucket bounds must ascend")
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, x: float) -> None:
        """Count one finite, non-negative observation (anything else is not a measurement: ignored)."""
        if not math.isfinite(x) or x < 0:
            return
        self.counts[bisect_left(self.bounds, x)] += 1
        self.total += x

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, observations <= le)`` per bound, then ``+Inf``: the buckets of a Prometheus histogram."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*(f"{b:g}" for b in self.bounds), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, float(running)))
        return out
