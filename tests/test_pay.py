"""Pay for verified work (issue 14): what a request is worth, what a round is worth, who cannot game it."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from gateway.metering import StreamMeter
from gateway.protocol.measurement import FailureReason, Measurement
from gateway.protocol.sse import ChunkFramer, frame
from scoring.credit import CreditConfig, request_credit
from scoring.pay import paid_tokens, peak_decode_rate, round_value, work_s
from scoring.rounds import SHOWN_SPEED_MIN, RoundAccumulator
from scoring.scorer import Scorer

CFG = CreditConfig()
ROUND_S = 60.0


def answer(hk: str = "a", *, tokens: int = 64, max_tokens: int = 64, ttft: float = 0.3, rate: float = 440.0,
           concurrency: float = 1.0, probe: bool = False, finish: str = "length", audited: bool = False,
           slots: int = 4, prompt: int = 0) -> Measurement:
    return Measurement(uid=1, hotkey=hk, in_flight=0, prompt_tokens=prompt, max_tokens=max_tokens, ttft_s=ttft,
                       latency_s=ttft + (tokens - 1) / rate, completion_tokens=tokens, ok=True, probe=probe,
                       concurrency=concurrency, finish_reason=finish, audited=audited, slots=slots)


def test_work_is_card_time_of_paid_tokens_and_prompt() -> None:
    assert peak_decode_rate(CFG) == 440.0
    m = answer(tokens=64, prompt=2400)
    assert work_s(m, CFG, audits=True) == pytest.approx(64 / 440 + 2400 / 24000)
    # a long prompt is paid the prefill time it takes, no more: 10x the prompt is +0.9 card-seconds
    assert work_s(answer(prompt=24000, ttft=1.5), CFG, audits=True) - work_s(answer(prompt=2400), CFG, audits=True) == \
        pytest.approx(0.9)


def test_probes_failures_and_unconfirmed_early_stops_are_not_paid() -> None:
    assert paid_tokens(answer(probe=True), audits=True) == 0
    failed = dataclasses.replace(answer(), ok=False, failure=FailureReason.DROPPED)
    assert paid_tokens(failed, audits=True) == 0
    early = answer(tokens=2, finish="stop")
    assert early.stopped_early
    assert paid_tokens(early, audits=True) == 0  # two tokens and stop: worth nothing until an audit says so
    assert paid_tokens(dataclasses.replace(early, audited=True), audits=True) == 2
    assert paid_tokens(early, audits=False) == 2  # a validator without a reference cannot tell: paid as measured
    assert paid_tokens(answer(tokens=64, finish="stop"), audits=True) == 64  # stop at max_tokens is not early
    assert paid_tokens(answer(tokens=80, max_tokens=64), audits=True) == 64  # never past max_tokens


def test_free_draws_are_not_paid_where_the_validator_audits() -> None:
    """A sampled answer from a miner that declared no subnet sampler can only be judged plausible: unpaid (issue 25).
    Declaring none never earns more than running the sampler: the same traffic, half greedy, pays half."""
    free = dataclasses.replace(answer(), free_draw=True)
    assert paid_tokens(free, audits=True) == 0
    assert paid_tokens(free, audits=False) == 64  # no reference: nothing is checked, everything paid as measured
    declared, undeclared = RoundAccumulator(CFG, audits=True), RoundAccumulator(CFG, audits=True)
    for i in range(20):
        sampled = i % 2 == 0  # greedy answers are determined whatever the sampler: never free draws
        declared.add(answer("a", audited=True))
        undeclared.add(dataclasses.replace(answer("b", audited=True), free_draw=sampled))
    a, b = declared.miners["a"], undeclared.miners["b"]
    assert b.free_draws == 10 and a.free_draws == 0
    assert b.work_s == pytest.approx(a.work_s / 2)
    assert a.score == b.score  # quality is judged the same: only what is paid differs


def test_answers_no_audit_can_check_earn_nothing_and_junk_on_them_raises_no_credit() -> None:
    """Issue 27: tools, JSON mode, logit_bias, ... say what they are, and no audit can check the answers. The cheapest
    cheat: serve the rest honestly and junk on those, at once. Same traffic for both, 30 % of it such requests:
    the honest card answers them at its loaded speed, the cheater instantly. Neither is paid for them, and the junk
    does not lift the credit that multiplies the rest of the cheater's pay (credited, it made 1.56x the honest
    card's value)."""
    skipped = dataclasses.replace(answer(), skipped="tools")
    assert paid_tokens(skipped, audits=True) == 0
    assert paid_tokens(skipped, audits=False) == 64  # no reference: nothing is checked, everything paid as measured
    honest, cheat = RoundAccumulator(CFG, audits=True), RoundAccumulator(CFG, audits=True)
    for i in range(100):
        plain = i % 10 >= 3
        base = answer(ttft=0.7, rate=300.0, concurrency=1.0)  # a loaded card's plain answer, the same for both
        honest.add(dataclasses.replace(base, hotkey="h") if plain else
                   dataclasses.replace(answer("h", ttft=0.7, rate=300.0), skipped="tools"))
        cheat.add(dataclasses.replace(base, hotkey="c") if plain else
                  dataclasses.replace(answer("c", ttft=0.001, rate=50_000.0), skipped="tools"))
    h, c = honest.miners["h"], cheat.miners["c"]
    assert h.skipped == c.skipped == 30 and h.measured == c.measured == 70
    assert c.work_s == pytest.approx(h.work_s) and c.score == pytest.approx(h.score)
    assert round_value(c.work_s, c.score, ROUND_S) <= round_value(h.work_s, h.score, ROUND_S)
    failed = dataclasses.replace(skipped, ok=False, failure=FailureReason.DROPPED)
    acc = RoundAccumulator(CFG, audits=True)
    assert acc.add(failed) == 0.0  # failing such a request still costs credit: the user saw it


