"""Audit verdicts, strikes and the sampling policy: pure rules, each checked on both sides of its band."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import numpy as np
import pytest

from gateway.protocol.measurement import Answer, FailureReason, Measurement
from gateway.protocol.sampling import SamplingParams
from scoring.audit import (
    AuditBands,
    AuditFailure,
    CheckedIds,
    ForcedScores,
    StrikeBook,
    StrikePolicy,
    Verdict,
    apply_verdict,
    check_ids,
    check_logprobs,
    chosen_logprobs,
    judge,
    should_audit,
)

PIECES = {1: b"", 106: b"", 5: b"Hel", 6: b"lo", 7: b" world", 8: b"\xe2\x82", 9: b"\xac"}
STOPS = frozenset({1, 106})


def piece(t: int) -> bytes:
    return PIECES.get(t, b"?")


def answer(text: str = "Hello world", ids: tuple[int, ...] | None = (5, 6, 7), *, temperature: float = 0.0,
           finish: str = "stop", max_tokens: int = 16, stop: tuple[str, ...] = ()) -> Answer:
    return Answer(messages=[{"role": "user", "content": "hi"}], sampling=SamplingParams(temperature=temperature),
                  max_tokens=max_tokens, stop=stop, text=text, token_ids=ids, finish_reason=finish)


def scores(n: int, *, gap: float = 0.0, z_shift: float = 0.0, stop_gap: float = 0.0,
           stop_logp: float = -0.1) -> ForcedScores:
    return ForcedScores(gap=np.full(n, gap), outside=np.zeros(n, dtype=bool), nucleus_excess=np.zeros(n),
                        logp=np.full(n, -1.0 + z_shift), mean=np.full(n, -1.0), var=np.full(n, 1.0),
                        stop_gap=stop_gap, stop_logp=stop_logp)


def checked(a: Answer) -> CheckedIds:
    c = check_ids(a, vocab_size=262144, piece=piece, stop_ids=STOPS)
    assert isinstance(c, CheckedIds)
    return c


def test_structure_rules() -> None:
    assert checked(answer()).ids == (5, 6, 7)
    end = checked(answer(ids=(5, 6, 7, 106)))
    assert end.ids == (5, 6, 7) and end.ended_with_stop
    assert checked(answer(text="€", ids=(8, 9))).ids == (8, 9)  # a character split across two tokens

    def failure(a: Answer) -> AuditFailure | None:
        v = check_ids(a, vocab_size=262144, piece=piece, stop_ids=STOPS)
        assert isinstance(v, Verdict) and not v.passed
        return v.failure

    assert failure(answer(ids=None)) == AuditFailure.NO_TOKEN_IDS
    assert failure(answer(ids=())) == AuditFailure.NO_TOKEN_IDS
    assert failure(answer(ids=(5, 6, 300000))) == AuditFailure.UNKNOWN_TOKEN
    assert failure(answer(ids=(5, 6, -1))) == AuditFailure.UNKNOWN_TOKEN
    assert failure(answer(text="Hello there")) == AuditFailure.TEXT_MISMATCH
    assert failure(answer(ids=(5, 106, 6, 7))) == AuditFailure.TEXT_MISMATCH


def test_greedy_bands() -> None:
    a = answer()
    b = AuditBands(greedy_gap=1.0, greedy_miss_share=0.1, greedy_hard_gap=4.0)  # wider than the defaults
    assert judge(a, checked(a), scores(3, gap=0.9), b).passed
    off = scores(20, gap=0.0)
    off.gap[0] = 1.5  # one near-tie flip in 20: 5 % <= 10 %
    a20 = answer(text="?" * 20, ids=tuple([50] * 20))
    assert judge(a20, checked(a20), off, b).passed
    off.gap[1] = 1.5
    off.gap[2] = 1.5  # 15 %
    v = judge(a20, checked(a20), off, b)
    assert not v.passed and v.failure == AuditFailure.WRONG_TOKENS
    assert (v.positions, v.misses) == (20, 3)  # the sequential test's evidence, failed or passed
    off.gap[1] = off.gap[2] = 0.0
    assert (judge(a20, checked(a20), off, b).positions, judge(a20, checked(a20), off, b).misses) == (20, 1)
    hard = scores(20)
    hard.gap[5] = 4.5  # one token far below the reference's choice
    assert judge(a20, checked(a20), hard, b).failure == AuditFailure.WRONG_TOKENS


def test_sampled_z_band_is_two_sided() -> None:
    a = answer(temperature=0.8)
    c = checked(a)
    b = AuditBands(z_limit=6.0)
    assert judge(a, c, scores(3, z_shift=1.0), b).passed  # z = 3 / sqrt(3) = 1.7
    low = judge(a, c, scores(3, z_shift=-4.0), b)  # z = -6.9: not the asked distribution (random, cached, hot)
    assert not low.passed and low.failure == AuditFailure.IMPLAUSIBLE and low.z is not None and low.z < -6
    high = judge(a, c, scores(3, z_shift=4.0), b)  # z = +6.9: cheaper than asked (greedy where sampling was asked)
    assert high.failure == AuditFailure.IMPLAUSIBLE
    outside = scores(3)
    outside.logp[1], outside.outside[1] = -np.inf, True  # a token outside the nucleus
    assert judge(a, c, outside, b).failure == AuditFailure.IMPLAUSIBLE


def test_end_rules() -> None:
    b = AuditBands()
    a = answer(finish="stop")
    assert not judge(a, checked(a), scores(3, stop_gap=5.0), b).passed  # greedy: the model would go on
    assert judge(a, checked(a), scores(3, stop_gap=0.0), b).passed
    s = answer(finish="stop", temperature=0.9)
    assert judge(s, checked(s), scores(3, stop_logp=-3.0), b).passed  # p = 5 %: a plausible draw
    v = judge(s, checked(s), scores(3, stop_logp=-15.0), b)
    assert v.failure == AuditFailure.EARLY_STOP
    for other in ("content_filter", None):  # an end without "stop" is still a stop the model must have chosen
        o = dataclasses.replace(a, finish_reason=other)
        assert judge(o, checked(o), scores(3, stop_gap=5.0), b).failure == AuditFailure.EARLY_STOP
    client_stop = answer(finish="stop", stop=("\n",))
    assert judge(client_stop, checked(client_stop), scores(3, stop_gap=9.0), b).passed  # the client's own stop
    length = answer(finish="length", max_tokens=16)
    assert judge(length, checked(length), scores(3), b).failure == AuditFailure.FALSE_LENGTH
    full = answer(finish="length", max_tokens=3)
    assert judge(full, checked(full), scores(3, stop_gap=9.0), b).passed
    verdict = judge(a, checked(a), scores(3), b)
    assert verdict.tokens == 3


def test_penalised_requests_are_checked_for_structure_and_end_only() -> None:
    a = dataclasses.replace(answer(temperature=0.8), sampling=SamplingParams(temperature=0.8, penalised=True))
    assert judge(a, checked(a), scores(3, z_shift=-9.0), AuditBands()).passed


def test_bands_are_validated() -> None:
    with pytest.raises(ValueError):
        AuditBands(z_limit=0.0)
    with pytest.raises(ValueError):
        AuditBands(greedy_miss_share=1.5)
    for slack in (1.0, -0.1, True, float("nan")):  # a share of probability mass below 1
        with pytest.raises(ValueError, match="seeded_nucleus_slack"):
            AuditBands(seeded_nucleus_slack=slack)
    assert AuditBands(seeded_nucleus_slack=0).seeded_nucleus_slack == 0


def test_strikes_quarantine_and_release() -> None:
    book = StrikeBook(StrikePolicy(window=5, threshold=2, release_after=3))
    assert not book.record("a", passed=False, at=1.0)  # one strike: below the threshold
    assert not book.is_quarantined("a")
    for _ in range(5):
        book.record("a", passed=True, at=2.0)  # the strike slides out of the window
    assert book.records["a"].strikes == 0
    book.record("a", passed=False, at=3.0)
    assert book.record("a", passed=False, at=4.0)  # second strike in the window: quarantined now
    assert book.quarantined() == {"a"}
    book.record("a", passed=True, at=5.0)
    book.record("a", passed=True, at=5.0)
    book.record("a", passed=False, at=6.0)  # a failure restarts the clean run
    assert book.is_quarantined("a")
    assert not book.record("a", passed=True, at=7.0)
    assert not book.record("a", passed=True, at=7.0)
    assert book.record("a", passed=True, at=8.0)  # three in a row: released ...
    assert not book.is_quarantined("a") and book.records["a"].strikes == 1  # ... and its strikes stay (issue 23)
    assert book.record("a", passed=False, at=9.0)  # so the next failure quarantines it again at once
    for _ in range(3):
        book.record("a", passed=True, at=10.0)
    assert not book.is_quarantined("a")
    for _ in range(5):
        assert not book.record("a", passed=True, at=11.0)  # a passed audit never quarantines
    assert book.records["a"].strikes == 0  # strikes leave the window only by sliding out of it
    restored = StrikeBook.from_json(book.policy, book.to_json())
    assert restored.to_json() == book.to_json()
    with pytest.raises(ValueError):
        StrikeBook.from_json(book.policy, {"a": {"recent": "x"}})
    with pytest.raises(ValueError):
        StrikePolicy(window=2, threshold=3)


def _m(ok: bool = True, probe: bool = False, answered: bool = True, finish: str = "length") -> Measurement:
    return Measurement(uid=1, hotkey="hk", in_flight=0, prompt_tokens=5, max_tokens=16, ttft_s=0.1, latency_s=0.5,
                       completion_tokens=3 if finish == "stop" else 16, ok=ok, probe=probe,
                       answer=answer() if answered else None, failure=None if ok else FailureReason.DROPPED,
                       finish_reason=finish if ok else None)


def test_sampling_policy() -> None:
    rng = random.Random(1)
    picks = Counter(should_audit(_m(), rate=0.2, quarantined=False, draw=rng.random()) for _ in range(5000))
    assert 0.17 < picks[True] / 5000 < 0.23  # binomial sd 0.006: a 5-sd band
    assert should_audit(_m(probe=True), rate=0.0, quarantined=False, draw=0.99)
    assert should_audit(_m(), rate=0.0, quarantined=True, draw=0.99)
    # an early stop is paid only when audited, so it always is
    assert _m(finish="stop").stopped_early and not _m().stopped_early
    assert should_audit(_m(finish="stop"), rate=0.0, quarantined=False, draw=0.99)
    assert not should_audit(_m(ok=False), rate=1.0, quarantined=True, draw=0.0)
    assert not should_audit(_m(answered=False), rate=1.0, quarantined=False, draw=0.0)


def test_verdict_decides_what_is_paid() -> None:
    passed = apply_verdict(_m(), Verdict(True, tokens=7, prompt_tokens=3))
    assert passed.ok and passed.audited and passed.completion_tokens == 7 and passed.answer is None
    assert passed.prompt_tokens == 3  # the reference's tokenizer, not the gateway's estimate (5)
    assert apply_verdict(_m(), Verdict(True, tokens=7)).prompt_tokens == 5
    failed = apply_verdict(_m(), Verdict(False, AuditFailure.WRONG_TOKENS))
    assert not failed.ok and failed.failure == FailureReason.AUDIT_FAILED and failed.audited
    assert FailureReason.AUDIT_FAILED.blames_miner


def test_logit_noise_widens_the_band_at_low_temperature_only() -> None:
    """Batched and token-by-token logits differ a little; at T=0.2 that is amplified 5x (measured |z| 9.5)."""
    n = 40
    s = ForcedScores(gap=np.zeros(n), outside=np.zeros(n, dtype=bool), nucleus_excess=np.zeros(n),
                     logp=np.full(n, -1.2), mean=np.full(n, -1.0), var=np.full(n, 0.01), stop_gap=0.0, stop_logp=-0.1)
    cold = answer(text="?" * n, ids=tuple([50] * n), temperature=0.2, finish="length", max_tokens=n)
    assert judge(cold, checked(cold), s, AuditBands(logit_noise=0.0)).failure == AuditFailure.IMPLAUSIBLE
    assert judge(cold, checked(cold), s, AuditBands(logit_noise=0.15)).passed
    hot = dataclasses.replace(cold, sampling=SamplingParams(temperature=1.0))
    far = dataclasses.replace(s, logp=np.full(n, -2.5), var=np.full(n, 1.0))  # z = -60/sqrt(40.9): not noise
    assert judge(hot, checked(hot), far, AuditBands(logit_noise=0.15)).failure == AuditFailure.IMPLAUSIBLE


def test_seeded_sampled_answers_are_judged_token_by_token_like_greedy_ones() -> None:
    """With the subnet's seed a sampled answer is determined: the gap rules apply, the z-score does not."""
    b = AuditBands()
    seeded = dataclasses.replace(answer(temperature=0.8), sampling=SamplingParams(temperature=0.8, seed=11))
    c = checked(seeded)
    ok = judge(seeded, c, scores(3, z_shift=-9.0), b)  # an implausible z would fail a free draw, not a determined one
    assert ok.passed and ok.z is None and ok.tokens == 3
    assert judge(seeded, c, scores(3, gap=b.greedy_gap + 0.1), b).failure == AuditFailure.WRONG_TOKENS
    assert judge(seeded, c, scores(3, stop_gap=b.greedy_gap + 0.1), b).failure == AuditFailure.EARLY_STOP
    assert judge(seeded, c, scores(3, stop_gap=0.1, stop_logp=-15.0), b).passed  # the sampler did pick the end
    free = answer(temperature=0.8)
    assert judge(free, checked(free), scores(3, z_shift=-9.0), b).failure == AuditFailure.IMPLAUSIBLE


