"""Rounds, the trailing settlement window, and weights from settled scores."""

from __future__ import annotations

import math
import random

import pytest

from gateway.protocol.measurement import FailureReason, Measurement
from scoring.credit import CreditConfig
from scoring.rounds import RoundAccumulator, percentile
from scoring.settlement import Settlement
from scoring.weights import compute_weights, why_empty

CFG = CreditConfig()


def ok(hotkey: str, ttft: float, uid: int = 1, probe: bool = False) -> Measurement:
    # 8 tokens, under min_decode_tokens: decode is not judged, so credit is the TTFT credit.
    return Measurement(uid=uid, hotkey=hotkey, in_flight=0, prompt_tokens=0, max_tokens=8, ttft_s=ttft,
                       latency_s=ttft + 7 / 440.0, completion_tokens=8, ok=True, probe=probe)


def failed(hotkey: str, reason: FailureReason, uid: int = 1) -> Measurement:
    return Measurement(uid=uid, hotkey=hotkey, in_flight=0, prompt_tokens=0, max_tokens=64, ttft_s=None,
                       latency_s=0.05, completion_tokens=0, ok=False, failure=reason)


# -- rounds ------------------------------------------------------------------------------------------


def test_round_score_is_mean_credit_of_measured_requests() -> None:
    acc = RoundAccumulator(CFG)
    acc.add(ok("a", 0.2))  # 1.0
    acc.add(ok("a", 1.0, probe=True))  # 0.5
    acc.add(failed("a", FailureReason.TIMEOUT))  # 0.0
    acc.add(failed("a", FailureReason.BUSY))  # excluded
    acc.add(failed("a", FailureReason.CLIENT_DISCONNECT))  # excluded
    row = acc.miners["a"]
    assert row.requests == 5
    assert row.measured == 3
    assert row.score == pytest.approx(0.5)
    assert row.probes == 1 and row.organic == 4
    assert dict(row.failures) == {FailureReason.TIMEOUT: 1, FailureReason.BUSY: 1, FailureReason.CLIENT_DISCONNECT: 1}
    assert row.ttft_samples == [0.2, 1.0]
    assert acc.scores() == {"a": pytest.approx(0.5)}


def test_asked_but_nothing_completed_is_zero_and_unasked_is_absent() -> None:
    acc = RoundAccumulator(CFG)
    acc.add(failed("busy-only", FailureReason.BUSY))
    acc.add(failed("down", FailureReason.CONNECT))
    assert acc.scores() == {"busy-only": 0.0, "down": 0.0}
    assert "never-asked" not in acc.scores()


def test_round_keys_by_hotkey_and_keeps_latest_uid() -> None:
    acc = RoundAccumulator(CFG)
    acc.add(ok("a", 0.2, uid=3))
    acc.add(ok("a", 0.2, uid=4))
    acc.add(ok("b", 0.2, uid=3))
    assert set(acc.miners) == {"a", "b"}
    assert acc.miners["a"].uid == 4


def test_ttft_percentiles() -> None:
    rng = random.Random(5)
    xs = [rng.uniform(0, 1) for _ in range(1001)]
    acc = RoundAccumulator(CFG)
    for x in xs:
        acc.add(ok("a", x))
    s = sorted(xs)
    assert acc.miners["a"].ttft_p50 == pytest.approx(s[500])
    assert acc.miners["a"].ttft_p95 == pytest.approx(s[950])
    assert percentile([], 50) is None
    assert percentile([2.0], 95) == 2.0
    assert percentile([1.0, 3.0], 50) == pytest.approx(2.0)


# -- settlement --------------------------------------------------------------------------------------


def test_settled_is_window_mean_with_missing_rounds_zero() -> None:
    s = Settlement(window=4)
    s.push({"a": 1.0, "b": 0.5})
    s.push({"a": 1.0})
    assert s.settled() == {"a": pytest.approx(1.0), "b": pytest.approx(0.25)}
    s.push({"a": 0.5, "b": 1.0})
    s.push({})
    assert s.settled() == {"a": pytest.approx(2.5 / 4), "b": pytest.approx(1.5 / 4)}