def test_round_value_is_work_times_quality_per_round_second() -> None:
    assert round_value(30.0, 0.5, 60.0) == pytest.approx(0.25)
    assert round_value(30.0, 1.7, 60.0) == pytest.approx(0.5)  # quality is a credit: at most 1
    for bad in ((float("nan"), 1.0, 60.0), (1.0, 1.0, 0.0), (-5.0, 1.0, 60.0), (1.0, float("inf"), 60.0)):
        assert round_value(*bad) == 0.0


def test_splitting_chunks_without_ids_earns_nothing() -> None:
    """Half a token per chunk (no ids): counted by characters / 4, not by chunks."""
    def meter_for(pieces: list[str]) -> StreamMeter:
        f = ChunkFramer("c", 1, "m")
        meter = StreamMeter(max_tokens=200, started_at=0.0)
        for i, p in enumerate(pieces):
            meter.feed(f.content(p), now=0.1 + i * 0.01)
        meter.feed(frame(f.chunk({}, "length")) + b"data: [DONE]\n\n", now=1.0)
        return meter

    words = [f" w{i:03d}" for i in range(40)]  # 40 words of 5 characters
    whole = meter_for(words)
    halves = meter_for([h for w in words for h in (w[:2], w[2:])])
    assert whole.tokens == 40 and halves.tokens == 80  # chunks: what the meter used to pay
    assert whole.countable_tokens == halves.countable_tokens == 50  # 200 characters / 4, however chunked
    with_ids = StreamMeter(max_tokens=200, started_at=0.0)
    f = ChunkFramer("c", 1, "m")
    for i, w in enumerate(words):
        with_ids.feed(f.tokens(w, [i]), now=0.1 + i * 0.01)
    assert with_ids.countable_tokens == 40  # ids are counted as they are (the audit checks them)


def test_a_client_left_hanging_past_the_ttft_band_is_the_miners_timeout() -> None:
    gone = Measurement(uid=1, hotkey="a", in_flight=0, prompt_tokens=0, max_tokens=64, ttft_s=None, latency_s=0.3,
                       completion_tokens=0, ok=False, failure=FailureReason.CLIENT_DISCONNECT)
    assert request_credit(gone, CFG) is None  # left within the band: the client's own business
    hung = dataclasses.replace(gone, latency_s=CFG.zero_band_s + 0.01)
    assert request_credit(hung, CFG) == 0.0
    prefill = dataclasses.replace(hung, prompt_tokens=48000)  # 2 s of prefill allowance: not late yet
    assert request_credit(prefill, CFG) is None