def test_a_seeded_token_outside_the_nucleus_is_a_miss_not_a_failure_by_itself() -> None:
    """Issue-28 stop's CI: an honest token just beyond the reference's nucleus edge used to be infinitely far (a
    failed audit, a strike). Now it is a miss like a near-tie flip: one passes a short answer and is evidence for
    the sequential test; two in 20 tokens (a sampler that ignores ``top_p``) fail it, and the detail says so."""
    b = AuditBands()
    seeded = SamplingParams(temperature=1.0, top_p=0.8, seed=11)
    a20 = dataclasses.replace(answer(text="?" * 20, ids=tuple([50] * 20), temperature=1.0), sampling=seeded)
    edge = scores(20)
    edge.outside[7] = True
    v = judge(a20, checked(a20), edge, b)
    assert v.passed and (v.positions, v.misses) == (20, 1) and v.worst_gap == 0.0
    edge.outside[12] = True
    v = judge(a20, checked(a20), edge, b)
    assert v.failure == AuditFailure.WRONG_TOKENS and v.misses == 2 and "2 outside top_p" in v.detail


def test_one_near_tie_miss_never_fails_a_short_answer() -> None:
    a = answer(text="?" * 16, ids=tuple([50] * 16))
    one = scores(16)
    one.gap[3] = 0.6  # one flip beyond the 0.5 band: 6 % of 16 positions, over the 5 % share
    v = judge(a, checked(a), one, AuditBands())
    assert v.passed and v.worst_gap == pytest.approx(0.6)
    assert judge(a, checked(a), one, AuditBands(min_misses=0)).failure == AuditFailure.WRONG_TOKENS
    two = scores(16)
    two.gap[3] = two.gap[9] = 0.6
    failed = judge(a, checked(a), two, AuditBands())
    assert failed.failure == AuditFailure.WRONG_TOKENS and failed.worst_gap == pytest.approx(0.6)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="min_misses"):
            AuditBands(min_misses=bad)  # type: ignore[arg-type]


