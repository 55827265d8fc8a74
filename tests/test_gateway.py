"""The gateway over real sockets on loopback, against scripted fake miners (tests/fakes.py)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections import Counter

import aiohttp
import bittensor as bt
import pytest

from gateway.auth import ApiKeyAuth, bearer_token, hash_key, load_key_hashes
from gateway.protocol.signing import RequestSigner
from gateway.protocol.sse import ChunkDecoder, ChunkFramer, SSEGarbage, SSEParser, frame, parse_chunk
from gateway.upstream import UpstreamTimeouts
from scoring.measurement import FailureReason
from tests.conftest import API_KEY
from tests.fakes import MODEL, Script, body, contents, eventually, read_sse


async def error_of(resp: aiohttp.ClientResponse) -> dict:
    assert resp.content_type == "application/json"
    err = (await resp.json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# -- pure pieces: SSE parsing, auth, signing ----------------------------------------------------


def test_sse_parser_is_incremental_across_any_split():
    stream = ('data: {"a": "h\u00e9llo \u2603"}\r\n\r\n: comment\nevent: x\ndata: line1\ndata: line2\n\n'
              "data: [DONE]\n\n").encode()
    whole = SSEParser().feed(stream)
    assert whole == ['{"a": "h\u00e9llo \u2603"}', "line1\nline2", "[DONE]"]
    p = SSEParser()
    one_by_one = [e for i in range(len(stream)) for e in p.feed(stream[i:i + 1])]  # splits multibyte UTF-8 too
    assert one_by_one == whole


@pytest.mark.parametrize("data", [b"data: " + b"x" * 70_000, b"data: \xff\xfe\n\n", b"x" * 65_537])
def test_sse_parser_rejects_overlong_lines_and_bad_utf8(data):
    with pytest.raises(SSEGarbage):
        p = SSEParser(max_line_bytes=64 * 1024)
        for i in range(0, len(data), 4096):
            p.feed(data[i:i + 4096])


@pytest.mark.parametrize(
    "data",
    ['{"choices": [{"delta": {"content": "x"}}], "n": NaN}', '{"choices": [], "v": Infinity}',
     '{"choices": [], "v": 1e999}', '{"choices": [{}, {}]}', '{"choices": [{"delta": {"role": "user"}}]}',
     '{"choices": [{"delta": {"content": 5}}]}', '{"choices": [{"delta": [], "finish_reason": null}]}',
     '{"choices": [{"delta": {}, "finish_reason": "exploded"}]}', '{"object": "chat.completion", "choices": []}',
     '{"choices": [], "usage": {"completion_tokens": -1}}', '[1, 2]', '{"choices": [{"delta": {"content": "'
     + "y" * 5000 + '"}}]}', "{nope"],
)
def test_parse_chunk_rejects_bad_shapes(data):
    with pytest.raises(SSEGarbage):
        parse_chunk(data)


def test_parse_chunk_accepts_the_usual_shapes():
    assert parse_chunk('{"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": '
                       '"assistant", "content": ""}, "finish_reason": null}]}').role == "assistant"
    c = parse_chunk('{"choices": [{"delta": {"content": "hi"}, "finish_reason": "stop"}], "usage": null}')
    assert (c.content, c.finish_reason, c.usage) == ("hi", "stop", None)
    u = parse_chunk('{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}')
    assert u.usage == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5} and u.content == ""


def test_api_keys_from_file_list_and_env(tmp_path):
    f = tmp_path / "keys.txt"
    f.write_text("# operators\nsk-file-1\n\n  sk-file-2   # trailing comment\n#sk-disabled\n")
    hashes = load_key_hashes(keys_file=f, keys=["sk-list"], env={"TENSORGATE_API_KEYS": "sk-env-1, sk-env-2,"})
    assert hashes == {hash_key(k) for k in ("sk-file-1", "sk-file-2", "sk-list", "sk-env-1", "sk-env-2")}
    assert not any("sk-" in h for h in hashes)  # only hashes are kept
    auth = ApiKeyAuth(hashes)
    assert auth.check("Bearer sk-file-2") and auth.check("bearer sk-env-1")
    for bad in (None, "", "Bearer", "Bearer sk-disabled", "sk-list", "Basic sk-list", "Bearer sk-list-2"):
        assert not auth.check(bad)
    assert bearer_token("Bearer  abc ") == "abc"
    assert not ApiKeyAuth(frozenset()).check("Bearer anything")


def test_signer_nonces_strictly_increase_across_threads(alice):
    signer = RequestSigner(alice)
    per_thread: list[list[int]] = [[] for _ in range(4)]

    def run(out: list[int]) -> None:
        for _ in range(500):
            out.append(signer.next_nonce())

    threads = [threading.Thread(target=run, args=(out,)) for out in per_thread]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [n for out in per_thread for n in out]
    assert len(set(every)) == 2000
    assert all(out == sorted(out) and len(set(out)) == len(out) for out in per_thread)


def test_signed_request_verifies_at_the_receiver_only(alice, miner_keys):
    signer = RequestSigner(alice)
    bob, charlie = miner_keys[0].ss58_address, miner_keys[1].ss58_address
    body_bytes = b'{"x": 1}'
    store = bt.http_auth.InMemoryNonceStore()
    h1 = signer.sign(path="/v1/chat/completions", body=body_bytes, receiver_ss58=bob)
    h2 = signer.sign(path="/v1/chat/completions", body=body_bytes, receiver_ss58=bob)  # same instant, same body
    for h in (h1, h2):
        caller = bt.http_auth.verify(h, body_bytes, method="POST", path="/v1/chat/completions",
                                     self_hotkey_ss58=bob, nonce_store=store)
        assert caller.hotkey_ss58 == alice.ss58_address
    with pytest.raises(bt.http_auth.ReplayedRequest):
        bt.http_auth.verify(h1, body_bytes, method="POST", path="/v1/chat/completions", self_hotkey_ss58=bob,
                            nonce_store=store)
    with pytest.raises(bt.http_auth.WrongReceiver):
        bt.http_auth.verify(h1, body_bytes, method="POST", path="/v1/chat/completions", self_hotkey_ss58=charlie)


# -- happy paths ---------------------------------------------------------------------------------


async def test_streaming_is_incremental(make_miner, make_gateway):
    """The first token reaches the client while the miner is still holding the rest back."""
    m = await make_miner(Script("gated", tokens=4))
    h = await make_gateway([m])
    async with h.chat(body(max_tokens=4)) as r:
        assert r.status == 200
        assert r.headers["X-Tensorgate-Miner-Uid"] == "1"
        seen: list[str] = []

        async def first_content() -> None:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    c = json.loads(line[6:])["choices"][0]["delta"].get("content")
                    if c:
                        seen.append(c)
                        return

        await asyncio.wait_for(first_content(), timeout=10)  # a buffering gateway would block here
        assert seen == [m.token(0)]
        assert m.finished == 0 and m.active == 1
        m.gate.set()
        rest = await read_sse(r)
    assert contents(rest) == [m.token(i) for i in range(1, 4)]
    assert rest[-1] == "[DONE]"
    assert await eventually(lambda: h.router.total_in_flight() == 0 and m.active == 0)


async def test_non_streaming_is_assembled_with_usage_and_served_by(make_miner, make_gateway):
    m = await make_miner(Script("ok", tokens=6))
    h = await make_gateway([m])
    async with h.chat(body(stream=False, max_tokens=6)) as r:
        assert r.status == 200
        data = await r.json()
    assert data["object"] == "chat.completion"
    assert data["choices"][0]["message"] == {"role": "assistant", "content": "".join(m.token(i) for i in range(6))}
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 6
    assert data["tensorgate"] == {"miner_uid": 1, "miner_hotkey": m.hotkey}
    assert r.headers["X-Tensorgate-Miner-Uid"] == "1"
    # the miner was always asked to stream, with usage, and got the capped max_tokens
    assert m.bodies[0]["stream"] is True and m.bodies[0]["stream_options"] == {"include_usage": True}
    assert m.bodies[0]["max_tokens"] == 6


async def test_usage_chunk_is_opt_in(make_miner, make_gateway):
    m = await make_miner(Script("ok", tokens=3))
    h = await make_gateway([m])
    async with h.chat(body(max_tokens=3)) as r:
        plain = await read_sse(r)
    async with h.chat(body(max_tokens=3, stream_options={"include_usage": True})) as r:
        with_usage = await read_sse(r)
    assert not any(isinstance(e, dict) and "usage" in e for e in plain)
    usage = [e for e in with_usage if isinstance(e, dict) and "usage" in e]
    assert len(usage) == 1 and usage[0]["choices"] == []
    assert usage[0]["usage"]["completion_tokens"] == 3
    assert with_usage[-1] == "[DONE]"
    first = plain[0]
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"
    assert first["tensorgate"]["miner_uid"] == 1


async def test_ttft_clock_starts_at_dispatch_not_headers(make_miner, make_gateway):
    """A miner slow to send headers cannot hide that delay from TTFT."""
    m = await make_miner(Script("ok", tokens=20, headers_delay=0.3, token_delay=0.01))
    h = await make_gateway([m])
    async with h.chat(body(max_tokens=20)) as r:
        events = await read_sse(r)
    assert len(contents(events)) == 20
    [meas] = h.measurements()
    assert meas.ok and meas.completion_tokens == 20
    assert meas.ttft_s is not None and meas.ttft_s >= 0.3
    assert meas.latency_s >= meas.ttft_s + 19 * 0.01 * 0.9
    rate = meas.decode_rate(min_tokens=16)
    assert rate is not None and rate <= 19 / (19 * 0.01 * 0.9)


async def test_concurrent_requests_get_distinct_nonces(make_miner, make_gateway):
    m = await make_miner(Script("ok", tokens=2, token_delay=0.01), slots=32)
    h = await make_gateway([m])

    async def one() -> int:
        async with h.chat(body(stream=False, max_tokens=2)) as r:
            await r.read()
            return r.status

    statuses = await asyncio.gather(*(one() for _ in range(24)))
    assert statuses == [200] * 24
    assert m.auth_failures == 0 and m.requests == 24


# -- retry before the first byte, never after ----------------------------------------------------


async def test_retry_on_busy(make_miner, make_gateway):
    busy = await make_miner(Script("busy"), tag="busy-")
    ok = await make_miner(Script("ok", tokens=3), tag="ok-")
    h = await make_gateway([busy, ok], scores={"busy-": 1.0, "ok-": 0.0})  # busy is always tried first
    async with h.chat(body(max_tokens=3)) as r:
        assert r.status == 200
        assert r.headers["X-Tensorgate-Miner-Uid"] == str(h.uids["ok-"])
        events = await read_sse(r)
    assert contents(events) == [ok.token(i) for i in range(3)]
    assert busy.requests == 1 and ok.requests == 1
    fails = [(x.uid, x.failure) for x in h.measurements()]
    assert fails == [(h.uids["busy-"], FailureReason.BUSY), (h.uids["ok-"], None)]
    assert h.router.total_in_flight() == 0


async def test_retry_on_dead_miner(make_miner, make_gateway, dead_miner):
    ok = await make_miner(Script("ok", tokens=3), tag="ok-")
    h = await make_gateway([dead_miner, ok], scores={"dead": 1.0, "ok-": 0.0})
    async with h.chat(body(stream=False, max_tokens=3)) as r:
        assert r.status == 200
        assert (await r.json())["tensorgate"]["miner_uid"] == h.uids["ok-"]
    assert [x.failure for x in h.measurements()] == [FailureReason.CONNECT, None]
    assert h.router.total_in_flight() == 0


async def test_retry_on_failure_after_prelude_but_before_content(make_miner, make_gateway):
    """A role prelude is not a byte the client has seen: a miner dying after it is retried."""
    hang = await make_miner(Script("hang_first"), tag="hang-")
    ok = await make_miner(Script("ok", tokens=2), tag="ok-")
    h = await make_gateway([hang, ok], scores={"hang-": 1.0, "ok-": 0.0})
    async with h.chat(body(max_tokens=2)) as r:
        assert r.status == 200
        events = await read_sse(r)
    assert contents(events) == [ok.token(0), ok.token(1)]
    assert [x.failure for x in h.measurements()] == [FailureReason.TIMEOUT, None]


async def test_no_retry_after_first_byte(make_miner, make_gateway):
    drop = await make_miner(Script("drop_after", tokens=8, after=3), tag="drop-")
    ok = await make_miner(Script("ok", tokens=8), tag="ok-")
    h = await make_gateway([drop, ok], scores={"drop-": 1.0, "ok-": 0.0})
    async with h.chat(body(max_tokens=8)) as r:
        assert r.status == 200
        events = await asyncio.wait_for(read_sse(r), timeout=10)
    assert contents(events) == [drop.token(i) for i in range(3)]  # only that miner's tokens
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and events[-1] == "[DONE]" and events[-2] is errors[0]
    assert errors[0]["error"]["type"] == "upstream_error"
    assert ok.requests == 0
    assert [x.failure for x in h.measurements()] == [FailureReason.DROPPED]
    assert h.router.total_in_flight() == 0


async def test_non_streaming_failure_mid_answer_is_retried_on_another_miner(make_miner, make_gateway):
    """A non-streaming client has seen no byte until the whole answer is in, so a miner that drops
    mid-answer is retried; the answer holds only the second miner's tokens, never a splice."""
    drop = await make_miner(Script("drop_after", tokens=8, after=2), tag="drop-")
    ok = await make_miner(Script("ok", tokens=4), tag="ok-")
    h = await make_gateway([drop, ok], scores={"drop-": 1.0, "ok-": 0.0})
    async with h.chat(body(stream=False, max_tokens=4)) as r:
        assert r.status == 200
        doc = await r.json()
    assert doc["choices"][0]["message"]["content"] == "".join(ok.token(i) for i in range(4))
    assert doc["tensorgate"]["miner_uid"] == h.uids["ok-"]
    assert [x.failure for x in h.measurements()] == [FailureReason.DROPPED, None]
    assert h.router.total_in_flight() == 0


