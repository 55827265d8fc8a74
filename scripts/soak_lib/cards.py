"""A soak run's simulated cards, served on loopback: in the harness's own process, or apart from it.

Each miner of a scenario is a reference miner server (:func:`neurons.miner.server.start_miner`) over its card: its
own, one shared with the other hotkeys naming the same card, a cheat on top (:mod:`soak_lib.cheaters`), and the
invisible load of other validators (:meth:`soak_lib.load.CardRuntime.background`).

Why apart (issue 38): the cards used to share the gateway's event loop, so the gateway's own lag was multiplied by
the time scale and fell on the cards running the most streams: the card carrying other validators' load read as
0.56-0.59 of a card where its load says ~0.75, and that was the harness, not the rules. :class:`CardsApart` runs
them in a child process with its own loop (and core), behind the same interface as :class:`Cards`: the harness
starts them, sends the scenario's events (a card dies, returns, degrades) and collects what only the cards know
(their own first-token times, the 429s their servers sent, the other validators' streams they carried).

The cheaters' perfect oracle needs no channel: the probe runner marks the prompts it makes
(:class:`soak_lib.cheaters.ProbeOracle`), and a cheater reads the mark in the request it receives.

Example::

    async with CardsApart(scenario, options, validator_ss58) as cards:
        for m in cards.miners: ...                  # label, uid, hotkey, endpoint, slots
        await cards.apply(Event(3, "dies", "die"))
        reports = await cards.finish()              # {label: CardReport}
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import random
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol

from aiohttp import web
from bittensor.sp_core import Keypair
from loguru import logger

from neurons.miner.server import MINER_KEY, start_miner
from neurons.miner.trust import AllowList

from .cheaters import CheatRuntime, ProbeOracle
from .load import CardRuntime, MultiCardRuntime
from .scenarios import CardSpec, Event, Scenario

START_S = 120.0  # the child's start: imports, 40 servers
REPLY_S = 60.0  # an event, or the final report


class Options(Protocol):
    """What the cards read of the run's options (:class:`soak_lib.harness.RunOptions`)."""

    @property
    def scale(self) -> float: ...
    @property
    def seed(self) -> int: ...
    @property
    def util_ttft_s(self) -> float: ...
    @property
    def util_cap_s(self) -> float: ...
    @property
    def util_tau_s(self) -> float: ...


@dataclass(frozen=True, slots=True)
class MinerInfo:
    """One miner as the validator's side sees it."""

    label: str
    uid: int
    hotkey: str
    port: int
    slots: int

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass(frozen=True, slots=True)
class CardReport:
    """What only the card knows, at the end of a run."""

    runtime_ttfts: list[float]  # simulated s, measured inside the card
    refused_busy: int  # 429s its server sent because this validator filled its declared slots
    background_streams: int  # other validators' streams it carried


def miner_key(uid: int) -> Keypair:
    return Keypair.create_from_uri(f"//tensorgate-soak-miner-{uid}")


Runtime = CardRuntime | MultiCardRuntime | CheatRuntime


class _Miner:
    def __init__(self, spec: CardSpec, uid: int, runtime: Runtime) -> None:
        self.spec, self.uid, self.runtime = spec, uid, runtime
        self.key = miner_key(uid)
        self.runner: web.AppRunner | None = None
        self.port = 0
        self.refused_busy = 0

    async def start(self, trust: AllowList) -> None:
        self.runner, self.port = await start_miner(self.key, self.runtime, slots=self.spec.slots, trust=trust,
                                                   host="127.0.0.1", port=self.port)

    async def stop(self) -> None:
        if self.runner is not None:
            runner, self.runner = self.runner, None
            self.refused_busy += int(runner.app[MINER_KEY].refused_busy)
            await runner.cleanup()


def _card(spec: CardSpec, opts: Options, rng: random.Random, util: bool) -> CardRuntime | MultiCardRuntime:
    def one() -> CardRuntime:
        return CardRuntime(spec.profile, scale=opts.scale, rng=random.Random(rng.random()),
                           util_ttft_s=opts.util_ttft_s if util else 0.0, util_cap_s=opts.util_cap_s,
                           util_tau_s=opts.util_tau_s)
    return MultiCardRuntime([one() for _ in range(spec.cards)]) if spec.cards > 1 else one()


def _runtimes(sc: Scenario, opts: Options, rng: random.Random) -> list[Runtime]:
    """One runtime per miner: its own card, a card shared with the other hotkeys naming it, a cheat on top."""
    oracle = ProbeOracle()
    shared: dict[str, CardRuntime | MultiCardRuntime] = {}
    out: list[Runtime] = []
    for spec in sc.cards:
        if spec.card:
            if spec.card not in shared:
                shared[spec.card] = _card(spec, opts, rng, sc.util_ttft)
            base = shared[spec.card]
        else:
            base = _card(spec, opts, rng, sc.util_ttft)
        if spec.cheat:
            assert isinstance(base, CardRuntime), "cheats run on one card"
            out.append(CheatRuntime(base, spec.cheat, slots=spec.slots, is_probe=oracle, is_check=oracle.is_check))
        else:
            out.append(base)
    return out


