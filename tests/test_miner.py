"""The reference miner over loopback: auth, slots (429, never queued, freed on every path), proxy relay."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import bittensor as bt
import pytest
from aiohttp import web
from bittensor.sp_core import Keypair

from gateway.offers import SIGNATURE_HEADER, OfferError, read_offer
from gateway.protocol.openai import CHAT_PATH, SUBNET_SAMPLER, TOOLS
from gateway.protocol.sse import SSEParser, fold_tool_calls, frame, parse_chunk
from gateway.protocol.tools import prompt_messages
from neurons.chain.base import NeuronInfo
from neurons.keys import MissingKeyError, dev_keypair, load_hotkey
from neurons.miner.cli import main, parse_args
from neurons.miner.runtimes.proxy import ProxyRuntime, ProxyTimeouts
from neurons.miner.runtimes.sim import CardProfile, RuntimeFailure, SimulatedRuntime
from neurons.miner.server import MINER_KEY, MinerServer, start_miner
from neurons.miner.trust import AllowList, PermitTrust

VALI = dev_keypair("Alice")
MINER = dev_keypair("Bob")
OTHER = dev_keypair("Charlie")
REPO = Path(__file__).resolve().parents[1]


class Signer:
    """Signs like the gateway: strictly increasing nonces, so concurrent requests are never replays."""

    def __init__(self, keypair: Any = VALI, receiver: str = MINER.ss58_address) -> None:
        self.keypair = keypair
        self.receiver = receiver
        self._last = 0

    def headers(self, raw: bytes, nonce_ns: int | None = None) -> dict[str, str]:
        if nonce_ns is None:
            nonce_ns = max(time.time_ns(), self._last + 1)
            self._last = nonce_ns
        h = bt.http_auth.sign(self.keypair, method="POST", path=CHAT_PATH, body=raw, receiver_ss58=self.receiver,
                              nonce_ns=nonce_ns)
        return {**h, "Content-Type": "application/json"}


def payload(max_tokens: int = 16, **extra: Any) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    return json.dumps(body).encode()


def fast_card(**kw: Any) -> SimulatedRuntime:
    kw.setdefault("time_scale", 20.0)
    kw.setdefault("stop_rate", 0.0)
    return SimulatedRuntime(CardProfile(**kw), rng=random.Random(5))


class Miner:
    def __init__(self, runner: web.AppRunner, port: int) -> None:
        self.runner = runner
        self.url = f"http://127.0.0.1:{port}"
        self.server: MinerServer = runner.app[MINER_KEY]

    async def wait_busy(self, n: int, within_s: float = 5.0) -> None:
        deadline = time.monotonic() + within_s
        while self.server.busy != n:
            assert time.monotonic() < deadline, f"busy stayed {self.server.busy}, wanted {n}"
            await asyncio.sleep(0.01)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


@pytest.fixture
async def make_ref_miner() -> AsyncIterator[Any]:
    runners: list[web.AppRunner] = []

    async def make(runtime: Any = None, slots: int = 4, trust: Any = None, **kw: Any) -> Miner:
        runner, port = await start_miner(MINER, runtime or fast_card(), slots=slots,
                                         trust=trust or AllowList({VALI.ss58_address}), **kw)
        runners.append(runner)
        return Miner(runner, port)

    yield make
    for r in runners:
        await r.cleanup()


async def post(session: aiohttp.ClientSession, m: Miner, raw: bytes, headers: dict[str, str]) -> tuple[int, Any]:
    async with session.post(m.url + CHAT_PATH, data=raw, headers=headers) as resp:
        text = await resp.text()
        if resp.content_type == "application/json":
            return resp.status, json.loads(text)
        return resp.status, text


def sse_events(text: str) -> list[Any]:
    out: list[Any] = []
    for block in text.split("\n\n"):
        if block:
            data = block.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---- happy path ------------------------------------------------------------------------------------


async def test_health_and_signed_stream(session: aiohttp.ClientSession, make_ref_miner: Any) -> None:
    m = await make_ref_miner(slots=3)
    async with session.get(m.url + "/health") as r:
        assert r.status == 200
        assert await r.json() == {"status": "ok", "hotkey": MINER.ss58_address, "slots": 3, "contexts": None, "busy": 0,
                                  "runtime": "sim:rtx5090", "runtime_state": "simulated rtx5090",
                                  "sampler": "tensorgate-gumbel/1", "models": [],
                                  "features": ["logprobs", "response_format", "tools"]}
        # signed by the miner's hotkey (gateway.offers): what it declares is this hotkey's, byte for byte
        offer = read_offer(await r.read(), r.headers[SIGNATURE_HEADER], MINER.ss58_address)
        assert offer.features == {"logprobs", "response_format", "tools"} and not offer.models
        with pytest.raises(OfferError):
            read_offer(await r.read(), r.headers[SIGNATURE_HEADER], Keypair.create_from_uri("//Eve").ss58_address)
    raw = payload(max_tokens=12)
    async with session.post(m.url + CHAT_PATH, data=raw, headers=Signer().headers(raw)) as resp:
        assert resp.status == 200
        assert resp.content_type == "text/event-stream"
        assert resp.headers["X-Miner-Slots"] == "3"
        assert resp.headers["X-Miner-Sampler"] == "tensorgate-gumbel/1"  # the validator audits and pays on it
        events = sse_events(await resp.text())
    assert events[0]["choices"][0]["delta"] == {"role": "assistant"}
    tokens = [e for e in events if isinstance(e, dict) and e["choices"] and "content" in e["choices"][0]["delta"]]
    assert len(tokens) == 12
    assert events[-2]["usage"]["completion_tokens"] == 12 and events[-1] == "[DONE]"
    assert m.server.busy == 0 and m.server.served == 1


# ---- auth -------------------------------------------------------------------------------------------


def _err(body: Any) -> dict[str, Any]:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


async def test_auth_refusals(session: aiohttp.ClientSession, make_ref_miner: Any) -> None:
    m = await make_ref_miner()
    raw = payload()
    # unsigned
    status, body = await post(session, m, raw, {"Content-Type": "application/json"})
    assert status == 401 and _err(body)["type"] == "authentication_error"
    # bad signature: headers signed over another body
    status, body = await post(session, m, raw, Signer().headers(payload(max_tokens=99)))
    assert status == 401 and _err(body)["code"] == "BadSignature"
    # signature bytes tampered
    h = Signer().headers(raw)
    sig = h["X-Bittensor-Signature"]
    h["X-Bittensor-Signature"] = sig[:-2] + ("00" if sig[-2:] != "00" else "11")
    status, body = await post(session, m, raw, h)
    assert status == 401
    # wrong receiver
    status, body = await post(session, m, raw, Signer(receiver=OTHER.ss58_address).headers(raw))
    assert status == 403 and _err(body)["code"] == "wrong_receiver"
    # a valid signature from a hotkey the miner does not trust
    status, body = await post(session, m, raw, Signer(keypair=OTHER).headers(raw))
    assert status == 403 and _err(body)["code"] == "untrusted_caller"
    # stale nonce
    status, body = await post(session, m, raw, Signer().headers(raw, nonce_ns=time.time_ns() - 60 * 10**9))
    assert status == 401 and _err(body)["code"] == "StaleRequest"
    # replay: the same signed request twice
    h = Signer().headers(raw)
    status, _ = await post(session, m, raw, h)
    assert status == 200
    status, body = await post(session, m, raw, h)
    assert status == 401 and _err(body)["code"] == "ReplayedRequest"
    assert m.server.busy == 0 and m.server.served == 1


async def test_a_request_captured_before_a_restart_cannot_be_replayed(session: aiohttp.ClientSession,
                                                                     make_ref_miner: Any) -> None:
    """Issue 15: the replay cache lived in memory, so a restart made a fresh captured request playable again."""
    raw = payload()
    captured = Signer().headers(raw)  # signed and used against the miner before it restarts
    await asyncio.sleep(0.01)
    restarted = await make_ref_miner()  # a new process: an empty in-memory cache
    status, body = await post(session, restarted, raw, captured)
    assert status == 401 and _err(body)["code"] == "ReplayedRequest"
    status, _ = await post(session, restarted, raw, Signer().headers(raw))  # signed after the start: served
    assert status == 200


async def test_many_concurrent_signed_requests_all_accepted(session: aiohttp.ClientSession,
                                                             make_ref_miner: Any) -> None:
    n = 40
    m = await make_ref_miner(slots=n)
    signer = Signer()
    raws = [payload(max_tokens=4) for _ in range(n)]  # identical bodies: only the nonce tells them apart
    results = await asyncio.gather(*(post(session, m, raw, signer.headers(raw)) for raw in raws))
    assert [s for s, _ in results] == [200] * n
    assert all(text.endswith("data: [DONE]\n\n") for _, text in results)
    assert m.server.served == n and m.server.busy == 0


# ---- request validation ---------------------------------------------------------------------------------


async def test_body_cap_and_bad_json(session: aiohttp.ClientSession, make_ref_miner: Any) -> None:
    m = await make_ref_miner(max_body_bytes=4096)
    big = payload(padding="x" * 5000)
    status, body = await post(session, m, big, Signer().headers(big))
    assert status == 413 and _err(body)["code"] == "payload_too_large"

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the cap must hold while reading
        for _ in range(10):
            yield b"x" * 1000

    async with session.post(m.url + CHAT_PATH, data=chunked(), headers={"Content-Type": "application/json"}) as r:
        assert r.status == 413
    for raw, code in ((b"{not json", "invalid_json"), (b"\xff\xfe", "invalid_json"),
                      (b"[1, 2]", "invalid_value"), (json.dumps({"messages": []}).encode(), "invalid_value"),
                      (payload(stream=False), "invalid_value")):
        status, body = await post(session, m, raw, Signer().headers(raw))
        assert status == 400 and _err(body)["code"] == code, raw
    assert m.server.busy == 0


# ---- slots ------------------------------------------------------------------------------------------


async def test_full_miner_answers_429_at_once_never_queues(session: aiohttp.ClientSession, make_ref_miner: Any) -> None:
    m = await make_ref_miner(runtime=fast_card(time_scale=1.0), slots=2)
    signer = Signer()
    held = []
    for _ in range(2):
        raw = payload(max_tokens=20000)  # ~45 s of decoding at 440 tok/s: holds its slot
        resp = await session.post(m.url + CHAT_PATH, data=raw, headers=signer.headers(raw))
        assert resp.status == 200
        await resp.content.readany()
        held.append(resp)
    assert m.server.busy == 2
    raw = payload()
    t0 = time.monotonic()
    async with session.post(m.url + CHAT_PATH, data=raw, headers=signer.headers(raw)) as r:
        elapsed = time.monotonic() - t0
        assert r.status == 429
        assert r.headers["Retry-After"] == "0"
        assert _err(await r.json())["type"] == "busy"
    assert elapsed < 1.0, elapsed  # refused, not queued behind the held streams
    assert m.server.busy == 2 and m.server.refused_busy == 1
    for resp in held:
        resp.close()
    await m.wait_busy(0)
    status, _ = await post(session, m, raw, signer.headers(raw))
    assert status == 200


async def test_contexts_in_all_are_shared_honestly_across_validators(session: aiohttp.ClientSession,
                                                                     make_ref_miner: Any) -> None:
    """Issue 24 item 5: --slots counted per validator while the runtime had --slots contexts in all, so a second
    validator waited behind the first. With ``contexts`` the miner answers it 429 at once instead, and says how
    many contexts it has in /health."""
    dave = dev_keypair("Dave")
    m = await make_ref_miner(runtime=fast_card(time_scale=1.0), slots=2, contexts=2,
                             trust=AllowList({VALI.ss58_address, dave.ss58_address}))
    async with session.get(m.url + "/health") as r:
        health = await r.json()
    assert health["slots"] == 2 and health["contexts"] == 2
    first, second = Signer(), Signer(dave)
    held = []
    for _ in range(2):
        raw = payload(max_tokens=20000)  # holds its slot
        resp = await session.post(m.url + CHAT_PATH, data=raw, headers=first.headers(raw))
        assert resp.status == 200
        await resp.content.readany()
        held.append(resp)
    raw = payload()
    t0 = time.monotonic()
    async with session.post(m.url + CHAT_PATH, data=raw, headers=second.headers(raw)) as r:
        assert r.status == 429 and r.headers["X-Miner-Slots"] == "2"
        assert "contexts" in _err(await r.json())["message"]
    assert time.monotonic() - t0 < 1.0  # refused at once, not queued behind the other validator's streams
    held.pop().close()
    await m.wait_busy(1)
    status, _ = await post(session, m, raw, second.headers(raw))
    assert status == 200
    for resp in held:
        resp.close()


async def test_slot_freed_on_runtime_error(session: aiohttp.ClientSession, make_ref_miner: Any) -> None:
    m = await make_ref_miner(runtime=fast_card(fail_rate=1.0), slots=1)
    for _ in range(3):  # would be 429 after the first if the slot leaked
        raw = payload()
        status, body = await post(session, m, raw, Signer().headers(raw))
        assert status == 500 and _err(body)["type"] == "server_error"
    assert m.server.busy == 0


class BreaksMidStream:
    """A runtime that fails after its first frame, with a clean failure or a bug."""

    name = "test:breaks"
    sampler = None
    features: frozenset[str] = frozenset()

    def __init__(self, exc: Exception) -> None:
        self.exc = exc
        self.active = 0

    async def stream(self, payload: dict[str, Any]) -> AsyncGenerator[bytes, None]:
        self.active += 1
        try:
            yield b'data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'
            await asyncio.sleep(0)
            raise self.exc
        finally:
            self.active -= 1


@pytest.mark.parametrize("exc", [RuntimeFailure("card fell over"), ZeroDivisionError("bug")])
async def test_slot_freed_on_mid_stream_error(session: aiohttp.ClientSession, make_ref_miner: Any,
                                              exc: Exception) -> None:
    rt = BreaksMidStream(exc)
    m = await make_ref_miner(runtime=rt, slots=1)
    for _ in range(2):
        raw = payload()
        status, text = await post(session, m, raw, Signer().headers(raw))
        assert status == 200
        events = sse_events(text)
        assert "error" in events[-1] and "[DONE]" not in events
    assert m.server.busy == 0 and rt.active == 0


@pytest.mark.parametrize("hang_s", [0.0, 30.0])  # disconnect while decoding, and while waiting for a first token
async def test_slot_freed_on_client_disconnect(session: aiohttp.ClientSession, make_ref_miner: Any,
                                               hang_s: float) -> None:
    rt = fast_card(time_scale=1.0, hang_s=hang_s)
    m = await make_ref_miner(runtime=rt, slots=1)
    raw = payload(max_tokens=20000)
    resp = await session.post(m.url + CHAT_PATH, data=raw, headers=Signer().headers(raw))
    assert resp.status == 200
    first = await resp.content.readany()
    if not hang_s:
        while b'"content"' not in first:
            first += await resp.content.readany()
    assert m.server.busy == 1 and rt.active == 1
    resp.close()  # the caller walks away mid-stream
    await m.wait_busy(0)
    for _ in range(100):
        if rt.active == 0:
            break
        await asyncio.sleep(0.01)
    assert rt.active == 0
    raw = payload(max_tokens=2)
    m.server.runtime = fast_card()
    status, _ = await post(session, m, raw, Signer().headers(raw))
    assert status == 200


# ---- trust ------------------------------------------------------------------------------------------


class FakeChain:
    def __init__(self) -> None:
        self.neurons: list[NeuronInfo] = []
        self.fail = False

    async def metagraph(self) -> list[NeuronInfo]:
        if self.fail:
            raise ConnectionError("chain down")
        return self.neurons


def _n(uid: int, hk: str, permit: bool, stake: float = 100.0) -> NeuronInfo:
    return NeuronInfo(uid=uid, hotkey=hk, endpoint=None, validator_permit=permit, validator_trust=0.0, stake=stake)


async def test_permit_trust_follows_metagraph_and_survives_failures() -> None:
    chain = FakeChain()
    chain.neurons = [_n(0, "A", True), _n(1, "B", False), _n(2, "C", True, stake=1.0)]
    trust = PermitTrust(chain, min_stake=10.0)
    assert not trust.allows("A")
    assert await trust.refresh()
    assert trust.allows("A") and not trust.allows("B") and not trust.allows("C")
    chain.fail = True
    assert not await trust.refresh()
    assert trust.allows("A")  # last good set kept
    chain.fail = False
    chain.neurons = [_n(0, "B", True)]
    await trust.refresh()
    assert trust.allows("B") and not trust.allows("A")


# ---- proxy runtime --------------------------------------------------------------------------------------


class FakeOpenAI:
    """A tiny OpenAI-compatible streaming server; ``gate`` holds the stream after its first chunk."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.bodies: list[dict[str, Any]] = []
        self.gate = asyncio.Event()
        self.finished = False
        self.script: list[bytes] | None = None  # frames to answer with, whole, instead of the default stream

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        if self.script is not None:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for piece in self.script:
                await resp.write(piece)
            await resp.write_eof()
            return resp
        if self.mode in ("400", "429", "500"):
            err = {"error": {"message": f"upstream says {self.mode}", "type": "x", "param": None, "code": None}}
            return web.json_response(err, status=int(self.mode))
        if self.mode == "hang":
            await asyncio.sleep(5)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n')
        await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n')
        if self.mode == "break":
            assert request.transport is not None
            request.transport.close()
            return resp
        await asyncio.wait_for(self.gate.wait(), timeout=10)
        await resp.write(b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')
        self.finished = True
        await resp.write_eof()
        return resp


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[FakeOpenAI, str]]:
    fake = FakeOpenAI()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake.chat)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield fake, f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        fake.gate.set()
        await runner.cleanup()