def test_load_allowance_needs_shown_speed_and_stops_at_declared_slots() -> None:
    """Load from other validators: a card that has shown full speed is judged at its declared slots."""
    loaded_rate = 300.0 / 2  # one invisible stream shares the card

    def long(hk: str, *, rate: float, slots: int = 4) -> Measurement:
        # 256 tokens, first token at the band's edge: on time exactly when the rate is the expected one
        return answer(hk, tokens=256, max_tokens=256, ttft=CFG.full_band_s, rate=rate, slots=slots)

    acc = RoundAccumulator(CFG)
    for _ in range(5):
        acc.add(long("shown", rate=loaded_rate))
    assert acc.miners["shown"].score == 0.0  # 150 tok/s against 440 expected at concurrency 1
    for _ in range(SHOWN_SPEED_MIN):
        acc.add(long("shown", rate=440.0))
    assert acc.miners["shown"].allowed_load and acc.miners["shown"].score == pytest.approx(1.0)
    # a card that is never fast gets no allowance: a slow card cannot hide behind invisible load
    slow = RoundAccumulator(CFG)
    for _ in range(10):
        slow.add(long("slow", rate=loaded_rate))
    assert not slow.miners["slow"].allowed_load and slow.miners["slow"].score == 0.0
    # the allowance stops at the slots it declares: 2 slots cannot excuse a card shared 8 ways
    over = RoundAccumulator(CFG)
    for _ in range(SHOWN_SPEED_MIN):
        over.add(long("over", rate=440.0, slots=2))
    for _ in range(5):
        over.add(long("over", rate=300.0 / 8, slots=2))
    assert over.miners["over"].allowed_load
    assert over.miners["over"].score == pytest.approx(SHOWN_SPEED_MIN / (SHOWN_SPEED_MIN + 5))


def test_the_load_allowance_counts_the_speed_shown_over_two_rounds_and_no_more() -> None:
    """Issue 38: a round of two user requests found a loaded honest card busy both times and credited it 0.33 (0.06
    off its settled credit), one round after it had shown its full speed four times. The round after still allows for
    the load; the one after that, with no speed shown again, does not (a card keeps it only by showing its speed)."""
    loaded = answer("card", tokens=256, max_tokens=256, ttft=CFG.full_band_s, rate=300.0 / 2, slots=4)
    fast = dataclasses.replace(loaded, latency_s=CFG.full_band_s + 255 / 440.0)
    scorer = Scorer(CFG)
    for _ in range(SHOWN_SPEED_MIN):
        scorer.record(fast)
    scorer.close_round(round_s=60.0)
    scores = []
    for _ in range(2):
        for _ in range(2):
            scorer.record(loaded)
        scores.append(scorer.close_round(round_s=60.0).rows[0].credit)
    assert scores == [pytest.approx(1.0), 0.0]
    # one fast answer in each of two rounds is the two the allowance asks for; one in one round is not
    for _ in range(SHOWN_SPEED_MIN - 1):
        scorer.record(fast)
    scorer.record(loaded)
    assert scorer.close_round(round_s=60.0).rows[0].credit == pytest.approx(0.5)  # one fast, one judged alone: 0
    scorer.record(fast)
    scorer.record(loaded)
    assert scorer.close_round(round_s=60.0).rows[0].credit == pytest.approx(1.0)  # two over two rounds: allowed


def test_one_card_split_across_hotkeys_earns_what_it_earns_as_one() -> None:
    rng = random.Random(3)
    one, split = Scorer(CFG), Scorer(CFG)
    for _ in range(3):
        for _ in range(40):  # same work in both runs: 40 answers of the card, 40 of an honest neighbour
            n = rng.choice((32, 64, 128))
            one.record(answer("card", tokens=n, max_tokens=128))
            split.record(answer(rng.choice(["s1", "s2", "s3", "s4"]), tokens=n, max_tokens=128))
            m = answer("honest", tokens=n, max_tokens=128)
            one.record(m)
            split.record(m)
        one.close_round(round_s=ROUND_S)
        split.close_round(round_s=ROUND_S)
    w_one = one.weights({"card": 1, "honest": 2})
    w_split = split.weights({"s1": 1, "s2": 3, "s3": 4, "s4": 5, "honest": 2})
    assert w_one[1] == pytest.approx(0.5)
    assert sum(w_split[u] for u in (1, 3, 4, 5)) == pytest.approx(w_one[1])


