"""The front door as an ASGI app, called directly: its refusals byte by byte, no server, no sockets."""

from __future__ import annotations

import json
import random
from collections.abc import MutableMapping
from typing import Any

import pytest
from bittensor.sp_core import Keypair

from gateway.app import Gateway, GatewayConfig
from gateway.http.client import MinerClient
from gateway.protocol.measurement import MeasurementQueue
from gateway.protocol.signing import RequestSigner
from gateway.router import Router
from gateway.upstream import Upstream

KEY = "sk-asgi-test"


@pytest.fixture
def app() -> Gateway:
    upstream = Upstream(MinerClient(), RequestSigner(Keypair.create_from_uri("//Alice")), MeasurementQueue())
    cfg = GatewayConfig.from_sources(keys=[KEY], env={}, max_body_bytes=200, freeze_heap=False)
    return Gateway(cfg, Router(rng=random.Random(0)), upstream)


async def call(app: Gateway, method: str, path: str, headers: list[tuple[bytes, bytes]], *,
               body: list[bytes] | None = None, version: str = "1.1") -> tuple[int, dict[bytes, bytes], Any, int]:
    """Run one request; returns (status, headers, JSON body, body messages the app asked for)."""
    scope = {"type": "http", "http_version": version, "method": method, "path": path, "headers": headers}
    chunks = list(body or [b""])
    asked = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal asked
        asked += 1
        chunk = chunks.pop(0) if chunks else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    await app(scope, receive, send)
    start = sent[0]
    raw = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], dict(start["headers"]), json.loads(raw) if raw else None, asked


HOST = [(b"host", b"gw")]
AUTH = [(b"authorization", f"Bearer {KEY}".encode())]


async def test_http09_is_refused(app: Gateway) -> None:
    status, _, body, _ = await call(app, "GET", "/health", [], version="0.9")
    assert status == 400 and "HTTP/1.0 and HTTP/1.1" in body["error"]["message"]


async def test_http11_needs_host_and_http10_does_not(app: Gateway) -> None:
    assert (await call(app, "GET", "/health", []))[0] == 400
    assert (await call(app, "GET", "/health", [], version="1.0"))[0] == 200


async def test_control_characters_in_a_header_value_are_refused(app: Gateway) -> None:
    status, headers, body, _ = await call(app, "GET", "/health", [*HOST, (b"x-a", b"a\x01b")])
    assert status == 400 and headers[b"connection"] == b"close"
    assert (await call(app, "GET", "/health", [*HOST, (b"x-a", b"a\tb")]))[0] == 200


async def test_unknown_path_404_and_wrong_method_405_with_allow(app: Gateway) -> None:
    assert (await call(app, "GET", "/nope", HOST))[0] == 404
    status, headers, body, _ = await call(app, "DELETE", "/v1/models", HOST)
    assert status == 405 and headers[b"allow"] == b"GET, HEAD" and body["error"]["code"] == "method_not_allowed"


async def test_no_key_is_refused_before_the_body_is_read(app: Gateway) -> None:
    status, headers, body, asked = await call(app, "POST", "/v1/chat/completions", HOST, body=[b"{}"])
    assert status == 401 and asked == 0 and headers[b"www-authenticate"] == b"Bearer"
    assert body["error"]["type"] == "authentication_error"


async def test_an_announced_body_over_the_cap_is_refused_unread(app: Gateway) -> None:
    headers = [*HOST, *AUTH, (b"content-length", b"1000")]
    status, _, body, asked = await call(app, "POST", "/v1/chat/completions", headers, body=[b"x" * 1000])
    assert status == 413 and asked == 0 and body["error"]["code"] == "payload_too_large"


async def test_a_streamed_body_is_refused_once_it_passes_the_cap(app: Gateway) -> None:
    parts = [b"x" * 90, b"x" * 90, b"x" * 90, b"x" * 90]
    status, _, _, asked = await call(app, "POST", "/v1/chat/completions", [*HOST, *AUTH], body=parts)
    assert status == 413 and asked == 3  # stopped reading at the part that crossed 200 bytes


async def test_invalid_json_and_a_bad_field_are_400s_naming_it(app: Gateway) -> None:
    status, _, body, _ = await call(app, "POST", "/v1/chat/completions", [*HOST, *AUTH], body=[b"{nope"])
    assert status == 400 and body["error"]["code"] == "invalid_json"
    bad = json.dumps({"model": "tensorgate/sim-5090", "messages": [], "max_tokens": 1}).encode()
    status, _, body, _ = await call(app, "POST", "/v1/chat/completions", [*HOST, *AUTH], body=[bad])
    assert status == 400 and body["error"]["param"] == "messages"


async def test_no_miner_is_a_429_with_retry_after(app: Gateway) -> None:
    ok = json.dumps({"model": "tensorgate/sim-5090", "messages": [{"role": "user", "content": "hi"}]}).encode()
    status, headers, body, _ = await call(app, "POST", "/v1/chat/completions", [*HOST, *AUTH], body=[ok])
    assert status == 429 and headers[b"retry-after"] == b"1" and body["error"]["code"] == "no_capacity"
    assert app.outcomes["429"] == 1
