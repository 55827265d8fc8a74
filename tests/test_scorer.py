"""The scorer: reports, routing credits, weights, persistence and restore-on-start."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.protocol.measurement import FailureReason, Measurement, MeasurementSink
from scoring.capacity import UNMEASURED
from scoring.credit import CreditConfig
from scoring.scorer import Scorer
from scoring.store import ScoreStore

ROUND_S = 300.0


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def ok(hotkey: str, uid: int, ttft: float, probe: bool = False) -> Measurement:
    # 8 tokens, under min_decode_tokens: decode is not judged, so credit is the TTFT credit.
    return Measurement(uid=uid, hotkey=hotkey, in_flight=0, prompt_tokens=0, max_tokens=8, ttft_s=ttft,
                       latency_s=ttft + 7 / 440.0, completion_tokens=8, ok=True, probe=probe)


def failed(hotkey: str, uid: int, reason: FailureReason) -> Measurement:
    return Measurement(uid=uid, hotkey=hotkey, in_flight=0, prompt_tokens=0, max_tokens=64, ttft_s=None,
                       latency_s=0.05, completion_tokens=0, ok=False, failure=reason)


def play_round(s: Scorer, clock: Clock, per_miner: dict[tuple[str, int], list[float]],
               store: ScoreStore | None = None):
    """One round; with a store, persisted as the validator does it (``store.save_round(*report.saved)``)."""
    for (hk, uid), ttfts in per_miner.items():
        for t in ttfts:
            s.record(ok(hk, uid, t))
    clock.t += ROUND_S
    report = s.close_round(clock.t)
    if store is not None:
        assert report.saved is not None
        store.save_round(*report.saved)
    return report


def restored(store: ScoreStore, **kw) -> Scorer:
    s = Scorer(CreditConfig(), **kw)
    s.restore(store)
    return s


def test_scorer_is_a_measurement_sink_that_never_raises() -> None:
    s: MeasurementSink = Scorer(CreditConfig())
    s.record(None)  # type: ignore[arg-type]
    s.record(object())  # type: ignore[arg-type]
    s.record(ok("a", 1, 0.2))
    assert isinstance(s, Scorer)
    report = s.close_round(1.0)
    assert report.dropped == 2
    assert [r.hotkey for r in report.rows] == ["a"]
    assert "could not be recorded" in report.format_table()


def test_report_rows() -> None:
    clock = Clock()
    s = Scorer(CreditConfig(), clock=clock)
    s.record(ok("a", 1, 0.2, probe=True))
    s.record(ok("a", 1, 1.0))
    s.record(failed("a", 1, FailureReason.TIMEOUT))
    s.record(failed("a", 1, FailureReason.BUSY))
    s.record(failed("b", 2, FailureReason.TIMEOUT))
    assert s.pending == 2
    report = s.close_round(clock.t)
    assert report.index == 1 and report.ended_at == clock.t
    rows = report.by_hotkey()
    a = rows["a"]
    assert (a.uid, a.requests, a.measured, a.probes, a.organic) == (1, 4, 3, 1, 3)
    assert a.credit == pytest.approx(0.5)  # (1.0 + 0.5 + 0.0) / 3; the 429 is excluded
    assert a.ttft_p50 == pytest.approx(0.6) and a.ttft_p95 == pytest.approx(0.96)
    assert a.failures == {FailureReason.TIMEOUT: 1, FailureReason.BUSY: 1}
    assert a.settled == pytest.approx(0.5)
    b = rows["b"]
    assert (b.requests, b.measured, b.credit, b.ttft_p50) == (1, 1, 0.0, None)
    assert s.pending == 0
    assert s.close_round(clock.t + 1).index == 2


def test_routing_latest_round_and_settled_for_unasked_miners() -> None:
    clock = Clock()
    s = Scorer(CreditConfig(), window=4, clock=clock)
    play_round(s, clock, {("a", 1): [0.2], ("b", 2): [0.2], ("c", 3): [1.5]})
    # no capacity check ran: every credit is routed at the unmeasured multiplier
    assert s.routing_scores() == {"a": UNMEASURED, "b": UNMEASURED, "c": 0.0}
    play_round(s, clock, {("a", 1): [1.0]})  # a slows down; b and c got no requests
    r = s.routing_scores()
    assert r["a"] == pytest.approx(0.5 * UNMEASURED)  # latest round wins over a's settled 0.75
    assert r["b"] == pytest.approx(0.5 * UNMEASURED)  # settled: (1 + 0) / 2
    assert r["c"] == 0.0  # a failing miner stays at 0, it does not fall back to the prior
    assert s.settled() == {"a": pytest.approx(0.75), "b": pytest.approx(0.5), "c": 0.0}
    for _ in range(3):
        play_round(s, clock, {("a", 1): [0.2]})
    assert set(s.routing_scores()) == {"a"}  # b and c left the window: routed at the prior again


def test_weights_follow_settled_and_current_metagraph() -> None:
    clock = Clock()
    s = Scorer(CreditConfig(), window=3, clock=clock)
    play_round(s, clock, {("a", 1): [0.2], ("b", 2): [1.0], ("old", 7): [0.2]})
    w = s.weights({"a": 1, "b": 2, "new": 7})  # uid 7 re-registered to "new"
    assert w == {1: pytest.approx(2 / 3), 2: pytest.approx(1 / 3)}
    assert s.weights({"x": 9}) == {}
    table = s.close_round(clock.t + 1).format_table(weights=w)
    assert "0.667" in table and "0.333" in table


def test_format_table() -> None:
    clock = Clock()
    s = Scorer(CreditConfig(), clock=clock)
    report = play_round(s, clock, {("5FHneW46xGXgs5mUiveU4sbTyGBzmstUspZC92UhjJM694ty", 12): [0.25, 0.75]})
    table = report.format_table(weights={12: 1.0})
    lines = table.splitlines()
    assert lines[0].startswith("round 1")
    for col in ("uid", "req", "ttft50", "credit", "settled", "cards", "work_s", "value", "weight"):
        assert col in lines[1]
    row = lines[2].split()
    assert row[0] == "12" and row[1] == "5FHne..694ty"
    assert row[2] == "2" and row[4] == "0.500"  # requests, ttft p50
    assert row[6] == "0.875" and row[7] == "0.875" and row[8] == "0.50" and row[11] == "1.000"  # 0.50: unmeasured
    assert row[9] == "0.04"  # two answers of 8 tokens at 440 tok/s: 0.036 card-seconds
    assert float(row[10]) == pytest.approx(2 * 8 / 440 * 0.875 / ROUND_S, abs=1e-5)
    assert report.format_table().splitlines()[2].split()[11] == "-"


def test_rounds_are_persisted(tmp_path: Path) -> None:
    clock = Clock()
    with ScoreStore(tmp_path) as st:
        s = restored(st, clock=clock)
        play_round(s, clock, {("a", 1): [0.2, 0.2], ("b", 2): [1.0]}, st)
        play_round(s, clock, {("a", 1): [0.2]}, st)
        rounds = st.load_rounds(12)
        assert [r.index for r in rounds] == [1, 2]
        assert rounds[0].scores() == {"a": 1.0, "b": pytest.approx(0.5)}
        assert rounds[1].scores() == {"a": 1.0}  # b had no requests: absent, settled as 0
        assert rounds[0].miners[0].requests == 2
        routing, at = st.routing_credits()
        assert routing == s.routing_scores() and at == clock.t


def test_restore_recent_state_without_paying_missed_rounds(tmp_path: Path) -> None:
    clock = Clock()
    with ScoreStore(tmp_path) as st:
        s1 = restored(st, window=12, clock=clock, restore_max_age_s=3600)
        play_round(s1, clock, {("a", 1): [0.2], ("b", 2): [1.0]}, st)
        play_round(s1, clock, {("a", 1): [0.2], ("b", 2): [0.2]}, st)
        play_round(s1, clock, {("a", 1): [1.0]}, st)
        settled_before, routing_before = s1.settled(), s1.routing_scores()
    assert settled_before == {"a": pytest.approx(2.5 / 3), "b": pytest.approx(1.5 / 3)}

    clock.t += 1800  # down for 30 minutes: six rounds that never ran
    with ScoreStore(tmp_path) as st:
        s2 = restored(st, window=12, clock=clock, restore_max_age_s=3600)
        assert s2.restored
        assert s2.settled() == settled_before  # not diluted by the downtime
        assert s2.routing_scores() == routing_before  # routable at once
        assert s2.weights({"a": 1, "b": 2}) == {1: pytest.approx(2.5 / 4), 2: pytest.approx(1.5 / 4)}
        report = play_round(s2, clock, {("a", 1): [0.2]}, st)
        assert report.index == 4  # rounds continue; none invented for the downtime
        assert s2.settled() == {"a": pytest.approx(3.5 / 4), "b": pytest.approx(1.5 / 4)}
        assert [r.index for r in st.load_rounds(100)] == [1, 2, 3, 4]


def test_restore_skips_stale_state_but_keeps_it_on_disk(tmp_path: Path) -> None:
    clock = Clock()
    with ScoreStore(tmp_path) as st:
        s1 = restored(st, clock=clock)
        play_round(s1, clock, {("a", 1): [0.2]}, st)
        play_round(s1, clock, {("a", 1): [0.2]}, st)
    clock.t += 7200
    with ScoreStore(tmp_path) as st:
        s2 = restored(st, clock=clock, restore_max_age_s=3600)
        assert not s2.restored
        assert s2.settled() == {} and s2.routing_scores() == {}
        assert s2.weights({"a": 1}) == {}
        report = play_round(s2, clock, {("b", 2): [0.2]}, st)
        assert report.index == 3
        assert s2.settled() == {"b": 1.0}
        assert [r.index for r in st.load_rounds(100)] == [1, 2, 3]


def test_restore_window_is_bounded(tmp_path: Path) -> None:
    clock = Clock()
    with ScoreStore(tmp_path) as st:
        s1 = restored(st, window=3, clock=clock)
        play_round(s1, clock, {("old", 1): [0.2]}, st)
        for _ in range(3):
            play_round(s1, clock, {("a", 2): [0.2]}, st)
    with ScoreStore(tmp_path) as st:
        s2 = restored(st, window=3, clock=clock)
        assert s2.settled() == {"a": 1.0}


def test_a_round_with_nothing_measured_does_not_route_a_miner_at_zero() -> None:
    """Only truthful 429s and clients that left (a round cut short at a stop): the round says nothing of the miner."""
    clock = Clock()
    s = Scorer(CreditConfig(), window=4, clock=clock)
    play_round(s, clock, {("a", 1): [0.2], ("b", 2): [0.2]})
    s.record(failed("a", 1, FailureReason.BUSY))
    s.record(failed("a", 1, FailureReason.CLIENT_DISCONNECT))
    s.record(ok("b", 2, 0.2))
    clock.t += ROUND_S
    s.close_round(clock.t)
    r = s.routing_scores()
    assert s.settled()["a"] > 0.0
    assert r["a"] == pytest.approx(s.settled()["a"] * UNMEASURED)  # its settled credit, not the round's 0
    assert r["b"] == pytest.approx(1.0 * UNMEASURED)
