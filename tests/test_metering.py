"""The stream meter (gateway.metering): the rules the validator pays on, fed bytes and clock times, no sockets."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from gateway.metering import MeterFailure, StreamMeter
from gateway.protocol.measurement import FailureReason


def ev(obj: Any) -> bytes:
    return b"data: " + (obj.encode() if isinstance(obj, str) else json.dumps(obj).encode()) + b"\n\n"


def tok(text: str) -> bytes:
    return ev({"choices": [{"delta": {"content": text}, "finish_reason": None}]})


ROLE = ev({"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}]})
FINISH = ev({"choices": [{"delta": {}, "finish_reason": "stop"}]})
DONE = ev("[DONE]")


def test_ttft_is_the_first_content_not_the_role_prelude() -> None:
    m = StreamMeter(max_tokens=8, started_at=100.0)
    assert [c.role for c in m.feed(ROLE, now=100.05)] == ["assistant"]
    assert m.ttft_s is None and m.tokens == 0
    m.feed(tok("Hi"), now=100.30)
    m.feed(tok(" there"), now=100.40)
    assert m.ttft_s == pytest.approx(0.30) and m.tokens == 2
    m.feed(FINISH + DONE, now=100.45)
    assert m.done and m.finish_reason == "stop"


def test_usage_is_recorded_but_tokens_are_counted_by_the_meter() -> None:
    m = StreamMeter(max_tokens=8, started_at=0.0)
    m.feed(tok("a") + tok("b") + ev({"choices": [], "usage": {"completion_tokens": 999}}) + DONE, now=1.0)
    assert m.tokens == 2 and m.usage == {"completion_tokens": 999}


def test_a_stream_split_anywhere_measures_the_same() -> None:
    body = ROLE + b"".join(tok(f"t{i} ") for i in range(20)) + FINISH + DONE
    whole = StreamMeter(max_tokens=64, started_at=0.0)
    want = [c for c in whole.feed(body, now=1.0)]
    rng = random.Random(7)
    for _ in range(50):
        m = StreamMeter(max_tokens=64, started_at=0.0)
        cuts = sorted(rng.sample(range(1, len(body)), 12))
        got = []
        for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True):
            got += m.feed(body[a:b], now=1.0)
        assert got == want and m.tokens == 20 and m.done


@pytest.mark.parametrize(
    ("stream", "reason"),
    [
        (tok("a") + tok("b") + tok("c"), FailureReason.OVERLONG),
        (ROLE + DONE, FailureReason.EMPTY),
        (ev({"error": {"message": "oom"}}), FailureReason.DROPPED),
        (b"data: {not json\n\n", FailureReason.GARBAGE),
        (b'data: {"choices": [{"delta": {"content": "x"}}], "n": NaN}\n\n', FailureReason.GARBAGE),
        (b'data: {"choices": [{"delta": {"content": "\xff"}}]}\n\n', FailureReason.GARBAGE),
        (ev({"choices": "nope"}), FailureReason.GARBAGE),
        (b"data: " + b"a" * 70_000, FailureReason.GARBAGE),
    ],
    ids=["overlong", "done-without-content", "error-event", "json", "nan", "utf8", "shape", "long-line"],
)
def test_each_broken_rule_is_the_miners_failure(stream: bytes, reason: FailureReason) -> None:
    m = StreamMeter(max_tokens=2, started_at=0.0)
    with pytest.raises(MeterFailure) as e:
        m.feed(stream, now=1.0)
        m.end()  # a failure found after valid chunks of the same read surfaces on the next call
    assert e.value.reason == reason


def test_valid_chunks_before_a_broken_rule_in_the_same_read_are_kept() -> None:
    """The client still gets what the miner sent before it broke a rule; the failure comes next."""
    m = StreamMeter(max_tokens=2, started_at=0.0)
    chunks = m.feed(tok("a") + tok("b") + tok("c"), now=1.0)
    assert [c.content for c in chunks] == ["a", "b"]
    assert m.pending is not None and m.pending.reason == FailureReason.OVERLONG
    with pytest.raises(MeterFailure):
        m.feed(tok("d"), now=1.1)
    with pytest.raises(MeterFailure):
        m.end()


def test_how_a_stream_may_end() -> None:
    done = StreamMeter(8, 0.0)
    done.feed(tok("a") + FINISH, now=1.0)
    done.end()  # a finish after content, then EOF without [DONE]: complete
    assert done.done
    cut = StreamMeter(8, 0.0)
    cut.feed(tok("a"), now=1.0)
    with pytest.raises(MeterFailure) as e:
        cut.end()
    assert e.value.reason == FailureReason.DROPPED
    empty = StreamMeter(8, 0.0)
    empty.feed(FINISH, now=1.0)
    with pytest.raises(MeterFailure) as e:
        empty.end()
    assert e.value.reason == FailureReason.EMPTY


def test_bytes_after_done_are_ignored() -> None:
    m = StreamMeter(8, 0.0)
    m.feed(tok("a") + DONE + tok("b") + b"garbage", now=1.0)
    assert m.done and m.tokens == 1
    assert m.feed(tok("c"), now=2.0) == []


def test_stall_deadline_counts_from_the_last_valid_event() -> None:
    m = StreamMeter(8, 0.0)
    m.feed(ROLE, now=0.2)
    assert m.last_event_at == 0.2
    m.feed(tok("a"), now=0.5)
    m.feed(b": keep-alive comment\n\n", now=3.0)  # a comment is not an event: the miner is still stalling
    assert m.last_event_at == 0.5


def test_decode_concurrency_is_time_weighted() -> None:
    m = StreamMeter(8, 0.0)
    m.feed(tok("a"), now=1.0, in_flight=1)
    m.feed(tok("b"), now=2.0, in_flight=1)  # one second alone
    m.feed(tok("c"), now=3.0, in_flight=3)  # one second shared by three
    assert m.decode_concurrency() == pytest.approx(2.0)
    assert StreamMeter(8, 0.0).decode_concurrency() is None


def tok_ids(text: str, ids: list[int]) -> bytes:
    return ev({"choices": [{"delta": {"content": text}, "finish_reason": None, "token_ids": ids}]})


def test_tokens_are_the_ids_a_chunk_names_not_the_chunks() -> None:
    m = StreamMeter(max_tokens=8, started_at=0.0, keep_answer=True)
    m.feed(ROLE + tok_ids("Hello", [5, 6]) + tok_ids("", [8]) + tok_ids("€", [9]) + FINISH + DONE, now=0.2)
    assert m.tokens == 4 and m.done
    assert m.ids == [5, 6, 8, 9] and "".join(m.text) == "Hello€" and m.ids_complete
    assert m.ttft_s == 0.2


def test_a_chunk_without_ids_marks_the_answer_unverifiable() -> None:
    m = StreamMeter(max_tokens=8, started_at=0.0, keep_answer=True)
    m.feed(tok_ids("a", [1]) + tok("b") + FINISH + DONE, now=0.1)
    assert m.tokens == 2 and not m.ids_complete


def test_ids_beyond_max_tokens_are_overlong() -> None:
    m = StreamMeter(max_tokens=3, started_at=0.0)
    with pytest.raises(MeterFailure) as e:
        m.feed(tok_ids("abcd", [1, 2, 3, 4]), now=0.1)
    assert e.value.reason == FailureReason.OVERLONG
    kept = StreamMeter(max_tokens=3, started_at=0.0)
    assert not kept.keep_answer and kept.feed(tok_ids("abc", [1, 2, 3]), now=0.1) and kept.ids == []


def test_text_an_answer_may_carry_is_bounded_by_its_tokens() -> None:
    """A non-streamed answer is held whole: 4 KB per token at max_tokens would be 16 MB a request."""
    m = StreamMeter(max_tokens=4, started_at=0.0)
    m.feed(tok("a" * 100), now=0.1)  # one long token is fine (the cap is 32 x 4 + one chunk's 4096)
    with pytest.raises(MeterFailure) as e:
        for _ in range(3):
            m.feed(tok("b" * 4000), now=0.2)
    assert e.value.reason == FailureReason.GARBAGE and "characters" in e.value.detail


def _content(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"delta": {"content": text}}]}).encode() + b"\n\n"


def test_answers_held_at_once_share_one_budget() -> None:
    """Issue 15 item 4: one answer is capped, and so is what all held answers weigh together."""
    from gateway.metering import HELD_CHUNK_OVERHEAD, AnswerBudget

    budget = AnswerBudget(max_chars=100 + 2 * HELD_CHUNK_OVERHEAD)
    a = StreamMeter(64, 0.0, budget=budget, must_hold=True)
    b = StreamMeter(64, 0.0, budget=budget, must_hold=True)
    a.feed(_content("x" * 60), now=0.1)
    assert budget.held == 60 + HELD_CHUNK_OVERHEAD  # each piece held costs its object too
    with pytest.raises(MeterFailure) as e:
        b.feed(_content("y" * 50), now=0.1)
    assert e.value.reason == FailureReason.LOCAL_RESOURCES  # the gateway's condition: no miner is blamed
    a.release()
    a.release()  # idempotent
    assert budget.held == 0 and budget.refused == 1
    # an answer kept only for a possible audit is dropped, not failed: the user's stream goes on
    kept = StreamMeter(64, 0.0, budget=budget, keep_answer=True)
    budget.take(budget.max_chars - 10)
    kept.feed(_content("z" * 20), now=0.2)
    assert not kept.keep_answer and kept.text == [] and kept.tokens == 1 and budget.held == budget.max_chars - 10


def test_a_check_streams_arrivals_are_its_reads_that_brought_tokens() -> None:
    """A capacity-check stream keeps when its tokens came (seconds after the start, tokens so far), for the check's
    common deadline; a read without tokens adds none, and other streams keep nothing."""
    m = StreamMeter(max_tokens=8, started_at=100.0, timeline=True)
    m.feed(ROLE, now=100.1)
    m.feed(tok_ids("a", [1]), now=100.4)
    m.feed(tok_ids("b c", [2, 3]), now=101.0)
    m.feed(FINISH + DONE, now=101.2)
    assert m.arrivals == [(pytest.approx(0.4), 1), (pytest.approx(1.0), 3)]
    plain = StreamMeter(max_tokens=8, started_at=0.0)
    plain.feed(tok_ids("a", [1]), now=0.2)
    assert plain.arrivals is None
