"""One scoring round: accumulate measurements per miner, then reduce them to a round score.

Keyed by hotkey, never by UID: a UID that is re-registered to a new hotkey is a different miner and
must not inherit anything. The UID is kept only for display.

A miner's round score is the mean credit of its *measured* requests (those not excluded, see
:data:`scoring.credit.EXCLUDED_FAILURES`). A miner that was dispatched to but completed nothing
measurable scores 0; a miner that received no request at all is simply absent from the round.

Example::

    acc = RoundAccumulator(CreditConfig())
    acc.add(measurement)                 # any number of times
    stats = acc.miners["5F..."]          # MinerRound: requests, measured, ttft_p50, score, ...
    scores = acc.scores()                # {hotkey: round score}
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from scoring.credit import CreditConfig, request_credit
from scoring.measurement import Measurement


def percentile(samples: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (``q`` in [0, 100]) of ``samples``; None when empty."""
    if not samples:
        return None
    xs = sorted(samples)
    pos = (len(xs) - 1) * min(100.0, max(0.0, q)) / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(slots=True)
class MinerRound:
    """Everything one round saw of one miner."""

    hotkey: str
    uid: int
    requests: int = 0  # dispatched, whatever the outcome
    measured: int = 0  # requests that count toward credit (not busy / client_disconnect)
    credit_sum: float = 0.0
    probes: int = 0
    organic: int = 0
    audited: int = 0  # answers teacher-forced on the reference (failed ones also count in failures)
    ttft_samples: list[float] = field(default_factory=list)  # successful requests only
    failures: Counter[str] = field(default_factory=Counter)

    @property
    def score(self) -> float:
        """Mean credit of measured requests; 0 for a miner asked that completed nothing measurable."""
        return self.credit_sum / self.measured if self.measured else 0.0

    @property
    def ttft_p50(self) -> float | None:
        return percentile(self.ttft_samples, 50)

    @property
    def ttft_p95(self) -> float | None:
        return percentile(self.ttft_samples, 95)


class RoundAccumulator:
    """Per-hotkey accumulation for the round in progress. ``add`` is O(1) and cheap."""

    def __init__(self, cfg: CreditConfig) -> None:
        self.cfg = cfg
        self.miners: dict[str, MinerRound] = {}

    def add(self, m: Measurement) -> float | None:
        """Fold one measurement in; returns its credit (None when excluded)."""
        row = self.miners.get(m.hotkey)
        if row is None:
            row = self.miners[m.hotkey] = MinerRound(hotkey=m.hotkey, uid=m.uid)
        row.uid = m.uid
        row.requests += 1
        if m.probe:
            row.probes += 1
        else:
            row.organic += 1
        if m.audited:
            row.audited += 1
        if not m.ok:
            row.failures[m.failure or "unknown"] += 1
        credit = request_credit(m, self.cfg)
        if credit is not None:
            row.measured += 1
            row.credit_sum += credit
        if m.ok and m.ttft_s is not None and math.isfinite(m.ttft_s) and m.ttft_s >= 0:
            row.ttft_samples.append(float(m.ttft_s))
        return credit

    def scores(self) -> dict[str, float]:
        """Round score per hotkey that received at least one request."""
        return {hk: row.score for hk, row in self.miners.items()}

    def __len__(self) -> int:
        return len(self.miners)
