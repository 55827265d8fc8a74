"""Measurements from every gateway process to the one scorer, through a Redis Stream and a consumer group.

Each gateway process publishes what it measured (with the answer kept for audit, when it keeps one) as one stream
entry, MessagePack of the :class:`~gateway.protocol.measurement.Measurement` itself (msgspec: the dataclasses are
the schema, so a field added to them travels without a second definition here). The scorer reads them as the group's one
consumer and acknowledges an entry only once the round holding it is saved (:meth:`MeasurementReader.ack`), so a
scorer killed with ``kill -9`` reads again, at its restart, every entry it had not saved: nothing acknowledged is
lost. Entries it had read but not acknowledged come back first (the consumer's pending list, read from ``0``).

Redis down: :class:`MeasurementPublisher` keeps measurements in a bounded local buffer (the oldest dropped past
``max_buffer``, counted and logged, never silently) and sends them when Redis is back. Publishing never blocks
nor raises into the serving path: ``record`` appends to the buffer, and a background task sends it in batches.
A batch that failed is sent again whole, though Redis may have taken part of it: each entry carries its publisher's
name for it, and the reader drops a name it read lately (the last :data:`SEEN`), so no measurement is paid twice.

Example::

    pub = MeasurementPublisher(link)            # a MeasurementSink for Upstream
    asyncio.create_task(pub.run())
    reader = MeasurementReader(link)
    await reader.start()
    for m in await reader.pull():               # m.ref: its stream id
        ...
    await reader.ack([m.ref for m in saved])
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import secrets
from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import Any

import msgspec
from loguru import logger
from redis.exceptions import ResponseError

from gateway.protocol.measurement import Measurement

from .link import RedisError, RedisLink, woken

STREAM = "measurements"
GROUP = "scorer"
FIELD = b"m"
ID_FIELD = b"id"  # the publisher's own name for the entry: a batch sent again after a failure is read once
SEEN = 200_000  # entry names the reader remembers, to drop what a retried batch sent twice
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Measurement)


def encode(m: Measurement) -> bytes:
    return _ENCODER.encode(m)


def decode(raw: bytes) -> Measurement:
    """A stream entry's measurement; raises ``msgspec.DecodeError``/``ValidationError`` on anything else."""
    return _DECODER.decode(raw)


class MeasurementPublisher:
    """A :class:`~gateway.protocol.measurement.MeasurementSink` for the shared stream; buffers while Redis is down."""

    def __init__(self, link: RedisLink, *, max_buffer: int = 50_000, batch: int = 512, every_s: float = 0.05,
                 max_stream: int = 200_000) -> None:
        self.link = link
        self.key = link.key(STREAM)
        self.max_buffer = max_buffer
        self.batch = batch
        self.every_s = every_s
        self.max_stream = max_stream  # entries kept on the stream (approximate trim); the scorer reads far fewer
        self._buffer: deque[tuple[bytes, bytes]] = deque()  # (name, measurement)
        self._name = secrets.token_hex(6)
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self.sent = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._buffer)

    def record(self, m: Measurement) -> None:
        if len(self._buffer) >= self.max_buffer:
            self._buffer.popleft()
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("measurement buffer full ({} waiting for Redis): {} dropped so far", self.max_buffer,
                               self.dropped)
        self._buffer.append((f"{self._name}:{next(self._ids)}".encode(), encode(m)))
        if len(self._buffer) >= self.batch:
            self._wake.set()

    async def run(self) -> None:
        """Send the buffer every ``every_s`` (sooner when a batch is full), until cancelled."""
        while True:
            await woken(self._wake, self.every_s)
            await self.send()

    async def send(self) -> int:
        """Send what the buffer holds while Redis takes it; returns how many were sent."""
        sent = 0
        while self._buffer and self.link.usable():
            items = [self._buffer[i] for i in range(min(self.batch, len(self._buffer)))]
            pipe = self.link.redis.pipeline(transaction=False)
            for name, raw in items:
                pipe.xadd(self.key, {ID_FIELD: name, FIELD: raw}, maxlen=self.max_stream, approximate=True)
            try:
                await pipe.execute()
            except (RedisError, OSError) as e:
                self.link.failed(e)  # kept: they go when Redis is back; what had gone is read once (ID_FIELD)
                break
            self.link.worked()
            for _ in items:
                self._buffer.popleft()
            sent += len(items)
        self.sent += sent
        return sent


