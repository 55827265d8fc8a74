"""Settlement: a trailing window over the last N rounds this validator actually ran.

A miner's settled score is the sum of its round scores over the window divided by the number of
rounds in the window, so a round in which it was absent counts 0 and a miner that vanishes decays
to 0 within N rounds, then drops out. Keyed by hotkey: a UID whose hotkey changed starts from
nothing. Rounds the validator did not run (downtime) are never in the window, so they are neither
paid nor held against anyone. Until N rounds have run, the divisor is the rounds run so far.

Example::

    s = Settlement(window=12)
    s.push({"hk-a": 1.0, "hk-b": 0.5})
    s.push({"hk-a": 1.0})
    s.settled()                        # {"hk-a": 1.0, "hk-b": 0.25}
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping


def _clean(score: float) -> float:
    """Round scores (credits) live in [0, 1]; anything else is clamped, NaN and inf count 0."""
    if not isinstance(score, int | float) or not math.isfinite(score):
        return 0.0
    return min(1.0, max(0.0, float(score)))


class Settlement:
    """The last ``window`` rounds' credits, each a ``{hotkey: credit}`` mapping (absent = 0).

    Values (pay) settle over the same window in :class:`scoring.pay.PayWindow`, which also holds and
    forfeits unverified pay.
    """

    def __init__(self, window: int = 12, history: Iterable[Mapping[str, float]] = ()) -> None:
        if window < 1:
            raise ValueError(f"settlement window must be >= 1 round, got {window}")
        self.window = window
        self._rounds: deque[dict[str, float]] = deque(maxlen=window)
        for r in history:
            self.push(r)

    def push(self, round_scores: Mapping[str, float]) -> None:
        """Append one closed round; the oldest falls out once the window is full."""
        self._rounds.append({hk: _clean(s) for hk, s in round_scores.items()})

    def settled(self) -> dict[str, float]:
        """Settled score per hotkey seen in the window (0.0 entries included until they fall out)."""
        if not self._rounds:
            return {}
        totals: dict[str, float] = {}
        for r in self._rounds:
            for hk, s in r.items():
                totals[hk] = totals.get(hk, 0.0) + s
        n = len(self._rounds)
        return {hk: t / n for hk, t in totals.items()}

    def rounds(self) -> list[dict[str, float]]:
        """The window, oldest first (copies)."""
        return [dict(r) for r in self._rounds]

    def __len__(self) -> int:
        return len(self._rounds)
