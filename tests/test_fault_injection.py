"""Fault injection at smoke scale (issue 15's proof): hostile miners and hostile clients at once, seeded.

Miners fault before the first byte (500, garbage, JSON nested 5,000 deep, hanging, a 200 whose head the gateway
refuses: gzip, not an event stream) and after it (drops, stalls), next to honest ones; clients read normally, walk away
mid-stream or before the answer, read slowly, send malformed bodies (lone surrogates included), stall
their body, or send an oversized head. Whatever the mix, these hold, and the counts per class are printed (``-s``):

* no slot leaked: the router and every miner end with nothing in flight;
* no miner booked for a client's or the validator's fault: an honest miner's measurements are all
  complete or ``client_disconnect``;
* no 5xx for client input, and no 500 at all: a client's bad body gets a 4xx; the gateway answers
  502/503/504 only when miners failed;
* every request is answered or ended, none hangs (each client call is bounded);
* a client leaving mid-write is counted, not logged as an error with a traceback (it was, once per client).

Kill -9 during writes is covered where the writes are: ``tests/test_store.py`` kills a process
mid-commit and finds every settled round.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections import Counter
from typing import Any

import aiohttp

from gateway.protocol.measurement import FailureReason
from tests.fakes import Script, body, eventually

HONEST = ("ok-a-", "ok-b-")
FAULTY = {
    "http500-": Script("http500"),
    "garbage-": Script("garbage"),
    "hang-": Script("hang_first"),
    "drop-": Script("drop_after", tokens=8, after=3),
    "stall-": Script("stall_after", tokens=8, after=3),
    "nan-": Script("nan"),
    "deep-": Script("deep_json"),  # a chunk nested past the decoder's recursion limit: garbage, not a crash
    "gzip-": Script("gzip"),  # a 200 whose head the gateway refuses: its connection must still be closed
    "not-sse-": Script("not_sse"),
}
BAD_BODIES: list[bytes] = [
    b"{not json", b"[]", b'{"model": 7, "messages": []}', b'{"messages": [{"role": ["user"], "content": "hi"}]}',
    json.dumps({"model": "tensorgate/sim-5090", "messages": [{"role": "user", "content": "x"}],
                "max_tokens": -3}).encode(),
    json.dumps({"model": "tensorgate/sim-5090", "messages": "hi"}).encode(), b"\xff\xfe\x00",
    json.dumps({"model": "tensorgate/sim-5090", "messages": [{"role": "user", "content": "x"}],
                "temperature": "hot"}).encode(),
    # a lone surrogate: no miner can encode it (issue 24: five such prompts zeroed honest miners)
    b'{"model": "tensorgate/sim-5090", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
    b'{"model": "tensorgate/sim-5090", "messages": [{"role": "user", "content": "x"}], "stop": ["\\udfff"]}',
]
CLIENTS = ("normal", "normal", "non-stream", "vanish-mid-stream", "vanish-before-answer", "slow-reader", "bad-input",
           "stalled-body", "oversized-head")


async def _raw(h: Any, data: bytes, within_s: float) -> bytes:
    """Send raw bytes (what a client library never sends) and read until the gateway closes or ``within_s``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", h.gateway.port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(within_s):
            return await reader.read()
    finally:
        writer.close()


