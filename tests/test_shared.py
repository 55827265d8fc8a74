"""State shared by gateway processes through a real Redis (gateway.shared): leases, key limits, measurements, routing.

Two "processes" here are two independent sets of objects, each with its own Redis connection, in one event loop:
what one holds in Redis the other sees only through Redis. Real processes and kill -9 are in test_scale_out.py.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from gateway.protocol.measurement import Answer, FailureReason, Measurement
from gateway.protocol.sampling import SamplingParams
from gateway.quota import KeyPolicy, QuotaBook, Refusal, Ticket, ratelimit_headers, utc_day
from gateway.router import Candidate, Router
from gateway.shared.leases import SharedLeases
from gateway.shared.limits import SharedLimits, SharedTicket
from gateway.shared.link import RedisLink
from gateway.shared.measurements import MeasurementPublisher, MeasurementReader
from gateway.shared.routing import RoutingFollower, publish, view
from tests.redis_server import RedisServer, free_port

NS = "tensorgate:test"
MINERS = [Candidate(uid=1, hotkey="hk-a", endpoint="127.0.0.1:1", slots=2),
          Candidate(uid=2, hotkey="hk-b", endpoint="127.0.0.1:2", slots=2)]


def _router(seed: int = 0) -> Router:
    r = Router(rng=random.Random(seed))
    r.sync(MINERS)
    return r


Links = Callable[..., list[RedisLink]]


@pytest.fixture
async def links(redis_url: str) -> AsyncIterator[Links]:
    """``links(n)``: n connections to the test's Redis, as n processes would hold; all closed after the test."""
    made: list[RedisLink] = []

    def make(n: int = 2) -> list[RedisLink]:
        new = [RedisLink(redis_url, NS) for _ in range(n)]
        made.extend(new)
        return new

    yield make
    for link in made:
        await link.aclose()


async def test_a_miners_declared_slots_hold_across_processes(links: Links) -> None:
    a_link, b_link = links()
    a, b = _router(1), _router(2)
    la, lb = SharedLeases(a_link, a, name="a"), SharedLeases(b_link, b, name="b")
    held = []
    for router, leases in ((a, la), (b, lb)):  # one each on uid 1: its two slots
        lease = router.acquire_uid(1)
        assert lease is not None and await leases.hold(lease)
        held.append((router, lease))
    assert held[1][1].in_flight_at_dispatch == 1  # the other process's stream counts at dispatch
    third = a.acquire_uid(1)
    assert third is not None and not await la.hold(third)  # full subnet-wide
    a.release(third)
    assert a.get(1).elsewhere == 1  # type: ignore[union-attr]  # the refusal told A what B holds
    # what A's router picks now: uid 2 only (uid 1 is full subnet-wide)
    assert {a.pick().uid for _ in range(20)} == {2}  # type: ignore[union-attr]
    router, lease = held[1]
    router.release(lease, served=True)  # B's release is mirrored in the background
    await lb.flush()
    await la.refresh()
    assert a.get(1).elsewhere == 0  # type: ignore[union-attr]
    again = a.acquire_uid(1)
    assert again is not None and await la.hold(again)


async def test_a_dead_processs_leases_expire_and_a_live_ones_are_renewed(links: Links) -> None:
    a_link, b_link = links()
    a, b = _router(), _router()
    dead = SharedLeases(a_link, a, name="dead", ttl_s=1.0)
    live = SharedLeases(b_link, b, name="live", ttl_s=1.0, refresh_s=0.05)
    runner = asyncio.create_task(live.run())  # renews every third of the ttl; `dead` never runs: killed
    try:
        for router, leases in ((a, dead), (b, live)):
            lease = router.acquire_uid(1)
            assert lease is not None and await leases.hold(lease)
        probe = a.acquire_uid(1)
        assert probe is not None and not await dead.hold(probe)
        a.release(probe)
        await asyncio.sleep(1.6)  # past the ttl: the dead one's lease is gone, the live one's renewed
        again = a.acquire_uid(1)
        assert again is not None and await dead.hold(again)
        assert again.in_flight_at_dispatch == 1  # the live process's lease is still there
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


async def test_decode_concurrency_counts_every_process_delivering_streams(links: Links) -> None:
    a_link, b_link = links()
    a, b = _router(), _router()
    la, lb = SharedLeases(a_link, a, name="a"), SharedLeases(b_link, b, name="b")
    lease = b.acquire_uid(1)
    assert lease is not None and await lb.hold(lease)
    lease.start_delivering()
    await lb.flush()
    await la.refresh()
    m = a.get(1)
    assert m is not None and (m.elsewhere, m.elsewhere_delivering) == (1, 1)
    b.release(lease)
    await lb.flush()
    await la.refresh()
    assert (m.elsewhere, m.elsewhere_delivering) == (0, 0)


