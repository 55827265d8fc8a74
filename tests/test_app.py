"""The front door's answers (gateway.app): status codes, OpenAI error bodies, limits, over real sockets."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.protocol.measurement import FailureReason
from gateway.upstream import UpstreamTimeouts
from tests.conftest import API_KEY
from tests.fakes import MODEL, Script, body, contents, error_of, eventually


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
        ({"model": MODEL, "messages": [{"role": ["user"], "content": "hi"}]}, "messages[0].role"),  # was a 500
        ({"model": MODEL, "messages": [{"role": {"r": 1}, "content": "hi"}]}, "messages[0].role"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0]"),
        (body(max_tokens=0), "max_tokens"),
        (body(max_tokens=True), "max_tokens"),
        (body(max_completion_tokens=-3), "max_completion_tokens"),
        (body(n=9), "n"),
        (body(n=0), "n"),
        (body(temperature=2.5), "temperature"),
        (body(top_p=-0.1), "top_p"),
        (body(stream="yes"), "stream"),  # type: ignore[arg-type]  # the wrong type is the test
        (body(stream=False, stream_options={"include_usage": True}), "stream_options"),
        (body(stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
        (body(stop=[1, 2]), "stop"),
        (body(tools=[{"type": "function"}]), "tools[0]"),
        (body(tools=[]), "tools"),
        (body(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools[0].function.name"),
        (body(tool_choice="auto"), "tool_choice"),  # no tools
        (body(tools=[{"type": "function", "function": {"name": "f"}}],
              tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice"),
        (body(top_logprobs=3), "top_logprobs"),  # without logprobs
        (body(logprobs=True, top_logprobs=21), "top_logprobs"),
        (body(logit_bias={"abc": 1}), "logit_bias"),
        (body(logit_bias={"5": 101}), "logit_bias"),
        (body(response_format={"type": "yaml"}), "response_format"),
        (body(response_format={"type": "json_schema", "json_schema": {"schema": {}}}), "response_format.json_schema"),
        (body(top_k=-2), "top_k"),
        (body(min_p=1.5), "min_p"),
        (body(functions=[{"name": "f"}]), "functions"),
        ({"model": MODEL, "messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id"),
        ({"model": MODEL, "messages": [{"role": "assistant", "content": None,
                                        "tool_calls": [{"id": "c1", "type": "function",
                                                        "function": {"name": "f", "arguments": {"x": 1}}}]}]},
         "messages[0].tool_calls[0].function.arguments"),
        # a lone surrogate no miner can encode (issue 24: forwarded, it made honest miners answer 500, booked on them)
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi \ud800"}]}, "messages[0].content"),
        ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
         "messages[0].content[0].text"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi", "name": "\ud83d"}]}, "messages[0].name"),
        (body(stop=["ok", "\ud800"]), "stop[1]"),
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
        assert r.headers["X-Max-Tokens-Capped"] == "50"  # issue 39 row 10: capped, and said so
    async with h.chat(body(stream=True, max_tokens=51)) as r:
        assert r.status == 200 and r.headers["X-Max-Tokens-Capped"] == "50"
        await r.read()
    async with h.chat({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}) as r:
        assert r.status == 200 and "X-Max-Tokens-Capped" not in r.headers
    async with h.chat(body(stream=False, max_tokens=50)) as r:
        assert r.status == 200 and "X-Max-Tokens-Capped" not in r.headers
    assert [b["max_tokens"] for b in m.bodies] == [50, 50, 20, 50]


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
    # a 429 with none of this validator's streams on the miner is a refusal, whatever slots it declares
    assert [x.failure for x in h2.measurements()] == [FailureReason.REFUSED, FailureReason.REFUSED]


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


async def test_a_request_id_is_kept_or_made_returned_and_in_every_log_line_about_the_request(make_miner,
                                                                                              make_gateway) -> None:
    """Issue 26: one id per request, from X-Request-Id or made, in the answer's header, the error body and the logs."""
    from loguru import logger

    from neurons.validator.process import log_format

    lines: list[str] = []
    sink = logger.add(lambda msg: lines.append(str(msg)), format=log_format, level="DEBUG")
    try:
        m = await make_miner(Script("garbage"))  # a miner failure: the gateway logs about the request
        h = await make_gateway([m], max_retries=0, access_log=True)
        async with h.chat(body(), headers={"X-Request-Id": "trace-42.a:b"}) as r:
            assert r.status == 502 and r.headers["X-Request-Id"] == "trace-42.a:b"
            assert (await error_of(r))["request_id"] == "trace-42.a:b"
        async with h.chat(body(), headers={"X-Request-Id": "not a token\\x7f"}) as r:
            made = r.headers["X-Request-Id"]
            assert made.startswith("req_") and len(made) == 28  # the client's was not a sane token: a new one
            await r.read()
        async with h.client.get(h.base_url + "/health") as r:
            assert r.headers["X-Request-Id"].startswith("req_")  # every answer has one
        import yarl  # issue 39 row 5: a %0A in the path forged a second access-log line

        async with h.client.get(yarl.URL(h.base_url + "/v1/x%0AGET%20/forged%20200%0D", encoded=True)) as r:
            assert r.status == 404
    finally:
        logger.remove(sink)
    logged = "".join(lines)
    assert "GET /v1/x\\x0aGET /forged 200\\x0d 404" in logged, lines[-3:]
    assert not any(line.startswith("GET /forged") for line in logged.splitlines())
    about = [line for line in lines if "[trace-42.a:b]" in line]
    assert any("garbage" in line for line in about), lines[-10:]  # the miner's failure, logged with the id
    assert any("POST /v1/chat/completions 502" in line for line in about)  # the access log line
    assert not any("[trace-42.a:b]" in line for line in lines if "GET /health" in line)  # only its own lines