def test_a_miner_that_serves_only_probes_earns_nothing() -> None:
    s = Scorer(CFG)
    for _ in range(10):
        s.record(answer("probe-only", probe=True))
        s.record(failed := dataclasses.replace(answer("probe-only"), ok=False, failure=FailureReason.REFUSED,
                                               ttft_s=None, completion_tokens=0))
        s.record(answer("honest"))
    assert failed.failure is not None and failed.failure.blames_miner
    report = s.close_round(round_s=ROUND_S)
    rows = report.by_hotkey()
    assert rows["probe-only"].credit == pytest.approx(0.5)  # its probes were perfect, its refusals 0
    assert rows["probe-only"].work_s == 0.0 and rows["probe-only"].value == 0.0
    assert s.weights({"probe-only": 1, "honest": 2}) == {2: 1.0}


def test_value_survives_a_restart(tmp_path) -> None:
    from scoring.store import ScoreStore

    t = [1_000_000.0]
    with ScoreStore(tmp_path) as st:
        s = Scorer(CFG, clock=lambda: t[0])
        s.restore(st)
        for _ in range(20):
            s.record(answer("a"))
        t[0] += ROUND_S
        st.save_round(*s.close_round().saved)  # type: ignore[misc]
        before = s.settled_values()
        assert before["a"] == pytest.approx(20 * 64 / 440 / ROUND_S)
        again = Scorer(CFG, clock=lambda: t[0])
        assert again.restore(st)
        assert again.settled_values() == pytest.approx(before)


# -- issue 23: numbers the miner chooses ----------------------------------------------------------------


def held(m: Measurement) -> Measurement:
    """The same answer with its first token held back and everything sent in one burst at the end."""
    return dataclasses.replace(m, ttft_s=m.latency_s, concurrency=None)


@pytest.mark.parametrize("rate", [440.0, 300.0, 220.0, 150.0])
@pytest.mark.parametrize("tokens", [64, 128, 512])
def test_holding_the_first_token_never_raises_credit(rate: float, tokens: int) -> None:
    """A card of any speed earns at most its streaming credit by holding its answer and bursting it."""
    honest = answer(tokens=tokens, max_tokens=tokens, ttft=0.45, rate=rate)
    assert (request_credit(held(honest), CFG) or 0.0) <= (request_credit(honest, CFG) or 0.0) + 1e-9
    acc_h, acc_b = RoundAccumulator(CFG), RoundAccumulator(CFG)
    for _ in range(5):
        acc_h.add(honest)
        acc_b.add(held(honest))
        acc_h.add(dataclasses.replace(honest, capacity_check=True))
        acc_b.add(dataclasses.replace(held(honest), capacity_check=True))
    assert acc_h.miners["a"].measured == acc_b.miners["a"].measured == 5  # the check streams are read, not credited
    assert acc_b.miners["a"].score <= acc_h.miners["a"].score + 1e-9
    # the capacity check reads no more from the burst than from the stream: the burst shows no extra cards (and a
    # burst whose first token came after the TTFT band's zero delivers nothing at all: scoring.rounds)
    held_rates, streamed = acc_b.miners["a"].capacity_rates, acc_h.miners["a"].capacity_rates
    assert len(held_rates) == len(streamed) == 5
    assert all(b <= h + 1e-9 for b, h in zip(held_rates, streamed, strict=True)), (held_rates, streamed)


def test_a_half_speed_card_is_judged_by_when_its_answer_is_complete() -> None:
    """Issue 23's burst cheat: before, holding turned credit ~0 into 1. The clock starts at dispatch now."""
    streamed = answer(tokens=256, max_tokens=256, ttft=0.45, rate=220.0)
    # complete at (0.5 + 255/440) / (0.45 + 255/220) = 0.67 of an honest card's time: partial credit
    assert request_credit(streamed, CFG) == pytest.approx((1.0795 / 1.6091 - 0.5) / 0.3, abs=1e-3)
    assert request_credit(held(streamed), CFG) == 0.0  # the burst: its first token 1.6 s late, decode unchanged
    fast = answer(tokens=256, max_tokens=256, ttft=0.45, rate=440.0)
    assert request_credit(fast, CFG) == 1.0 and (request_credit(held(fast), CFG) or 0.0) < 0.5  # held: TTFT 1.03 s