async def test_redis_down_routes_on_local_counts_and_says_so_once() -> None:
    link = RedisLink(f"redis://127.0.0.1:{free_port()}/0", NS, timeout_s=0.2, retry_s=30.0)
    r = _router()
    leases = SharedLeases(link, r)
    try:
        for _ in range(5):
            lease = r.acquire_uid(1)
            assert lease is not None and await leases.hold(lease)  # local counts decide, as with one process
            assert lease.token is None
        assert link.outages == 1 and link.failures == 1  # one failed call, then no I/O until retry_s
    finally:
        await link.aclose()


async def test_key_limits_hold_across_processes(links: Links) -> None:
    a_link, b_link = links()
    a, b = SharedLimits(a_link, QuotaBook(), share=2), SharedLimits(b_link, QuotaBook(), share=2)
    policy = KeyPolicy("alice", rpm=6)
    got = [await (a if i % 2 else b).admit(policy, 10) for i in range(8)]
    admitted = [g for g in got if isinstance(g, SharedTicket)]
    refused = [g for g in got if isinstance(g, Refusal)]
    assert len(admitted) == 6 and len(refused) == 2
    assert refused[0].limit == "requests per minute" and 1 <= refused[0].retry_after_s <= 60
    # where the key stands over every process, for the x-ratelimit-* headers: the sixth left none of six
    assert [t.standing.requests for t in admitted if t.standing is not None] == [1, 2, 3, 4, 5, 6]
    assert admitted[-1].standing is not None and 0 < admitted[-1].standing.requests_reset_s <= 60
    assert ratelimit_headers(policy, admitted[-1].standing)["x-ratelimit-remaining-requests"] == "0"
    assert refused[0].standing is not None and refused[0].standing.requests == 6
    streams = KeyPolicy("bob", streams=2)
    t1, t2 = await a.admit(streams, 1), await b.admit(streams, 1)
    assert isinstance(t1, SharedTicket) and isinstance(t2, SharedTicket)
    third = await a.admit(streams, 1)
    assert isinstance(third, Refusal) and third.limit == "concurrent streams"
    b.settle(t2, 1)
    await b.flush()
    assert isinstance(await a.admit(streams, 1), SharedTicket)


async def test_token_limits_charge_the_reservation_then_what_was_used(links: Links) -> None:
    a_link, b_link = links()
    a, b = SharedLimits(a_link, QuotaBook()), SharedLimits(b_link, QuotaBook())
    policy = KeyPolicy("carol", tpm=1000, tpd=1500)
    t = await a.admit(policy, 800)
    assert isinstance(t, SharedTicket)
    over = await b.admit(policy, 300)  # 800 reserved elsewhere: 1,100 > 1,000 a minute
    assert isinstance(over, Refusal) and over.limit == "tokens per minute"
    a.settle(t, 100)  # it used 100: 700 back in the minute and the day
    await a.flush()
    t2 = await b.admit(policy, 300)
    assert isinstance(t2, SharedTicket)
    b.settle(t2, 300)
    await b.flush()
    fill = await a.admit(policy, 600)  # 400 + 600: the minute exactly full
    assert isinstance(fill, SharedTicket)
    one_more = await b.admit(policy, 1)
    assert isinstance(one_more, Refusal) and one_more.limit == "tokens per minute"
    daily = KeyPolicy("frank", tpd=1000)
    first = await a.admit(daily, 700)
    assert isinstance(first, SharedTicket)
    refused = await b.admit(daily, 400)
    assert isinstance(refused, Refusal) and refused.limit == "tokens per day" and refused.retry_after_s >= 1
    a.settle(first, 200)  # used 200 of its 700: the day has 800 left
    await a.flush()
    assert isinstance(await b.admit(daily, 400), SharedTicket)
    too_big = await b.admit(policy, 1001)
    assert isinstance(too_big, Refusal) and "more than the 1000 a minute allows" in too_big.detail


