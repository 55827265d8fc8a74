"""Probe traffic: the validator's own requests, so idle miners stay measured.

Each round, every candidate gets ``per_miner`` probes at random moments of the round. A probe takes
the very same path as an organic request after routing (same signer, same request shape, same
upstream code, same measurement), only the miner is chosen by the schedule instead of the router,
so a miner cannot tell probes from organic traffic and serve them better.

Example::

    plan = plan_round(uids=[1, 2, 3], per_miner=2, round_s=300.0, rng=random.Random(0))
    plan[0]        # (offset_s, uid), sorted by offset
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from loguru import logger

from gateway.router import Lease, Router

from .prompts import PromptGenerator


def plan_round(uids: Iterable[int], per_miner: int, round_s: float, rng: random.Random) -> list[tuple[float, int]]:
    """Random moments in the round (the last 10 % left free so probes finish inside it), per miner."""
    horizon = max(0.0, round_s * 0.9)
    plan = [(rng.uniform(0.0, horizon), uid) for uid in uids for _ in range(per_miner)]
    plan.sort()
    return plan


ProbeFn = Callable[[Lease, dict[str, Any]], Awaitable[Any]]


class ProbeRunner:
    """Runs one round's probe plan; each probe holds a router lease so organic routing sees it."""

    def __init__(self, router: Router, probe: ProbeFn, prompts: PromptGenerator, model: str,
                 rng: random.Random | None = None) -> None:
        self._router = router
        self._probe = probe
        self._prompts = prompts
        self._model = model
        self._rng = rng if rng is not None else random.Random()
        self._tasks: set[asyncio.Task[None]] = set()
        self.sent = 0
        self.skipped = 0

    async def run_round(self, per_miner: int, round_s: float) -> None:
        """Fire this round's plan, then return at the round's end.

        Probes still streaming when the round ends are not cancelled (that would count as the
        miner's failure); they finish in the background and land in the next round.
        """
        uids = [m.uid for m in self._router.miners()]
        plan = plan_round(uids, per_miner, round_s, self._rng)
        loop = asyncio.get_running_loop()
        start = loop.time()
        for offset, uid in plan:
            delay = start + offset - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            t = asyncio.create_task(self._one(uid), name=f"probe-{uid}")
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
        left = start + round_s - loop.time()
        if left > 0:
            await asyncio.sleep(left)

    async def aclose(self) -> None:
        """Cancel probes still in flight (shutdown)."""
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _one(self, uid: int) -> None:
        lease = self._router.acquire_uid(uid)
        if lease is None:  # the miner left the metagraph since the plan was made
            self.skipped += 1
            return
        try:
            self.sent += 1
            await self._probe(lease, self._prompts.payload(self._model))
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.opt(exception=True).warning("probe to uid {} raised", uid)
        finally:
            self._router.release(lease)
