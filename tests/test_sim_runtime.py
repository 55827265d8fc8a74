"""The simulated card's load model, measured from the actual stream timing (compressed with time_scale)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.protocol.openai import requested_max_tokens
from neurons.miner.runtimes.base import RuntimeFailure
from neurons.miner.runtimes.sim import PROFILES, CardProfile, SimulatedRuntime, parse_profile


@dataclass
class Trace:
    """What a client saw: the events and when each yield arrived (real seconds since the request)."""

    events: list[Any] = field(default_factory=list)  # parsed JSON chunks, "[DONE]" or ("raw", bytes)
    token_times: list[tuple[float, int]] = field(default_factory=list)  # (t, tokens in that yield)
    start: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(k for _, k in self.token_times)

    @property
    def first(self) -> float:
        return self.token_times[0][0]

    @property
    def last(self) -> float:
        return self.token_times[-1][0]

    def content(self) -> str:
        return "".join(e["choices"][0]["delta"].get("content", "") for e in self.events
                       if isinstance(e, dict) and e.get("choices"))


def _parse(frames: bytes) -> list[Any]:
    out: list[Any] = []
    for block in frames.split(b"\n\n"):
        if not block:
            continue
        assert block.startswith(b"data: "), block
        data = block[len(b"data: "):]
        if data == b"[DONE]":
            out.append("[DONE]")
            continue
        try:
            out.append(json.loads(data.decode()))
        except (UnicodeDecodeError, ValueError):
            out.append(("raw", data))
    return out


async def run(rt: SimulatedRuntime, payload: dict[str, Any], delay: float = 0.0) -> Trace:
    if delay:
        await asyncio.sleep(delay)
    tr = Trace(start=time.monotonic())
    async for frames in rt.stream(payload):
        t = time.monotonic() - tr.start
        evs = _parse(frames)
        tr.events.extend(evs)
        k = sum(1 for e in evs if isinstance(e, dict) and e.get("choices")
                and "content" in e["choices"][0]["delta"])
        if k:
            tr.token_times.append((t, k))
    return tr


def body(max_tokens: int = 64, chars: int = 8, usage: bool = True) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "x" * chars}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": usage}}


def card(**kw: Any) -> SimulatedRuntime:
    kw.setdefault("stop_rate", 0.0)
    kw.setdefault("jitter", 0.0)
    return SimulatedRuntime(CardProfile(**kw), rng=random.Random(7))


# ---- shape -----------------------------------------------------------------------------------------


async def test_frames_follow_the_contract() -> None:
    rt = card(time_scale=50.0)
    tr = await run(rt, body(max_tokens=20))
    evs = tr.events
    assert evs[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert all(e["object"] == "chat.completion.chunk" for e in evs if isinstance(e, dict))
    assert len({e["id"] for e in evs if isinstance(e, dict)}) == 1
    tokens = [e for e in evs[1:-3]]
    assert len(tokens) == 20 and all(e["choices"][0]["delta"]["content"] for e in tokens)
    assert evs[-3]["choices"][0]["finish_reason"] == "length"
    assert evs[-2]["choices"] == [] and evs[-2]["usage"]["completion_tokens"] == 20
    assert evs[-2]["usage"]["total_tokens"] == evs[-2]["usage"]["prompt_tokens"] + 20
    assert evs[-1] == "[DONE]"
    assert rt.active == 0
    assert len(tr.content().split()) == 20  # one word per token


async def test_no_usage_chunk_unless_asked_and_max_completion_tokens_wins() -> None:
    rt = card(time_scale=50.0)
    payload = body(max_tokens=30, usage=False)
    payload["max_completion_tokens"] = 5
    tr = await run(rt, payload)
    assert tr.tokens == 5
    assert not any(isinstance(e, dict) and "usage" in e for e in tr.events)
    assert tr.events[-1] == "[DONE]"


async def test_default_length_and_stop_rate() -> None:
    rt = card(time_scale=200.0)
    payload = body()
    del payload["max_tokens"]
    assert (await run(rt, payload)).tokens == 256
    rt = SimulatedRuntime(CardProfile(time_scale=200.0, stop_rate=1.0, jitter=0.0), rng=random.Random(3))
    tr = await run(rt, body(max_tokens=100))
    assert 50 <= tr.tokens < 100 and tr.events[-3]["choices"][0]["finish_reason"] == "stop"


def test_requested_max_tokens_is_lenient() -> None:
    assert requested_max_tokens({"max_tokens": 9}) == 9
    assert requested_max_tokens({"max_tokens": True}) == 256
    assert requested_max_tokens({"max_tokens": -1}, default=3) == 3


def test_profiles_and_parser() -> None:
    assert parse_profile("rtx5090") is PROFILES["rtx5090"]
    slow = parse_profile("rtx5090-slow")
    fast = PROFILES["rtx5090"]
    assert slow.base_ttft_s >= 1.8 * fast.base_ttft_s and slow.single_tok_s <= 0.6 * fast.single_tok_s
    p = parse_profile("rtx5090-slow:time_scale=10, fail_rate=0.5,drop_after_tokens=3")
    assert (p.time_scale, p.fail_rate, p.drop_after_tokens, p.name) == (10.0, 0.5, 3, "rtx5090-slow")
    assert isinstance(p.drop_after_tokens, int)
    for bad in ("nope", "rtx5090:bogus=1", "rtx5090:time_scale", "rtx5090:time_scale=x", "rtx5090:fail_rate=2",
                "rtx5090:time_scale=0", "rtx5090:name=x", "rtx5090:jitter=nan"):
        with pytest.raises(ValueError):
            parse_profile(bad)


def test_rate_model() -> None:
    p = PROFILES["rtx5090"]
    assert p.per_stream_tok_s(1) == 440.0
    assert p.per_stream_tok_s(2) == 150.0 and p.per_stream_tok_s(4) == 75.0
    assert p.ttft_s(0, 0) == pytest.approx(0.45)
    assert p.ttft_s(24000, 0) == pytest.approx(1.45)
    assert p.ttft_s(0, 3) > p.ttft_s(0, 1) > p.ttft_s(0, 0)


# ---- timing, measured ------------------------------------------------------------------------------
# Each measurement is converted back to simulated seconds (x time_scale). A loaded 2-core machine wakes
# sleepers late, which only ever adds latency: lower bounds are exact, upper bounds only catch a gross
# error (a doubled sleep) and leave at least 100 ms of real time for scheduling.

TS = 4.0
SLACK_S = 0.1  # real seconds of scheduling delay an upper bound allows


async def test_idle_ttft_about_450ms() -> None:
    rt = card(time_scale=TS)
    ttfts = [(await run(rt, body(max_tokens=2))).first * TS for _ in range(3)]
    assert min(ttfts) >= 0.42, ttfts
    assert sorted(ttfts)[1] <= 0.45 + SLACK_S * TS, ttfts  # median; a doubled sleep would be 0.9


async def test_prefill_adds_prompt_over_24k_tok_s() -> None:
    rt = card(time_scale=TS)
    short = (await run(rt, body(max_tokens=2, chars=4))).first * TS
    long = (await run(rt, body(max_tokens=2, chars=4 * 24000))).first * TS  # 24k tokens: +1.0 s
    assert 0.8 <= long - short <= 1.0 + SLACK_S * TS, (short, long)  # a doubled prefill would be 2.0


async def test_single_stream_decode_about_440() -> None:
    rt = card(time_scale=TS)
    tr = await run(rt, body(max_tokens=400))
    assert tr.tokens == 400
    rate = (tr.tokens - 1) / (tr.last - tr.first) / TS
    assert 440 * 0.75 <= rate <= 440 * 1.15, rate
    # batched writes: far fewer yields than tokens (one sleep per tick, not per token)
    assert len(tr.token_times) < tr.tokens / 3


async def test_a_late_wake_up_before_the_first_token_does_not_stretch_the_stream() -> None:
    """The card's decode runs from when its first token was due, not from when this machine's loop got round to it:
    a GPU does not wait for the validator's CPU. Stretched, a stream stays active longer and slows the card's other
    streams, and beside CPU hogs a card carrying other validators' streams read fewer cards (issue 38)."""
    rt = card(time_scale=TS)
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, time.sleep, 0.3)  # the loop stalls 0.3 s during the first token's wait (0.11 s)
    tr = await run(rt, body(max_tokens=800))  # 799 tokens at 440 tok/s: 0.45 s of decode after the first token
    assert tr.tokens == 800
    assert tr.first >= 0.3  # the first token came late: the stall held it
    assert tr.last <= 0.6, tr.last  # and the decode caught up: due at 0.57 s; stretched it would end at 0.8 s


