"""The gateway's HTTP/1.1 front door, spoken to over raw loopback sockets (bytes on the wire, not a client's view)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from gateway.http import server as http_server
from gateway.http.server import HttpServer, Request, Response

Handler = Callable[[Request, Response], Awaitable[None]]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Awaitable[HttpServer]]]:
    servers: list[HttpServer] = []

    async def make(handler: Handler, **kw: object) -> HttpServer:
        s = HttpServer(handler, host="127.0.0.1", port=0, **kw)  # type: ignore[arg-type]
        await s.start()
        servers.append(s)
        return s

    yield make
    for s in servers:
        await s.stop()


async def echo(req: Request, resp: Response) -> None:
    resp.send_json(200, {"method": req.method, "path": req.path, "query": req.query, "body": req.body.decode(),
                         "version": list(req.version), "x": req.headers.get("x-thing")})


async def talk(port: int, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection; everything the server writes until it closes (5 s at most)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.read(), 5.0)
    finally:
        writer.close()


def responses(raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Split Content-Length-framed responses (what ``send`` writes)."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
        n = int(headers.get("content-length", "0"))
        out.append((status, headers, rest[:n]))
        raw = rest[n:]
    return out


def get(path: str, extra: bytes = b"", version: bytes = b"1.1") -> bytes:
    return b"GET %s HTTP/%s\r\nHost: x\r\n%s\r\n" % (path.encode(), version, extra)


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n%s" % (path.encode(), len(body), extra, body)


async def test_keep_alive_and_pipelined_requests_are_answered_in_order(serve):
    s = await serve(echo)
    raw = await talk(s.port, get("/a?q=1") + post("/b", b"hello") + get("/c", b"Connection: close\r\n"))
    got = responses(raw)
    assert [r[0] for r in got] == [200, 200, 200]
    bodies = [json.loads(r[2]) for r in got]
    assert [(b["method"], b["path"]) for b in bodies] == [("GET", "/a"), ("POST", "/b"), ("GET", "/c")]
    assert bodies[0]["query"] == "q=1" and bodies[1]["body"] == "hello"
    assert got[2][1]["connection"] == "close" and "connection" not in got[0][1]
    assert "date" in got[0][1] and got[0][1]["content-type"] == "application/json"


async def test_http10_closes_unless_asked_to_keep_alive(serve):
    s = await serve(echo)
    raw = await talk(s.port, get("/a", version=b"1.0") + get("/never", version=b"1.0"))
    got = responses(raw)
    assert len(got) == 1 and raw.startswith(b"HTTP/1.0 200")  # closed after the first answer
    raw = await talk(s.port, get("/a", b"Connection: keep-alive\r\n", b"1.0") + get("/b", version=b"1.0"))
    got = responses(raw)
    assert len(got) == 2 and got[0][1]["connection"] == "keep-alive"


async def test_chunked_request_bodies_are_decoded_and_repeated_headers_joined(serve):
    s = await serve(echo)
    req = (b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nX-Thing: a\r\nX-Thing: b\r\n"
           b"Connection: close\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
    (status, _, body), = responses(await talk(s.port, req))
    assert status == 200 and json.loads(body)["body"] == "hello world" and json.loads(body)["x"] == "a,b"


async def test_bodies_over_the_cap_get_413_without_reaching_the_handler(serve):
    calls = []

    async def h(req: Request, resp: Response) -> None:
        calls.append(req.path)
        resp.send(200, b"ok")

    s = await serve(h, max_body_bytes=100)
    (status, headers, body), = responses(await talk(s.port, post("/big", b"x" * 101)))
    assert status == 413 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "payload_too_large"
    chunked = b"POST /big HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + b"40\r\n" + b"y" * 64 + b"\r\n"
    (status, _, _), = responses(await talk(s.port, chunked * 1 + b"40\r\n" + b"y" * 64 + b"\r\n0\r\n\r\n"))
    assert status == 413
    (status, _, _), = responses(await talk(s.port, post("/fits", b"x" * 100, b"Connection: close\r\n")))
    assert status == 200 and calls == ["/fits"]


async def test_check_head_refuses_before_the_body_is_read(serve):
    calls = []

    async def h(req: Request, resp: Response) -> None:
        calls.append(req.path)
        resp.send(200, b"ok")

    def check(method: str, path: str, headers: dict[str, str]) -> http_server.Refusal | None:
        if path == "/locked" and headers.get("authorization") != "yes":
            return http_server.Refusal(401, "no key", "invalid_api_key", type="authentication_error",
                                       headers={"WWW-Authenticate": "Bearer"})
        return None

    s = await serve(h, check_head=check)
    reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
    try:  # the answer comes before any of the announced megabyte is sent
        writer.write(b"POST /locked HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n")
        (status, headers, body), = responses(await asyncio.wait_for(reader.read(), 5.0))
    finally:
        writer.close()
    assert status == 401 and headers["www-authenticate"] == "Bearer" and headers["connection"] == "close"
    assert json.loads(body)["error"] == {"message": "no key", "type": "authentication_error", "param": None,
                                         "code": "invalid_api_key"}
    keyed = post("/locked", b"x", b"Authorization: yes\r\nConnection: close\r\n")
    (status, _, _), = responses(await talk(s.port, keyed))
    assert status == 200 and calls == ["/locked"]


async def test_expect_100_continue_is_answered_before_the_body_comes(serve):
    s = await serve(echo)
    reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
    try:
        writer.write(b"POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n"
                     b"Connection: close\r\n\r\n")
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"ok")
        (status, _, body), = responses(await asyncio.wait_for(reader.read(), 5.0))
        assert status == 200 and json.loads(body)["body"] == "ok"
    finally:
        writer.close()
    (status, _, _), = responses(await talk(s.port, get("/e", b"Expect: teapot\r\n")))
    assert status == 417


async def test_garbage_upgrades_and_huge_heads_are_refused_with_json(serve):
    s = await serve(echo, max_head_bytes=1024)
    (status, _, body), = responses(await talk(s.port, b"NOT HTTP AT ALL\r\n\r\n"))
    assert status == 400 and json.loads(body)["error"]["code"] == "bad_request"
    # an Upgrade is ignored: the request is served as HTTP, and nothing after it is read as HTTP
    got = responses(await talk(s.port, get("/up", b"Connection: Upgrade\r\nUpgrade: websocket\r\n") + get("/no")))
    assert [(r[0], json.loads(r[2])["path"]) for r in got] == [(200, "/up")]
    (status, _, body), = responses(await talk(s.port, get("/", b"X-Big: " + b"z" * 2000 + b"\r\n")))
    assert status == 431 and json.loads(body)["error"]["code"] == "head_too_large"
    # a request fully answered before the garbage behind it still gets its answer first
    got = responses(await talk(s.port, get("/ok") + b"\x00\x01garbage\r\n\r\n"))
    assert [r[0] for r in got] == [200, 400]


async def test_idle_connections_close_and_half_sent_requests_get_408(serve):
    s = await serve(echo, keepalive_timeout=0.2)
    reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
    try:
        assert await asyncio.wait_for(reader.read(), 5.0) == b""  # closed by the server, silently
    finally:
        writer.close()
    (status, _, _), = responses(await talk(s.port, b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nab"))
    assert status == 408


async def test_a_client_that_leaves_cancels_its_handler(serve):
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def slow(req: Request, resp: Response) -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    s = await serve(slow)
    reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
    writer.write(get("/wait"))
    await asyncio.wait_for(started.wait(), 5.0)
    writer.close()
    await asyncio.wait_for(cancelled.wait(), 5.0)
    for _ in range(50):
        if not s.connections:
            break
        await asyncio.sleep(0.02)
    assert not s.connections


async def test_handler_errors_become_500_before_the_first_byte_and_a_close_after_it(serve):
    async def h(req: Request, resp: Response) -> None:
        if req.path == "/late":
            resp.start(200, {"Content-Type": "text/plain"}, b"partial")
        if req.path == "/inject":
            resp.send(200, b"", headers={"X-Evil": "a\r\nSet-Cookie: x=1"})
        raise RuntimeError("boom")

    s = await serve(h)
    (status, _, body), = responses(await talk(s.port, get("/early", b"Connection: close\r\n")))
    assert status == 500 and json.loads(body)["error"]["type"] == "server_error"
    (status, _, _), = responses(await talk(s.port, get("/inject", b"Connection: close\r\n")))
    assert status == 500  # a header with a line break is never written
    raw = await talk(s.port, get("/late") + get("/never"))  # the stream cannot be ended: the connection closes
    assert raw.count(b"HTTP/1.1") == 1 and raw.endswith(b"7\r\npartial\r\n")


async def test_streams_are_chunked_for_http11_and_close_delimited_for_http10(serve):
    async def stream(req: Request, resp: Response) -> None:
        resp.start(200, {"Content-Type": "text/event-stream"}, b"one ")
        resp.push(b"two ")
        assert resp.unsent >= 0
        await resp.write(b"three")
        resp.end(b"!")

    s = await serve(stream)
    raw = await talk(s.port, get("/s") + get("/s", b"Connection: close\r\n"))
    first, _, rest = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in first.lower()
    assert rest.startswith(b"4\r\none \r\n4\r\ntwo \r\n5\r\nthree\r\n1\r\n!\r\n0\r\n\r\nHTTP/1.1 200")  # then answer 2
    raw = await talk(s.port, get("/s", version=b"1.0"))
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"chunked" not in head.lower() and body == b"one two three!"


async def test_head_gets_headers_only(serve):
    s = await serve(echo)
    raw = await talk(s.port, b"HEAD /h HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"Content-Length: " in head and body == b""


async def test_stop_lets_running_handlers_finish_then_cancels_the_rest(serve, monkeypatch):
    monkeypatch.setattr(http_server, "LINGER_S", 0.1)
    release = asyncio.Event()
    cancelled = []

    async def h(req: Request, resp: Response) -> None:
        try:
            if req.path == "/quick":
                await release.wait()
            else:
                await asyncio.sleep(30)
            resp.send(200, b"done")
        except asyncio.CancelledError:
            cancelled.append(req.path)
            raise

    s = await serve(h, shutdown_timeout=0.5)
    quick = asyncio.create_task(talk(s.port, get("/quick")))
    stuck = asyncio.create_task(talk(s.port, get("/stuck")))
    idle_r, idle_w = await asyncio.open_connection("127.0.0.1", s.port)
    for _ in range(100):
        if sum(c.task is not None for c in s.connections) == 2:
            break
        await asyncio.sleep(0.01)
    stopping = asyncio.create_task(s.stop())
    await asyncio.sleep(0.05)
    release.set()
    await asyncio.wait_for(stopping, 5.0)
    assert responses(await quick)[0][2] == b"done"  # finished within the grace period
    assert await stuck == b"" and cancelled == ["/stuck"]
    assert await asyncio.wait_for(idle_r.read(), 5.0) == b""  # an idle connection is closed at once
    idle_w.close()
