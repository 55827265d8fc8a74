"""Streaming chat-completion clients at a fixed concurrency, timing TTFT and total time per request.

TTFT is the time from sending the request to the first SSE frame that carries non-empty
``delta.content`` (a role-only prelude does not count); total is the time to ``data: [DONE]``.
One ``ClientSession`` per level, keep-alive on, explicit timeouts.

``stagger_s`` starts each worker after a seeded random offset in ``[0, stagger_s)``: with a fixed-schedule
upstream every request lasts the same time, so workers that start together stay in lockstep forever
and every request arrives in a burst of ``concurrency``; offsets over one request's duration give the
steady state of that many independent streams instead. ``sign`` adds per-request headers (btauth)
before the clock starts.

Example::

    res = asyncio.run(run_level("http://127.0.0.1:8000/v1/chat/completions", concurrency=16,
                                requests=200, body=chat_body(32), headers={"Authorization": "Bearer x"}))
    res.ttfts_ms()[:3], res.rps
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

Signer = Callable[[str, bytes], dict[str, str]]  # (url, body) -> extra headers for this one request


def chat_body(max_tokens: int, model: str = "bench") -> bytes:
    """The request every path receives: small prompt, streamed, usage requested."""
    return json.dumps({
        "model": model,
        "messages": [{"role": "user", "content": "Count slowly, one word at a time."}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }).encode()


@dataclass(slots=True)
class Sample:
    ok: bool
    status: int
    ttft_s: float | None
    total_s: float
    tokens: int
    error: str | None = None


@dataclass
class LevelResult:
    concurrency: int
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.ok]

    @property
    def errors(self) -> int:
        return len(self.samples) - len(self.ok)

    @property
    def rps(self) -> float:
        return len(self.ok) / self.wall_s if self.wall_s > 0 else 0.0

    def ttfts_ms(self) -> list[float]:
        return [s.ttft_s * 1000.0 for s in self.ok if s.ttft_s is not None]

    def totals_ms(self) -> list[float]:
        return [s.total_s * 1000.0 for s in self.ok]

    def first_error(self) -> str | None:
        return next((s.error for s in self.samples if not s.ok), None)


def _has_content(payload: bytes) -> bool:
    try:
        obj = json.loads(payload)
    except ValueError:
        return False
    for choice in obj.get("choices") or ():
        if (choice.get("delta") or {}).get("content"):
            return True
    return False


async def one_request(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str],
                      expect_tokens: int | None = None, sign: Signer | None = None) -> Sample:
    """Send one streamed request and time it; never raises."""
    if sign is not None:
        headers = {**headers, **sign(url, body)}
    t0 = time.perf_counter()
    ttft: float | None = None
    tokens = 0
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            if resp.status != 200:
                text = (await resp.text())[:200]
                return Sample(False, resp.status, None, time.perf_counter() - t0, 0, f"HTTP {resp.status}: {text}")
            done = False
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                if ttft is None:
                    if _has_content(payload):
                        ttft = time.perf_counter() - t0
                        tokens += 1
                elif b'"content"' in payload:
                    tokens += 1
            total = time.perf_counter() - t0
            if not done:
                return Sample(False, 200, ttft, total, tokens, "stream ended before [DONE]")
            if expect_tokens is not None and tokens != expect_tokens:
                return Sample(False, 200, ttft, total, tokens, f"got {tokens} tokens, expected {expect_tokens}")
            return Sample(True, 200, ttft, total, tokens)
    except (TimeoutError, aiohttp.ClientError) as e:
        return Sample(False, 0, ttft, time.perf_counter() - t0, tokens, f"{type(e).__name__}: {e}")


async def run_level(url: str | list[str], *, concurrency: int, requests: int, body: bytes,
                    headers: dict[str, str] | None = None, warmup: int = 0, expect_tokens: int | None = None,
                    timeout_s: float = 60.0, sign: Signer | None = None, stagger_s: float = 0.0,
                    seed: int = 0) -> LevelResult:
    """``requests`` timed requests (after ``warmup`` untimed ones) with ``concurrency`` in flight at once.

    A list of URLs is used round-robin per request (the "direct" path spreads over every miner).
    """
    urls = [url] if isinstance(url, str) else list(url)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=10.0)
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency, ttl_dns_cache=300)
    result = LevelResult(concurrency)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if warmup:
            await _drive(session, urls, body, hdrs, min(concurrency, warmup), warmup, expect_tokens, None, sign)
        rng = random.Random(seed)
        offsets = [rng.uniform(0.0, stagger_s) if stagger_s > 0 else 0.0 for _ in range(concurrency)]
        t0 = time.perf_counter()
        await _drive(session, urls, body, hdrs, concurrency, requests, expect_tokens, result.samples, sign, offsets)
        result.wall_s = time.perf_counter() - t0
    return result


async def _drive(session: aiohttp.ClientSession, urls: list[str], body: bytes, headers: dict[str, str],
                 concurrency: int, requests: int, expect_tokens: int | None, out: list[Sample] | None,
                 sign: Signer | None = None, offsets: list[float] | None = None) -> None:
    remaining = requests

    async def worker(offset: float) -> None:
        nonlocal remaining
        if offset > 0:
            await asyncio.sleep(offset)
        while remaining > 0:
            remaining -= 1
            s = await one_request(session, urls[remaining % len(urls)], body, headers, expect_tokens, sign)
            if out is not None:
                out.append(s)

    n = max(1, min(concurrency, requests))
    await asyncio.gather(*(worker(offsets[i] if offsets else 0.0) for i in range(n)))