async def test_non_streaming_gives_502_when_every_miner_fails_mid_answer(make_miner, make_gateway):
    drops = [await make_miner(Script("drop_after", tokens=8, after=2), tag=f"d{i}-") for i in range(2)]
    h = await make_gateway(drops, max_retries=1)
    async with h.chat(body(stream=False)) as r:
        assert r.status == 502
        await error_of(r)
    assert [x.failure for x in h.measurements()] == [FailureReason.DROPPED, FailureReason.DROPPED]
    assert h.router.total_in_flight() == 0


async def test_stall_mid_stream_ends_with_error_event_not_a_hang(make_miner, make_gateway):
    stall = await make_miner(Script("stall_after", tokens=8, after=2))
    h = await make_gateway([stall])
    async with h.chat(body(max_tokens=8)) as r:
        events = await asyncio.wait_for(read_sse(r), timeout=10)
    assert len(contents(events)) == 2
    assert events[-2]["error"]["code"] == "upstream_timeout" and events[-1] == "[DONE]"
    assert [x.failure for x in h.measurements()] == [FailureReason.TIMEOUT]
    assert await eventually(lambda: stall.active == 0)  # the gateway hung up: the miner's slot is free


async def test_retries_are_bounded(make_miner, make_gateway):
    miners = [await make_miner(Script("http500"), tag=f"bad{i}-") for i in range(5)]
    h = await make_gateway(miners, max_retries=2)
    async with h.chat(body()) as r:
        assert r.status == 502
        await error_of(r)
    assert sum(m.requests for m in miners) == 3
    assert [x.failure for x in h.measurements()] == [FailureReason.HTTP_STATUS] * 3


