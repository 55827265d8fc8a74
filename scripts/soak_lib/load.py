"""Card runtimes for the soak: the simulated 5090, plus what the field shows and the sim does not model.

:class:`CardRuntime` wraps :class:`neurons.miner.runtimes.sim.SimulatedRuntime` (time-scaled) and adds:

* a **recent-utilisation TTFT term** (off unless ``util_ttft_s > 0``): extra first-token delay
  ``min(util_cap_s, util_ttft_s * u)`` simulated seconds, where ``u`` is the card's busy fraction
  (share of time with at least one stream active), an exponential moving average with time
  constant ``util_tau_s``. Why: in the field, requests one per 20 s never overlapped, yet the card
  a deterministic tie-break favoured measured TTFT 1030 ms while the other measured 461 ms, i.e. the
  unloaded base (450 ms + prefill). The cold card saw no extra load and the hot card a lot, so the
  extra load follows *this* validator's routing: other validators run the same code, score the same
  cards alike and pile onto the same one. Their traffic is not simulated stream by stream here (it
  would also slow the decode of our own requests and make every credit noisy); it is folded into
  the one term, proportional to the busy time our own routing causes, and calibrated to the field.
  The sim's own load model only reacts to streams that overlap (``ttft_per_stream_s``, the serial
  prefill queue, shared decode), so it gives the same TTFT to both cards when nothing overlaps.
* swapping the card's profile mid-run (a card that degrades);
* the runtime-side TTFT of each request (time from the runtime starting to its first token), so
  the harness can report how much of the measured TTFT is the validator's own overhead.

:class:`MultiCardRuntime` is a miner with several cards behind one endpoint (twice the slots
because it has twice the hardware): each request goes to the card with fewest active streams.

Example::

    card = CardRuntime(PROFILES["rtx5090"], scale=20.0, rng=random.Random(0), util_ttft_s=12.0)
    runner, port = await start_miner(key, card, slots=4, trust=AllowList({vali}))
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import random
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from neurons.miner.runtimes.base import RuntimeHealth
from neurons.miner.runtimes.sim import CardProfile, SimulatedRuntime


class CardRuntime:
    """One simulated card; ``scale`` is the soak's time compression (applied to the profile)."""

    def __init__(self, profile: CardProfile, *, scale: float, rng: random.Random, util_ttft_s: float = 0.0,
                 util_cap_s: float = 0.7, util_tau_s: float = 300.0) -> None:
        self.scale = scale
        self.util_ttft_s = util_ttft_s
        self.util_cap_s = util_cap_s
        self._tau_real = util_tau_s / scale
        self._base = dataclasses.replace(profile, time_scale=scale)
        self.inner = SimulatedRuntime(self._base, rng=rng)
        self.name = self.inner.name
        self.sampler = self.inner.sampler
        self.features = self.inner.features
        self._n = 0
        self._u = 0.0
        self._t: float | None = None
        self.runtime_ttfts: list[float] = []  # simulated seconds, runtime side
        self.extra_ttfts: list[float] = []  # simulated seconds added by the utilisation term
        self.background_streams = 0  # served for other validators (see background)

    @property
    def profile(self) -> CardProfile:
        return self._base

    @property
    def active(self) -> int:
        return self.inner.active

    def health(self) -> RuntimeHealth:
        return self.inner.health()

    def set_profile(self, profile: CardProfile) -> None:
        """From the next request on, the card behaves like ``profile`` (degradation, recovery)."""
        self._base = dataclasses.replace(profile, time_scale=self.scale)
        self.inner.profile = self._base

    def _advance(self, now: float) -> None:
        if self._t is None:
            self._t = now
            return
        dt = now - self._t
        if dt > 0:
            a = math.exp(-dt / self._tau_real)
            self._u = self._u * a + (1.0 - a) * (1.0 if self._n > 0 else 0.0)
            self._t = now

    def utilisation(self) -> float:
        self._advance(asyncio.get_running_loop().time())
        return self._u

    def extra_ttft_s(self) -> float:
        """Simulated seconds the utilisation term adds to a request arriving now."""
        if self.util_ttft_s <= 0:
            return 0.0
        return min(self.util_cap_s, self.util_ttft_s * self.utilisation())

    async def stream(self, payload: dict[str, Any]) -> AsyncGenerator[bytes, None]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        extra = self.extra_ttft_s()
        # read by the inner generator's first step, which runs below with no await in between
        self.inner.profile = dataclasses.replace(self._base, hang_s=self._base.hang_s + extra)
        self._advance(t0)
        self._n += 1
        first = True
        try:
            async with contextlib.aclosing(self.inner.stream(payload)) as frames:
                async for chunk in frames:
                    if first and b'"content"' in chunk:
                        first = False
                        self.runtime_ttfts.append((loop.time() - t0) * self.scale)
                        self.extra_ttfts.append(extra)
                    yield chunk
        finally:
            self._advance(loop.time())
            self._n -= 1


    async def background(self, rps: float, rng: random.Random) -> None:
        """Streams from other validators, invisible to this one: Poisson arrivals at ``rps`` (simulated),
        sharing the card's decode with its own streams; runs until cancelled."""
        tasks: set[asyncio.Task[None]] = set()
        try:
            while True:
                await asyncio.sleep(rng.expovariate(rps) / self.scale)
                payload = {"messages": [{"role": "user", "content": "other validator " * rng.randint(4, 60)}],
                           "max_tokens": rng.choice((64, 96, 128)), "stream": True}
                t = asyncio.create_task(self._drain(payload))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
        finally:
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _drain(self, payload: dict[str, Any]) -> None:
        self.background_streams += 1
        async with contextlib.aclosing(self.inner.stream(payload)) as frames:
            async for _ in frames:
                pass


class MultiCardRuntime:
    """Several cards behind one miner: each request goes to the least busy card."""

    def __init__(self, cards: Sequence[CardRuntime]) -> None:
        if not cards:
            raise ValueError("a multi-card runtime needs at least one card")
        self.cards = list(cards)
        self.name = f"sim:{len(self.cards)}x{self.cards[0].profile.name}"
        self.sampler = self.cards[0].sampler
        self.features = self.cards[0].features

    @property
    def active(self) -> int:
        return sum(c.active for c in self.cards)

    def health(self) -> RuntimeHealth:
        return RuntimeHealth(ok=True, detail=f"{len(self.cards)} simulated cards")

    @property
    def runtime_ttfts(self) -> list[float]:
        return [t for c in self.cards for t in c.runtime_ttfts]

    def set_profile(self, profile: CardProfile) -> None:
        for c in self.cards:
            c.set_profile(profile)

    async def stream(self, payload: dict[str, Any]) -> AsyncGenerator[bytes, None]:
        card = min(self.cards, key=lambda c: c.active)
        async with contextlib.aclosing(card.stream(payload)) as frames:
            async for chunk in frames:
                yield chunk