def test_ids_may_run_on_through_a_stop_string_that_ends_in_the_last_token() -> None:
    """A runtime honouring ``stop`` sends the text before the string and names every id it generated (issue 24)."""
    def fails(a: Answer) -> bool:
        return isinstance(check_ids(a, vocab_size=262144, piece=piece, stop_ids=STOPS), Verdict)

    assert not fails(answer(text="Hello", ids=(5, 6, 7), stop=(" wo",)))  # " wo" completes in the last token
    assert not fails(answer(text="Hel", ids=(5, 6), stop=("lo",)))
    assert fails(answer(text="Hel", ids=(5, 6, 7), stop=("lo",)))  # a whole token more after the stop string
    assert fails(answer(text="Hel", ids=(5, 6), stop=("xx",)))  # not the client's stop string
    assert fails(answer(text="Hel", ids=(5, 6), stop=()))
    assert fails(answer(text="Hel", ids=(5, 6), stop=("lo",), finish="length"))  # only an answer that stopped


def test_reported_logprobs_hold_within_the_band_and_lies_fail() -> None:
    """The raw log-probabilities a miner reports are checked against the reference's: honest numerics (off by up to
    0.44 nats, measured) pass; a logprob of 0 everywhere, a shift past the band, or entries for only some tokens
    fail; an answer with nothing reported (not asked) or a tool call is not checked."""
    raw = np.log(np.array([0.9, 0.4, 0.05, 0.6, 0.3] * 4))
    honest = answer()
    noisy = dataclasses.replace(honest, logprobs=tuple(raw + np.tile([0.4, -0.4], 10)))
    b = AuditBands()
    assert check_logprobs(honest, raw, b) is None and check_logprobs(noisy, raw, b) is None
    one_off = list(raw)
    one_off[3] += 3.0  # one position in 20 may miss, as a greedy answer's may
    assert check_logprobs(dataclasses.replace(honest, logprobs=tuple(one_off)), raw, b) is None
    for lie in (np.zeros_like(raw), raw + 1.5, raw[:10]):
        v = check_logprobs(dataclasses.replace(honest, logprobs=tuple(lie)), raw, b)
        assert v is not None and not v.passed and v.failure == AuditFailure.WRONG_LOGPROBS, lie
    stopped = dataclasses.replace(honest, stop=("\n",), logprobs=tuple(raw[:18]))  # the stop string's own left out
    assert check_logprobs(stopped, raw, b) is None
    called = dataclasses.replace(honest, logprobs=(), tool_calls=(("f", "{}"),))
    assert check_logprobs(called, raw, b) is None
    rows = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]])) + 3.0  # logits: any shift
    assert chosen_logprobs(rows, [1, 2]) == pytest.approx(np.log([0.25, 0.8]))