async def test_a_keys_use_today_is_every_processs_as_redis_counts_it(links: Links) -> None:
    a_link, b_link = links()
    a, b = SharedLimits(a_link, QuotaBook()), SharedLimits(b_link, QuotaBook())
    policy = KeyPolicy("grace", streams=4, tpd=10_000)
    now = time.time()  # one day for every call, whenever the test runs
    assert await a.usage("grace", now) == {"day": utc_day(now), "requests_today": 0, "tokens_today": 0,
                                           "in_flight": 0}
    first, second = await a.admit(policy, 100, now), await b.admit(policy, 300, now)
    assert isinstance(first, SharedTicket) and isinstance(second, SharedTicket)
    used = await b.usage("grace", now)
    assert used is not None and (used["requests_today"], used["tokens_today"], used["in_flight"]) == (2, 400, 2)
    a.settle(first, 40, now)  # used 40 of its 100; its stream ends
    await a.flush()
    used = await a.usage("grace", now)
    assert used is not None and (used["requests_today"], used["tokens_today"], used["in_flight"]) == (2, 340, 1)


async def test_redis_down_admits_a_local_share_of_each_limit() -> None:
    link = RedisLink(f"redis://127.0.0.1:{free_port()}/0", NS, timeout_s=0.2, retry_s=30.0)
    limits = SharedLimits(link, QuotaBook(), share=4)
    try:
        got = [await limits.admit(KeyPolicy("dave", rpm=20), 1) for _ in range(7)]
        assert sum(isinstance(g, Ticket) for g in got) == 5  # 20 / 4 processes
        assert isinstance(got[-1], Refusal)
        unlimited = await limits.admit(KeyPolicy("erin"), 1)
        assert isinstance(unlimited, Ticket)  # keys without limits never need Redis
        assert link.outages == 1
    finally:
        await link.aclose()


async def test_a_fallback_share_is_cut_from_what_the_key_had_used_when_redis_went_away(links: Links) -> None:
    """Issue 39 row 6: each process's fallback share ignored what the key had already used (rpm key 72 of 60,
    tpd key 3,480 of 3,000 across an outage). Two processes use 8 of a key's 10 requests a minute through Redis,
    then Redis goes away: together they admit at most the 2 left, and nothing more within that minute."""
    a_link, b_link = links()
    a, b = SharedLimits(a_link, QuotaBook(), share=2), SharedLimits(b_link, QuotaBook(), share=2)
    policy = KeyPolicy("frank", rpm=10, tpd=1000)
    now = time.time()
    for i in range(8):
        assert isinstance(await (a if i % 2 else b).admit(policy, 10, now), SharedTicket)
    for link in (a_link, b_link):
        link.failed(OSError("redis went away"))
    later = now + 1.0
    admitted = [await lim.admit(policy, 10, later) for lim in (a, b) for _ in range(6)]
    assert sum(isinstance(t, Ticket) for t in admitted) <= 2  # 10 - 8 left, however the processes split it
    assert a.fallbacks + b.fallbacks == 12
    # a minute on, the per-minute window is the whole share again; the daily tokens stay cut (80 of 1000 used)
    share = a.local_share(policy, now + 61.0)
    assert share.rpm == 5 and share.tpd == (1000 - 80) // 2


async def test_a_request_for_n_answers_holds_n_streams_across_processes(links: Links) -> None:
    """Issue 39 row 7, with Redis: n=3 holds 3 of a key's 4 streams subnet-wide (members ticket#1..#3), renewed
    and freed together; another process's n=2 is refused until they are freed."""
    a_link, b_link = links()
    a, b = SharedLimits(a_link, QuotaBook(), share=2), SharedLimits(b_link, QuotaBook(), share=2)
    policy = KeyPolicy("gina", streams=4)
    three = await a.admit(policy, 10, streams=3)
    assert isinstance(three, SharedTicket) and three.streams == 3
    refused = await b.admit(policy, 10, streams=2)
    assert isinstance(refused, Refusal) and "asks for 2 streams" in refused.detail and "3 of 4" in refused.detail
    one = await b.admit(policy, 10)
    assert isinstance(one, SharedTicket)
    used = await a.usage("gina")
    assert used is not None and used["in_flight"] == 4
    a.settle(three, 10)
    await a.flush()
    again = await b.admit(policy, 10, streams=3)
    assert isinstance(again, SharedTicket)  # the 3 were freed at settle
    assert isinstance(await b.admit(KeyPolicy("hank", streams=1), 10, streams=8), Refusal)


def _measurement(i: int, *, answer: bool = False) -> Measurement:
    kept = Answer(messages=[{"role": "user", "content": f"q{i}"}], sampling=SamplingParams(0.7, 0.9, False, 42),
                  max_tokens=8, stop=(), text=f"a{i}", token_ids=(1, 2), finish_reason="stop") if answer else None
    return Measurement(uid=i % 3, hotkey=f"hk{i}", in_flight=0, prompt_tokens=5, max_tokens=8, ttft_s=0.1,
                       latency_s=0.3, completion_tokens=2, ok=i % 4 != 0,
                       failure=None if i % 4 else FailureReason.DROPPED, concurrency=1.0, answer=kept)


