"""What the state file holds, as records (a round, a miner's line in it, an audit, a weights submission), and the
errors opening it can raise, each naming the file and what to do (:mod:`scoring.store` reads and writes them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from scoring.pay import RoundPay


@dataclass(frozen=True, slots=True)
class StoredAudit:
    """One audit outcome as persisted (``failure`` None when it passed)."""

    at: float
    hotkey: str
    uid: int
    probe: bool
    passed: bool
    failure: str | None
    detail: str
    tokens: int


class StateError(Exception):
    """The state file cannot be used as it is. The message says which file and what to do."""

    def __init__(self, path: Path, problem: str, remedy: str) -> None:
        self.path = path
        super().__init__(f"{path}: {problem}. {remedy}")


class CorruptStateError(StateError):
    """The file is not a readable tensorgate scoring database."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(
            path,
            problem,
            "Move the file (and any -wal/-shm beside it) aside to start with no settlement history, "
            "or restore it from a backup; it is not reset automatically.",
        )


class NewerSchemaError(StateError):
    """The file was written by a newer release with a schema this one does not know."""

    def __init__(self, path: Path, found: int, understood: int) -> None:
        super().__init__(
            path,
            f"schema version {found} is newer than this release understands ({understood})",
            "Run the newer tensorgate release, or point --state-dir at another directory.",
        )


@dataclass(frozen=True, slots=True)
class StoredMiner:
    """One miner's line in one settled round."""

    hotkey: str
    uid: int
    score: float  # the round score settlement averages (mean credit of measured requests)
    requests: int = 0
    measured: int = 0
    credit_sum: float = 0.0
    ttft_p50: float | None = None
    ttft_p95: float | None = None
    failures: dict[str, int] = field(default_factory=dict)
    work_s: float = 0.0  # card-seconds of paid work
    value: float = 0.0  # the verified part of the round's value (scoring.pay.RoundPay)
    unverified: float = 0.0  # the part no audit looked at: paid as the pay window allows
    audits_passed: int = 0
    audits_failed: int = 0
    quarantined: bool = False
    unmeasured: bool = False  # routed before any capacity check had read it (scoring.pay.RoundPay)
    capacity: float | None = None  # the capacity reading this round pushed, lifted as pushed; None: not checked


@dataclass(frozen=True, slots=True)
class StoredRound:
    index: int
    ended_at: float
    miners: list[StoredMiner] = field(default_factory=list)

    def scores(self) -> dict[str, float]:
        return {m.hotkey: m.score for m in self.miners}

    def pays(self) -> dict[str, RoundPay]:
        return {m.hotkey: RoundPay(m.value, m.unverified, m.audits_passed, m.audits_failed, m.quarantined,
                                   m.unmeasured) for m in self.miners}


@dataclass(frozen=True, slots=True)
class StoredWeights:
    block: int
    at: float
    weights: dict[int, float]
