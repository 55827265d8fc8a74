"""The lean miner HTTP client: body framings, keep-alive reuse, draining, broken responses, stale connections."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from gateway.http.client import MAX_HEAD_BYTES, MinerConnection, MinerHTTPError, MinerPool, encode_request

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[bool]]


@dataclass
class RawServer:
    """A loopback TCP server whose handler answers the n-th request on a connection (False: close it)."""

    handler: Handler
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    server: asyncio.Server | None = None

    @property
    def endpoint(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                self.requests.append(head + await reader.readexactly(length))
                n += 1
                if not await self.handler(reader, writer, n):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def raw_server() -> AsyncIterator[Callable[[Handler], Awaitable[RawServer]]]:
    made: list[RawServer] = []

    async def make(handler: Handler) -> RawServer:
        s = RawServer(handler)
        s.server = await asyncio.start_server(s._serve, "127.0.0.1", 0)
        made.append(s)
        return s

    yield make
    for s in made:
        assert s.server is not None
        s.server.close()


class Collector:
    """A listener that keeps the body and signals the end (or failure) of the response."""

    def __init__(self) -> None:
        self.body = bytearray()
        self.reads = 0
        self.done = asyncio.Event()
        self.got_body = asyncio.Event()

    def on_read(self, conn: MinerConnection) -> None:
        self.reads += 1
        self.body += conn.take_body()
        if self.body:
            self.got_body.set()
        if conn.complete or conn.error is not None:
            self.done.set()


def request(endpoint: str, body: bytes = b"{}") -> bytes:
    return encode_request("POST", "/v1/chat/completions", endpoint, {"Content-Type": "application/json"}, body)


async def roundtrip(pool: MinerPool, endpoint: str) -> tuple[MinerConnection, Collector]:
    conn = await pool.connect(endpoint, connect_timeout=2.0)
    c = Collector()
    conn.send(request(endpoint), c)
    await asyncio.wait_for(c.done.wait(), 5.0)
    return conn, c


def ok_length(body: bytes) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        return True
    return handler


async def test_content_length_response_and_keep_alive_reuse(raw_server):
    srv = await raw_server(ok_length(b"hello"))
    async with MinerPool() as pool:
        for _ in range(3):
            conn, c = await roundtrip(pool, srv.endpoint)
            assert conn.status == 200 and conn.headers["content-type"] == "text/plain"
            assert bytes(c.body) == b"hello" and conn.complete and conn.keep_alive
            pool.release(conn)
        assert pool.opened == 1 and srv.connections == 1 and len(srv.requests) == 3
        assert conn.uses == 3 and pool.idle_count(srv.endpoint) == 1


async def test_interim_1xx_answers_are_skipped(raw_server):
    async def handler(reader, writer, n):
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.01)
        await ok_length(b"final")(reader, writer, n)
        return True

    srv = await raw_server(handler)
    async with MinerPool() as pool:
        conn, c = await roundtrip(pool, srv.endpoint)
        assert conn.status == 200 and "link" not in conn.headers and bytes(c.body) == b"final" and conn.keep_alive


async def test_chunked_body_over_several_reads_is_decoded(raw_server):
    async def handler(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for part in (b"data: a\n\n", b"data: bb\n\n", b"data: [DONE]\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    srv = await raw_server(handler)
    async with MinerPool() as pool:
        conn, c = await roundtrip(pool, srv.endpoint)
        assert bytes(c.body) == b"data: a\n\ndata: bb\n\ndata: [DONE]\n\n"
        assert c.reads >= 3  # one listener call per network read, not per chunk of bytes
        assert conn.complete and conn.keep_alive


async def test_read_to_close_body_completes_on_eof_and_is_not_reused(raw_server):
    async def handler(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\nuntil the end")
        await writer.drain()
        return False

    srv = await raw_server(handler)
    async with MinerPool() as pool:
        conn, c = await roundtrip(pool, srv.endpoint)
        assert bytes(c.body) == b"until the end" and conn.complete and not conn.keep_alive
        pool.release(conn)
        assert conn.closed and pool.idle_count() == 0


@pytest.mark.parametrize("reply", [b"NOT HTTP AT ALL\r\n\r\n", b"HTTP/1.1 200 OK\r\nX: " + b"y" * MAX_HEAD_BYTES])
async def test_garbage_and_oversized_heads_are_errors(raw_server, reply):
    async def handler(reader, writer, n):
        writer.write(reply)
        await writer.drain()
        await asyncio.sleep(1.0)
        return False

    srv = await raw_server(handler)
    async with MinerPool() as pool:
        conn, c = await roundtrip(pool, srv.endpoint)
        assert isinstance(conn.error, MinerHTTPError) and conn.closed and not conn.head_done


async def test_connection_the_server_closes_leaves_the_pool(raw_server):
    async def handler(reader, writer, n):
        await ok_length(b"x")(reader, writer, n)
        return False  # close after every response, without saying so in a header

    srv = await raw_server(handler)
    async with MinerPool() as pool:
        conn, _ = await roundtrip(pool, srv.endpoint)
        pool.release(conn)
        for _ in range(100):
            if conn.closed:
                break
            await asyncio.sleep(0.01)
        assert conn.closed and pool.idle_count() == 0
        conn2, c2 = await roundtrip(pool, srv.endpoint)
        assert conn2 is not conn and bytes(c2.body) == b"x" and pool.opened == 2


async def test_released_mid_response_drains_then_parks_or_times_out(raw_server):
    release_end = asyncio.Event()

    async def handler(reader, writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await release_end.wait()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    srv = await raw_server(handler)
    async with MinerPool(drain_timeout=0.3) as pool:
        conn = await pool.connect(srv.endpoint, connect_timeout=2.0)
        c = Collector()
        conn.send(request(srv.endpoint), c)
        await asyncio.wait_for(c.got_body.wait(), 5.0)
        pool.release(conn)  # the caller is done before the HTTP message ended
        assert pool.idle_count() == 0 and not conn.closed
        release_end.set()
        for _ in range(100):
            if pool.idle_count():
                break
            await asyncio.sleep(0.01)
        assert pool.idle_count(srv.endpoint) == 1 and not conn.closed

        release_end.clear()
        conn = await pool.connect(srv.endpoint, connect_timeout=2.0)
        c = Collector()
        conn.send(request(srv.endpoint), c)
        await asyncio.wait_for(c.got_body.wait(), 5.0)
        pool.release(conn)
        await asyncio.sleep(0.5)  # the end never comes: the drain timeout closes it
        assert conn.closed and pool.idle_count() == 0
        release_end.set()


async def test_idle_connections_expire(raw_server):
    srv = await raw_server(ok_length(b"x"))
    async with MinerPool(idle_timeout=0.05) as pool:
        conn, _ = await roundtrip(pool, srv.endpoint)
        pool.release(conn)
        await asyncio.sleep(0.02)
        assert not conn.closed and pool.idle_count() == 1
        await asyncio.sleep(0.2)  # nobody came back for it: the sweep closed it
        assert conn.closed and pool.idle_count() == 0
        conn2, _ = await roundtrip(pool, srv.endpoint)
        assert conn2 is not conn and pool.opened == 2


async def test_connect_refused_and_bad_endpoint():
    async with MinerPool() as pool:
        with pytest.raises(OSError):
            await pool.connect("127.0.0.1:1", connect_timeout=2.0)
        with pytest.raises(ValueError):
            await pool.connect("no-port", connect_timeout=2.0)


def test_request_encoding_refuses_header_injection():
    raw = encode_request("POST", "/p", "h:1", {"A": "b"}, b"xyz")
    assert raw == b"POST /p HTTP/1.1\r\nHost: h:1\r\nContent-Length: 3\r\nA: b\r\n\r\nxyz"
    with pytest.raises(ValueError):
        encode_request("POST", "/p", "h:1", {"A": "b\r\nEvil: 1"}, b"")


def sse_answer(tokens: int) -> bytes:
    frames = [b'data: {"choices":[{"index":0,"delta":{"role":"assistant"},"finish_reason":null}]}\n\n']
    frames += [b'data: {"choices":[{"index":0,"delta":{"content":"t%d "},"finish_reason":null}]}\n\n' % i
               for i in range(tokens)]
    frames += [b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n', b"data: [DONE]\n\n"]
    body = b"".join(frames)
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


async def test_upstream_retries_a_stale_pooled_connection_once_on_a_fresh_one(raw_server, alice):
    """The miner closed a keep-alive connection just as it was reused: the request goes out again, re-signed."""
    from gateway.protocol.signing import RequestSigner
    from gateway.router import Candidate, Router
    from gateway.upstream import Upstream
    from scoring.measurement import MeasurementQueue
    from tests.fakes import body

    async def handler(reader, writer, n):
        if n > 1:
            return False  # the race: the connection dies instead of answering its second request
        writer.write(sse_answer(3))
        await writer.drain()
        return True

    srv = await raw_server(handler)
    router = Router()
    router.sync([Candidate(uid=1, hotkey=alice.ss58_address, endpoint=srv.endpoint)])
    sink = MeasurementQueue()
    async with MinerPool() as pool:
        up = Upstream(pool, RequestSigner(alice), sink)
        for _ in range(2):
            lease = router.acquire()
            assert lease is not None
            try:
                m = await up.probe(lease, body(max_tokens=8))
            finally:
                router.release(lease)
            assert m.ok and m.completion_tokens == 3
        assert pool.opened == 2 and srv.connections == 2 and len(sink.drain()) == 2
        nonces = {line for r in srv.requests for line in r.split(b"\r\n")
                  if line.lower().startswith(b"x-bittensor-nonce")}
        assert len(srv.requests) == 3 and len(nonces) == 3  # the resent request carries a fresh signature


async def test_a_consumer_that_falls_behind_pauses_reading_and_loses_nothing(raw_server, alice):
    """Chunks pile up past PAUSE_CHUNKS while nobody reads: TCP pushes back on the miner, then all arrive."""
    from gateway import upstream as up_mod
    from gateway.protocol.signing import RequestSigner
    from gateway.router import Candidate, Router
    from gateway.upstream import Upstream
    from scoring.measurement import MeasurementQueue
    from tests.fakes import body

    n = up_mod.PAUSE_CHUNKS + 500
    finish = asyncio.Event()

    async def handler(reader, writer, _):
        frames = sse_answer(n).partition(b"\r\n\r\n")[2].split(b"\n\n")[:-1]
        body_now = b"".join(f + b"\n\n" for f in frames[:-2])  # every token, but not the finish and [DONE]
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"%x\r\n%s\r\n" % (len(body_now), body_now))
        await writer.drain()
        await finish.wait()
        rest = b"".join(f + b"\n\n" for f in frames[-2:])
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(rest), rest))
        await writer.drain()
        return True

    srv = await raw_server(handler)
    router = Router()
    router.sync([Candidate(uid=1, hotkey=alice.ss58_address, endpoint=srv.endpoint)])
    async with MinerPool() as pool:
        up = Upstream(pool, RequestSigner(alice), MeasurementQueue())
        lease = router.acquire()
        assert lease is not None
        try:
            async with await up.open(lease, body(max_tokens=n + 10)) as stream:
                conn = stream._conn
                assert conn is not None
                for _ in range(200):  # bounded: the miner's bytes arrive within a few reads
                    if conn._paused:
                        break
                    await asyncio.sleep(0.005)
                assert conn._paused and not stream.finished  # nobody read, so reading stopped
                finish.set()
                got = [ch.content async for ch in stream if ch.content]
                assert not conn._paused
        finally:
            router.release(lease)
        assert got == [f"t{i} " for i in range(n)] and stream.ok