async def test_measurements_reach_the_scorer_whole_and_unacknowledged_ones_come_back(links: Links) -> None:
    pub_link, scorer_link, again_link = links(3)
    pub = MeasurementPublisher(pub_link)
    sent = [_measurement(i, answer=i % 2 == 0) for i in range(30)]
    for m in sent:
        pub.record(m)
    assert await pub.send() == 30
    first = MeasurementReader(scorer_link)
    got = await first.pull()
    assert got == sent and [m.answer for m in got] == [m.answer for m in sent]  # answers travel for the audit
    assert all(m.ref for m in got)
    assert await first.ack([m.ref for m in got[:10] if m.ref])  # the round holding these was saved
    # the scorer dies before saving the rest; its successor reads exactly those again, then new ones
    late = _measurement(99)
    pub.record(late)
    await pub.send()
    second = MeasurementReader(again_link)
    assert await second.pull() == [*sent[10:], late]
    assert await second.pull() == []


async def test_redis_down_measurements_wait_in_a_bounded_buffer_and_go_when_it_is_back() -> None:
    server = RedisServer().start()
    link = RedisLink(server.url, NS, timeout_s=0.3, retry_s=0.2)
    reader_link = RedisLink(server.url, NS)
    pub = MeasurementPublisher(link, max_buffer=50)
    try:
        server.kill()
        for i in range(60):
            pub.record(_measurement(i))
        assert await pub.send() == 0 and len(pub) == 50 and pub.dropped == 10  # bounded, the loss counted
        server.start()
        await asyncio.sleep(0.25)  # retry_s
        assert await pub.send() == 50 and len(pub) == 0
        got = await MeasurementReader(reader_link).pull()
        assert [m.hotkey for m in got] == [f"hk{i}" for i in range(10, 60)]
        assert link.outages == 1  # logged once down, once back
    finally:
        await link.aclose()
        await reader_link.aclose()
        server.kill()


async def test_garbage_on_the_stream_is_skipped_not_fatal(links: Links) -> None:
    link, = links(1)
    pub = MeasurementPublisher(link)
    pub.record(_measurement(1))
    await pub.send()
    await link.redis.xadd(pub.key, {b"m": b"\x00not msgpack"})
    await link.redis.xadd(pub.key, {b"other": b"x"})
    pub.record(_measurement(2))
    await pub.send()
    reader = MeasurementReader(link)
    got = await reader.pull()
    assert [m.hotkey for m in got] == ["hk1", "hk2"] and reader.unreadable == 2


async def test_gateways_route_by_the_view_the_scorer_publishes(links: Links) -> None:
    pub_link, sub_link = links()
    scorer, gateway = _router(), Router(rng=random.Random(3))
    scorer.set_scores({"hk-a": 0.9, "hk-b": 0.0})
    scorer.set_quarantined({"hk-b"})
    a = scorer.get(1)
    assert a is not None
    scorer.learn_offer(a, frozenset({"org/m"}), frozenset({"tools"}))
    assert await publish(pub_link, view(scorer))
    follower = RoutingFollower(sub_link, gateway)
    assert await follower.follow_once() and not await follower.follow_once()  # applied once, then unchanged
    ga, gb = gateway.get(1), gateway.get(2)
    assert ga is not None and gb is not None
    assert (ga.score, ga.models, ga.features, gb.quarantined) == (0.9, frozenset({"org/m"}),
                                                                  frozenset({"tools"}), True)
    assert gateway.routable() == 1


async def test_relay_waits_for_room_when_other_processes_fill_every_slot(links: Links) -> None:
    """The relay's lease step: every miner full elsewhere, the request waits (bounded) and then gets one."""
    from gateway.relay import Relay, RelayConfig

    a_link, b_link = links()
    a, b = _router(), _router()
    la, lb = SharedLeases(a_link, a, name="a", refresh_s=0.05), SharedLeases(b_link, b, name="b")
    runner = asyncio.create_task(la.run())
    try:
        held = []
        for uid in (1, 2):
            for _ in range(2):  # each miner's two slots
                lease = b.acquire_uid(uid)
                assert lease is not None and await lb.hold(lease)
                held.append(lease)
        relay = Relay(RelayConfig(), a, None, None)  # type: ignore[arg-type]  # only its lease step runs here
        relay.leases = la

        class Req:
            model = None
            needs: frozenset[str] = frozenset()
            sampled = False
            max_tokens = 64
            prompt_tokens = 10

        loop = asyncio.get_running_loop()
        assert await relay._acquire(Req(), set(), loop.time() + 0.3) is None  # type: ignore[arg-type]
        waiting = asyncio.create_task(relay._acquire(Req(), set(), loop.time() + 5.0))  # type: ignore[arg-type]
        await asyncio.sleep(0.2)
        b.release(held[0])
        await lb.flush()
        lease = await waiting
        assert lease is not None and lease.miner.uid == 1 and lease.token is not None
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