# -- client disconnect ---------------------------------------------------------------------------


async def test_disconnect_mid_stream_frees_both_sides(make_miner, make_gateway):
    m = await make_miner(Script("gated", tokens=4))
    h = await make_gateway([m])
    resp = await h.client.post(h.base_url + "/v1/chat/completions", json=body(max_tokens=4), headers=h.auth)
    assert resp.status == 200
    async for line in resp.content:
        if b'"content":"m' in line:
            break
    assert h.router.total_in_flight() == 1 and m.active == 1
    resp.close()  # drop the connection mid-stream
    assert await eventually(lambda: h.router.total_in_flight() == 0 and m.active == 0)
    assert m.cancelled == 1 and m.finished == 0
    assert await eventually(lambda: len(h.measurements()) == 1)
    [meas] = h.measurements()
    assert meas.failure == FailureReason.CLIENT_DISCONNECT and not meas.ok


async def test_disconnect_before_first_byte_cancels_upstream(make_miner, make_gateway):
    m = await make_miner(Script("hang_headers"))
    h = await make_gateway([m], timeouts=UpstreamTimeouts(first_token=30.0, stall=30.0, total=60.0))
    task = asyncio.create_task(h.client.post(h.base_url + "/v1/chat/completions", json=body(), headers=h.auth))
    assert await eventually(lambda: m.active == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await eventually(lambda: h.router.total_in_flight() == 0 and m.active == 0)
    assert await eventually(lambda: len(h.measurements()) == 1)
    assert h.measurements()[0].failure == FailureReason.CLIENT_DISCONNECT


# -- error codes ---------------------------------------------------------------------------------


async def test_auth(make_miner, make_gateway):
    m = await make_miner()
    h = await make_gateway([m])
    url = h.base_url + "/v1/chat/completions"
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": API_KEY}, {"Authorization": "Basic x"}):
        async with h.client.post(url, json=body(), headers=headers) as r:
            assert r.status == 401
            assert (await error_of(r))["code"] == "invalid_api_key"
    # refused from the head, before the body is read: too big a body still gets 401, not 413
    big = json.dumps(body(messages=[{"role": "user", "content": "x" * (2 << 20)}])).encode()
    async with h.client.post(url, data=big, headers={"Content-Type": "application/json"}) as r:
        assert r.status == 401 and (await error_of(r))["code"] == "invalid_api_key"
    for path in ("/v1/models", "/v1/status"):
        async with h.client.get(h.base_url + path) as r:
            assert r.status == 401
    async with h.client.get(h.base_url + "/health") as r:
        assert r.status == 200 and (await r.json())["status"] == "ok"
    async with h.client.get(h.base_url + "/v1/models", headers=h.auth) as r:
        assert r.status == 200
        assert [d["id"] for d in (await r.json())["data"]] == [MODEL]
    assert m.requests == 0 and h.measurements() == []
    async with h.client.get(h.base_url + "/v1/status", headers=h.auth) as r:
        assert (await r.json())["outcomes"] == {"401": 7}  # 5 refused from the head, 2 by their handler


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": MODEL}, "messages"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0]"),
        (body(max_tokens=0), "max_tokens"),
        (body(max_tokens=True), "max_tokens"),
        (body(max_completion_tokens=-3), "max_completion_tokens"),
        (body(n=2), "n"),
        (body(temperature=2.5), "temperature"),
        (body(top_p=-0.1), "top_p"),
        (body(stream="yes"), "stream"),  # type: ignore[arg-type]  # the wrong type is the test
        (body(stream=False, stream_options={"include_usage": True}), "stream_options"),
        (body(stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
        (body(stop=[1, 2]), "stop"),
        (body(tools=[{"type": "function"}]), "tools"),
    ],
)
async def test_400_names_the_field(make_miner, make_gateway, payload, param):
    m = await make_miner()
    h = await make_gateway([m])
    async with h.chat(payload) as r:
        assert r.status == 400
        err = await error_of(r)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert m.requests == 0