class MeasurementReader:
    """The scorer's side: one consumer of the group, acknowledging what the saved rounds hold.

    At start it reads the consumer's pending entries first (read before a restart, never acknowledged), then new
    ones. Should a read fail in transit, the entries Redis delivered with it are pending too: the next read
    takes the pending list again from the last entry received, so none waits for a restart.
    """

    def __init__(self, link: RedisLink, *, consumer: str = "scorer") -> None:
        self.link = link
        self.key = link.key(STREAM)
        self.consumer = consumer
        self._pending_from: str | None = "0"  # read the pending list after this id; None: read new entries
        self._last = "0"  # the last entry received
        self._seen: OrderedDict[bytes, None] = OrderedDict()  # publishers' entry names lately read
        self._started = False
        self.read = 0
        self.unreadable = 0
        self.duplicates = 0

    async def start(self) -> None:
        try:
            await self.link.redis.xgroup_create(self.key, GROUP, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._started = True
        self.link.worked()

    async def pull(self, limit: int = 5000) -> list[Measurement]:
        """Up to ``limit`` measurements not yet acknowledged (pending ones first); [] while Redis is down."""
        if not self.link.usable():
            return []
        out: list[Measurement] = []
        try:
            if not self._started:
                await self.start()
            while len(out) < limit:
                count = min(1000, limit - len(out))
                reply: Any = await self.link.redis.xreadgroup(GROUP, self.consumer,
                                                         {self.key: self._pending_from or ">"}, count=count)
                entries = reply[0][1] if reply else []
                if self._pending_from is not None and len(entries) < count:
                    self._pending_from = None  # the pending list is read: new entries from the next read
                elif not entries:
                    break
                out.extend(await self._decoded(entries))
                if self._pending_from is not None:
                    self._pending_from = self._last
        except (RedisError, OSError) as e:
            self.link.failed(e)
            self._pending_from = self._last  # what a failed read delivered is pending: read it again
            self.read += len(out)
            return out
        self.link.worked()
        self.read += len(out)
        return out

    async def _decoded(self, entries: list[Any]) -> list[Measurement]:
        out: list[Measurement] = []
        bad: list[str] = []  # acknowledged at once: unreadable, or read before
        for entry_id, fields in entries:
            ref = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            self._last = ref
            name = fields.get(ID_FIELD) if isinstance(fields, dict) else None
            if name is not None:
                if name in self._seen:  # a batch its publisher sent again after a failure: once is enough
                    self.duplicates += 1
                    bad.append(ref)
                    continue
                self._seen[name] = None
                if len(self._seen) > SEEN:
                    self._seen.popitem(last=False)
            try:
                m = decode(fields[FIELD])
            except (KeyError, TypeError, ValueError, msgspec.DecodeError, msgspec.ValidationError) as e:
                self.unreadable += 1
                logger.error("shared measurement stream: entry {} is unreadable ({!r}); acknowledged and skipped",
                             ref, e)
                bad.append(ref)
                continue
            out.append(dataclasses.replace(m, ref=ref))
        if bad:
            await self.link.redis.xack(self.key, GROUP, *bad)
        return out

    async def ack(self, refs: Iterable[str]) -> bool:
        """Acknowledge entries whose round is saved; False (kept pending, to be acknowledged later) on failure.

        Then the stream is trimmed below its oldest entry still pending (or the last one read, when none is): what
        every saved round holds leaves Redis, what the scorer may still need stays.
        """
        ids = list(refs)
        if not ids:
            return True
        try:
            for i in range(0, len(ids), 1000):
                await self.link.redis.xack(self.key, GROUP, *ids[i:i + 1000])
            pending: Any = await self.link.redis.xpending(self.key, GROUP)
            oldest = pending.get("min") if isinstance(pending, dict) and pending.get("pending") else None
            keep_from = oldest.decode() if isinstance(oldest, bytes) else oldest or self._last
            await self.link.redis.xtrim(self.key, minid=keep_from, approximate=True)
        except (RedisError, OSError) as e:
            self.link.failed(e)
            return False
        self.link.worked()
        return True
