"""Runs one scenario under one router: real gateway, router, reference miners, probes and scorer.

Everything talks over loopback ephemeral ports: the simulated cards behind
:func:`neurons.miner.server.start_miner` (:mod:`soak_lib.cards`: on this event loop, or apart in a process of their
own where the scenario says so, so the gateway's lag is not the cards'); the validator's serving path as
:func:`neurons.validator.build.build_parts` wires it, with the router under test; its scorer fed
through :class:`soak_lib.timescale.TimeScaledSink`; probes from :class:`neurons.validator.probes.ProbeRunner`,
and organic clients posting to the gateway over HTTP. Each round: events (degrade, die, revive),
traffic and probes for ``round_s``, drain, ``close_round``, routing scores and weights republished.

Example::

    result = asyncio.run(run_scenario(build_scenarios()["burst"], "project", RunOptions(scale=20.0)))
    result.series["card-a"].share       # per-round organic share
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from bittensor.sp_core import Keypair
from loguru import logger

from gateway.protocol.measurement import Measurement, MeasurementQueue
from gateway.router import Candidate, Router
from gateway.upstream import UpstreamTimeouts
from neurons.reference.toy import ToyReference
from neurons.validator.build import build_parts
from neurons.validator.config import ValidatorConfig
from neurons.validator.probes import ProbeRunner
from neurons.validator.prompts import PromptGenerator
from scoring.rounds import percentile
from scoring.scorer import Scorer

from .cards import Cards, CardsApart, MinerInfo, cancelled
from .cheaters import SELF_MARK, ProbeOracle
from .routers import learn_slots, make_router
from .scenarios import Scenario
from .timescale import TimeScaledSink, scaled_timeouts

API_KEY = "sk-soak-local-0000"
MODEL = "tensorgate/sim-5090"
DRAIN_S = 10.0  # real seconds a round waits for stragglers before it closes anyway


@dataclass(frozen=True, slots=True)
class RunOptions:
    scale: float = 20.0
    seed: int = 1
    window: int = 12
    util_ttft_s: float = 12.0  # simulated seconds of TTFT per unit of recent busy fraction (seed only)
    util_cap_s: float = 0.7
    util_tau_s: float = 300.0
    # Gateways sharing state through Redis (issue 28): this many gateways, each its own router, leases and limits
    # in Redis, the client's requests spread over them in turn. 1: the single process, no Redis.
    gateways: int = 1
    redis_url: str | None = None
    cards_apart: bool | None = None  # the cards in a process of their own; None: as the scenario says
    log_level: str = "WARNING"  # the cards' process logs at this level


@dataclass
class MinerSeries:
    """Per-round figures of one miner (index = round)."""

    label: str
    uid: int
    hotkey: str
    dispatched: list[int] = field(default_factory=list)  # organic dispatches, any outcome
    served: list[int] = field(default_factory=list)  # organic, completed OK
    share: list[float] = field(default_factory=list)  # served / all organic served in the round
    probes: list[int] = field(default_factory=list)
    credit: list[float | None] = field(default_factory=list)  # round score; None: no request
    settled: list[float] = field(default_factory=list)
    weight: list[float] = field(default_factory=list)
    cards: list[float] = field(default_factory=list)  # routing multiplier from the capacity checks (scoring.capacity)
    alive: list[bool] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)  # simulated s, successful requests (organic + probes)
    runtime_ttfts: list[float] = field(default_factory=list)  # simulated s, measured inside the card
    background_streams: int = 0  # streams the card served for other validators (invisible load)
    max_in_flight_at_dispatch: int = 0
    refused_busy: int = 0  # the miner's own 429s for this validator's streams filling its slots (0: never over them)


@dataclass
class RunResult:
    scenario: str
    router: str
    scale: float
    rounds: int
    series: dict[str, MinerSeries]
    wall_s: float = 0.0
    client: Counter[str] = field(default_factory=Counter)
    overlap_violations: int = 0  # sequential traffic: dispatches with something already in flight
    sequential: bool = False
    cards_apart: bool = False
    slots_seen: dict[str, int] = field(default_factory=dict)


class _Prompts(PromptGenerator):
    """The project's prompt generator with the scenario's completion lengths (sub-second in ``seed``).

    ``oracle``: told every prompt made, so the adversarial scenario's cheaters recognise probes perfectly.
    """

    def __init__(self, rng: random.Random, max_tokens: tuple[int, ...], oracle: ProbeOracle | None = None) -> None:
        super().__init__(rng)
        self._choices = max_tokens
        self._oracle = oracle

    def payload(self, model: str) -> dict[str, Any]:
        p = super().payload(model)
        p["max_tokens"] = self._rng.choice(self._choices)
        if self._oracle is not None:
            self._oracle.remember(p)
        return p


class _Probes(ProbeRunner):
    """The validator's probe runner, telling the oracle which payloads are capacity-check streams."""

    def __init__(self, *args: Any, oracle: ProbeOracle, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._oracle = oracle

    def _check_payload(self, model: str, least: int) -> dict[str, Any]:
        payload = super()._check_payload(model, least)
        self._oracle.remember(payload, check=True)
        return payload


async def run_scenario(sc: Scenario, router_kind: str, opts: RunOptions) -> RunResult:
    """One bounded soak run; every server and task is stopped before it returns."""
    t_start = time.monotonic()
    rng = random.Random(f"{opts.seed}:{sc.name}")  # same traffic and cards for every router
    router_rng = random.Random(f"{opts.seed}:{sc.name}:{router_kind}")
    scale = opts.scale
    vkey = Keypair.create_from_uri("//tensorgate-soak-validator")
    oracle = ProbeOracle()
    apart = opts.cards_apart if opts.cards_apart is not None else sc.cards_apart
    host: Cards | CardsApart = (CardsApart(sc, opts, vkey.ss58_address, log_level=opts.log_level) if apart
                                else Cards(sc, opts, vkey.ss58_address))
    current: list[Measurement] = []
    router: Router = make_router(router_kind, router_rng)
    tasks: set[asyncio.Task[Any]] = set()
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(host)
        cards = host
        miners = cards.miners
        by_uid = {m.uid: m for m in miners}
        hk2uid = {m.hotkey: m.uid for m in miners}
        result = RunResult(sc.name, router_kind, scale, sc.rounds,
                           {m.label: MinerSeries(m.label, m.uid, m.hotkey) for m in miners},
                           sequential=sc.traffic.kind == "sequential", cards_apart=apart)

        def tap(m: Measurement) -> None:
            current.append(m)
            s = result.series[by_uid[m.uid].label]
            if m.ok and m.ttft_s is not None:
                s.ttfts.append(m.ttft_s)
            if not m.probe:
                s.max_in_flight_at_dispatch = max(s.max_in_flight_at_dispatch, m.in_flight)

        session = await stack.enter_async_context(aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)))
        client = await stack.enter_async_context(aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)))
        slots = {m.uid: 1 for m in miners}
        if router_kind == "slots":
            for m in miners:
                slots[m.uid] = await learn_slots(session, m.endpoint)
        result.slots_seen = {m.label: slots[m.uid] for m in miners}
        router.sync([Candidate(uid=m.uid, hotkey=m.hotkey, endpoint=m.endpoint, slots=slots[m.uid])
                     for m in miners])
        # The validator's own wiring; measurements are drained into the scorer at each round's close,
        # rescaled to simulated seconds on the way (the validator drains its queue the same way).
        queue = MeasurementQueue()  # every gateway's measurements, in the order they came (the stream's job)
        cfg = ValidatorConfig(gateway_port=0, models=[MODEL], max_retries=2, settlement_rounds=opts.window,
                              redis_url=opts.redis_url if opts.gateways > 1 else None, gateway_workers=opts.gateways)
        parts = build_parts(cfg, vkey, api_keys=[API_KEY], router=router, sink=queue,
                            timeouts=scaled_timeouts(UpstreamTimeouts(), scale), env={},
                            reference=ToyReference() if sc.audits else None)
        others = []  # the other gateways: their own router and upstream, the same Redis, no scorer
        for i in range(1, opts.gateways):
            other_router = make_router(router_kind, random.Random(f"{opts.seed}:{sc.name}:{router_kind}:{i}"))
            other_router.sync([Candidate(uid=m.uid, hotkey=m.hotkey, endpoint=m.endpoint,
                                         slots=slots[m.uid]) for m in miners])
            others.append(build_parts(cfg, vkey, api_keys=[API_KEY], router=other_router, sink=queue,
                                      timeouts=scaled_timeouts(UpstreamTimeouts(), scale), env={},
                                      reference=ToyReference() if sc.audits else None))
        auditor = parts.auditor
        if auditor is not None:
            audits = asyncio.create_task(auditor.run())
            stack.push_async_callback(cancelled, audits)
        for p in (parts, *others):
            if router_kind not in ("project", "slots"):  # the reference routers ignore X-Miner-Slots
                p.upstream.on_slots = None
            if p.shared is not None:
                for name, loop_fn in p.shared.loops().items():
                    t = asyncio.create_task(loop_fn(), name=name)
                    stack.push_async_callback(cancelled, t)
        scorer, upstream = parts.scorer, parts.upstream
        sink = TimeScaledSink(scorer, scale, taps=(tap,))
        urls = []
        for p in (parts, *others):
            await p.gateway.start()
            stack.push_async_callback(p.aclose)
            urls.append(f"http://127.0.0.1:{p.gateway.port}/v1/chat/completions")
        hold = parts.shared.leases.hold if parts.shared is not None else None
        turn = itertools.count()
        prompts = _Prompts(random.Random(rng.random()), sc.traffic.max_tokens)
        probe_prompts = _Prompts(random.Random(rng.random()), sc.traffic.max_tokens, oracle)
        traffic_rng = random.Random(rng.random())
        probes = _Probes(router, upstream.probe, probe_prompts, MODEL, random.Random(rng.random()), oracle=oracle,
                         hold=hold)
        alive = {m.label: True for m in miners}

        async def post(body: dict[str, Any], label: str = "") -> None:
            """One client request through the gateway, its outcome counted as ``label`` + status."""
            url = urls[next(turn) % len(urls)]  # the gateways in turn (SO_REUSEPORT spreads connections so)
            try:
                async with client.post(url, json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                                       timeout=aiohttp.ClientTimeout(total=max(30.0, 600.0 / scale))) as resp:
                    await resp.read()
                    result.client[f"{label}{resp.status}"] += 1
            except (TimeoutError, aiohttp.ClientError) as e:
                result.client[f"{label}{type(e).__name__}"] += 1

        async def organic() -> None:
            await post(prompts.payload(MODEL))

        async def self_dealt() -> None:
            """A key holder's own long prompt, for its own miner to answer at once when routed there."""
            text = SELF_MARK + " " + "please read this carefully " * traffic_rng.randint(400, 700)
            await post({"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 64,
                        "temperature": 0, "stream": True}, "self:")

        async def self_dealing_round(round_real: float) -> None:
            loop = asyncio.get_running_loop()
            end = loop.time() + round_real
            while sc.self_dealing_interval_s > 0:
                gap = traffic_rng.expovariate(1.0 / sc.self_dealing_interval_s) / scale
                if loop.time() + gap >= end:
                    break
                await asyncio.sleep(gap)
                spawn(self_dealt())

        def spawn(coro: Any) -> None:
            t = asyncio.create_task(coro)
            tasks.add(t)
            t.add_done_callback(tasks.discard)

        async def probe_one(uid: int) -> None:
            lease = router.acquire_uid(uid)
            if lease is None:
                return
            try:
                if hold is not None and not await hold(lease):
                    return
                await upstream.probe(lease, probe_prompts.payload(MODEL))
            finally:
                router.release(lease)

        async def sequential_round(round_real: float) -> None:
            """One request at a time: organic every interval, probes half-way between two of them."""
            interval = sc.traffic.interval_s
            n = max(1, int(sc.round_s // interval))
            plan: list[tuple[float, int | None]] = [(k * interval, None) for k in range(n)]
            slots_for_probes = traffic_rng.sample(range(n), min(n, sc.probes_per_miner * len(miners)))
            uids = [m.uid for m in miners for _ in range(sc.probes_per_miner)]
            plan += [(k * interval + interval / 2, uid) for k, uid in zip(slots_for_probes, uids, strict=False)]
            plan.sort(key=lambda x: x[0])
            loop = asyncio.get_running_loop()
            start = loop.time()
            for at, uid in plan:
                delay = start + at / scale - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                if router.total_in_flight() != 0:
                    result.overlap_violations += 1
                if uid is None:
                    await organic()
                elif alive[by_uid[uid].label]:
                    await probe_one(uid)
            left = start + round_real - loop.time()
            if left > 0:
                await asyncio.sleep(left)

        async def open_loop_round(round_real: float) -> None:
            loop = asyncio.get_running_loop()
            end = loop.time() + round_real
            tr = sc.traffic
            while True:
                gap = traffic_rng.expovariate(1.0 / tr.interval_s) if tr.kind == "poisson" else tr.interval_s
                if loop.time() + gap / scale >= end:
                    break
                await asyncio.sleep(gap / scale)
                k = traffic_rng.randint(tr.burst_min, tr.burst_max) if tr.kind == "burst" else 1
                for _ in range(k):
                    spawn(organic())
            left = end - loop.time()
            if left > 0:
                await asyncio.sleep(left)

        try:
            for r in range(sc.rounds):
                for ev in sc.events:
                    if ev.round != r:
                        continue
                    await cards.apply(ev)
                    if ev.action in ("die", "revive"):
                        alive[ev.label] = ev.action == "revive"
                    logger.info("{} round {}: {} {}", sc.name, r, ev.label, ev.action)
                round_real = sc.round_s / scale
                if sc.traffic.kind == "sequential":
                    await sequential_round(round_real)
                else:
                    await asyncio.gather(open_loop_round(round_real), self_dealing_round(round_real),
                                         probes.run_round(sc.probes_per_miner, round_real))
                if tasks:  # organic stragglers; probes and sequential traffic are already awaited
                    await asyncio.wait(set(tasks), timeout=DRAIN_S)
                for meas in queue.drain():
                    if auditor is None or not auditor.take(meas):
                        sink.record(meas)
                quarantined: set[str] = set()
                if auditor is not None:  # the validator's own order: audited answers are paid as their verdict says
                    for _ in range(200):
                        if not auditor.backlog:
                            break
                        await asyncio.sleep(0.05)
                    await asyncio.sleep(0.05)  # the one being audited
                    for meas in auditor.ready():
                        sink.record(meas)
                    quarantined = auditor.book.quarantined()
                    router.set_quarantined(quarantined)
                    auditor.new_round()
                _close(scorer, router, result, miners, alive, current, hk2uid, quarantined)
                for p in others:  # what the validator publishes for its other gateways (gateway.shared.routing)
                    p.router.set_scores(scorer.routing_scores(), scorer.routing_shares())
                    p.router.set_quarantined(quarantined)
                current.clear()
        finally:
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for label, report in (await cards.finish()).items():
            result.series[label].runtime_ttfts = report.runtime_ttfts
            result.series[label].refused_busy += report.refused_busy
            result.series[label].background_streams = report.background_streams
    result.wall_s = time.monotonic() - t_start
    return result


def _close(scorer: Scorer, router: Router, result: RunResult, miners: list[MinerInfo], alive: dict[str, bool],
           batch: list[Measurement], hk2uid: dict[str, int], quarantined: set[str] | None = None) -> None:
    report = scorer.close_round(quarantined=quarantined or frozenset())
    router.set_scores(scorer.routing_scores(), scorer.routing_shares())
    weights = scorer.weights(hk2uid, exclude=quarantined or set())
    rows = report.by_hotkey()
    served_total = sum(1 for x in batch if not x.probe and x.ok)
    for m in miners:
        s = result.series[m.label]
        mine = [x for x in batch if x.uid == m.uid]
        s.dispatched.append(sum(1 for x in mine if not x.probe))
        served = sum(1 for x in mine if not x.probe and x.ok)
        s.served.append(served)
        s.share.append(served / served_total if served_total else 0.0)
        s.probes.append(sum(1 for x in mine if x.probe))
        row = rows.get(m.hotkey)
        s.credit.append(row.credit if row is not None and row.requests else None)
        s.settled.append(row.settled if row is not None else 0.0)
        s.weight.append(weights.get(m.uid, 0.0))
        s.cards.append(row.capacity if row is not None else 0.0)
        s.alive.append(alive[m.label])


def ttft_summary(s: MinerSeries) -> tuple[float | None, float | None]:
    return percentile(s.ttfts, 50), percentile(s.ttfts, 95)