async def test_400_malformed_json_404_unknown_model_413_too_big(make_miner, make_gateway):
    m = await make_miner()
    h = await make_gateway([m], max_body_bytes=4096)
    url = h.base_url + "/v1/chat/completions"
    async with h.client.post(url, data=b"{not json", headers=h.auth) as r:
        assert r.status == 400 and (await error_of(r))["code"] == "invalid_json"
    async with h.client.post(url, data=b"[1, 2]", headers=h.auth) as r:
        assert r.status == 400
    async with h.chat(body(model="gpt-9")) as r:
        assert r.status == 404
        err = await error_of(r)
        assert err["code"] == "model_not_found" and err["param"] == "model"
    big = body(messages=[{"role": "user", "content": "x" * 5000}])
    async with h.chat(big) as r:
        assert r.status == 413
        await error_of(r)

    async def chunked():  # no Content-Length: the cap still holds while reading
        for _ in range(10):
            yield b" " * 1000

    async with h.client.post(url, data=chunked(), headers=h.auth) as r:
        assert r.status == 413
    async with h.client.get(h.base_url + "/v1/nothing", headers=h.auth) as r:
        assert r.status == 404 and (await error_of(r))["code"] == "not_found"
    assert m.requests == 0
    # the 413s came from the server before any handler ran; they are counted all the same
    async with h.client.get(h.base_url + "/v1/status", headers=h.auth) as r:
        outcomes = (await r.json())["outcomes"]
    assert outcomes == {"400": 2, "404": 2, "413": 2}


async def test_max_tokens_capped_by_config(make_miner, make_gateway):
    m = await make_miner(Script("ok", tokens=3))
    h = await make_gateway([m], max_tokens_cap=50, default_max_tokens=20)
    async with h.chat(body(stream=False, max_tokens=10_000)) as r:
        assert r.status == 200
    async with h.chat({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}) as r:
        assert r.status == 200
    assert [b["max_tokens"] for b in m.bodies] == [50, 20]


async def test_429_when_nothing_eligible_or_all_busy(make_miner, make_gateway):
    h = await make_gateway([])
    async with h.chat(body()) as r:
        assert r.status == 429
        assert (await error_of(r))["code"] == "no_capacity"
        assert "Retry-After" in r.headers
    busy = [await make_miner(Script("busy"), tag=f"b{i}-") for i in range(2)]
    h2 = await make_gateway(busy)
    async with h2.chat(body()) as r:
        assert r.status == 429
    assert [x.failure for x in h2.measurements()] == [FailureReason.BUSY, FailureReason.BUSY]


async def test_502_and_504_before_first_byte(make_miner, make_gateway, dead_miner):
    h = await make_gateway([dead_miner])
    async with h.chat(body()) as r:
        assert r.status == 502
    hang = await make_miner(Script("hang_headers"))
    h2 = await make_gateway([hang], timeouts=UpstreamTimeouts(first_token=0.3, stall=0.3, total=5.0))
    async with h2.chat(body(stream=False)) as r:
        assert r.status == 504
        assert (await error_of(r))["type"] == "timeout_error"
    assert [x.failure for x in h2.measurements()] == [FailureReason.TIMEOUT]
    assert await eventually(lambda: hang.active == 0)


# -- misbehaving miners are recorded with the right reason ---------------------------------------


@pytest.mark.parametrize(
    ("script", "reason"),
    [
        (Script("garbage"), FailureReason.GARBAGE),
        (Script("nan"), FailureReason.GARBAGE),
        (Script("invalid_utf8"), FailureReason.GARBAGE),
        (Script("long_line"), FailureReason.GARBAGE),
        (Script("wrong_shape"), FailureReason.GARBAGE),
        (Script("overlong", tokens=12), FailureReason.OVERLONG),
        (Script("hang_headers"), FailureReason.TIMEOUT),
        (Script("hang_first"), FailureReason.TIMEOUT),
        (Script("stall_after", after=2), FailureReason.TIMEOUT),
        (Script("drop_after", after=2), FailureReason.DROPPED),
        (Script("empty"), FailureReason.EMPTY),
        (Script("http500"), FailureReason.HTTP_STATUS),
        (Script("busy"), FailureReason.BUSY),
        (Script("no_done", tokens=3), None),
        (Script("ok", tokens=3), None),
    ],
    ids=lambda v: v.behavior if isinstance(v, Script) else str(v),
)
async def test_probe_records_failure_reason(make_miner, make_gateway, script, reason):
    m = await make_miner(script)
    h = await make_gateway([m])
    lease = h.router.acquire_uid(1)
    assert lease is not None
    try:
        meas = await asyncio.wait_for(h.upstream.probe(lease, body(max_tokens=8)), timeout=15)
    finally:
        h.router.release(lease)
    assert meas.failure == reason and meas.ok is (reason is None) and meas.probe
    assert h.measurements() == [meas]
    if reason == FailureReason.OVERLONG:
        assert meas.completion_tokens == 8
    assert await eventually(lambda: m.active == 0)


async def test_overlong_stream_is_cut_at_max_tokens(make_miner, make_gateway):
    m = await make_miner(Script("overlong", tokens=50))
    h = await make_gateway([m])
    async with h.chat(body(max_tokens=5)) as r:
        events = await read_sse(r)
    assert len(contents(events)) == 5
    assert "error" in events[-2] and events[-1] == "[DONE]"
    assert [x.failure for x in h.measurements()] == [FailureReason.OVERLONG]


async def test_garbage_before_content_is_retried(make_miner, make_gateway):
    bad = await make_miner(Script("nan"), tag="bad-")
    ok = await make_miner(Script("ok", tokens=2), tag="ok-")
    h = await make_gateway([bad, ok], scores={"bad-": 1.0, "ok-": 0.0})
    async with h.chat(body(stream=False, max_tokens=2)) as r:
        assert r.status == 200
    assert [x.failure for x in h.measurements()] == [FailureReason.GARBAGE, None]


# -- bookkeeping under a burst -------------------------------------------------------------------