BODY = {"model": "caller-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}


async def test_proxy_asks_vllm_for_the_subnet_sampler_only_when_it_runs_the_plugin(
        session: aiohttp.ClientSession, upstream: tuple[FakeOpenAI, str]) -> None:
    """``--runtime.sampler subnet``: each seeded request names its seed in ``vllm_xargs`` (the plugin's argument),
    other extra arguments kept; without it the runtime is asked nothing and declares no sampler."""
    fake, url = upstream
    fake.gate.set()
    with_plugin = ProxyRuntime(url, session, sampler=SUBNET_SAMPLER)
    plain = ProxyRuntime(url, session)
    assert (with_plugin.sampler, plain.sampler) == (SUBNET_SAMPLER, None)
    for rt, body in ((with_plugin, {**BODY, "seed": 42, "vllm_xargs": {"other": 1}}), (with_plugin, BODY),
                     (plain, {**BODY, "seed": 42})):
        async for _ in rt.stream(body):
            pass
    assert fake.bodies[0]["vllm_xargs"] == {"other": 1, "tensorgate_seed": 42} and fake.bodies[0]["seed"] == 42
    assert "vllm_xargs" not in fake.bodies[1] and "vllm_xargs" not in fake.bodies[2]
    with pytest.raises(ValueError, match="unknown sampler"):
        ProxyRuntime(url, session, sampler="mine")


async def test_proxy_relays_chunk_by_chunk(session: aiohttp.ClientSession, upstream: tuple[FakeOpenAI, str]) -> None:
    fake, url = upstream
    rt = ProxyRuntime(url + "/", session, model="served-model")
    assert rt.name == f"proxy:{url}"
    gen = rt.stream(BODY)
    got = b""
    while b'"Hi"' not in got:
        got += await asyncio.wait_for(anext(gen), timeout=5)
    assert not fake.finished and rt.active == 1  # the first content arrived while upstream is still open
    fake.gate.set()
    async for chunk in gen:
        got += chunk
    assert got.endswith(b"data: [DONE]\n\n") and fake.finished
    assert fake.bodies[0]["model"] == "served-model" and fake.bodies[0]["messages"] == BODY["messages"]
    assert rt.active == 0
    # without a configured model the caller's model is kept
    fake.gate = asyncio.Event()
    fake.gate.set()
    async for _ in ProxyRuntime(url, session).stream(BODY):
        pass
    assert fake.bodies[1]["model"] == "caller-model"


def _vllm_frames(pieces: list[tuple[str, list[int]]], finish: str) -> list[bytes]:
    """A vLLM chat stream with ``return_token_ids``: role, one chunk a piece, finish, usage, [DONE]."""
    head = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    frames = [frame({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})]
    frames += [frame({**head, "choices": [{"index": 0, "delta": {"content": t}, "token_ids": ids}]})
               for t, ids in pieces]
    frames.append(frame({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}))
    frames.append(frame({**head, "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 5}}))
    return [*frames, b"data: [DONE]\n\n"]


def _answer(raw: bytes) -> tuple[str, dict[int, dict[str, Any]], list[int], str | None, list[dict[str, int]]]:
    """What a validator reads from a miner's stream: text, folded calls, token ids, finish, usage chunks."""
    text, finish = "", None
    calls: dict[int, dict[str, Any]] = {}
    ids: list[int] = []
    usages: list[dict[str, int]] = []
    for event in SSEParser().feed(raw):
        if event == "[DONE]":
            continue
        info = parse_chunk(event)
        text += info.content
        ids += info.token_ids or ()
        if info.tool_calls:
            fold_tool_calls(calls, info.tool_calls)
        finish = info.finish_reason or finish
        if info.usage:
            usages.append(info.usage)
    return text, calls, ids, finish, usages


WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}]
TOOL_BODY = {**BODY, "tools": WEATHER, "return_token_ids": True}


async def test_proxy_writes_tool_turns_and_turns_a_written_call_into_tool_call_deltas(
        session: aiohttp.ClientSession, upstream: tuple[FakeOpenAI, str]) -> None:
    """A runtime that renders its own template re-serializes ``tools``, so a proxy declaring ``tools`` sends the
    subnet's tool turns instead (the prompt the reference renders) and parses the call the model wrote: the
    validator gets OpenAI's tool-call deltas, finish ``tool_calls``, usage, and every token id in order."""
    fake, url = upstream
    call = [("<tool_call>", [1, 2]), ('\n{"name": "get_weather", ', [3]), ('"arguments": {"city": "Paris"}}', [4]),
            ("\n</tool_call>", [5, 6])]
    fake.script = _vllm_frames(call, "stop")
    rt = ProxyRuntime(url, session, features=frozenset({TOOLS}))
    raw = b"".join([c async for c in rt.stream(TOOL_BODY)])
    sent = fake.bodies[0]
    assert "tools" not in sent and sent["messages"] == prompt_messages(TOOL_BODY)
    assert "get_weather" in sent["messages"][0]["content"] and sent["return_token_ids"] is True
    text, calls, ids, finish, usages = _answer(raw)
    assert text == "" and finish == "tool_calls" and ids == [1, 2, 3, 4, 5, 6]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris"})]
    assert usages == [{"prompt_tokens": 9, "completion_tokens": 5}] and raw.endswith(b"data: [DONE]\n\n")
    # a text answer flows on as text with its ids and the runtime's finish
    fake.script = _vllm_frames([("It is", [7]), (" sunny.", [8, 9])], "length")
    text, calls, ids, finish, _ = _answer(b"".join([c async for c in rt.stream(TOOL_BODY)]))
    assert (text, calls, ids, finish) == ("It is sunny.", {}, [7, 8, 9], "length")
    # tool_choice none: the turns are still written (same prompt as the reference) and the stream relayed as is
    fake.script = _vllm_frames([("<tool_call>", [1])], "stop")
    raw = b"".join([c async for c in rt.stream({**TOOL_BODY, "tool_choice": "none"})])
    assert "tools" not in fake.bodies[-1] and raw == b"".join(fake.script)
    # a runtime that breaks its stream's framing fails the answer cleanly, never half a call
    fake.script = [b'data: {"choices": 7}\n\n']
    with pytest.raises(RuntimeFailure, match="unreadable"):
        async for _ in rt.stream(TOOL_BODY):
            pass


async def test_proxy_without_the_tools_feature_passes_tools_through(
        session: aiohttp.ClientSession, upstream: tuple[FakeOpenAI, str]) -> None:
    fake, url = upstream
    fake.script = _vllm_frames([("<tool_call>", [1])], "stop")
    raw = b"".join([c async for c in ProxyRuntime(url, session).stream(TOOL_BODY)])
    assert fake.bodies[0]["tools"] == WEATHER and fake.bodies[0]["messages"] == BODY["messages"]
    assert raw == b"".join(fake.script)


@pytest.mark.parametrize("mode,status,msg", [("400", 400, "upstream says 400"), ("429", 429, "upstream says 429"),
                                             ("500", 502, "upstream says 500")])
async def test_proxy_maps_upstream_errors(session: aiohttp.ClientSession, upstream: tuple[FakeOpenAI, str],
                                          mode: str, status: int, msg: str) -> None:
    fake, url = upstream
    fake.mode = mode
    rt = ProxyRuntime(url, session)
    with pytest.raises(RuntimeFailure) as ei:
        await anext(rt.stream(BODY))
    assert ei.value.status == status and ei.value.message == msg
    assert rt.active == 0


async def test_proxy_unreachable_timeout_and_break(session: aiohttp.ClientSession,
                                                   upstream: tuple[FakeOpenAI, str]) -> None:
    fake, url = upstream
    with socket_port() as dead:
        rt = ProxyRuntime(f"http://127.0.0.1:{dead}", session, timeouts=ProxyTimeouts(connect_s=2.0))
        with pytest.raises(RuntimeFailure) as ei:
            await anext(rt.stream(BODY))
        assert ei.value.status == 502 and ei.value.code == "runtime_unreachable"
    fake.mode = "hang"
    rt = ProxyRuntime(url, session, timeouts=ProxyTimeouts(read_s=0.3))
    with pytest.raises(RuntimeFailure) as ei:
        await anext(rt.stream(BODY))
    assert ei.value.status == 504
    fake.mode = "break"
    rt = ProxyRuntime(url, session)
    with pytest.raises(RuntimeFailure) as ei:
        async for _ in rt.stream(BODY):
            pass
    assert ei.value.code == "runtime_dropped" and rt.active == 0


class socket_port:
    """A loopback port that nothing listens on (bound then closed)."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        return None


async def test_miner_in_front_of_proxy_streams_before_upstream_ends(
        session: aiohttp.ClientSession, upstream: tuple[FakeOpenAI, str], make_ref_miner: Any) -> None:
    fake, url = upstream
    async with aiohttp.ClientSession() as miner_session:
        m = await make_ref_miner(runtime=ProxyRuntime(url, miner_session), slots=1)
        raw = json.dumps(BODY).encode()
        async with session.post(m.url + CHAT_PATH, data=raw, headers=Signer().headers(raw)) as resp:
            assert resp.status == 200
            got = b""
            while b'"Hi"' not in got:
                got += await asyncio.wait_for(resp.content.readany(), timeout=5)
            assert not fake.finished
            fake.gate.set()
            got += await resp.content.read()
        assert got.endswith(b"data: [DONE]\n\n")
        async with session.get(m.url + "/health") as r:
            assert (await r.json())["runtime"] == f"proxy:{url}"
        fake.mode = "500"
        status, body = await post(session, m, raw, Signer().headers(raw))
        assert status == 502 and _err(body)["message"] == "upstream says 500"
        assert m.server.busy == 0


# ---- keys and CLI ------------------------------------------------------------------------------------


def test_dev_keypair() -> None:
    assert dev_keypair("Alice").ss58_address == "5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY"
    assert dev_keypair("//Bob").ss58_address == dev_keypair("Bob").ss58_address != dev_keypair("Alice").ss58_address


def test_load_hotkey(tmp_path: Path) -> None:
    w = bt.Wallet(name="mw", hotkey="hk", path=str(tmp_path))
    w.create_new_hotkey(suppress=True)
    kp = load_hotkey("mw", "hk", str(tmp_path))
    assert kp.ss58_address == w.hotkey.ss58_address
    assert kp.verify(b"x", kp.sign(b"x"))
    with pytest.raises(MissingKeyError) as ei:
        load_hotkey("mw", "nope", str(tmp_path))
    assert isinstance(ei.value, KeyError)
    msg = str(ei.value)
    assert "nope" in msg and str(tmp_path) in msg and "btcli wallet new-hotkey" in msg


def test_cli_missing_wallet_and_bad_args(tmp_path: Path) -> None:
    assert main(["--wallet.path", str(tmp_path), "--wallet.name", "ghost", "--allow", VALI.ss58_address,
                 "--runtime.sim", "rtx5090"]) == 2
    args = parse_args(["--runtime.sim", "rtx5090-slow:time_scale=2", "--allow", "X", "--allow", "Y"])
    assert args.allow == ["X", "Y"] and args.axon_ip == "127.0.0.1" and args.slots == 4
    for bad in (["--runtime.sim", "gtx1080"], ["--slots", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_cli_serves_a_simulated_card_only_when_named_or_with_a_dev_key(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 23: a miner started with a wallet and no runtime used to serve the simulated card on any network."""
    with pytest.raises(SystemExit) as e:
        parse_args(["--wallet.name", "miner", "--netuid", "7"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no runtime" in err and "--runtime.url" in err and "Traceback" not in err
    assert parse_args(["--dev-key", "Bob", "--allow", "X"]).runtime_sim == "rtx5090"  # local testing
    assert parse_args(["--wallet.name", "miner", "--runtime.sim", "rtx5090-slow"]).runtime_sim == "rtx5090-slow"
    with pytest.raises(SystemExit):
        parse_args(["--runtime.url", "http://127.0.0.1:1", "--runtime.sim", "rtx5090"])  # two runtimes


def test_cli_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "neurons.miner", "--dev-key", "Bob", "--allow", VALI.ss58_address,
           "--axon.port", "0", "--runtime.sim", "rtx5090:time_scale=20", "--slots", "2",
           "--serve.models", "org/a, org/b"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        port = None
        deadline = time.monotonic() + 30
        assert proc.stderr is not None
        while port is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            if "listening on" in line:
                port = int(line.split("listening on ")[1].split()[0].rsplit(":", 1)[1])
        assert port, "miner did not report its port"
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            health = json.loads(r.read())
        assert health == {"status": "ok", "hotkey": dev_keypair("Bob").ss58_address, "slots": 2, "contexts": None,
                          "busy": 0, "runtime": "sim:rtx5090", "runtime_state": "simulated rtx5090",
                          "sampler": "tensorgate-gumbel/1", "models": ["org/a", "org/b"],
                          "features": ["logprobs", "response_format", "tools"]}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        if proc.stderr is not None:
            proc.stderr.close()


class _SlowToCloseRuntime:
    """A runtime that sends ``[DONE]`` and only then finishes (a proxy waiting for its upstream to close)."""

    name = "slow-to-close"
    sampler = None
    features: frozenset[str] = frozenset()

    def health(self) -> Any:
        from neurons.miner.runtimes.base import RuntimeHealth

        return RuntimeHealth(ok=True, detail="test")

    async def stream(self, payload: dict[str, Any]) -> AsyncGenerator[bytes, None]:
        from gateway.protocol.sse import DONE_FRAME, ChunkFramer, frame

        f = ChunkFramer("chatcmpl-x", 0, "m")
        yield frame(f.chunk({"role": "assistant"}, None)) + f.tokens("hi", [7])
        yield frame(f.chunk({}, "stop")) + DONE_FRAME
        await asyncio.sleep(0.3)  # cleanup after [DONE]: the caller has its answer already


async def test_a_one_slot_miner_is_free_again_when_the_validator_reads_done(make_sim_miner, make_gateway):
    """The miner frees its slot before it sends ``[DONE]``: the gateway releases its lease on reading it and
    may send the next request at once, and a 429 with none of its streams on the miner is a refusal."""
    m = await make_sim_miner(slots=1, runtime=_SlowToCloseRuntime())
    h = await make_gateway([m])
    for _ in range(5):  # back to back, no pause: each request goes out the moment the last [DONE] is read
        lease = h.router.acquire_uid(1)
        assert lease is not None
        try:
            await h.upstream.probe(lease, {"model": "tensorgate/sim-5090", "stream": True, "max_tokens": 4,
                                           "messages": [{"role": "user", "content": "hi"}]})
        finally:
            h.router.release(lease)
    failures = [x.failure for x in h.measurements() if not x.ok]
    assert failures == [] and m.server.refused_busy == 0


def test_stop_matcher_holds_back_only_what_may_start_a_stop_string() -> None:
    from neurons.miner.runtimes.framing import StopMatcher

    m = StopMatcher(("END", "\n\n"))
    assert m.feed("Hello", [1]) == [("Hello", [1])]
    assert m.feed(" E", [2]) == []  # " E" may start "END": held, whole token and ids
    assert m.feed("x", [3]) == [(" E", [2]), ("x", [3])]  # it did not
    assert m.feed("\n", [4]) == []
    got = m.feed("\nEN", [5])  # the stop string completes inside this token
    assert got == [("", [4, 5])] and m.stopped  # the text before it (none), every id generated so far
    m = StopMatcher(("END",))
    assert m.feed("ab", [1]) == [("ab", [1])]
    assert m.feed("cEN", [2]) == []
    assert m.feed("Dtail", [3]) == [("c", [2, 3])] and m.stopped  # "c" sent, ids up to the stop's last token
    m = StopMatcher(("END",))
    m.feed("E", [1])
    assert m.flush() == [("E", [1])]  # the answer ended: what was held is sent
    assert StopMatcher(()).feed("x", [9]) == [("x", [9])]