class Cards:
    """The scenario's cards in this process, on this event loop."""

    def __init__(self, sc: Scenario, opts: Options, validator: str) -> None:
        rng = random.Random(f"{opts.seed}:{sc.name}:cards")  # the same cards, in this process or apart
        self._trust = AllowList({validator})
        self._miners = [_Miner(spec, uid, rt) for uid, (spec, rt)
                        in enumerate(zip(sc.cards, _runtimes(sc, opts, rng), strict=True), start=1)]
        self._bg_rng = random.Random(rng.random())
        self._stack = contextlib.AsyncExitStack()
        self.miners: list[MinerInfo] = []

    async def __aenter__(self) -> Cards:
        await self._stack.__aenter__()
        try:
            for m in self._miners:
                await m.start(self._trust)
                self._stack.push_async_callback(m.stop)
            for m in self._miners:
                if m.spec.background_rps > 0 and isinstance(m.runtime, CardRuntime):
                    bg = asyncio.create_task(m.runtime.background(m.spec.background_rps,
                                                                  random.Random(self._bg_rng.random())))
                    self._stack.push_async_callback(cancelled, bg)
        except BaseException:
            await self._stack.aclose()
            raise
        self.miners = [MinerInfo(m.spec.label, m.uid, m.key.ss58_address, m.port, m.spec.slots)
                       for m in self._miners]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def apply(self, ev: Event) -> None:
        m = next(x for x in self._miners if x.spec.label == ev.label)
        if ev.action == "die":
            await m.stop()
        elif ev.action == "revive":
            await m.start(self._trust)
        elif ev.action == "degrade" and ev.profile is not None:
            m.runtime.set_profile(ev.profile)

    async def finish(self) -> dict[str, CardReport]:
        """Stop every server and background stream, and report."""
        await self._stack.aclose()
        return {m.spec.label: CardReport(list(m.runtime.runtime_ttfts), m.refused_busy,
                                         m.runtime.background_streams if isinstance(m.runtime, CardRuntime) else 0)
                for m in self._miners}


class CardsApart:
    """The same cards in a child process (spawned: nothing of this loop is copied into it), the same interface."""

    def __init__(self, sc: Scenario, opts: Options, validator: str, *, log_level: str = "WARNING") -> None:
        self._args = (sc, opts, validator, log_level)
        self._proc: Any = None
        self._conn: Connection | None = None
        self.miners: list[MinerInfo] = []

    async def __aenter__(self) -> CardsApart:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(child, *self._args), name="soak-cards", daemon=True)
        self._proc.start()
        child.close()
        try:
            self.miners = await self._reply(within=START_S)
        except BaseException:
            await self._end()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._end()

    async def apply(self, ev: Event) -> None:
        await self._ask(("event", ev))

    async def finish(self) -> dict[str, CardReport]:
        reports: dict[str, CardReport] = await self._ask(("finish",))
        await self._end()
        return reports

    async def _ask(self, msg: tuple[Any, ...]) -> Any:
        if self._conn is None:
            raise RuntimeError("the cards' process has ended")
        self._conn.send(msg)
        return await self._reply(within=REPLY_S)

    async def _reply(self, *, within: float) -> Any:
        conn = self._conn
        assert conn is not None

        def wait() -> Any:
            if not conn.poll(within):
                raise TimeoutError(f"the cards' process did not answer within {within:.0f} s")
            return conn.recv()

        kind, value = await asyncio.get_running_loop().run_in_executor(None, wait)
        if kind == "error":
            raise RuntimeError(f"the cards' process failed: {value}")
        return value

    async def _end(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send(("stop",))
            conn.close()
        proc, self._proc = self._proc, None
        if proc is not None:
            await asyncio.get_running_loop().run_in_executor(None, proc.join, 10.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)


def _child(conn: Connection, sc: Scenario, opts: Options, validator: str, log_level: str) -> None:
    logger.remove()
    logger.add(sys.stderr, level=log_level)
    try:
        asyncio.run(_serve(conn, sc, opts, validator))
    except Exception as e:  # the parent gets one line and stops the run; nothing else is there to tell
        with contextlib.suppress(OSError):
            conn.send(("error", repr(e)))
    finally:
        conn.close()


async def _serve(conn: Connection, sc: Scenario, opts: Options, validator: str) -> None:
    loop = asyncio.get_running_loop()
    async with Cards(sc, opts, validator) as cards:
        conn.send(("ok", cards.miners))
        while True:
            msg = await loop.run_in_executor(None, conn.recv)
            if msg[0] == "event":
                await cards.apply(msg[1])
                conn.send(("ok", None))
            elif msg[0] == "finish":
                conn.send(("ok", await cards.finish()))
                return
            else:  # "stop": the parent is gone or done
                return


async def cancelled(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait for it to end (an exit-stack callback: the harness's tasks use it too)."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