async def test_burst_of_mixed_outcomes_balances_the_books(make_miner, make_gateway, dead_miner):
    miners = [
        await make_miner(Script("ok", tokens=4, token_delay=0.005), slots=3, tag="ok-"),
        await make_miner(Script("ok", tokens=4), slots=1, tag="tight-"),  # often busy under the burst
        await make_miner(Script("drop_after", tokens=4, after=1), slots=4, tag="drop-"),
        await make_miner(Script("garbage"), slots=4, tag="junk-"),
        await make_miner(Script("stall_after", tokens=4, after=1), slots=4, tag="stall-"),
        await make_miner(Script("gated", tokens=4), slots=4, tag="gated-"),  # never opened: clients give up
    ]
    h = await make_gateway([*miners, dead_miner], seed=3,
                           timeouts=UpstreamTimeouts(connect=2.0, first_token=0.6, stall=0.4, total=10.0))
    rng = random.Random(11)
    statuses: Counter[str] = Counter()

    async def one(i: int) -> None:
        stream = rng.random() < 0.6
        give_up = rng.random() < 0.2
        try:
            async with asyncio.timeout(0.25 if give_up else 20):
                async with h.chat(body(stream=stream, max_tokens=4)) as r:
                    await r.read()
                    statuses[str(r.status)] += 1
        except TimeoutError:
            statuses["gave_up"] += 1

    await asyncio.gather(*(one(i) for i in range(40)))
    assert sum(statuses.values()) == 40
    assert await eventually(lambda: h.router.total_in_flight() == 0, within_s=10)
    assert await eventually(lambda: all(m.active == 0 for m in miners), within_s=10)
    assert await eventually(lambda: len(h.measurements()) == h.upstream.dispatched, within_s=10)
    by_uid = Counter(x.uid for x in h.measurements())
    for m in miners:  # every request a miner saw is exactly one measurement, and vice versa
        assert by_uid[h.uids[m.tag]] == m.requests, m.tag
    assert by_uid[h.uids["dead"]] == h.upstream.dispatched - sum(m.requests for m in miners)
    assert sum(m.served for m in h.router.miners()) == sum(x.ok for x in h.measurements())
    assert statuses["200"] >= 1 and statuses["200"] + statuses["gave_up"] >= sum(x.ok for x in h.measurements())
    async with h.client.get(h.base_url + "/v1/status", headers=h.auth) as r:
        status = await r.json()
    assert status["in_flight"] == 0
    per_uid = {s["uid"]: s for s in status["miners"]}
    assert sum(s["requests"] for s in per_uid.values()) == h.upstream.dispatched
    assert per_uid[h.uids["ok-"]]["ttft_p50_s"] is not None
    junk = per_uid[h.uids["junk-"]]
    assert junk["failures"][FailureReason.GARBAGE] >= 1 and junk["ok"] == 0
    assert junk["failures"][FailureReason.GARBAGE] + junk["failures"].get(FailureReason.BUSY, 0) == miners[3].requests


# -- several simulated miners: the real reference miner (neurons.miner + SimulatedRuntime) -------


async def test_several_simulated_miners_serve_a_burst(make_sim_miner, make_gateway):
    sims = [await make_sim_miner("rtx5090:time_scale=20", slots=2, tag=f"s{i}") for i in range(3)]
    h = await make_gateway(sims, seed=5, timeouts=UpstreamTimeouts(first_token=10.0, stall=5.0, total=30.0))

    async def one(i: int) -> tuple[int, str | None, int]:
        async with h.chat(body(stream=i % 2 == 0, max_tokens=24)) as r:
            if r.status != 200:
                await r.read()
                return r.status, None, 0
            uid = r.headers["X-Tensorgate-Miner-Uid"]
            if i % 2 == 0:
                events = await read_sse(r)
                assert events[-1] == "[DONE]" and not any("error" in e for e in events if isinstance(e, dict))
                return 200, uid, len(contents(events))
            data = await r.json()
            return 200, uid, data["usage"]["completion_tokens"]

    results = await asyncio.gather(*(one(i) for i in range(10)))  # 10 > 6 slots: some get 429
    served = [r for r in results if r[0] == 200]
    assert len(served) >= 6 and all(r[0] in (200, 429) for r in results)
    assert all(1 <= n <= 24 for _, _, n in served)  # the card may stop early ("stop"), never more
    assert len({uid for _, uid, _ in served}) == 3  # every card got work
    assert await eventually(lambda: h.router.total_in_flight() == 0 and all(s.server.busy == 0 for s in sims))
    assert len(h.measurements()) == h.upstream.dispatched
    assert sum(s.server.served + s.server.refused_busy for s in sims) == h.upstream.dispatched
    assert all(m.failure in (None, FailureReason.BUSY) for m in h.measurements())


async def test_slow_card_measures_slower_than_fast_card(make_sim_miner, make_gateway):
    fast = await make_sim_miner("rtx5090:time_scale=4,jitter=0", slots=1, tag="fast")
    slow = await make_sim_miner("rtx5090-slow:time_scale=4,jitter=0", slots=1, tag="slow")
    h = await make_gateway([fast, slow])
    for _ in range(3):
        for uid in (1, 2):
            lease = h.router.acquire_uid(uid)
            assert lease is not None
            try:
                m = await h.upstream.probe(lease, body(max_tokens=16))
            finally:
                h.router.release(lease)
            assert m.ok and m.completion_tokens >= 8
    ttft = {uid: h.upstream.stats[uid].ttft_p50() for uid in (1, 2)}
    # fast: 0.45 s / 4 = 0.11 s, slow: 0.9 s / 4 = 0.23 s; TTFT is never below the card's own delay
    assert ttft[1] >= 0.10 and ttft[2] >= 0.21
    assert ttft[2] > ttft[1] + 0.05


async def test_disconnect_frees_the_real_miners_slot(make_sim_miner, make_gateway):
    sim = await make_sim_miner("rtx5090:time_scale=1", slots=1)  # ~0.5 s TTFT then 440 tok/s
    h = await make_gateway([sim], timeouts=UpstreamTimeouts(first_token=10.0, stall=5.0, total=30.0))
    resp = await h.client.post(h.base_url + "/v1/chat/completions", json=body(max_tokens=2000), headers=h.auth)
    assert resp.status == 200
    async for line in resp.content:
        if b'"content":"' in line and b'"content":""' not in line:
            break
    assert sim.server.busy == 1
    resp.close()
    assert await eventually(lambda: sim.server.busy == 0 and h.router.total_in_flight() == 0)
    assert await eventually(lambda: len(h.measurements()) == 1)
    assert h.measurements()[0].failure == FailureReason.CLIENT_DISCONNECT
    async with h.chat(body(stream=False, max_tokens=4)) as r:  # the single slot is usable again
        assert r.status == 200


