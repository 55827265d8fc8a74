"""Talking to miners over HTTP/1.1: one ``aiohttp.ClientSession`` with keep-alive connections per miner.

Why aiohttp: it is already the project's HTTP library (the reference miner, the traffic client, the SDK),
it parses with llhttp, pools and expires keep-alive connections, bounds response heads and exposes the
body read by read, which is all the stream meter needs. The hand-written client it replaced
(``httptools`` straight in ``data_received``) saved a little CPU per token but was ~350 lines of HTTP
we owned, and it merged a second response sent on the same connection into the first.

Settings that matter here: no ``Accept-Encoding`` (a miner's stream must arrive as written: identity),
no automatic decompression, response heads capped (:data:`MAX_HEAD_FIELD_BYTES` a line),
connection pooling without a cap (the router bounds concurrency per miner), idle connections closed
after ``idle_timeout`` so a miner no longer routed to keeps no socket open.

Example::

    async with MinerClient() as client:
        resp = await client.post("127.0.0.1:8091", "/v1/chat/completions", body, headers, connect_timeout=3.0)
        data = await resp.content.readany()     # b"" at the end
        resp.release()                          # or resp.close(): drop the connection (frees the miner's slot)
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType

import aiohttp

MAX_HEAD_FIELD_BYTES = 8 * 1024  # one status or header line of a miner's answer


class MinerClient:
    """The pooled client every dispatch goes through. The session opens on first use (no I/O here)."""

    def __init__(self, *, idle_timeout: float = 15.0) -> None:
        self.idle_timeout = idle_timeout
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self.idle_timeout)
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
                timeout=aiohttp.ClientTimeout(total=None),
                max_line_size=MAX_HEAD_FIELD_BYTES,
                max_field_size=MAX_HEAD_FIELD_BYTES,
            )
        return self._session

    async def post(self, endpoint: str, path: str, body: bytes, headers: Mapping[str, str], *,
                   connect_timeout: float) -> aiohttp.ClientResponse:
        """POST and return once the response head arrived; the caller bounds the wait for it.

        Raises ``aiohttp.ClientError`` (connect errors, a miner that hung up, bytes that are not
        HTTP) or ``TimeoutError``.
        """
        timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout, sock_connect=connect_timeout)
        return await self._open().post(f"http://{endpoint}{path}", data=body, headers=headers, timeout=timeout,
                                       allow_redirects=False)

    async def get(self, endpoint: str, path: str, *, timeout_s: float) -> aiohttp.ClientResponse:
        """GET (a miner's /health); the whole exchange bounded by ``timeout_s``. Use as ``async with``."""
        return await self._open().get(f"http://{endpoint}{path}", timeout=aiohttp.ClientTimeout(total=timeout_s),
                                      allow_redirects=False)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> MinerClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
