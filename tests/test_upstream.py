"""The miner side of a dispatch over real loopback sockets: what a miner's bytes on the wire do to the stream."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

from bittensor.sp_core import Keypair

from gateway.http.client import MinerClient
from gateway.protocol.signing import RequestSigner
from gateway.router import Candidate, Router
from gateway.upstream import Upstream, UpstreamTimeouts
from scoring.measurement import MeasurementQueue

PAYLOAD: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 8}


def _sse(tokens: int) -> bytes:
    chunks: list[dict[str, Any]] = [{"choices": [{"delta": {"content": f"t{i} "}, "finish_reason": None}]}
                                    for i in range(tokens)]
    chunks.append({"choices": [{"delta": {}, "finish_reason": "stop"}]})
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


class RawMiner:
    """A miner written at the byte level: ``answer(request_index)`` is what it writes for each request."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.connections = 0
        self.requests = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> RawMiner:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def endpoint(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                self.requests += 1
                writer.write(self.answer(self.requests))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def _probe_n(endpoint: str, n: int) -> list:
    kp = Keypair.create_from_uri("//Bob")
    router = Router(rng=random.Random(0))
    router.sync([Candidate(uid=1, hotkey=kp.ss58_address, endpoint=endpoint)])
    out = []
    async with MinerClient() as client:
        up = Upstream(client, RequestSigner(Keypair.create_from_uri("//Alice")), MeasurementQueue(),
                      timeouts=UpstreamTimeouts(connect=2.0, first_token=2.0, stall=1.0, total=5.0))
        for _ in range(n):
            lease = router.acquire()
            assert lease is not None
            try:
                out.append(await up.probe(lease, PAYLOAD))
            finally:
                router.release(lease)
            await asyncio.sleep(0.05)
    return out


async def test_a_second_response_in_the_same_read_is_not_merged_and_the_connection_is_dropped() -> None:
    """The hand-written client merged it into the first (status 200 -> 500, bodies joined)."""
    def answer(_: int) -> bytes:
        body = _sse(3)
        first = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        return first + b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 5\r\n\r\nerror"

    async with RawMiner(answer) as miner:
        results = await _probe_n(miner.endpoint, 3)
    assert [(m.ok, m.completion_tokens) for m in results] == [(True, 3)] * 3  # each answer judged alone
    assert miner.connections == 3  # a connection that carried stray bytes is never reused


async def test_a_clean_keep_alive_answer_reuses_its_connection() -> None:
    def answer(_: int) -> bytes:
        body = _sse(2)
        return b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n" % len(body) + body

    async with RawMiner(answer) as miner:
        results = await _probe_n(miner.endpoint, 3)
    assert all(m.ok for m in results)
    assert miner.connections == 1 and miner.requests == 3


async def test_a_response_that_is_not_http_is_the_miners_garbage() -> None:
    async with RawMiner(lambda _: b"SSH-2.0-OpenSSH_9.6\r\n\r\n") as miner:
        [m] = await _probe_n(miner.endpoint, 1)
    assert not m.ok and m.failure == "garbage"
