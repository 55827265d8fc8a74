"""Strikes and quarantine: what failed audits cost a miner beyond the one request.

Pure bookkeeping, keyed by hotkey (a re-registered UID starts clean; a hotkey that moves UIDs keeps
its record). Each audit outcome joins the hotkey's window of its last ``window`` audits; a failed
audit is a strike. A hotkey with ``threshold`` strikes in its window is **quarantined**: left out of
organic routing and paid 0, while probes keep reaching it and every answer it gives is audited. It
is released after ``release_after`` audits in a row pass. Its strikes stay in its window (issue 23:
release used to clear them, so a miner that served probes well and users junk cycled in and out):
a released hotkey whose window still holds ``threshold - 1`` strikes goes back at its next failed
audit, and a passed audit never quarantines. One honest false failure stays below a threshold of 2;
a cheater's failures come in runs. A hotkey is also quarantined when the sequential test over its audited
tokens alarms (:mod:`scoring.audit.sequential`): a small steady shift no single answer shows. What
quarantine costs in pay is :class:`scoring.pay.PayWindow`'s.

Example::

    book = StrikeBook(StrikePolicy(window=20, threshold=2, release_after=5))
    book.record("5F...", passed=False, at=now)
    book.record("5F...", passed=False, at=now)     # -> True: quarantined now
    book.quarantined()                               # {"5F..."}
    state = book.to_json(); StrikeBook.from_json(policy, state)   # persisted with the scoring state
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .sequential import SequentialTest


@dataclass(frozen=True, slots=True)
class StrikePolicy:
    window: int = 20
    threshold: int = 2
    release_after: int = 5
    sequential: SequentialTest = field(default_factory=SequentialTest)  # evidence over audited tokens

    def __post_init__(self) -> None:
        if self.window < 1 or not 1 <= self.threshold <= self.window or self.release_after < 1:
            raise ValueError(f"need window >= 1, 1 <= threshold <= window, release_after >= 1: {self}")


@dataclass(slots=True)
class StrikeRecord:
    """One hotkey's audit history: recent outcomes (True = passed), quarantine and its clean run."""

    recent: deque[bool]
    quarantined_at: float | None = None
    clean_run: int = 0  # audits passed in a row while quarantined
    audits: int = 0
    failures: int = 0
    evidence: float = 0.0  # the sequential test's sum (scoring.audit.sequential)
    positions: int = 0  # greedy or seeded positions audited, all time
    alarms: int = 0  # times the sequential test crossed its threshold

    @property
    def strikes(self) -> int:
        return sum(1 for ok in self.recent if not ok)


@dataclass(slots=True)
class StrikeBook:
    policy: StrikePolicy = field(default_factory=StrikePolicy)
    records: dict[str, StrikeRecord] = field(default_factory=dict)

    def _record(self, hotkey: str) -> StrikeRecord:
        r = self.records.get(hotkey)
        if r is None:
            r = self.records[hotkey] = StrikeRecord(recent=deque(maxlen=self.policy.window))
        return r

    def record(self, hotkey: str, *, passed: bool, at: float, positions: int = 0, misses: int = 0) -> bool:
        """Book one audit; returns True when this outcome changed the hotkey's quarantine state.

        ``positions``/``misses``: the answer's greedy or seeded positions and those off the reference's choice,
        for the sequential test. Its alarm quarantines like ``threshold`` strikes, and a quarantined hotkey
        whose evidence alarms again starts its clean run over (its sum restarts at 0 after each alarm).
        """
        r = self._record(hotkey)
        r.audits += 1
        r.recent.append(passed)
        if not passed:
            r.failures += 1
        test = self.policy.sequential
        r.positions += max(0, positions)
        r.evidence = test.update(r.evidence, positions=positions, misses=misses)
        alarm = test.alarmed(r.evidence)
        if alarm:
            r.alarms += 1
            r.evidence = 0.0
        if r.quarantined_at is None:
            if alarm or (not passed and r.strikes >= self.policy.threshold):
                r.quarantined_at = at
                r.clean_run = 0
                return True
            return False
        r.clean_run = r.clean_run + 1 if passed and not alarm else 0
        if r.clean_run >= self.policy.release_after:
            r.quarantined_at = None
            r.clean_run = 0
            return True
        return False

    def is_quarantined(self, hotkey: str) -> bool:
        r = self.records.get(hotkey)
        return r is not None and r.quarantined_at is not None

    def quarantined(self) -> set[str]:
        return {hk for hk, r in self.records.items() if r.quarantined_at is not None}

    # -- persistence -----------------------------------------------------------------------------

    def to_json(self) -> dict[str, dict[str, Any]]:
        return {hk: {"recent": [int(x) for x in r.recent], "quarantined_at": r.quarantined_at,
                     "clean_run": r.clean_run, "audits": r.audits, "failures": r.failures,
                     "evidence": r.evidence, "positions": r.positions, "alarms": r.alarms}
                for hk, r in self.records.items()}

    @classmethod
    def from_json(cls, policy: StrikePolicy, data: dict[str, Any]) -> StrikeBook:
        """Rebuild from :meth:`to_json`; raises ValueError on a malformed entry (the store says which file)."""
        book = cls(policy)
        if not isinstance(data, dict):
            raise ValueError("strike book is not an object")
        for hk, d in data.items():
            try:
                q = d.get("quarantined_at")
                rec = StrikeRecord(recent=deque((bool(x) for x in d["recent"]), maxlen=policy.window),
                                   quarantined_at=None if q is None else float(q), clean_run=int(d["clean_run"]),
                                   audits=int(d.get("audits", 0)), failures=int(d.get("failures", 0)),
                                   evidence=float(d.get("evidence", 0.0)), positions=int(d.get("positions", 0)),
                                   alarms=int(d.get("alarms", 0)))
                if not (math.isfinite(rec.evidence) and rec.evidence >= 0):
                    raise ValueError(f"evidence {rec.evidence!r}")
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise ValueError(f"strike record of {hk!r} is malformed: {e!r}") from None
            book.records[str(hk)] = rec
        return book