def _aggregate_rate(traces: list[Trace]) -> float:
    """Tokens per simulated second over the window in which every stream was decoding."""
    lo = max(t.first for t in traces)
    hi = min(t.last for t in traces)
    assert hi - lo > 0.1, "streams barely overlapped"
    n = sum(k for t in traces for (at, k) in t.token_times if lo < at <= hi)
    return n / (hi - lo) / TS


@pytest.mark.parametrize("n,max_tokens", [(2, 500), (4, 300)])
async def test_shared_card_decodes_300_in_total(n: int, max_tokens: int) -> None:
    rt = card(time_scale=TS)
    traces = await asyncio.gather(*(run(rt, body(max_tokens=max_tokens)) for _ in range(n)))
    assert all(t.tokens == max_tokens for t in traces)
    agg = _aggregate_rate(list(traces))
    assert 300 * 0.75 <= agg <= 300 * 1.2, agg
    assert rt.active == 0


async def test_rate_recovers_when_a_stream_leaves() -> None:
    rt = card(time_scale=TS)
    short, long = await asyncio.gather(run(rt, body(max_tokens=60)), run(rt, body(max_tokens=700)))
    # after the short stream ended, the long one runs alone at ~440 tok/s
    end = short.last + 0.05  # past the tick in which the rate is recomputed
    # Leave out the last batch: a stall just before it would stretch the span while the tokens left
    # to emit are capped by max_tokens, understating the rate for reasons that are not the card's.
    after = [(t, k) for (t, k) in long.token_times if t > end][:-1]
    span = after[-1][0] - after[0][0]
    rate = sum(k for _, k in after[1:]) / span / TS
    assert rate >= 440 * 0.75, rate