def test_vanished_miner_decays_to_zero_within_the_window() -> None:
    window = 12
    s = Settlement(window=window)
    for _ in range(window):
        s.push({"a": 1.0, "gone": 1.0})
    assert s.settled()["gone"] == pytest.approx(1.0)
    previous = 1.0
    for k in range(1, window):
        s.push({"a": 1.0})
        now = s.settled()["gone"]
        assert now == pytest.approx((window - k) / window)
        assert now < previous
        previous = now
    s.push({"a": 1.0})
    assert "gone" not in s.settled()
    assert s.settled()["a"] == pytest.approx(1.0)


def test_uid_whose_hotkey_changed_starts_from_nothing() -> None:
    """UID 7 was 'old'; it is re-registered to 'new'. The new hotkey inherits nothing."""
    acc_old = RoundAccumulator(CFG)
    for _ in range(3):
        acc_old.add(ok("old", 0.2, uid=7))
    s = Settlement(window=4)
    for _ in range(4):
        s.push(acc_old.scores())
    acc_new = RoundAccumulator(CFG)
    acc_new.add(ok("new", 1.0, uid=7))  # credit 0.5
    s.push(acc_new.scores())
    settled = s.settled()
    assert settled["new"] == pytest.approx(0.5 / 4)
    assert settled["old"] == pytest.approx(3 / 4)
    # With the metagraph now mapping uid 7 to "new", only the new hotkey is paid, at its own score.
    w = compute_weights(settled, {"new": 7, "other": 8})
    assert w == {7: pytest.approx(1.0)}
    assert compute_weights({"old": settled["old"], "x": 0.5}, {"new": 7, "x": 2}) == {2: pytest.approx(1.0)}


def test_settlement_window_validation_and_clamping() -> None:
    with pytest.raises(ValueError):
        Settlement(window=0)
    s = Settlement(window=2, history=[{"a": math.nan, "b": 7.0, "c": -1.0}])
    assert s.settled() == {"a": 0.0, "b": 1.0, "c": 0.0}
    assert Settlement().settled() == {}


def test_history_longer_than_window_keeps_latest() -> None:
    s = Settlement(window=3, history=[{"a": 1.0}, {"a": 1.0}, {"b": 1.0}, {"b": 1.0}, {"b": 1.0}])
    assert s.settled() == {"b": pytest.approx(1.0)}
    assert len(s) == 3


# -- weights -----------------------------------------------------------------------------------------


def test_weights_proportional_to_settled_scores() -> None:
    rng = random.Random(99)
    settled = {f"hk{i}": rng.uniform(0.01, 1.0) for i in range(50)}
    h2u = {f"hk{i}": i + 100 for i in range(50)}
    w = compute_weights(settled, h2u)
    assert sum(w.values()) == pytest.approx(1.0)
    total = sum(settled.values())
    for i in range(50):
        assert w[i + 100] == pytest.approx(settled[f"hk{i}"] / total)
    # Ratios are preserved pairwise.
    assert w[100] / w[101] == pytest.approx(settled["hk0"] / settled["hk1"])


def test_weights_drop_unregistered_zero_and_bad_scores() -> None:
    settled = {"a": 0.6, "b": 0.2, "gone": 0.9, "zero": 0.0, "nan": math.nan, "neg": -1.0, "inf": math.inf}
    h2u = {"a": 1, "b": 2, "zero": 3, "nan": 4, "neg": 5, "inf": 6}
    assert compute_weights(settled, h2u) == {1: pytest.approx(0.75), 2: pytest.approx(0.25)}


def test_all_zero_gives_empty_and_a_reason() -> None:
    assert compute_weights({}, {"a": 1}) == {}
    assert "no miner" in why_empty({}, {"a": 1})
    assert compute_weights({"a": 0.0, "b": 0.0}, {"a": 1, "b": 2}) == {}
    assert "settled at 0" in why_empty({"a": 0.0, "b": 0.0}, {"a": 1, "b": 2})
    assert compute_weights({"gone": 1.0}, {"a": 1}) == {}
    assert "metagraph" in why_empty({"gone": 1.0}, {"a": 1})
