"""The miner side of a dispatch (gateway.upstream): what each miner behaviour and its wire bytes are recorded as."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import random
from typing import Any

import pytest
from aiohttp import web
from bittensor.sp_core import Keypair

from gateway.http.client import MinerClient
from gateway.protocol.measurement import FailureReason, MeasurementQueue
from gateway.protocol.openai import SUBNET_SAMPLER
from gateway.protocol.sampling import is_seed
from gateway.protocol.signing import RequestSigner
from gateway.router import Candidate, Router
from gateway.upstream import Upstream, UpstreamTimeouts, refusal
from tests.fakes import MODEL, Script, body, contents, eventually, read_sse

PAYLOAD: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 8}


def _sse(tokens: int) -> bytes:
    chunks: list[dict[str, Any]] = [{"choices": [{"delta": {"content": f"t{i} "}, "finish_reason": None}]}
                                    for i in range(tokens)]
    chunks.append({"choices": [{"delta": {}, "finish_reason": "stop"}]})
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


class RawMiner:
    """A miner written at the byte level: ``answer(request_index)`` is what it writes for each request."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.connections = 0
        self.requests = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> RawMiner:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def endpoint(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                self.requests += 1
                writer.write(self.answer(self.requests))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def _probe_n(endpoint: str, n: int) -> list:
    kp = Keypair.create_from_uri("//Bob")
    router = Router(rng=random.Random(0))
    router.sync([Candidate(uid=1, hotkey=kp.ss58_address, endpoint=endpoint)])
    out = []
    async with MinerClient() as client:
        up = Upstream(client, RequestSigner(Keypair.create_from_uri("//Alice")), MeasurementQueue(),
                      timeouts=UpstreamTimeouts(connect=2.0, first_token=2.0, stall=1.0, total=5.0))
        for _ in range(n):
            lease = router.acquire()
            assert lease is not None
            try:
                out.append(await up.probe(lease, PAYLOAD))
            finally:
                router.release(lease)
            await asyncio.sleep(0.05)
    return out


async def test_a_second_response_in_the_same_read_is_not_merged_and_the_connection_is_dropped() -> None:
    """The hand-written client merged it into the first (status 200 -> 500, bodies joined)."""
    def answer(_: int) -> bytes:
        body = _sse(3)
        first = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        return first + b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 5\r\n\r\nerror"

    async with RawMiner(answer) as miner:
        results = await _probe_n(miner.endpoint, 3)
    assert [(m.ok, m.completion_tokens) for m in results] == [(True, 3)] * 3  # each answer judged alone
    assert miner.connections == 3  # a connection that carried stray bytes is never reused


async def test_a_clean_keep_alive_answer_reuses_its_connection() -> None:
    def answer(_: int) -> bytes:
        body = _sse(2)
        return b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n" % len(body) + body

    async with RawMiner(answer) as miner:
        results = await _probe_n(miner.endpoint, 3)
    assert all(m.ok for m in results)
    assert miner.connections == 1 and miner.requests == 3


async def test_a_response_that_is_not_http_is_the_miners_garbage() -> None:
    async with RawMiner(lambda _: b"SSH-2.0-OpenSSH_9.6\r\n\r\n") as miner:
        [m] = await _probe_n(miner.endpoint, 1)
    assert not m.ok and m.failure == "garbage"


async def test_ttft_clock_starts_at_dispatch_not_headers(make_miner, make_gateway):
    """A miner slow to send headers cannot hide that delay from TTFT."""
    m = await make_miner(Script("ok", tokens=20, headers_delay=0.3, token_delay=0.01))
    h = await make_gateway([m])
    async with h.chat(body(max_tokens=20)) as r:
        events = await read_sse(r)
    assert len(contents(events)) == 20
    [meas] = h.measurements()
    assert meas.ok and meas.completion_tokens == 20
    assert meas.ttft_s is not None and meas.ttft_s >= 0.3
    # the whole answer took the headers' delay and the 19 gaps after the first token, counted from dispatch. Not
    # bounded from the first token: on a loaded machine the validator may read that token late and the next ones in
    # one burst (beside two CPU hogs: 0.15 s after a first token read at 0.35 s)
    assert meas.latency_s >= 0.3 + 19 * 0.01 * 0.9


async def test_concurrent_requests_get_distinct_nonces(make_miner, make_gateway):
    m = await make_miner(Script("ok", tokens=2, token_delay=0.01), slots=32)
    h = await make_gateway([m])

    async def one() -> int:
        async with h.chat(body(stream=False, max_tokens=2)) as r:
            await r.read()
            return r.status

    statuses = await asyncio.gather(*(one() for _ in range(24)))
    assert statuses == [200] * 24
    assert m.auth_failures == 0 and m.requests == 24


@pytest.mark.parametrize(
    ("script", "reason"),
    [
        (Script("garbage"), FailureReason.GARBAGE),
        (Script("nan"), FailureReason.GARBAGE),
        (Script("invalid_utf8"), FailureReason.GARBAGE),
        (Script("long_line"), FailureReason.GARBAGE),
        (Script("wrong_shape"), FailureReason.GARBAGE),
        (Script("overlong", tokens=12), FailureReason.OVERLONG),
        (Script("hang_headers"), FailureReason.TIMEOUT),
        (Script("hang_first"), FailureReason.TIMEOUT),
        (Script("stall_after", after=2), FailureReason.TIMEOUT),
        (Script("drop_after", after=2), FailureReason.DROPPED),
        (Script("empty"), FailureReason.EMPTY),
        (Script("http500"), FailureReason.HTTP_STATUS),
        (Script("busy"), FailureReason.REFUSED),  # none of our streams on it: a refusal whatever it declares
        (Script("refuse"), FailureReason.REFUSED),
        (Script("no_done", tokens=3), None),
        (Script("ok", tokens=3), None),
    ],
    ids=lambda v: v.behavior if isinstance(v, Script) else str(v),
)
async def test_probe_records_failure_reason(make_miner, make_gateway, script, reason):
    m = await make_miner(script)
    h = await make_gateway([m])
    lease = h.router.acquire_uid(1)
    assert lease is not None
    try:
        meas = await asyncio.wait_for(h.upstream.probe(lease, body(max_tokens=8)), timeout=15)
    finally:
        h.router.release(lease)
    assert meas.failure == reason and meas.ok is (reason is None) and meas.probe
    assert h.measurements() == [meas]
    if reason == FailureReason.OVERLONG:
        assert meas.completion_tokens == 8
    assert await eventually(lambda: m.active == 0)


async def test_slow_card_measures_slower_than_fast_card(make_sim_miner, make_gateway):
    fast = await make_sim_miner("rtx5090:time_scale=4,jitter=0", slots=1, tag="fast")
    slow = await make_sim_miner("rtx5090-slow:time_scale=4,jitter=0", slots=1, tag="slow")
    h = await make_gateway([fast, slow])
    for _ in range(3):
        for uid in (1, 2):
            lease = h.router.acquire_uid(uid)
            assert lease is not None
            try:
                m = await h.upstream.probe(lease, body(max_tokens=16))
            finally:
                h.router.release(lease)
            assert m.ok and m.completion_tokens >= 8
    ttft = {uid: h.upstream.stats[uid].ttft_p50() for uid in (1, 2)}
    # fast: 0.45 s / 4 = 0.11 s, slow: 0.9 s / 4 = 0.23 s; TTFT is never below the card's own delay
    assert ttft[1] >= 0.10 and ttft[2] >= 0.21
    assert ttft[2] > ttft[1] + 0.05


@pytest.mark.parametrize(
    ("knobs", "reason"),
    [("drop_after_tokens=3", FailureReason.DROPPED), ("garbage=1", FailureReason.GARBAGE),
     ("overlong=1", FailureReason.OVERLONG),
     ("nan_usage=1", FailureReason.GARBAGE), ("fail_rate=1", FailureReason.HTTP_STATUS)],
)
async def test_real_miner_fault_knobs_are_recorded(make_sim_miner, make_gateway, knobs, reason):
    sim = await make_sim_miner(f"rtx5090:time_scale=20,stop_rate=0,{knobs}", slots=1)
    h = await make_gateway([sim])
    lease = h.router.acquire_uid(1)
    assert lease is not None
    try:
        m = await h.upstream.probe(lease, body(max_tokens=16))
    finally:
        h.router.release(lease)
    assert m.failure == reason
    assert await eventually(lambda: sim.server.busy == 0)


async def test_probe_and_organic_bodies_look_alike(make_miner, make_gateway):
    """A miner cannot tell a probe from organic traffic by the request body's shape."""
    m = await make_miner(Script("ok", tokens=2))
    h = await make_gateway([m])
    organic = body(stream=False, max_tokens=2, temperature=0.5)
    async with h.chat(organic) as r:
        assert r.status == 200
    lease = h.router.acquire_uid(1)
    assert lease is not None
    try:  # a probe payload as neurons.validator.prompts builds it: different key order, "stream" already set
        await h.upstream.probe(lease, {"stream": True, "temperature": 0.5, "max_tokens": 2, "model": MODEL,
                                       "messages": organic["messages"]})
    finally:
        h.router.release(lease)
    assert [list(b) for b in m.bodies] == [list(m.bodies[0])] * 2
    seeds = [b.pop("seed") for b in m.bodies]  # every body carries a fresh sampler seed
    assert all(is_seed(s) for s in seeds) and seeds[0] != seeds[1]
    assert m.bodies[0] == m.bodies[1]
    assert [x.probe for x in h.measurements()] == [False, True]


async def test_client_seed_is_keyed_not_forwarded(make_miner, make_gateway):
    """A client's seed reaches the miner keyed by the validator's secret (so it cannot mark organic
    traffic), the same client seed gives the same wire seed, and the answer is audited with the wire seed."""
    m = await make_miner(Script("ok", tokens=2))
    h = await make_gateway([m])
    h.upstream.limits = dataclasses.replace(h.upstream.limits, keep_answers=True)
    for seed in (7, 7, 8, None, -3, -3):
        extra = {} if seed is None else {"seed": seed}
        async with h.chat(body(stream=False, max_tokens=2, temperature=0.5, **extra)) as r:
            assert r.status == 200
    sent = [b["seed"] for b in m.bodies]
    assert all(is_seed(s) for s in sent)
    assert sent[0] == sent[1] and sent[4] == sent[5] and len(set(sent)) == 4 and 7 not in sent and 8 not in sent
    # the first answer went out before the miner declared the subnet's sampler: a free draw, audited without seed
    assert [x.answer.sampling.seed for x in h.measurements() if x.answer is not None] == [None, *sent[1:]]
    assert [x.free_draw for x in h.measurements()] == [True] + [False] * 5


@pytest.mark.parametrize("declared", [SUBNET_SAMPLER, None, "tensorgate-gumbel/0"])
async def test_only_a_miner_that_declares_the_subnet_sampler_has_its_sampled_answers_seeded(
        make_miner, make_gateway, declared):
    """Every miner gets a seed; a sampled answer is audited with it (and paid) only when the miner's previous
    answer declared the subnet's sampler. Greedy answers are determined either way: never free draws."""
    m = await make_miner(Script("ok", tokens=2))
    m.sampler = declared
    h = await make_gateway([m])
    h.upstream.limits = dataclasses.replace(h.upstream.limits, keep_answers=True)
    for temperature in (0.7, 0.7, 0.0, 0.7):
        async with h.chat(body(stream=False, max_tokens=2, temperature=temperature)) as r:
            assert r.status == 200
    assert all(is_seed(b.get("seed")) for b in m.bodies)
    got = h.measurements()
    seeded = declared == SUBNET_SAMPLER
    assert [x.free_draw for x in got] == [True, not seeded, False, not seeded]
    assert [x.answer is not None and x.answer.sampling.seeded for x in got] == [False, seeded, False, seeded]
    miner = h.router.get(1)
    assert miner is not None and miner.declares_sampler is seeded


async def test_unseeded_limits_forward_the_clients_seed_only(make_miner, make_gateway):
    m = await make_miner(Script("ok", tokens=2))
    h = await make_gateway([m])
    h.upstream.limits = dataclasses.replace(h.upstream.limits, seeded_sampling=False)
    for extra in ({"seed": 7}, {}):
        async with h.chat(body(stream=False, max_tokens=2, temperature=0.5, **extra)) as r:
            assert r.status == 200
    assert [b.get("seed") for b in m.bodies] == [7, None]


async def test_decode_concurrency_counts_requests_that_join_mid_stream(make_sim_miner, make_gateway):
    """A request that a second one joins mid-decode ran at 1 < concurrency < 2, and an honest card
    earns full decode credit for it; the dispatch-time count (1) would have called it slow."""
    from scoring.credit import CreditConfig, decode_credit

    sim = await make_sim_miner("rtx5090:time_scale=4,jitter=0,stop_rate=0", slots=2)
    h = await make_gateway([sim], timeouts=UpstreamTimeouts(first_token=10.0, stall=5.0, total=30.0))
    lease_a = h.router.acquire_uid(1)
    assert lease_a is not None
    joined: asyncio.Task | None = None

    async def second() -> None:
        lease_b = h.router.acquire_uid(1)
        assert lease_b is not None
        try:
            await h.upstream.probe(lease_b, body(max_tokens=300))
        finally:
            h.router.release(lease_b)

    try:
        stream = await h.upstream.open(lease_a, body(max_tokens=900))
        async with stream:
            while batch := await stream.next_batch():
                if joined is None and stream.tokens >= 100 and any(c.content for c in batch):
                    joined = asyncio.create_task(second())
        await joined
    finally:
        h.router.release(lease_a)
    a = stream.measurement
    assert a is not None and a.ok and a.in_flight == 0
    assert a.concurrency is not None and 1.1 < a.concurrency < 1.95
    cfg = CreditConfig()
    assert a.ttft_s is not None
    rate = (a.completion_tokens - 1) / (a.latency_s - a.ttft_s)  # the card's own rate, from its first token
    # the sim runs 4x fast: scale the rate back to real seconds before judging it
    assert decode_credit(rate / 4, a.decode_concurrency, cfg) == pytest.approx(1.0)
    assert decode_credit(rate / 4, a.in_flight + 1, cfg) < 1.0


async def test_next_batch_returns_each_read_then_ends_without_waiting(make_miner, make_gateway):
    m = await make_miner(Script("ok", tokens=6))
    h = await make_gateway([m])
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
    lease = h.router.acquire()
    assert lease is not None
    try:
        async with await h.upstream.open(lease, payload) as stream:
            chunks = []
            while batch := await stream.next_batch():
                assert batch  # a read without chunks is not returned as an empty batch
                chunks += batch
            assert stream.ok and stream.tokens == 6
            assert await asyncio.wait_for(stream.next_batch(), 0.5) == []  # ended: never waits again
    finally:
        h.router.release(lease)
    assert [c.content for c in chunks if c.content] == [m.token(i) for i in range(6)]
    assert [x.ok for x in h.measurements()] == [True]


async def test_a_served_request_leaves_no_cycle_for_the_garbage_collector(make_miner, make_gateway):
    """Everything a request holds is freed by refcounting as it ends. Two cycles made each request's objects
    (about 40: its stream, meter, lease, measurement, aiohttp's request) garbage that only the collector could
    free: the stream's deadline held the stream's own method, and the server's write watchdog was a closure that
    scheduled itself. At 162 requests a second they made 11-12 gen-1 collections of 5-7 ms every 10 s."""
    m = await make_miner(Script("ok", tokens=4))
    h = await make_gateway([m])

    async def serve(n: int) -> None:
        for _ in range(n):
            async with h.chat(body(max_tokens=4)) as r:
                assert len(contents(await read_sse(r))) == 4
        for _ in range(5):
            await asyncio.sleep(0)  # the handlers' last steps after the client read the end

    await serve(2)  # warm: pools, caches, first-use state
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        await serve(10)
        assert len(h.measurements()) == 12
        gc.collect()
        ours = [type(o).__qualname__ for o in gc.garbage
                if type(o).__module__.startswith(("gateway.", "scoring.")) or isinstance(o, web.BaseRequest)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert ours == []


async def test_deadline_moves_with_events_and_total_still_caps(make_miner, make_gateway):
    """The one timer per stream is re-armed as tokens arrive (a slow-but-steady stream lives on), yet
    ``total`` ends a stream that never stalls."""
    steady = await make_miner(Script("ok", tokens=12, token_delay=0.1))  # ~1.1 s, gaps far below the stall
    h = await make_gateway([steady], timeouts=UpstreamTimeouts(connect=2.0, first_token=0.6, stall=0.6, total=15.0))
    async with h.chat(body(max_tokens=12)) as r:
        events = await asyncio.wait_for(read_sse(r), timeout=10)
    assert contents(events) == [steady.token(i) for i in range(12)] and events[-1] == "[DONE]"
    assert [x.ok for x in h.measurements()] == [True]

    capped = await make_gateway([steady], timeouts=UpstreamTimeouts(connect=2.0, first_token=0.6, stall=0.6,
                                                                      total=0.5))
    async with capped.chat(body(max_tokens=12)) as r:
        events = await asyncio.wait_for(read_sse(r), timeout=10)
    assert 1 <= len(contents(events)) < 12
    assert events[-2]["error"]["code"] == "upstream_timeout" and events[-1] == "[DONE]"
    assert [x.failure for x in capped.measurements()] == [FailureReason.TIMEOUT]
    assert await eventually(lambda: steady.active == 0)


async def test_slot_count_advertised_by_the_miner_reaches_the_router(make_sim_miner, make_gateway):
    sim = await make_sim_miner("rtx5090:time_scale=20", slots=3)
    h = await make_gateway([sim])
    h.upstream.on_slots = h.router.learn_slots
    h.router.learn_slots(h.router.get(1), 1)  # as the validator starts: the metagraph carries no slot count
    assert h.router.get(1).slots == 1
    lease = h.router.acquire_uid(1)
    try:
        m = await h.upstream.probe(lease, body(max_tokens=8))
    finally:
        h.router.release(lease)
    assert m.ok
    assert h.router.get(1).slots == 3


def test_a_429_is_judged_on_the_slots_declared_before_the_request() -> None:
    """Issue 23: a 429 with none of this validator's streams on the miner is a refusal, one slot or four."""
    assert refusal(0, 1) == FailureReason.REFUSED and refusal(0, 4) == FailureReason.REFUSED
    assert refusal(1, 1) == FailureReason.BUSY and refusal(3, 4) == FailureReason.BUSY  # full, within the slack
    assert refusal(1, 4) == FailureReason.REFUSED  # two of its four slots were free


async def test_a_refusals_own_slot_header_does_not_excuse_it(make_miner, make_gateway):
    """The miner declared 4 slots on its answers; its 429 says 1. Judged on the 4 it declared (issue 23)."""
    m = await make_miner(Script("busy"))  # every 429 declares as many slots as the caller uses
    h = await make_gateway([m])
    miner = h.router.get(1)
    assert miner is not None
    h.router.learn_slots(miner, 4)  # what its answers said
    held = h.router.acquire_uid(1)  # one of our streams is on it
    lease = h.router.acquire_uid(1)
    assert held is not None and lease is not None and lease.slots_at_dispatch == 4
    try:
        meas = await asyncio.wait_for(h.upstream.probe(lease, body(max_tokens=8)), timeout=15)
    finally:
        h.router.release(lease)
        h.router.release(held)
    assert meas.failure == FailureReason.REFUSED  # old code: the header's "1" made it BUSY


async def test_a_stream_left_hanging_is_not_load(make_miner, make_gateway):
    """Issue 23: streams a miner leaves open before their first byte used to count as the concurrency its
    other streams were judged at (a miner leaving check streams open read as 6 cards)."""
    m = await make_miner(Script("ok", tokens=20, token_delay=0.01), slots=8)
    h = await make_gateway([m])
    hanging = [h.router.acquire_uid(1) for _ in range(5)]  # in flight on the miner, never delivering
    lease = h.router.acquire_uid(1)
    assert lease is not None and all(x is not None for x in hanging)
    try:
        meas = await asyncio.wait_for(h.upstream.probe(lease, body(max_tokens=20)), timeout=15)
    finally:
        h.router.release(lease)
        for x in hanging:
            assert x is not None
            h.router.release(x)
    assert meas.ok and meas.in_flight == 5
    assert meas.concurrency == pytest.approx(1.0)  # only itself delivered
    miner = h.router.get(1)
    assert miner is not None and miner.delivering == 0 and miner.in_flight == 0
