"""API keys with names and limits (issue 14): parsing, the pure limiter, the gateway's 429, usage that survives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.auth import ApiKeyAuth, KeysFileError, default_name, load_keys, parse_keys_text
from gateway.quota import KeyPolicy, QuotaBook, Refusal, Standing, Ticket, duration, ratelimit_headers, utc_day

T0 = 1_796_256_000.0  # 2026-12-03 00:00:00 UTC


def test_keys_file_names_and_limits() -> None:
    text = """
    # operators' keys
    sk-alice  name=alice rpm=60 tpm=100000 tpd=2000000 streams=4
    sk-bob    name=bob            # unlimited
    sk-anon
    """
    parsed = dict(parse_keys_text(text))
    assert parsed["sk-alice"] == KeyPolicy("alice", rpm=60, tpm=100_000, tpd=2_000_000, streams=4)
    assert parsed["sk-bob"] == KeyPolicy("bob") and not parsed["sk-bob"].limited
    assert parsed["sk-anon"].name == default_name("sk-anon") and "sk-anon" not in parsed["sk-anon"].name


@pytest.mark.parametrize("line, why", [
    ("sk-x rpm=0", "positive integer"),
    ("sk-x rpm=ten", "positive integer"),
    ("sk-x burst=4", "not name="),
    ("sk-x name=", "not name="),
])
def test_a_keys_file_typo_is_refused_with_its_line(line: str, why: str) -> None:
    with pytest.raises(KeysFileError, match=rf"line 2: .*{why}"):
        parse_keys_text("sk-ok\n" + line)


def test_a_name_used_twice_is_refused() -> None:
    with pytest.raises(KeysFileError, match="line 2: the name 'a' is used twice"):
        parse_keys_text("sk-1 name=a\nsk-2 name=a")


def test_identify_returns_the_keys_policy(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("sk-alice name=alice rpm=2\n")
    auth = ApiKeyAuth(load_keys(keys_file=f, keys=["sk-list"], env={"TENSORGATE_API_KEYS": "sk-env"}))
    assert auth.identify("Bearer sk-alice") == KeyPolicy("alice", rpm=2)
    assert auth.identify("Bearer sk-env") == KeyPolicy(default_name("sk-env"))
    assert auth.identify("Bearer sk-nope") is None and auth.identify(None) is None


def test_requests_per_minute_and_when_to_come_back() -> None:
    book, p = QuotaBook(), KeyPolicy("a", rpm=3)
    for i in range(3):
        t = book.admit(p, 10, T0 + i)
        assert isinstance(t, Ticket)
        book.settle(t, 10, T0 + i)
    refused = book.admit(p, 10, T0 + 10)
    assert isinstance(refused, Refusal) and refused.limit == "requests per minute"
    assert refused.retry_after_s == pytest.approx(50.0)  # the first request leaves the window at T0 + 60
    assert isinstance(book.admit(p, 10, T0 + 60.5), Ticket)


def test_a_limit_cut_to_nothing_is_a_refusal_not_an_error() -> None:
    """Issue 56: while Redis is down a process admits its share of what is left of a key's limit, which can be 0;
    the book then raised IndexError on its empty window, a 500 for every request of a limited key."""
    refused = QuotaBook().admit(KeyPolicy("a", rpm=0), 10, T0)
    assert isinstance(refused, Refusal) and refused.limit == "requests per minute" and refused.retry_after_s == 60.0


def test_tokens_per_minute_reserve_up_front_and_settle_to_use() -> None:
    book, p = QuotaBook(), KeyPolicy("a", tpm=1000)
    a = book.admit(p, 600, T0)
    assert isinstance(a, Ticket)
    refused = book.admit(p, 600, T0 + 1)  # 600 reserved + 600 asked > 1000: refused before it runs
    assert isinstance(refused, Refusal) and refused.limit == "tokens per minute"
    book.settle(a, 150, T0 + 2)  # it used 150: the rest is given back at once
    b = book.admit(p, 600, T0 + 3)
    assert isinstance(b, Ticket)
    assert book.usage["a"].minute_sum == 750
    too_big = book.admit(p, 5000, T0 + 4)
    assert isinstance(too_big, Refusal) and "more than the 1000" in too_big.detail


def test_tokens_per_day_and_streams() -> None:
    book = QuotaBook()
    day = KeyPolicy("d", tpd=1000)
    t = book.admit(day, 900, T0 + 3600)
    assert isinstance(t, Ticket)
    book.settle(t, 900, T0 + 3600)
    refused = book.admit(day, 200, T0 + 7200)
    assert isinstance(refused, Refusal) and refused.limit == "tokens per day"
    assert refused.retry_after_s == pytest.approx(86_400 - 7200)  # UTC midnight
    assert isinstance(book.admit(day, 200, T0 + 86_400 + 1), Ticket)  # a new day
    streams = KeyPolicy("s", streams=2)
    held = [book.admit(streams, 1, T0), book.admit(streams, 1, T0)]
    third = book.admit(streams, 1, T0)
    assert isinstance(third, Refusal) and third.limit == "concurrent streams"
    assert isinstance(held[0], Ticket)
    book.settle(held[0], 1, T0 + 1)
    book.settle(held[0], 1, T0 + 1)  # settling twice frees one stream, not two
    assert book.usage["s"].in_flight == 1


def test_usage_is_kept_per_day_and_restored() -> None:
    book = QuotaBook()
    p = KeyPolicy("a", tpd=1000)
    t = book.admit(p, 300, T0 + 10)
    assert isinstance(t, Ticket)
    book.settle(t, 250, T0 + 11)
    assert book.snapshot() == [("a", utc_day(T0), 1, 250)]
    assert utc_day(T0) == "2026-12-03"
    again = QuotaBook()
    again.restore("a", "2026-12-03", 1, 950)
    refused = again.admit(p, 100, T0 + 20)  # a restart does not hand out a fresh day
    assert isinstance(refused, Refusal) and refused.limit == "tokens per day"


async def _gateway_with_key(make_miner: Any, make_gateway: Any, tmp_path: Path, key_line: str,
                            **hooks: Any) -> tuple[Any, Any]:
    """One honest miner behind a gateway whose keys file holds ``key_line`` (``hooks`` plugged into it)."""
    from tests.fakes import Script

    keys = tmp_path / "keys"
    keys.write_text(key_line + "\n")
    m = await make_miner(Script("ok", tokens=4))
    return m, await make_gateway([m], keys_file=str(keys), hooks=hooks)


async def test_the_gateway_counts_n_streams_for_a_request_for_n_answers(make_miner, make_gateway,
                                                                        tmp_path: Path) -> None:
    """Issue 39 row 7 at the front door: n=3 from a key limited to 2 streams is a 429 naming the streams it asks
    for, and reaches no miner; n=2 is served."""
    from tests.fakes import body, error_of

    m, h = await _gateway_with_key(make_miner, make_gateway, tmp_path, "sk-pair name=pair streams=2")
    pair = {"Authorization": "Bearer sk-pair"}
    async with h.chat(body(stream=False, max_tokens=4, n=3), headers=pair) as r:
        assert r.status == 429
        assert "asks for 3 streams" in (await error_of(r))["message"]
    assert m.requests == 0
    async with h.chat(body(stream=False, max_tokens=4, n=2), headers=pair) as r:
        assert r.status in (200, 502)  # one miner: the second answer may find it busy; admitted either way
        await r.read()
    assert m.requests >= 1


async def test_gateway_answers_429_rate_limit_exceeded_and_shows_the_callers_usage(make_miner, make_gateway,
                                                                                    tmp_path: Path) -> None:
    from tests.fakes import body, error_of

    m, h = await _gateway_with_key(make_miner, make_gateway, tmp_path, "sk-capped name=capped rpm=2 tpm=100000")
    capped = {"Authorization": "Bearer sk-capped"}
    for _ in range(2):
        async with h.chat(body(max_tokens=4), headers=capped) as r:
            assert r.status == 200
            await r.read()
    async with h.chat(body(max_tokens=4), headers=capped) as r:
        assert r.status == 429
        err = await error_of(r)
        assert err["code"] == "rate_limit_exceeded" and "requests per minute" in err["message"]
        assert "capped" in err["message"] and "sk-capped" not in err["message"]
        assert 1 <= int(r.headers["Retry-After"]) <= 60
    async with h.chat(body(max_tokens=4)) as r:  # another key is not held to this one's limit
        assert r.status == 200
        await r.read()
    assert m.requests == 3  # the refused request never reached a miner
    async with h.client.get(h.base_url + "/v1/status", headers=capped) as r:
        key = (await r.json())["key"]
    assert key["name"] == "capped" and key["limits"]["rpm"] == 2
    assert key["requests_today"] == 2 and key["in_flight"] == 0
    assert 8 <= key["tokens_today"] < 200  # settled to the prompt estimate + the 4 tokens of each answer


def test_key_usage_round_trips_through_the_store(tmp_path: Path) -> None:
    from scoring.store import ScoreStore

    with ScoreStore(tmp_path) as st:
        st.save_key_usage([("a", "2026-12-03", 3, 900), ("b", "2026-12-02", 1, 5)])
        st.save_key_usage([("a", "2026-12-03", 4, 1000)])  # the day's totals replace the earlier save
        assert st.load_key_usage("2026-12-03") == [("a", "2026-12-03", 4, 1000)]


def test_a_daily_limit_holds_over_restarts_that_never_saved_a_round() -> None:
    """Issue 24 item 9: a tpd=3000 key was admitted 4,260 tokens over 5 restarts (2 of them kill -9), usage being
    saved only at round close. Each "process" here dies without saving; only the claims written before serving
    (mark_due) survive, as they would in the state file."""
    policy = KeyPolicy("k", tpd=3000)
    disk: dict[tuple[str, str], tuple[int, int]] = {}
    admitted = writes = 0
    for life in range(5):
        book = QuotaBook()
        for (name, day), (req, tok) in disk.items():
            book.restore(name, day, req, tok)
        for i in range(40):
            t = book.admit(policy, 100, T0 + life * 100 + i)
            if isinstance(t, Refusal):
                break
            row = book.mark_due(policy, t)
            if row is not None:  # written before the request is served
                disk[(row[0], row[1])] = (row[2], row[3])
                writes += 1
            admitted += 100
            book.settle(t, 100, T0 + life * 100 + i)
        # kill -9: no snapshot, nothing else saved
    assert 3000 - 150 <= admitted <= 3000  # never more than the limit; at most a twentieth claimed unused
    assert writes <= 30  # one claim per twentieth of the limit, not one write per request


def test_a_key_without_a_daily_limit_writes_no_claims() -> None:
    book = QuotaBook()
    p = KeyPolicy("free", rpm=100)
    t = book.admit(p, 100, T0)
    assert isinstance(t, Ticket) and book.mark_due(p, t) is None


async def test_the_gateway_writes_a_keys_claim_before_the_miner_is_asked(make_miner, make_gateway,
                                                                         tmp_path: Path) -> None:
    from tests.fakes import body

    seen: list[tuple[tuple[str, str, int, int], int]] = []
    disk_full = [False]

    async def save(row: tuple[str, str, int, int]) -> None:
        if disk_full[0]:
            raise OSError("disk full")
        seen.append((row, m.requests))

    m, h = await _gateway_with_key(make_miner, make_gateway, tmp_path, "sk-daily name=daily tpd=100000",
                                   save_usage=save)
    for _ in range(2):
        async with h.chat(body(max_tokens=4), headers={"Authorization": "Bearer sk-daily"}) as r:
            assert r.status == 200
            await r.read()
    assert len(seen) == 1 and seen[0][1] == 0  # one claim (a twentieth of the day), before the miner saw anything
    assert seen[0][0][0] == "daily" and 5000 < seen[0][0][3] < 5100  # the first reservation + a twentieth
    disk_full[0] = True
    h.gateway.quota.usage["daily"].recorded = 0  # due again
    async with h.chat(body(max_tokens=4), headers={"Authorization": "Bearer sk-daily"}) as r:
        assert r.status == 200  # a state file that cannot be written never costs the client its answer
        await r.read()


def test_a_request_for_n_answers_holds_n_of_the_keys_streams() -> None:
    """Issue 39 row 7: ``n=8`` from a key limited to 1 stream held 8 miner streams (one request counted once)."""
    book = QuotaBook()
    one = KeyPolicy("solo", streams=1)
    refused = book.admit(one, 10, 0.0, streams=8)
    assert isinstance(refused, Refusal) and "asks for 8 streams" in refused.detail
    four = KeyPolicy("quad", streams=4)
    held = book.admit(four, 10, 0.0, streams=3)
    assert isinstance(held, Ticket)
    assert isinstance(book.admit(four, 10, 0.0, streams=2), Refusal)  # 3 + 2 > 4
    single = book.admit(four, 10, 0.0)
    assert isinstance(single, Ticket)  # 3 + 1 fits
    book.settle(held, 5, 1.0)
    assert isinstance(book.admit(four, 10, 1.0, streams=3), Ticket)  # its 3 streams came back at settle


def test_ratelimit_headers_say_where_the_key_stands_as_openai_writes_them() -> None:
    book = QuotaBook()
    p = KeyPolicy("k", rpm=3, tpm=1000, streams=4)
    first = book.admit(p, 300, T0)
    second = book.admit(p, 200, T0 + 15)
    assert isinstance(first, Ticket) and isinstance(second, Ticket)
    assert ratelimit_headers(p, second.standing) == {
        "x-ratelimit-limit-requests": "3", "x-ratelimit-remaining-requests": "1", "x-ratelimit-reset-requests": "45s",
        "x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": "500", "x-ratelimit-reset-tokens": "45s"}
    book.admit(p, 100, T0 + 16)
    refused = book.admit(p, 100, T0 + 30)  # the fourth request of the minute
    assert isinstance(refused, Refusal)
    assert ratelimit_headers(p, refused.standing)["x-ratelimit-remaining-requests"] == "0"
    assert ratelimit_headers(KeyPolicy("daily", tpd=10), second.standing) == {}  # no per-minute limit: none
    assert ratelimit_headers(p, None) == {}
    assert ratelimit_headers(p, Standing(tokens=1200)) == {  # what is not known is not said
        "x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "1m0s"}
    assert [duration(s) for s in (0.02, 1.5, 45.0, 360.0, -1.0)] == ["20ms", "1.5s", "45s", "6m0s", "0ms"]


async def test_the_sdk_reads_a_limited_keys_ratelimit_headers_on_answers_and_on_its_429(make_miner, make_gateway,
                                                                                        tmp_path: Path) -> None:
    """Issue 41: a 429 had ``Retry-After`` and no ``x-ratelimit-*``; every response of a limited key has them now,
    as OpenAI sends them, read here through the official SDK (its raw response, and its RateLimitError)."""
    import openai

    from tests.fakes import MODEL

    _, h = await _gateway_with_key(make_miner, make_gateway, tmp_path, "sk-paced name=paced rpm=2 tpm=100000")
    client = openai.AsyncOpenAI(base_url=h.base_url + "/v1", api_key="sk-paced", max_retries=0)
    try:
        left = []
        for _ in range(2):
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
            raw.parse()
            assert raw.headers["x-ratelimit-limit-requests"] == "2"
            assert raw.headers["x-ratelimit-limit-tokens"] == "100000"
            assert int(raw.headers["x-ratelimit-remaining-tokens"]) < 100000
            assert raw.headers["x-ratelimit-reset-requests"].endswith("s")
            left.append(raw.headers["x-ratelimit-remaining-requests"])
        assert left == ["1", "0"]
        with pytest.raises(openai.RateLimitError) as e:
            await client.chat.completions.create(model=MODEL, max_tokens=4,
                                                 messages=[{"role": "user", "content": "hi"}])
        assert e.value.response.headers["x-ratelimit-remaining-requests"] == "0"
        assert 1 <= int(e.value.response.headers["retry-after"]) <= 60
    finally:
        await client.close()