@pytest.mark.parametrize(
    ("knobs", "reason"),
    [("drop_after_tokens=3", FailureReason.DROPPED), ("garbage=1", FailureReason.GARBAGE),
     ("overlong=1", FailureReason.OVERLONG),
     ("nan_usage=1", FailureReason.GARBAGE), ("fail_rate=1", FailureReason.HTTP_STATUS)],
)
async def test_real_miner_fault_knobs_are_recorded(make_sim_miner, make_gateway, knobs, reason):
    sim = await make_sim_miner(f"rtx5090:time_scale=20,stop_rate=0,{knobs}", slots=1)
    h = await make_gateway([sim])
    lease = h.router.acquire_uid(1)
    assert lease is not None
    try:
        m = await h.upstream.probe(lease, body(max_tokens=16))
    finally:
        h.router.release(lease)
    assert m.failure == reason
    assert await eventually(lambda: sim.server.busy == 0)


async def test_probe_and_organic_bodies_look_alike(make_miner, make_gateway):
    """A miner cannot tell a probe from organic traffic by the request body's shape."""
    m = await make_miner(Script("ok", tokens=2))
    h = await make_gateway([m])
    organic = body(stream=False, max_tokens=2, temperature=0.5)
    async with h.chat(organic) as r:
        assert r.status == 200
    lease = h.router.acquire_uid(1)
    assert lease is not None
    try:  # a probe payload as neurons.validator.prompts builds it: different key order, "stream" already set
        await h.upstream.probe(lease, {"stream": True, "temperature": 0.5, "max_tokens": 2, "model": MODEL,
                                       "messages": organic["messages"]})
    finally:
        h.router.release(lease)
    assert [list(b) for b in m.bodies] == [list(m.bodies[0])] * 2
    assert m.bodies[0] == m.bodies[1]
    assert [x.probe for x in h.measurements()] == [False, True]


async def test_decode_concurrency_counts_requests_that_join_mid_stream(make_sim_miner, make_gateway):
    """A request that a second one joins mid-decode ran at 1 < concurrency < 2, and an honest card
    earns full decode credit for it; the dispatch-time count (1) would have called it slow."""
    from scoring.credit import CreditConfig, decode_credit

    sim = await make_sim_miner("rtx5090:time_scale=4,jitter=0,stop_rate=0", slots=2)
    h = await make_gateway([sim], timeouts=UpstreamTimeouts(first_token=10.0, stall=5.0, total=30.0))
    lease_a = h.router.acquire_uid(1)
    assert lease_a is not None
    joined: asyncio.Task | None = None

    async def second() -> None:
        lease_b = h.router.acquire_uid(1)
        assert lease_b is not None
        try:
            await h.upstream.probe(lease_b, body(max_tokens=300))
        finally:
            h.router.release(lease_b)

    try:
        stream = await h.upstream.open(lease_a, body(max_tokens=900))
        async with stream:
            while batch := await stream.next_batch():
                if joined is None and stream.tokens >= 100 and any(c.content for c in batch):
                    joined = asyncio.create_task(second())
        await joined
    finally:
        h.router.release(lease_a)
    a = stream.measurement
    assert a is not None and a.ok and a.in_flight == 0
    assert a.concurrency is not None and 1.1 < a.concurrency < 1.95
    cfg = CreditConfig()
    rate = a.decode_rate() or 0.0
    # the sim runs 4x fast: scale the rate back to real seconds before judging it
    assert decode_credit(rate / 4, a.decode_concurrency, cfg) == pytest.approx(1.0)
    assert decode_credit(rate / 4, a.in_flight + 1, cfg) < 1.0


# -- hot path: fast paths must agree with the slow ones ------------------------------------------

_ALPHABET = ['a', 'Z', ' ', '0', '\u00e9', '\u2603', '\U0001f600', '"', '\\', '\n', '\x01', '\x7f', '/', ',', '}']


def _random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(_ALPHABET) for _ in range(n))