def _slow_reply(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` (a Redis script) whose answer comes back 50 ms after the script ran: the network, slowed down."""
    async def slow(**kw: Any) -> Any:
        got = await call(**kw)
        await asyncio.sleep(0.05)
        return got

    return slow


async def test_a_client_that_leaves_while_its_lease_is_taken_leaves_no_lease_behind(links: Links) -> None:
    """Cancelled after the script ran but before its answer came back (the slow reply stands in for the network):
    the lease the script added is given back, not left to hold a slot until it expires."""
    link, = links(1)
    r = _router()
    leases = SharedLeases(link, r, name="a")
    leases._take = _slow_reply(leases._take)  # type: ignore[assignment]
    for _ in range(3):
        lease = r.acquire_uid(1)
        assert lease is not None
        task = asyncio.create_task(leases.hold(lease))
        await asyncio.sleep(0.02)  # the script has run; its answer is "on the way"
        assert await link.redis.zcard(link.key("lease", "hk-a")) == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        r.release(lease)
        await leases.flush()
        assert await link.redis.zcard(link.key("lease", "hk-a")) == 0


async def test_a_client_that_leaves_while_admitted_leaves_no_stream_of_its_key_behind(links: Links) -> None:
    link, = links(1)
    limits = SharedLimits(link, QuotaBook())
    admit = limits._admit
    limits._admit = _slow_reply(admit)  # type: ignore[assignment]
    policy = KeyPolicy("gina", streams=1)
    task = asyncio.create_task(limits.admit(policy, 10))
    await asyncio.sleep(0.02)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await limits.flush()
    limits._admit = admit
    assert isinstance(await limits.admit(policy, 10), SharedTicket)  # its one stream is free again


async def test_a_batch_sent_again_after_a_failure_is_read_once(links: Links) -> None:
    """Redis may take part of a pipeline whose reply is lost; the publisher sends it all again. Paying a
    measurement twice would pay the miner twice: the reader keeps one of each."""
    link, = links(1)
    pub = MeasurementPublisher(link)
    for i in range(3):
        pub.record(_measurement(i))
    again = list(pub._buffer)
    assert await pub.send() == 3
    pub._buffer.extend(again)  # the same entries, as a retry after a lost reply sends them
    assert await pub.send() == 3
    reader = MeasurementReader(link)
    got = await reader.pull()
    assert [m.hotkey for m in got] == ["hk0", "hk1", "hk2"] and reader.duplicates == 3


async def test_a_key_used_up_through_redis_gets_at_most_5_percent_more_with_redis_down(links: Links) -> None:
    """Issue 56: a key used up through Redis by bursts over two processes still got 8-14 more a minute of its 60 with
    Redis down (1.13-1.23x): a process whose requests Redis refused kept the view of its last admission, and its
    fallback share was cut from that. A refusal now tells the process the key's use too. Bursts of 80, 16 at once,
    each request to either process at random, before and right after Redis goes: within the minute, at most 1.05x."""
    a_link, b_link = links()
    procs = [SharedLimits(a_link, QuotaBook(), share=2), SharedLimits(b_link, QuotaBook(), share=2)]
    rng = random.Random(5)
    now = time.time()
    for seed in range(3):
        policy = KeyPolicy(f"used-up-{seed}", rpm=60)
        admitted = 0

        async def burst(tag: str) -> None:
            nonlocal admitted
            gate = asyncio.Semaphore(16)

            async def one() -> None:
                nonlocal admitted
                async with gate:
                    got = await rng.choice(procs).admit(policy, 1, now + 1.0)  # noqa: B023
                    admitted += not isinstance(got, Refusal)

            await asyncio.gather(*(one() for _ in range(80)))

        await burst("redis up")
        assert admitted == 60
        for link in (a_link, b_link):
            link.failed(OSError("redis went away"))
        await burst("redis down")
        assert admitted <= 63, f"{admitted} of 60 admitted in the minute ({admitted / 60:.2f}x)"
        for link in (a_link, b_link):
            link.worked()