async def test_ttft_rises_with_concurrency() -> None:
    rt = card(time_scale=TS, ttft_per_stream_s=0.25)
    idle = (await run(rt, body(max_tokens=2))).first * TS
    # four arrivals a few ms apart: each sees the earlier ones active
    traces = await asyncio.gather(*(run(rt, body(max_tokens=2), delay=0.004 * i) for i in range(4)))
    ttfts = [t.first * TS for t in traces]
    assert ttfts[3] - idle >= 0.5, (idle, ttfts)  # 3 others x 0.25 s, less generous slack
    assert ttfts[3] > ttfts[0]


async def test_prefill_is_queued_behind_others() -> None:
    rt = card(time_scale=TS)
    big = body(max_tokens=2, chars=4 * 24000)  # 1.0 s of prefill each
    a, b = await asyncio.gather(run(rt, big), run(rt, big, delay=0.005))
    assert b.first * TS - a.first * TS >= 0.7, (a.first * TS, b.first * TS)


async def test_jitter_is_small_and_seeded() -> None:
    def mk() -> SimulatedRuntime:
        return SimulatedRuntime(CardProfile(time_scale=200.0, jitter=0.03, stop_rate=0.3), rng=random.Random(11))

    a, b = await run(mk(), body(max_tokens=50)), await run(mk(), body(max_tokens=50))
    assert a.content() == b.content() and a.tokens == b.tokens


# ---- faults ---------------------------------------------------------------------------------------


async def test_fail_rate_raises_before_any_frame() -> None:
    rt = card(time_scale=50.0, fail_rate=1.0)
    gen = rt.stream(body())
    with pytest.raises(RuntimeFailure) as ei:
        await gen.__anext__()
    assert ei.value.status == 500
    assert rt.active == 0


async def test_hang_delays_first_token() -> None:
    rt = card(time_scale=TS, hang_s=2.0)
    tr = await run(rt, body(max_tokens=2))
    assert tr.first * TS >= 2.4


async def test_drop_after_tokens_ends_without_done() -> None:
    rt = card(time_scale=50.0, drop_after_tokens=5)
    tr = await run(rt, body(max_tokens=50))
    assert tr.tokens == 5
    assert "[DONE]" not in tr.events
    assert not any(isinstance(e, dict) and e.get("choices") and e["choices"][0].get("finish_reason")
                   for e in tr.events)


async def test_garbage_overlong_nan() -> None:
    rt = card(time_scale=50.0, garbage=1.0)
    assert any(isinstance(e, tuple) for e in (await run(rt, body(max_tokens=5))).events)
    rt = card(time_scale=50.0, overlong=1.0)
    assert (await run(rt, body(max_tokens=16))).tokens > 16
    rt = card(time_scale=50.0, nan_usage=1.0)
    tr = await run(rt, body(max_tokens=4))
    usage = [e for e in tr.events if isinstance(e, dict) and "usage" in e][0]["usage"]
    assert usage["prompt_tokens"] != usage["prompt_tokens"]  # NaN


async def test_cancel_mid_stream_frees_active() -> None:
    rt = card(time_scale=TS)
    task = asyncio.create_task(run(rt, body(max_tokens=4000)))
    for _ in range(200):
        await asyncio.sleep(0.01)
        if rt.active:
            break
    assert rt.active == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert rt.active == 0
    # closing the generator (the miner's path on client disconnect) frees it too
    gen = rt.stream(body(max_tokens=4000))
    await gen.__anext__()
    assert rt.active == 1
    await gen.aclose()
    assert rt.active == 0
