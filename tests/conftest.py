"""Shared fixtures: real keypairs, scripted fake miners and a gateway on loopback ephemeral ports."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from bittensor.sp_core import Keypair

from gateway.app import Gateway
from gateway.protocol.measurement import MeasurementQueue
from gateway.router import Candidate, Router
from gateway.upstream import Upstream, UpstreamTimeouts
from neurons.validator.build import ValidatorParts, build_parts
from neurons.validator.config import ValidatorConfig
from tests.fakes import MODEL, DeadMiner, FakeMiner, LoopbackMiner, Script
from tests.redis_server import RedisServer

API_KEY = "sk-test-0123456789"
# Short deadlines so fault tests end quickly, yet generous enough for a loaded 2-core machine.
FAST = UpstreamTimeouts(connect=2.0, first_token=1.0, stall=0.8, total=15.0)
_URIS = ["//Bob", "//Charlie", "//Dave", "//Eve", "//Ferdie", *(f"//Miner{i}" for i in range(6, 13))]


@pytest.fixture(scope="session")
def alice() -> Keypair:
    return Keypair.create_from_uri("//Alice")


@pytest.fixture(scope="session")
def miner_keys() -> list[Keypair]:
    return [Keypair.create_from_uri(u) for u in _URIS]


@pytest.fixture
async def make_miner(alice: Keypair, miner_keys: list[Keypair]) -> AsyncIterator[Callable[..., Awaitable[FakeMiner]]]:
    started: list[FakeMiner] = []

    async def make(script: Script | None = None, *, slots: int = 4, tag: str | None = None) -> FakeMiner:
        i = len(started)
        m = FakeMiner(miner_keys[i], trusted={alice.ss58_address}, script=script or Script(), slots=slots,
                      tag=tag or f"m{i}-")
        await m.start()
        started.append(m)
        return m

    yield make
    for m in started:
        await m.stop()


@pytest.fixture
def dead_miner(miner_keys: list[Keypair]) -> DeadMiner:
    return DeadMiner(miner_keys[-1])


@dataclass
class SimMiner(LoopbackMiner):
    """The real reference miner (neurons.miner) over a SimulatedRuntime, as the gateway sees it."""

    tag: str
    keypair: Any
    slots: int
    port: int
    server: Any  # neurons.miner.server.MinerServer: .busy, .served, .refused_busy
    runner: Any


@pytest.fixture
async def make_sim_miner(
    alice: Keypair, miner_keys: list[Keypair]
) -> AsyncIterator[Callable[..., Awaitable[SimMiner]]]:
    from neurons.miner.runtimes.sim import SimulatedRuntime, parse_profile
    from neurons.miner.server import MINER_KEY, start_miner
    from neurons.miner.trust import AllowList

    started: list[SimMiner] = []

    async def make(profile: str = "rtx5090:time_scale=20", *, slots: int = 2, seed: int = 0,
                   tag: str | None = None, runtime: Any = None) -> SimMiner:
        """``runtime``: share another miner's (``m.server.runtime``): one card behind several hotkeys."""
        i = len(started)
        kp = miner_keys[i]
        if runtime is None:
            runtime = SimulatedRuntime(parse_profile(profile), rng=random.Random(seed + i))
        runner, port = await start_miner(kp, runtime, slots=slots, trust=AllowList({alice.ss58_address}))
        m = SimMiner(tag=tag or f"sim{i}", keypair=kp, slots=slots, port=int(port), server=runner.app[MINER_KEY],
                     runner=runner)
        started.append(m)
        return m

    yield make
    for m in started:
        await m.runner.cleanup()


@dataclass
class Harness:
    gateway: Gateway
    router: Router
    upstream: Upstream
    sink: MeasurementQueue
    client: aiohttp.ClientSession
    uids: dict[str, int]  # miner tag -> uid
    items: list[Any] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.port}"

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def chat(self, body: dict[str, Any], **kw: Any) -> Any:
        """``async with h.chat(body) as resp`` — a POST to the gateway with the test key."""
        headers = {**self.auth, **kw.pop("headers", {})}
        return self.client.post(self.base_url + "/v1/chat/completions", json=body, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=30), **kw)

    def measurements(self) -> list[Any]:
        return list(self.sink._items)


@pytest.fixture
async def make_gateway(alice: Keypair) -> AsyncIterator[Callable[..., Awaitable[Harness]]]:
    """The validator's serving path, wired by the validator's own :func:`build_parts`, over given miners."""
    made: list[tuple[Harness, ValidatorParts]] = []

    async def make(miners: Sequence[FakeMiner | DeadMiner], *, scores: dict[str, float] | None = None,
                   timeouts: UpstreamTimeouts = FAST, seed: int = 0, max_retries: int = 2,
                   hooks: dict[str, Any] | None = None, **gw: Any) -> Harness:
        cfg = ValidatorConfig(gateway_port=0, models=[MODEL], max_retries=max_retries)
        gw.setdefault("freeze_heap", False)
        parts = build_parts(cfg, alice, api_keys=[API_KEY], router=Router(rng=random.Random(seed)),
                            timeouts=timeouts, env={}, **gw)
        router = parts.router
        uids = {m.tag: i + 1 for i, m in enumerate(miners)}
        router.sync([Candidate(uid=uids[m.tag], hotkey=m.hotkey, endpoint=m.endpoint, slots=getattr(m, "slots", 1))
                     for m in miners])
        if scores:
            router.set_scores({m.hotkey: scores[m.tag] for m in miners if m.tag in scores})
        if hooks:
            parts.gateway.plug(**hooks)  # as the validator plugs its own before the gateway starts
        await parts.gateway.start()
        client = aiohttp.ClientSession()
        h = Harness(gateway=parts.gateway, router=router, upstream=parts.upstream, sink=parts.measurements,
                    client=client, uids=uids, items=list(miners))
        made.append((h, parts))
        return h

    yield make
    for h, parts in made:
        await h.client.close()
        await parts.aclose()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real Redis for the session (tests that kill Redis start their own)."""
    server = RedisServer().start()
    yield server
    server.kill()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session's Redis, emptied for this test."""
    redis_server.flush()
    return redis_server.url
