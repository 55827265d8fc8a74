"""Organic traffic for the local subnet: a client sending chat completions through the gateway.

It is an ordinary OpenAI-style HTTP client (bearer key, streaming and non-streaming requests,
Poisson arrivals), so the local run exercises the gateway exactly as an outside client would.

Example::

    async with aiohttp.ClientSession() as s:
        t = OrganicTraffic(s, "http://127.0.0.1:8000", "sk-local", model="tensorgate/sim-5090",
                           rps=1.0, rng=random.Random(3))
        await t.run(duration_s=10)
        t.counts          # {"ok": 9, "429": 0, ...}
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter

import aiohttp
from loguru import logger

from .validator.prompts import MIXES, PromptGenerator, PromptMix


class OrganicTraffic:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        api_key: str,
        *,
        model: str,
        rps: float,
        rng: random.Random | None = None,
        max_in_flight: int = 64,
        mix: PromptMix = MIXES["gpu"],
    ) -> None:
        self._session = session
        self._url = base_url.rstrip("/") + "/v1/chat/completions"
        self._headers = {"Authorization": f"Bearer {api_key}"}
        self._model = model
        self._rps = rps
        self._rng = rng if rng is not None else random.Random()
        self._prompts = PromptGenerator(random.Random(self._rng.random()), mix)
        self._sem = asyncio.Semaphore(max_in_flight)
        self.counts: Counter[str] = Counter()
        self.served_by: Counter[int] = Counter()

    async def run(self, duration_s: float | None = None) -> None:
        """Send requests with exponential inter-arrival times until cancelled or ``duration_s`` passes."""
        loop = asyncio.get_running_loop()
        end = None if duration_s is None else loop.time() + duration_s
        tasks: set[asyncio.Task[None]] = set()
        try:
            while end is None or loop.time() < end:
                await asyncio.sleep(self._rng.expovariate(self._rps) if self._rps > 0 else 1.0)
                if self._rps <= 0 or self._sem.locked():
                    continue
                t = asyncio.create_task(self._one())
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for t in tasks:
                t.cancel()

    async def _one(self) -> None:
        async with self._sem:
            body = self._prompts.payload(self._model)
            body["stream"] = self._rng.random() < 0.7
            try:
                async with self._session.post(self._url, json=body, headers=self._headers,
                                              timeout=aiohttp.ClientTimeout(total=120)) as resp:
                    uid = resp.headers.get("X-Tensorgate-Miner-Uid")
                    if resp.status != 200:
                        self.counts[str(resp.status)] += 1
                        await resp.read()
                        return
                    errored = False
                    if body["stream"]:
                        async for line in resp.content:
                            if line.startswith(b'data: {"error"'):  # the gateway's mid-stream error event
                                errored = True
                    else:
                        json.loads(await resp.read())
                    self.counts["stream_error" if errored else "ok"] += 1
                    if uid is not None and uid.isdigit():
                        self.served_by[int(uid)] += 1
            except (TimeoutError, aiohttp.ClientError, ValueError) as e:
                self.counts["client_error"] += 1
                logger.debug("organic request failed: {!r}", e)
