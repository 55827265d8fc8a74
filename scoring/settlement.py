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


def _clean(score: float, cap: float | None) -> float:
    """Round scores live in [0, cap]; anything else is clamped, NaN and inf count 0."""
    if not isinstance(score, int | float) or not math.isfinite(score):
        return 0.0
    s = max(0.0, float(score))
    return s if cap is None else min(cap, s)


class Settlement:
    """The last ``window`` rounds' scores, each a ``{hotkey: score}`` mapping (absent = 0).

    ``cap``: the highest round score (1.0 for credits; None for values in card-equivalents, where a
    miner with two cards behind one hotkey may earn 2).
    """

    def __init__(self, window: int = 12, history: Iterable[Mapping[str, float]] = (), *,
                 cap: float | None = 1.0) -> None:
        if window < 1:
            raise ValueError(f"settlement window must be >= 1 round, got {window}")
        self.window = window
        self.cap = cap
        self._rounds: deque[dict[str, float]] = deque(maxlen=window)
        for r in history:
            self.push(r)

    def push(self, round_scores: Mapping[str, float]) -> None:
        """Append one closed round; the oldest falls out once the window is full."""
        self._rounds.append({hk: _clean(s, self.cap) for hk, s in round_scores.items()})

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