async def _client(kind: str, h: Any, rng: random.Random, outcome: Counter[str]) -> None:
    url = h.base_url + "/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=20)
    try:
        if kind == "stalled-body":  # an authenticated head, half a body, then nothing: 408 at the body deadline
            head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: {h.auth['Authorization']}"
                    f"\r\nContent-Length: 500\r\n\r\n").encode()
            answer = await _raw(h, head + b'{"model"', 8.0)
            outcome[f"{kind}:{answer[9:12].decode() or 'closed'}"] += 1
            return
        if kind == "oversized-head":
            answer = await _raw(h, b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer "
                                + b"k" * 40_000 + b"\r\n\r\n", 10.0)
            outcome[f"{kind}:{answer[9:12].decode() or 'closed'}"] += 1
            return
        if kind == "bad-input":
            async with h.client.post(url, data=rng.choice(BAD_BODIES), timeout=timeout,
                                     headers={**h.auth, "Content-Type": "application/json"}) as r:
                await r.read()
                outcome[f"{kind}:{r.status}"] += 1
            return
        if kind == "vanish-before-answer":
            try:
                async with h.client.post(url, json=body(max_tokens=8), headers=h.auth,
                                         timeout=aiohttp.ClientTimeout(total=0.05)) as r:
                    await r.read()
                    outcome[f"{kind}:{r.status}"] += 1
            except TimeoutError:
                outcome[f"{kind}:gone"] += 1
            return
        async with h.client.post(url, json=body(stream=kind != "non-stream", max_tokens=8), headers=h.auth,
                                 timeout=timeout) as r:
            if kind == "vanish-mid-stream" and r.status == 200:
                await r.content.readany()
                r.close()  # walks away after the first read
                outcome[f"{kind}:gone"] += 1
                return
            if kind == "slow-reader":
                for _ in range(200):  # a slow reader: 64 bytes, a pause, 64 bytes... (bounded)
                    if not await r.content.read(64):
                        break
                    await asyncio.sleep(0.02)
            else:
                await r.read()
            outcome[f"{kind}:{r.status}"] += 1
    except (aiohttp.ClientError, TimeoutError) as e:
        outcome[f"{kind}:{type(e).__name__}"] += 1


async def test_hostile_miners_and_clients_leak_nothing_and_blame_no_one_wrongly(make_miner, make_gateway,
                                                                                caplog: Any) -> None:
    rng = random.Random(15)
    miners = [await make_miner(Script("ok", tokens=8), tag=t) for t in HONEST]
    miners += [await make_miner(script, tag=tag) for tag, script in FAULTY.items()]
    h = await make_gateway(miners, seed=3, body_timeout=1.0)
    outcome: Counter[str] = Counter()
    kinds = [rng.choice(CLIENTS) for _ in range(140)]
    for i in range(0, len(kinds), 14):  # 14 at once: faults overlap with each other and with honest traffic
        await asyncio.gather(*(_client(k, h, rng, outcome) for k in kinds[i:i + 14]))

    # a client that leaves is counted, never an error logged with a traceback (a log any client could fill)
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("aiohttp") and r.levelno >= logging.ERROR]
    assert not logged, logged[:3]
    # no slot leaked
    assert await eventually(lambda: h.router.total_in_flight() == 0 and all(m.active == 0 for m in miners),
                            within_s=10.0), [(m.tag, m.active) for m in miners]
    # no client input answered 5xx, no 500 at all
    statuses = Counter(k.split(":", 1)[1] for k in outcome)
    assert "500" not in statuses, outcome
    bad = {k: v for k, v in outcome.items() if k.startswith("bad-input:")}
    assert bad and all(k.split(":")[1] in ("400", "404", "413", "422") for k in bad), bad
    assert all(k == "stalled-body:408" for k in outcome if k.startswith("stalled-body")), outcome
    assert all(k == "oversized-head:431" for k in outcome if k.startswith("oversized-head")), outcome
    # no honest miner booked for a client's or the validator's fault
    honest = {h.uids[t] for t in HONEST}
    wrong = [(m.uid, m.failure) for m in h.measurements()
             if m.uid in honest and not m.ok and m.failure != FailureReason.CLIENT_DISCONNECT]
    assert not wrong, wrong
    # faulty miners are booked as what they did, never as the client's walking away alone
    booked = Counter((m.uid, m.failure) for m in h.measurements() if not m.ok)
    for tag in FAULTY:
        uid = h.uids[tag]
        assert any(f is not None and f.blames_miner for (u, f), n in booked.items() if u == uid), (tag, booked)
    tried: Counter[str] = Counter()
    for k, n in outcome.items():
        tried[k.split(":", 1)[0]] += n
    print("\nfault injection: per client kind, what it got:", dict(sorted(outcome.items())))
    print("tried per kind:", dict(tried), "measurements:", len(h.measurements()), "wrongly blamed: 0")
    assert sum(tried.values()) == len(kinds)
