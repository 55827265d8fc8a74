"""The per-miner sequential test (scoring.audit.sequential) and its place in the strike book, on simulated evidence.

Rates from measurements on Gemma 3 270M (scripts/bench_audit.py): honest CPU against CPU 5.4e-4 of positions off
the reference's choice; a Q3_K_M requantization 9.7 %; a Q2_K one 24 %.
"""

from __future__ import annotations

import random

import pytest

from scoring.audit import StrikeBook, StrikePolicy
from scoring.audit.sequential import SequentialTest


def _tokens_to_alarm(test: SequentialTest, rate: float, rng: random.Random, limit: int, answer: int = 48) -> int | None:
    """Audited positions until the test alarms for a miner missing at ``rate`` (answers of ``answer`` tokens)."""
    s, seen = 0.0, 0
    while seen < limit:
        misses = sum(rng.random() < rate for _ in range(answer))
        s = test.update(s, positions=answer, misses=misses)
        seen += answer
        if test.alarmed(s):
            return seen
    return None


def test_honest_evidence_never_alarms_and_a_requantized_copy_is_caught_within_a_few_hundred_tokens() -> None:
    test = SequentialTest()
    rng = random.Random(1)
    assert _tokens_to_alarm(test, 5.4e-4, rng, limit=2_000_000) is None  # 2M honest tokens: no alarm
    for rate, within in ((0.24, 200), (0.097, 1000)):  # Q2_K, Q3_K_M
        runs = [_tokens_to_alarm(test, rate, rng, limit=within) for _ in range(300)]
        assert sum(r is not None for r in runs) >= 297, (rate, runs.count(None))  # >= 99 % of runs
    slow = sorted(t or 10**9 for t in (_tokens_to_alarm(test, 0.02, rng, limit=20_000) for _ in range(100)))
    assert slow[50] < 3000  # a 2 % shift: the median run alarms within a few thousand tokens


def test_update_floors_at_zero_and_weighs_misses() -> None:
    test = SequentialTest()
    assert test.update(0.0, positions=100, misses=0) == 0.0
    assert test.update(3.0, positions=0, misses=0) == 3.0
    one = test.update(0.0, positions=1, misses=1)
    assert one == pytest.approx(test.miss_weight)
    assert test.update(0.0, positions=10, misses=99) == test.update(0.0, positions=10, misses=10)  # clamped
    assert test.hit_weight < 0 < test.miss_weight
    with pytest.raises(ValueError):
        SequentialTest(p0=0.02, p1=0.01)


def test_an_alarm_quarantines_like_strikes_and_survives_a_restart() -> None:
    book = StrikeBook(StrikePolicy())
    for i in range(6):  # answers that each pass alone (2 misses in 40 are inside the per-answer band) ...
        if book.record("hk", passed=True, at=float(i), positions=40, misses=2):
            break
    assert book.is_quarantined("hk") and book.records["hk"].alarms == 1  # ... but not together
    assert book.records["hk"].strikes == 0
    again = StrikeBook.from_json(StrikePolicy(), book.to_json())
    assert again.is_quarantined("hk") and again.records["hk"].positions == book.records["hk"].positions
    for i in range(5):  # clean answers release it, as after strikes
        again.record("hk", passed=True, at=10.0 + i, positions=40, misses=0)
    assert not again.is_quarantined("hk")
    with pytest.raises(ValueError):
        StrikeBook.from_json(StrikePolicy(), {"hk": {**book.to_json()["hk"], "evidence": float("nan")}})


def test_a_quarantined_miner_whose_evidence_alarms_again_starts_its_clean_run_over() -> None:
    book = StrikeBook(StrikePolicy(release_after=3))
    book.record("hk", passed=False, at=0.0)
    book.record("hk", passed=False, at=1.0)
    assert book.is_quarantined("hk")
    book.record("hk", passed=True, at=2.0, positions=40, misses=0)
    book.record("hk", passed=True, at=3.0, positions=40, misses=0)
    for i in range(6):  # passes, but misses keep coming: the alarm resets the run
        book.record("hk", passed=True, at=4.0 + i, positions=40, misses=2)
    assert book.is_quarantined("hk")
