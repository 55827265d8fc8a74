"""Probe traffic: the validator's own requests, so idle miners stay measured.

Each round, every candidate gets ``per_miner`` probes at random moments of the round. A probe takes
the very same path as an organic request after routing (same signer, same request shape, same
upstream code, same measurement), only the miner is chosen by the schedule instead of the router,
so a miner cannot tell probes from organic traffic and serve them better.

At :data:`CAPACITY_CHECKS` random moments of each round, the **capacity check** fills every miner's
free declared slots but one at the same instant (:mod:`scoring.capacity`): one card registered as
several hotkeys then carries all their streams at once and shows it; the slot left free keeps
serving users. Its streams are ordinary probes, shaped like users' requests (issue 23: a check whose
every stream asked for exactly 64 tokens was told apart and gamed), drawn again while they ask for
fewer than :func:`scoring.capacity.check_tokens` asks at that many streams, so each one is timed over a decode
long next to the TTFT band (issue 38: at 64 tokens a card whose first token came at once read as 3.6 cards;
at least 251 tokens over 3 streams, 109 over 7). Spreading it over several
moments lets the median of the window (:class:`scoring.capacity.CapacityBook`) ignore one check that
happened to meet someone else's burst. It costs the validator the sum of all miners' slots in
streams, that often a round; ``capacity_check=False`` turns it off.

Example::

    plan = plan_round(uids=[1, 2, 3], per_miner=2, round_s=300.0, rng=random.Random(0))
    plan[0]        # (offset_s, uid), sorted by offset
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

from loguru import logger

from gateway.router import Lease, MinerState, Router
from scoring.capacity import check_tokens
from scoring.credit import CreditConfig

from .prompts import PromptGenerator


def plan_round(uids: Iterable[int], per_miner: int, round_s: float, rng: random.Random) -> list[tuple[float, int]]:
    """Random moments in the round (the last 10 % left free so probes finish inside it), per miner."""
    horizon = max(0.0, round_s * 0.9)
    plan = [(rng.uniform(0.0, horizon), uid) for uid in uids for _ in range(per_miner)]
    plan.sort()
    return plan


CAPACITY_CHECKS = 2  # capacity checks a round, each at its own random moment
_REDRAWS = 8  # drawing a long-enough shape this many times at most, then asking for the minimum


def check_streams(slots: int, busy: int) -> int:
    """The streams a capacity check starts on a miner with ``busy`` of its ``slots`` in use: every free slot but one
    (the one left keeps serving users), and one on an idle 1-slot miner. None on a miner with one slot free or none,
    so under heavy traffic a card's readings are seldom renewed; a hotkey not read yet routes at half a card and has
    room (``scripts/sim_routing_share.py`` prints how often each finds none)."""
    return max(1 if busy == 0 else 0, slots - busy - 1)


class ProbeFn(Protocol):
    """``Upstream.probe``: one probe on a lease, measured and recorded like organic traffic."""

    def __call__(self, lease: Lease, payload: dict[str, Any], *, capacity_check: bool = False) -> Awaitable[Any]: ...


class ProbeRunner:
    """Runs one round's probe plan; each probe holds a router lease so organic routing sees it."""

    def __init__(self, router: Router, probe: ProbeFn, prompts: PromptGenerator, models: str | tuple[str, ...],
                 rng: random.Random | None = None, *, capacity_check: bool = True,
                 hold: Callable[[Lease], Awaitable[bool]] | None = None, credit: CreditConfig | None = None) -> None:
        self._router = router
        self._credit = credit if credit is not None else CreditConfig()  # the bar the check's streams are timed by
        self._probe = probe
        # Gateways sharing Redis: a probe takes its place among the miner's declared slots subnet-wide like any
        # request (gateway.shared.leases), and is skipped when the other processes' requests fill them: a forced
        # probe would push the miner past its slots and get an honest card's 429 booked as a refusal.
        self._hold = hold
        self._prompts = prompts
        self._models = (models,) if isinstance(models, str) else tuple(models)  # the first: the subnet's
        self._rng = rng if rng is not None else random.Random()
        self._tasks: set[asyncio.Task[None]] = set()
        self.capacity_check = capacity_check
        self.sent = 0
        self.skipped = 0
        self.capacity_streams = 0
        # Hotkeys whose probes have delivered content: only they take a capacity check. Before its first answer a
        # miner's slots are not known and the connection to it is cold: at a soak's first check the honest cards'
        # first tokens came after the TTFT band's zero (connect and first-request costs) and read 0 cards.
        self.answered: set[str] = set()
        # Checks start in the second round: in the first, one hotkey of a card may have answered and its sibling not
        # yet, so the first was checked alone and read a whole card (0.83 of one for a sibling in the soak).
        self.rounds = 0

    async def run_round(self, per_miner: int, round_s: float) -> None:
        """Fire this round's plan, then return at the round's end.

        Probes still streaming when the round ends are not cancelled (that would count as the
        miner's failure); they finish in the background and land in the next round.
        """
        uids = [m.uid for m in self._router.miners()]
        plan: list[tuple[float, int | None]] = list(plan_round(uids, per_miner, round_s, self._rng))
        self.rounds += 1
        if self.capacity_check and uids and self.rounds > 1:
            for _ in range(CAPACITY_CHECKS):
                plan.append((self._rng.uniform(0.0, round_s * 0.6), None))  # None: a capacity check
            plan.sort(key=lambda x: x[0])
        loop = asyncio.get_running_loop()
        start = loop.time()
        for offset, uid in plan:
            delay = start + offset - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if uid is None:
                self.check_capacity()
                continue
            self._spawn(self.probe_once(uid), f"probe-{uid}")
        left = start + round_s - loop.time()
        if left > 0:
            await asyncio.sleep(left)

    def check_capacity(self) -> int:
        """Fill every miner's free declared slots but one with probes, all started now; returns how many."""
        sent = 0
        longest = max(self._prompts.mix.max_tokens)
        miners = self._router.miners()
        self.answered &= {m.hotkey for m in miners}  # hotkeys that left are forgotten
        for m in miners:
            if m.hotkey not in self.answered:
                continue
            busy = m.in_flight + m.elsewhere  # every gateway process's streams
            streams = check_streams(m.slots, busy)
            least = check_tokens(busy + streams, self._credit, longest=longest)
            for _ in range(streams):
                payload = self._check_payload(self._model_for(m), least)  # before the lease: nothing can leak it
                lease = self._router.acquire_uid(m.uid)
                if lease is None:
                    continue
                # tasks start at the loop's next turn, all together: no await between these spawns
                self._spawn(self._with_lease(lease, payload, capacity_check=True), f"capacity-{m.uid}")
                sent += 1
        self.capacity_streams += sent
        return sent

    def _model_for(self, m: MinerState) -> str:
        """The model a miner is probed on: the first the validator serves that the miner declared."""
        return next((x for x in self._models if self._router.serves(m, x)), self._models[0])

    def _check_payload(self, model: str, least: int) -> dict[str, Any]:
        """An ordinary probe that asks for at least ``least`` tokens."""
        for _ in range(_REDRAWS):
            payload = self._prompts.payload(model)
            asked = payload.get("max_tokens")
            if isinstance(asked, int) and asked >= least:
                return payload
        payload["max_tokens"] = least
        return payload

    def _spawn(self, coro: Any, name: str) -> None:
        t = asyncio.create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Cancel probes still in flight (shutdown)."""
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def probe_once(self, uid: int) -> None:
        """One ordinary probe to ``uid`` (the round's plan sends them)."""
        lease = self._router.acquire_uid(uid)
        if lease is None:  # the miner left the metagraph since the plan was made
            self.skipped += 1
            return
        await self._with_lease(lease, self._prompts.payload(self._model_for(lease.miner)))

    async def _with_lease(self, lease: Lease, payload: dict[str, Any], *, capacity_check: bool = False) -> None:
        try:
            if self._hold is not None and not await self._hold(lease):
                self.skipped += 1  # its slots are full of other processes' requests: measured by those
                return
            self.sent += 1
            await self._probe(lease, payload, capacity_check=capacity_check)
            if lease.delivering:
                self.answered.add(lease.miner.hotkey)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.opt(exception=True).warning("probe to uid {} raised", lease.miner.uid)
        finally:
            self._router.release(lease)