def test_json_log_lines_carry_the_request_id(capsys) -> None:
    """``--log.format json``: one object a line; a line written while serving a request names its id."""
    import json

    from loguru import logger

    from neurons.validator.process import json_line

    sink = logger.add(json_line, level="INFO")
    try:
        with logger.contextualize(request_id="req_abc"):
            logger.info("about a request: {}", "x")
        logger.warning("about nothing")
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.remove(sink)
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    assert lines[0]["message"] == "about a request: x" and lines[0]["request_id"] == "req_abc"
    assert lines[0]["level"] == "INFO" and lines[0]["time"].endswith("+00:00")
    assert "request_id" not in lines[1] and lines[1]["level"] == "WARNING"
    assert "ValueError: boom" in lines[2]["exception"]


async def test_ready_says_why_not_while_no_miner_is_routable(make_miner, make_gateway) -> None:
    """Issue 26: /health only says the process answers; /ready is what a load balancer should read."""
    m = await make_miner()
    h = await make_gateway([m])
    async with h.client.get(h.base_url + "/ready") as r:
        assert r.status == 200 and (await r.json())["status"] == "ready"
    h.router.set_quarantined({m.hotkey})  # every miner quarantined: nothing to route to
    async with h.client.get(h.base_url + "/ready") as r:
        got = await r.json()
        assert r.status == 503 and "no miner is routable" in got["reason"] and r.headers["Retry-After"] == "5"
    async with h.client.get(h.base_url + "/health") as r:
        assert r.status == 200  # alive all along
    with pytest.raises(RuntimeError):  # a serving gateway's hooks are frozen
        h.gateway.plug(readiness=lambda: None)
    told = await make_gateway([m], hooks={"readiness": lambda: "the metagraph is 900 s old"})
    async with told.client.get(told.base_url + "/ready") as r:  # the validator's reason, in its words
        assert r.status == 503 and (await r.json())["reason"] == "the metagraph is 900 s old"


async def test_ready_turns_503_when_the_only_miner_dies_and_back_when_it_answers(make_miner, make_gateway) -> None:
    """Issue 39 row 4: /ready read membership, so it answered 200 for over 90 s after the only miner died while
    every request got a 502. Now the first failed dispatch (connection refused) makes it 503, and the first answer
    after the miner comes back makes it 200 again."""
    m = await make_miner()
    h = await make_gateway([m], max_retries=0)
    async with h.chat(body()) as r:
        assert r.status == 200
        await r.read()
    port = m.port
    await m.stop()
    async with h.chat(body()) as r:
        assert r.status == 502
    async with h.client.get(h.base_url + "/ready") as r:
        got = await r.json()
        assert r.status == 503 and "no routable miner is answering" in got["reason"], got
    await m.start(port=port)
    async with h.chat(body()) as r:
        assert r.status == 200
        await r.read()
    async with h.client.get(h.base_url + "/ready") as r:
        assert r.status == 200