def _server_chunk(style: int, cid: str, content: str | None, finish: str | None = None, role: str | None = None) -> str:
    """A chunk as one of several servers would write it (key order, spacing, extras, escaping)."""
    delta: dict = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if style == 0:  # vLLM-like, compact
        obj = {"id": cid, "object": "chat.completion.chunk", "created": 1, "model": "m",
               "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    if style == 1:  # spaced, ASCII-escaped, delta last
        obj = {"choices": [{"finish_reason": finish, "index": 0, "delta": delta}], "id": cid, "model": "m"}
        return json.dumps(obj)
    # llama-server-like: extra fields after the choices, usage null
    obj = {"choices": [{"index": 0, "finish_reason": finish, "delta": delta}], "created": 2, "id": cid,
           "model": "m", "system_fingerprint": "b1", "object": "chat.completion.chunk", "usage": None,
           "timings": {"predicted_ms": 1.5}}
    return json.dumps(obj, separators=(", ", ": "), ensure_ascii=False)


def _same_as_parse_chunk(dec: ChunkDecoder, data: str, max_content: int) -> None:
    try:
        want = parse_chunk(data, max_content)
    except SSEGarbage as e:
        with pytest.raises(type(e)):
            dec.decode(data)
        return
    assert dec.decode(data) == want


@pytest.mark.parametrize("style", [0, 1, 2])
def test_chunk_decoder_agrees_with_parse_chunk_on_seeded_streams(style):
    rng = random.Random(1000 + style)
    fast_hits = 0
    for _ in range(60):
        dec = ChunkDecoder(max_content_chars=40)
        cid = f"chatcmpl-{rng.randrange(10**6)}"
        stream = [_server_chunk(style, cid, "", role="assistant")]
        for _ in range(rng.randrange(1, 30)):
            r = rng.random()
            if r < 0.6:
                text = "".join(rng.choice("abc xyz.") for _ in range(rng.randrange(1, 8)))  # plain tokens
            elif r < 0.9:
                text = _random_text(rng, rng.randrange(0, 8))  # quotes, escapes, control chars, unicode
            else:
                text = "w" * rng.randrange(38, 44)  # around max_content_chars
            stream.append(_server_chunk(style, cid, text))
        stream.append(_server_chunk(style, cid, None, finish="stop"))
        for data in stream:
            had = dec.has_template
            _same_as_parse_chunk(dec, data, 40)
            fast_hits += had
    assert fast_hits > 500  # the template was learnt and used, not only the slow path


@pytest.mark.parametrize("first,later", [
    # the content also occurs as another value: the template must sit on delta.content
    ('{"id":"x","choices":[{"delta":{"content":"x"}}]}', ['{"id":"y","choices":[{"delta":{"content":"x"}}]}',
                                                          '{"id":"x","choices":[{"delta":{"content":"q"}}]}']),
    # a duplicate key: the last one wins, in the template as in json.loads
    ('{"choices":[{"delta":{"content":"a","content":"b"}}]}', ['{"choices":[{"delta":{"content":"a","content":"z"}}]}',
                                                               '{"choices":[{"delta":{"content":"z","content":"b"}}]}']),
    # a body smuggling structure, NaN or an escape through the template's slot
    ('{"choices":[{"delta":{"content":"t"},"finish_reason":null}]}',
     ['{"choices":[{"delta":{"content":"t"},"finish_reason":"stop"},{"delta":{"content":""},"finish_reason":null}]}',
      '{"choices":[{"delta":{"content":"","x":NaN,"y":""},"finish_reason":null}]}',
      '{"choices":[{"delta":{"content":"\\"},"finish_reason":null}]}',
      '{"choices":[{"delta":{"content":"\\u0041"},"finish_reason":null}]}',
      '{"choices":[{"delta":{"content":"tab\there"},"finish_reason":null}]}',
      '{"choices":[{"delta":{"content":"' + "y" * 41 + '"},"finish_reason":null}]}']),
    # content as a key's text, and backslashes elsewhere: never a template
    ('{"t":{"t":1},"choices":[{"delta":{"content":"t"}}]}', ['{"t":{"u":1},"choices":[{"delta":{"content":"u"}}]}']),
    ('{"id":"a\\\\b","choices":[{"delta":{"content":"c"}}]}',
     ['{"id":"a\\\\b","choices":[{"delta":{"content":"d"}}]}']),
])
def test_chunk_decoder_cannot_be_fooled(first, later):
    dec = ChunkDecoder(max_content_chars=40)
    _same_as_parse_chunk(dec, first, 40)
    for data in later:
        _same_as_parse_chunk(dec, data, 40)
        _same_as_parse_chunk(dec, data, 40)  # and again, once any template was (re)learnt from it


def test_chunk_framer_writes_what_json_dumps_would():
    rng = random.Random(7)
    for model in ("tensorgate/sim-5090", 'q"uote\\d \u2603 tg\u2603probe'):
        out = ChunkFramer("chatcmpl-abc", 1_700_000_000, model)
        for _ in range(300):
            text = _random_text(rng, rng.randrange(0, 12))
            expected = frame({"id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 1_700_000_000,
                              "model": model, "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None,
                                                           "finish_reason": None}]})
            assert out.content(text) == expected
            assert json.loads(expected[6:])["choices"][0]["delta"]["content"] == text
        usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
        assert json.loads(out.usage(usage)[6:]) == {"id": "chatcmpl-abc", "object": "chat.completion.chunk",
                                                    "created": 1_700_000_000, "model": model, "choices": [],
                                                    "usage": usage}


def test_sse_parser_line_limit_is_exact_in_one_read_or_many():
    limit = 1000
    ok = b"data: " + b"x" * (limit - 6) + b"\n\n"  # a line of exactly `limit` bytes
    bad = b"data: " + b"x" * (limit - 5) + b"\n\n"
    assert SSEParser(max_line_bytes=limit).feed(ok) == ["x" * (limit - 6)]
    p = SSEParser(max_line_bytes=limit)
    assert [e for i in range(0, len(ok), 7) for e in p.feed(ok[i:i + 7])] == ["x" * (limit - 6)]
    assert not p.pending()
    for step in (len(bad), 7, 1):
        p = SSEParser(max_line_bytes=limit)
        with pytest.raises(SSEGarbage):
            for i in range(0, len(bad), step):
                p.feed(bad[i:i + step])


def test_signer_fast_path_signs_like_the_sdk(alice, miner_keys):
    signer = RequestSigner(alice)
    bob = miner_keys[0].ss58_address
    store = bt.http_auth.InMemoryNonceStore()
    sdk = bt.http_auth.sign(alice, method="POST", path="/p", body=b"{}", receiver_ss58=bob, nonce_ns=1)
    per_request = {bt.http_auth.HEADER_NONCE, bt.http_auth.HEADER_SIGNATURE}
    for i in range(3):  # the first goes through the SDK, later ones through the cached signer
        body_bytes = f'{{"i": {i}}}'.encode()
        h = signer.sign(path="/p", body=body_bytes, receiver_ss58=bob)
        assert set(h) == set(sdk)
        assert {k: v for k, v in h.items() if k not in per_request} == {k: v for k, v in sdk.items()
                                                                          if k not in per_request}
        caller = bt.http_auth.verify(h, body_bytes, method="POST", path="/p", self_hotkey_ss58=bob, nonce_store=store)
        assert caller.hotkey_ss58 == alice.ss58_address
        with pytest.raises(bt.http_auth.BadSignature):
            bt.http_auth.verify(h, body_bytes + b" ", method="POST", path="/p", self_hotkey_ss58=bob)


async def test_next_batch_returns_each_read_then_ends_without_waiting(make_miner, make_gateway):
    m = await make_miner(Script("ok", tokens=6))
    h = await make_gateway([m])
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
    lease = h.router.acquire()
    assert lease is not None
    try:
        async with await h.upstream.open(lease, payload) as stream:
            chunks = []
            while batch := await stream.next_batch():
                assert batch  # a read without chunks is not returned as an empty batch
                chunks += batch
            assert stream.ok and stream.tokens == 6
            assert await asyncio.wait_for(stream.next_batch(), 0.5) == []  # ended: never waits again
    finally:
        h.router.release(lease)
    assert [c.content for c in chunks if c.content] == [m.token(i) for i in range(6)]
    assert [x.ok for x in h.measurements()] == [True]


