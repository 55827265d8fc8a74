"""The least a Python proxy can cost: a bare asyncio relay, for the gateway benchmark's ``pyrelay`` path.

No API key, no JSON, no routing choice, no signing, no measurement, no re-framing: it parses each
request with ``httptools``, forwards it round-robin over pooled keep-alive connections to the fake
miners (they accept unsigned requests), and writes each body read straight back as one HTTP chunk
from the read callback. Whatever it adds over ``direct`` is the price of one more CPython asyncio hop
on this machine (event loop, two sockets, scheduling), which bounds from below what any Python
gateway, this one included, can add. It is a benchmark helper, not a proxy anyone should run: it
handles only the happy path of a streaming POST.

``--meter`` (the benchmark's ``pymeter`` path) adds, in the same read callback, the per-token work no
gateway can skip: each read goes through the gateway's own :class:`~gateway.metering.StreamMeter` and
its content is framed anew for the client by :class:`~gateway.protocol.sse.ChunkFramer`. No per-request
work (keys, routing, signing, measurements) and no task woken per read: it is what a gateway whose relay
ran in ``asyncio.Protocol`` callbacks could reach per relayed token, the floor of such a rewrite.

Prints ``READY {"port": ..., "pid": ...}`` once listening; exits when its parent dies::

    python scripts/bench_lib/bare_relay.py --ports 8091,8092
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import time
from typing import cast

import httptools

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


class _Reframer:
    """One answer as the gateway would send it on (``--meter``): each read metered, each token framed anew,
    ``[DONE]`` at the end. The gateway is imported here only, so the bare relay's own RSS stays the floor too."""

    def __init__(self) -> None:
        from gateway.metering import StreamMeter
        from gateway.protocol.sse import ChunkFramer

        self.meter = StreamMeter(max_tokens=1 << 20, started_at=time.monotonic())
        self.framer = ChunkFramer("chatcmpl-bench", 0, "bench")

    def __call__(self, body: bytes) -> bytes:
        chunks = self.meter.feed(body, time.monotonic())
        out = b"".join([self.framer.content(c.content) for c in chunks if c.content])
        return out + b"data: [DONE]\n\n" if self.meter.done else out


class _Upstream(asyncio.Protocol):
    """One pooled connection to a fake miner; relays the body of the response in progress to ``client``."""

    def __init__(self, port: int, idle: list[_Upstream], metered: bool) -> None:
        self.port = port
        self.idle = idle
        self.metered = metered
        self.reframe: _Reframer | None = None  # the answer in progress, with --meter
        self.client: asyncio.Transport | None = None
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.started = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        if self.client is None:
            return
        if self.metered:
            if self.reframe is None:
                self.reframe = _Reframer()
            body = self.reframe(body)
            if not body:
                return
        frame = b"%x\r\n%b\r\n" % (len(body), body)
        self.client.write(frame if self.started else HEAD + frame)
        self.started = True

    def on_message_complete(self) -> None:
        if self.client is not None:
            self.client.write(b"0\r\n\r\n")
        self.client, self.started, self.reframe = None, False, None
        self.parser = httptools.HttpResponseParser(self)
        self.idle.append(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.idle:
            self.idle.remove(self)
        if self.client is not None:
            self.client.close()


class _Client(asyncio.Protocol):
    def __init__(self, relay: BareRelay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.body = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        body, self.body = bytes(self.body), bytearray()
        asyncio.get_running_loop().create_task(self.relay.forward(self, body))


class BareRelay:
    def __init__(self, ports: list[int], meter: bool) -> None:
        self._meter = meter
        if meter:
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the repo
        self._next = itertools.cycle(ports)
        self._idle: dict[int, list[_Upstream]] = {p: [] for p in ports}

    async def forward(self, client: _Client, body: bytes) -> None:
        port = next(self._next)
        idle = self._idle[port]
        if idle:
            up = idle.pop()
        else:
            loop = asyncio.get_running_loop()
            _, up = await loop.create_connection(lambda: _Upstream(port, idle, self._meter), "127.0.0.1", port)
        up.client = client.transport
        assert up.transport is not None
        up.transport.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                           b"\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))


async def serve(ports: list[int], meter: bool) -> None:
    relay = BareRelay(ports, meter)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(relay), "127.0.0.1", 0)
    print("READY " + json.dumps({"port": server.sockets[0].getsockname()[1], "pid": os.getpid()}), flush=True)
    parent = os.getppid()
    async with server:
        while os.getppid() == parent:  # noqa: ASYNC110 (a parent's death is no event: poll for it)
            await asyncio.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A bare asyncio streaming relay (benchmark helper: the Python floor).")
    p.add_argument("--ports", required=True, help="comma list of fake miner ports on 127.0.0.1")
    p.add_argument("--meter", action="store_true", help="meter and re-frame each read as the gateway does")
    a = p.parse_args(argv)
    asyncio.run(serve([int(x) for x in a.ports.split(",")], a.meter))
    return 0


if __name__ == "__main__":
    sys.exit(main())