def test_unaudited_pay_is_held_until_an_audit_passes_and_forfeited_by_a_failure() -> None:
    from scoring.pay import PayWindow, RoundPay

    w = PayWindow(4)
    w.push({"a": RoundPay(verified=0.0, unverified=0.8), "b": RoundPay(verified=0.1, unverified=0.8, passed=2)})
    assert w.settled() == {"a": 0.0, "b": pytest.approx(0.9)}  # a: nothing confirmed yet, held
    w.push({"a": RoundPay(verified=0.1, unverified=0.8, passed=1)})
    assert w.settled()["a"] == pytest.approx((0.1 + 1.6) / 2)  # one audit passed: the held pay is paid
    w.push({"b": RoundPay(verified=0.1, unverified=0.8, passed=3, failed=1)})
    assert w.settled()["b"] == pytest.approx((0.9 + 0.1) / 3)  # one failure forfeits its own round's unaudited pay
    w.push({"b": RoundPay(verified=0.1, unverified=0.8, passed=3, failed=1)})
    assert w.settled()["b"] == pytest.approx((0.1 + 0.1 + 0.1) / 4)  # a second one in the window: all of it
    w.push({"a": RoundPay(verified=0.2, unverified=0.8, passed=5, quarantined=True)})
    assert w.settled()["a"] == 0.0  # quarantined at a close in the window: the window settles at 0
    for _ in range(3):
        w.push({"a": RoundPay(verified=0.2, unverified=0.8, passed=5)})
    assert w.settled()["a"] == 0.0  # still in the window
    w.push({"a": RoundPay(verified=0.2, unverified=0.8, passed=5)})
    assert w.settled()["a"] == pytest.approx(1.0)  # the quarantined round left the window
    w.push({"a": RoundPay(verified=float("nan"), unverified=-3.0, passed=1)})
    assert math.isfinite(w.settled()["a"])


def test_a_round_routed_before_the_first_capacity_check_is_paid_at_the_card_share() -> None:
    """Issue 38: an ``unmeasured`` round waits for the hotkey's first reading and is paid at its share of a card, never
    more than in full; other rounds are not touched."""
    from scoring.pay import PayWindow, RoundPay

    w = PayWindow(2)
    w.push({"new": RoundPay(verified=0.4, unmeasured=True), "old": RoundPay(verified=0.4)})
    assert w.settled() == {"new": 0.0, "old": pytest.approx(0.4)}  # held: no reading yet
    assert w.settled({"new": 0.25, "old": 0.25}) == {"new": pytest.approx(0.1), "old": pytest.approx(0.4)}
    assert w.settled({"new": 2.0})["new"] == pytest.approx(0.4)  # two cards behind it: paid in full, no more
    assert w.settled({"new": float("nan")})["new"] == 0.0
    w.push({"new": RoundPay(verified=0.1, unverified=0.4, passed=1, unmeasured=True)})
    assert w.settled({"new": 0.5})["new"] == pytest.approx((0.2 + 0.25) / 2)  # verified and unverified alike
    w.push({"new": RoundPay(verified=0.4)})
    assert w.settled({"new": 0.5})["new"] == pytest.approx((0.25 + 0.4) / 2)


def test_junk_served_to_users_is_not_paid_when_probes_pass() -> None:
    """Honest to probes, junk to users: one failed audit of a user's answer forfeits all it served unaudited."""
    s = Scorer(CFG, window=3, audits=True)
    for _ in range(3):
        for hk in ("cheat", "unconfirmed", "honest"):
            s.record(answer(hk, probe=True, audited=True))  # probes: audited, passed
            for _ in range(9):
                s.record(answer(hk))  # users' answers nobody looked at
        s.record(dataclasses.replace(answer("cheat"), ok=False, failure=FailureReason.AUDIT_FAILED, audited=True))
        s.record(answer("cheat", audited=True))  # and some of its users' answers pass: it serves junk now and then
        s.record(answer("honest", audited=True))  # one of its users' answers was audited and passed
        s.close_round(round_s=ROUND_S)
    values = s.settled_values()
    # the cheat keeps only the answers an audit verified: a tenth of what the honest miner settles, at most
    assert values["honest"] > 0.0 and values["cheat"] < 0.1 * values["honest"]
    assert values["unconfirmed"] == 0.0  # passing probes releases nothing: only a user's answer confirms


def test_a_prompt_is_paid_no_more_prefill_than_the_time_to_first_token_shows() -> None:
    """The self-dealer (issue 23): its own 4,000-token prompts answered at once, precomputed."""
    honest = answer(prompt=4000, ttft=0.62)
    assert work_s(honest, CFG, audits=False) == pytest.approx(64 / 440 + 4000 / 24000)  # 0.17 s of prefill < TTFT
    instant = answer(prompt=4000, ttft=0.001)
    assert work_s(instant, CFG, audits=False) == pytest.approx(64 / 440 + 0.001)