async def test_deadline_moves_with_events_and_total_still_caps(make_miner, make_gateway):
    """The one timer per stream is re-armed as tokens arrive (a slow-but-steady stream lives on), yet
    ``total`` ends a stream that never stalls."""
    steady = await make_miner(Script("ok", tokens=12, token_delay=0.1))  # ~1.1 s, gaps far below the stall
    h = await make_gateway([steady], timeouts=UpstreamTimeouts(connect=2.0, first_token=0.6, stall=0.6, total=15.0))
    async with h.chat(body(max_tokens=12)) as r:
        events = await asyncio.wait_for(read_sse(r), timeout=10)
    assert contents(events) == [steady.token(i) for i in range(12)] and events[-1] == "[DONE]"
    assert [x.ok for x in h.measurements()] == [True]

    capped = await make_gateway([steady], timeouts=UpstreamTimeouts(connect=2.0, first_token=0.6, stall=0.6,
                                                                      total=0.5))
    async with capped.chat(body(max_tokens=12)) as r:
        events = await asyncio.wait_for(read_sse(r), timeout=10)
    assert 1 <= len(contents(events)) < 12
    assert events[-2]["error"]["code"] == "upstream_timeout" and events[-1] == "[DONE]"
    assert [x.failure for x in capped.measurements()] == [FailureReason.TIMEOUT]
    assert await eventually(lambda: steady.active == 0)


async def test_relayed_frames_are_the_openai_shape(make_miner, make_gateway):
    m = await make_miner(Script("ok", tokens=5))
    h = await make_gateway([m])
    async with h.chat(body(max_tokens=5, stream_options={"include_usage": True})) as r:
        events = await read_sse(r)
    first, *middle, usage, done = events
    assert done == "[DONE]"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["tensorgate"] == {"miner_uid": 1, "miner_hotkey": m.hotkey}
    cid = first["id"]
    assert cid.startswith("chatcmpl-") and cid != f"chatcmpl-{m.tag}"  # the gateway's id, not the miner's
    for e in middle:
        assert set(e) == {"id", "object", "created", "model", "choices"}
        assert (e["id"], e["object"], e["created"], e["model"]) == (cid, "chat.completion.chunk", first["created"],
                                                                    MODEL)
        assert set(e["choices"][0]) == {"index", "delta", "logprobs", "finish_reason"}
    assert contents(middle) == [m.token(i) for i in range(5)]
    assert middle[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5 and usage["id"] == cid


async def test_relay_sends_once_per_miner_read_with_head_and_tail_joined(make_miner, make_gateway):
    """Headers go out with the first frame, usage and ``[DONE]`` with the last: never a send per chunk."""
    from gateway.protocol.openai import SchemaLimits, parse_chat_request

    m = await make_miner(Script("ok", tokens=8, token_delay=0.02))  # tokens 1..7 arrive in reads of their own
    h = await make_gateway([m])
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    req = parse_chat_request(body(max_tokens=8, stream_options={"include_usage": True}), SchemaLimits(models=(MODEL,)))
    await h.gateway.relay.dispatch(req, send)
    start, bodies = sent[0], sent[1:]
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert all(b["type"] == "http.response.body" for b in bodies)
    assert [b["more_body"] for b in bodies] == [True] * (len(bodies) - 1) + [False]
    frames = b"".join(b["body"] for b in bodies).split(b"\n\n")[:-1]
    assert len(frames) == 12  # role, 8 tokens, finish, usage, [DONE]
    assert b"role" in bodies[0]["body"] and m.token(0).encode() in bodies[0]["body"]  # role + first token: one send
    assert bodies[-1]["body"].endswith(b"data: [DONE]\n\n") and b'"usage"' in bodies[-1]["body"]
    assert len(bodies) < len(frames)  # reads, not frames, set the number of sends
    assert h.measurements()[-1].ok


async def test_a_client_that_never_reads_costs_the_miner_nothing(make_miner, make_gateway):
    """While the relay waits for a slow client to take a write, no miner deadline runs: the miner is
    not booked ``timeout`` for the client's back-pressure."""
    from gateway.protocol.openai import SchemaLimits, parse_chat_request

    m = await make_miner(Script("ok", tokens=6))
    h = await make_gateway([m], timeouts=UpstreamTimeouts(connect=2.0, first_token=1.0, stall=0.2, total=15.0))
    writes = 0

    async def slow_send(message: dict) -> None:
        nonlocal writes
        writes += 1
        if writes == 2:
            await asyncio.sleep(0.6)  # three stall periods with the client not reading

    req = parse_chat_request(body(max_tokens=6), SchemaLimits(models=(MODEL,)))
    await h.gateway.relay.dispatch(req, slow_send)
    assert [x.failure for x in h.measurements()] == [None]


async def test_http10_client_gets_a_whole_stream_without_chunk_framing(make_miner, make_gateway):
    """HTTP/1.0 has no chunked encoding: the stream is close-delimited, its frames written bare."""
    m = await make_miner(Script("ok", tokens=6, token_delay=0.01))
    h = await make_gateway([m])
    raw = json.dumps(body(max_tokens=6)).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", h.gateway.port)
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.0\r\nAuthorization: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (h.auth["Authorization"].encode(), len(raw), raw))
        answer = await asyncio.wait_for(reader.read(), 10.0)  # HTTP/1.0: the body ends when the gateway closes
    finally:
        writer.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith((b"HTTP/1.0 200", b"HTTP/1.1 200")) and b"chunked" not in head.lower()
    events = [line[6:].decode() for line in payload.split(b"\n") if line.startswith(b"data: ")]
    assert all(line.startswith(b"data: ") for line in payload.split(b"\n") if line)  # no chunk sizes between
    parsed = [json.loads(e) if e != "[DONE]" else e for e in events]
    assert contents(parsed) == [m.token(i) for i in range(6)] and parsed[-1] == "[DONE]"


async def test_slot_count_advertised_by_the_miner_reaches_the_router(make_sim_miner, make_gateway):
    sim = await make_sim_miner("rtx5090:time_scale=20", slots=3)
    h = await make_gateway([sim])
    h.upstream.on_slots = h.router.learn_slots
    h.router.learn_slots(h.router.get(1), 1)  # as the validator starts: the metagraph carries no slot count
    assert h.router.get(1).slots == 1
    lease = h.router.acquire_uid(1)
    try:
        m = await h.upstream.probe(lease, body(max_tokens=8))
    finally:
        h.router.release(lease)
    assert m.ok
    assert h.router.get(1).slots == 3


async def test_a_started_gateway_freezes_the_startup_heap_out_of_full_collections(make_miner, make_gateway):
    import gc

    gc.unfreeze()
    m = await make_miner()
    try:
        await make_gateway([m], freeze_heap=False)
        assert gc.get_freeze_count() == 0
        await make_gateway([m], freeze_heap=True)
        assert gc.get_freeze_count() > 1000  # the SDK, imports and everything else allocated so far
    finally:
        gc.unfreeze()
