"""The one path every dispatched request takes, organic or probe: sign, POST, stream, measure.

Everything is measured on the validator's clock. The TTFT clock starts at dispatch, before signing
and connecting (a slow accept queue is the miner's latency too, never hidden by timing from response
headers); TTFT ends at the first chunk carrying content (the role-only prelude does not count);
completion tokens are the content chunks the gateway itself counted. Whatever the miner does —
refuse (429), hang, stall, send garbage, NaN, too-long lines, more tokens than ``max_tokens``, drop
the connection — the stream is bounded, stopped and recorded as exactly one :class:`Measurement`.

The bytes travel over :class:`gateway.http.client.MinerPool` (pooled keep-alive connections, parsed
inside ``data_received``): each network read is parsed, measured and queued at once, so TTFT is
taken when the bytes arrive, not when the consumer gets round to them.

Example::

    up = Upstream(MinerPool(), RequestSigner(keypair), sink=MeasurementQueue())
    lease = router.acquire()
    try:
        async with await up.open(lease, {"model": m, "messages": msgs, "max_tokens": 64}) as stream:
            async for chunk in stream:          # ChunkInfo(role, content, finish_reason, usage)
                print(chunk.content, end="")
    except UpstreamError as e:
        e.reason                                # a FAIL_* constant; e.measurement was already recorded
    finally:
        router.release(lease)

    m = await up.probe(lease, payload)          # the same code path, consumed to the end

A relay that writes once per network read uses ``await stream.next_batch()`` (every chunk decoded
from one read; ``[]`` at the end) and ``stream.ready`` (True when the next call will not wait). A relay
can go further with ``stream.push_to(sink)``: from then on each read's chunks (and at once, those that
came with the response head) go to ``sink(chunks)`` inside the read callback itself (no task switch per
token, the first one included), and
``await stream.wait_push()`` returns when the stream ended or the sink said it is full (returned
False: its client is behind); ``next_batch`` then carries on with whatever came after.
"""

from __future__ import annotations

import asyncio
import statistics
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from loguru import logger

from scoring.measurement import FailureReason, Measurement, MeasurementSink

from .http.client import MinerConnection, MinerHTTPError, MinerPool, encode_request
from .protocol.openai import CHAT_PATH, DEFAULT_MAX_TOKENS, SLOTS_HEADER, encode_body, miner_body, requested_max_tokens
from .protocol.signing import RequestSigner
from .protocol.sse import DONE, ChunkDecoder, ChunkInfo, SSEErrorEvent, SSEGarbage, SSEParser
from .protocol.tokens import estimate_prompt_tokens
from .router import Lease, MinerState

_SLOTS = SLOTS_HEADER.lower()  # advisory: clamped by the router (header names arrive lower-cased)
PAUSE_CHUNKS = 1024  # decoded chunks waiting for the consumer before reading from the miner pauses


class _DeadlinePassed(Exception):
    """Set on the stream's pending wait by its deadline timer."""


@dataclass(frozen=True, slots=True)
class UpstreamTimeouts:
    """Seconds. ``first_token`` counts from dispatch; ``stall`` between chunks; ``total`` caps everything."""

    connect: float = 3.0
    first_token: float = 30.0
    stall: float = 15.0
    total: float = 300.0


@dataclass(frozen=True, slots=True)
class UpstreamLimits:
    max_line_bytes: int = 64 * 1024
    max_content_chars: int = 4096  # one chunk's delta.content; a token is a few characters
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # for payloads that name no max_tokens


class UpstreamError(Exception):
    """The dispatch failed; ``measurement`` (already handed to the sink) says how."""

    def __init__(self, reason: str, measurement: Measurement, *, status: int | None = None,
                 after_content: bool = False, detail: str = "") -> None:
        super().__init__(f"{reason}{': ' + detail if detail else ''}")
        self.reason = reason
        self.measurement = measurement
        self.status = status
        self.after_content = after_content
        self.detail = detail


@dataclass(slots=True)
class MinerStats:
    """Recent outcomes of one miner, for the status page (scoring keeps its own books)."""

    ttfts: deque[float] = field(default_factory=lambda: deque(maxlen=50))
    requests: int = 0
    ok: int = 0
    failures: Counter[str] = field(default_factory=Counter)

    def ttft_p50(self) -> float | None:
        return statistics.median(self.ttfts) if self.ttfts else None


class Upstream:
    """Dispatches requests to miners over one shared :class:`MinerPool`."""

    def __init__(
        self,
        pool: MinerPool,
        signer: RequestSigner,
        sink: MeasurementSink,
        timeouts: UpstreamTimeouts | None = None,
        limits: UpstreamLimits | None = None,
    ) -> None:
        self._pool = pool
        self._signer = signer
        self._sink = sink
        self.timeouts = timeouts or UpstreamTimeouts()
        self.limits = limits or UpstreamLimits()
        self.stats: dict[int, MinerStats] = {}
        self.dispatched = 0
        # Called with (miner, n) when a miner advertises its slot count (``X-Miner-Slots``) in an answer;
        # the validator wires it to ``Router.learn_slots`` so least-in-flight compares in_flight / slots.
        self.on_slots: Callable[[MinerState, int], None] | None = None

    async def open(self, lease: Lease, payload: dict[str, Any], *, probe: bool = False,
                   timeouts: UpstreamTimeouts | None = None) -> UpstreamStream:
        """Sign and POST ``payload`` (forced to ``stream: true`` with usage) to the lease's miner.

        Returns once the miner answered 200 with an event stream. Raises :class:`UpstreamError`
        (measurement recorded) for busy, connect errors, non-200, timeouts before headers.
        """
        stream = UpstreamStream(self, lease, payload, probe=probe, timeouts=timeouts or self.timeouts)
        await stream._connect()
        return stream

    async def probe(self, lease: Lease, payload: dict[str, Any], *,
                    timeouts: UpstreamTimeouts | None = None) -> Measurement:
        """A probe: the organic code path, consumed to the end. Never raises for miner failures."""
        try:
            stream = await self.open(lease, payload, probe=True, timeouts=timeouts)
        except UpstreamError as e:
            return e.measurement
        async with stream:
            try:
                async for _ in stream:
                    pass
            except UpstreamError as e:
                return e.measurement
        assert stream.measurement is not None
        return stream.measurement

    def _record(self, m: Measurement) -> None:
        st = self.stats.get(m.uid)
        if st is None:
            st = self.stats[m.uid] = MinerStats()
        st.requests += 1
        if m.ok:
            st.ok += 1
        elif m.failure is not None:
            st.failures[m.failure] += 1
        if m.ttft_s is not None:
            st.ttfts.append(m.ttft_s)
        try:
            self._sink.record(m)
        except Exception:  # the sink must never break serving
            logger.opt(exception=True).error("measurement sink raised; measurement for uid {} lost", m.uid)


class UpstreamStream:
    """One dispatch: an async iterator of :class:`ChunkInfo`, recorded exactly once when it ends.

    Use it as ``async with``: leaving the block before the stream finished (client gone, task
    cancelled) closes the miner connection at once and records ``client_disconnect``.
    """

    def __init__(self, upstream: Upstream, lease: Lease, payload: dict[str, Any], *, probe: bool,
                 timeouts: UpstreamTimeouts) -> None:
        self._up = upstream
        self._loop = asyncio.get_running_loop()
        self.t0 = self._loop.time()  # the TTFT clock starts at dispatch, before anything else
        self.lease = lease
        self.uid = lease.miner.uid
        self.hotkey = lease.miner.hotkey
        self.probe = probe
        self._tmo = timeouts
        limits = upstream.limits
        self.max_tokens = requested_max_tokens(payload, limits.default_max_tokens)
        body = miner_body(payload, self.max_tokens)
        messages = body.get("messages")
        self.prompt_tokens = estimate_prompt_tokens(messages) if isinstance(messages, list) else 0
        self._body = encode_body(body)
        self._parser = SSEParser(max_line_bytes=limits.max_line_bytes)
        self._decoder = ChunkDecoder(limits.max_content_chars)
        self._timer: asyncio.TimerHandle | None = None  # the one deadline timer, moved lazily
        self._waiter: asyncio.Future[None] | None = None  # the consumer waiting for the next read
        self._conn: MinerConnection | None = None
        self._streaming = False  # the head was accepted: reads are parsed as they arrive
        self._push: Callable[[list[ChunkInfo]], bool] | None = None
        self._pending: deque[ChunkInfo] = deque()
        self._error: UpstreamError | None = None
        self._last_event = self.t0
        self.tokens = 0
        self.ttft_s: float | None = None
        self._last_content = self.t0
        self._conc_area = 0.0  # integral of in-flight on this miner over the decode phase
        self.finish_reason: str | None = None
        self.usage: dict[str, int] | None = None
        self.measurement: Measurement | None = None
        upstream.dispatched += 1

    # -- state -----------------------------------------------------------------------------------

    @property
    def content_started(self) -> bool:
        return self.ttft_s is not None

    @property
    def finished(self) -> bool:
        return self.measurement is not None

    @property
    def ok(self) -> bool:
        return self.measurement is not None and self.measurement.ok

    def _finish(self, failure: str | None, *, status: int | None = None, detail: str = "") -> Measurement:
        """Record the one measurement of this dispatch and drop the connection (idempotent)."""
        if self.measurement is not None:
            return self.measurement
        m = Measurement(
            uid=self.uid,
            hotkey=self.hotkey,
            in_flight=self.lease.in_flight_at_dispatch,
            prompt_tokens=self.prompt_tokens,
            max_tokens=self.max_tokens,
            ttft_s=self.ttft_s,
            latency_s=max(0.0, self._loop.time() - self.t0),
            completion_tokens=self.tokens,
            ok=failure is None,
            failure=failure,
            probe=self.probe,
            concurrency=self._decode_concurrency(),
        )
        self.measurement = m
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._conn is not None:
            if failure in (None, FailureReason.BUSY, FailureReason.HTTP_STATUS):
                self._up._pool.release(self._conn)  # reused once its response has ended cleanly
            else:
                self._conn.close()  # frees the miner's slot now, not when the socket times out
        if failure is not None and failure != FailureReason.CLIENT_DISCONNECT:
            self._error = UpstreamError(failure, m, status=status, after_content=self.content_started,
                                        detail=detail)
            logger.debug("uid {} {}{}", self.uid, failure, f" ({detail})" if detail else "")
        self._up._record(m)
        self._wake()
        return m

    def _decode_concurrency(self) -> float | None:
        if self.ttft_s is None:
            return None
        decode_s = self._last_content - (self.t0 + self.ttft_s)
        return self._conc_area / decode_s if decode_s > 0 else None

    def _fail(self, failure: str, *, status: int | None = None, detail: str = "") -> UpstreamError:
        self._finish(failure, status=status, detail=detail)
        assert self._error is not None
        return self._error

    # -- connect ---------------------------------------------------------------------------------

    async def _connect(self) -> None:
        miner = self.lease.miner
        try:
            conn, reused = await self._send(reused_ok=True)
            if reused and conn.error is not None and not conn.head_done and not isinstance(conn.error, MinerHTTPError):
                conn.close()  # a pooled connection the miner had already closed: once more on a fresh one
                conn, _ = await self._send(reused_ok=False)
            if not conn.head_done:
                if isinstance(conn.error, MinerHTTPError):
                    raise self._fail(FailureReason.GARBAGE, detail=f"bad HTTP response: {conn.error}")
                raise self._fail(FailureReason.CONNECT, detail=type(conn.error).__name__)
            advertised = conn.headers.get(_SLOTS)
            if advertised is not None and self._up.on_slots is not None and advertised.isdigit():
                self._up.on_slots(miner, int(advertised))
            status = conn.status
            if status == 429:
                raise self._fail(FailureReason.BUSY, status=429)
            if status != 200:
                raise self._fail(FailureReason.HTTP_STATUS, status=status, detail=f"HTTP {status}")
            ctype = conn.headers.get("content-type", "").partition(";")[0].strip().lower()
            if ctype != "text/event-stream":
                raise self._fail(FailureReason.GARBAGE, status=200, detail=f"content type {ctype!r}")
            encoding = conn.headers.get("content-encoding", "identity").strip().lower()
            if encoding != "identity":
                raise self._fail(FailureReason.GARBAGE, status=200, detail=f"content encoding {encoding!r}")
            self._streaming = True
            self._consume(conn)  # body bytes that came with the head
        except UpstreamError:
            raise
        except BaseException:
            # cancelled (client gone, shutdown) or an unexpected bug: still exactly one measurement
            self._finish(FailureReason.CLIENT_DISCONNECT)
            raise

    async def _send(self, *, reused_ok: bool) -> tuple[MinerConnection, bool]:
        """Sign and write the request; return (connection, reused) once the head arrived or it failed."""
        miner = self.lease.miner
        tmo = self._tmo
        try:
            remaining = self._next_deadline() - self._loop.time()
            conn = await self._up._pool.connect(miner.endpoint, connect_timeout=max(0.0, min(tmo.connect, remaining)),
                                                fresh=not reused_ok)
        except (OSError, TimeoutError, ValueError) as e:
            raise self._fail(FailureReason.CONNECT, detail=type(e).__name__) from None
        self._conn = conn
        reused = conn.uses > 0
        headers = self._up._signer.sign(path=CHAT_PATH, body=self._body, receiver_ss58=miner.hotkey)
        headers["Content-Type"] = "application/json"
        headers["Accept"] = "text/event-stream"
        try:
            conn.send(encode_request("POST", CHAT_PATH, miner.endpoint, headers, self._body), self)
        except ConnectionError as e:
            conn.error = e
            return conn, reused
        if self._timer is None:
            self._timer = self._loop.call_at(self._next_deadline(), self._on_deadline)
        while not conn.head_done and conn.error is None:
            if self._loop.time() >= self._next_deadline():
                raise self._fail(FailureReason.TIMEOUT, detail="no response headers before the first-token deadline")
            await self._wait()
        return conn, reused

    # -- streaming -------------------------------------------------------------------------------

    def __aiter__(self) -> UpstreamStream:
        return self

    async def __anext__(self) -> ChunkInfo:
        while True:
            if self._pending:
                return self._pending.popleft()
            if self._error is not None:
                raise self._error
            if self.finished:
                raise StopAsyncIteration
            await self._fill()

    async def next_batch(self) -> list[ChunkInfo]:
        """Every chunk available now, waiting for one network read if none is; ``[]`` once the stream ended.

        The same chunks, order and errors as iteration, grouped so a relay writes once per read.
        """
        while not self._pending:
            if self._error is not None:
                raise self._error
            if self.finished:
                return []
            await self._fill()
        batch = list(self._pending)
        self._pending.clear()
        return batch

    def push_to(self, sink: Callable[[list[ChunkInfo]], bool] | None) -> None:
        """Hand each later read's chunks to ``sink`` as they are parsed; ``None`` goes back to ``next_batch``.

        ``sink`` returns False when it can take no more: pushing stops and later chunks wait for
        ``next_batch`` (reading from the miner pauses once they pile up). Chunks already waiting (they
        came with the response head) go to ``sink`` at once, unless the stream has ended: then they are
        left, with the ending, to ``next_batch``.
        """
        self._push = sink
        if sink is not None and self._pending and self.measurement is None:
            self._hand_over(sink)

    async def wait_push(self) -> None:
        """While pushing, wait until the stream ended (failures included) or the sink said it is full."""
        while self._push is not None and self.measurement is None:
            await self._fill()

    @property
    def ready(self) -> bool:
        """True when the next ``next_batch``/``__anext__`` returns or raises without waiting on the miner."""
        return bool(self._pending) or self.measurement is not None

    def _next_deadline(self) -> float:
        t = self._tmo
        if self.content_started:
            deadline = self._last_event + t.stall
        else:
            deadline = self.t0 + t.first_token
        return min(deadline, self.t0 + t.total)

    def _on_deadline(self) -> None:
        """The deadline timer: re-armed when events moved the deadline, else it ends a pending read.

        One timer per stream instead of an ``asyncio.timeout`` per read: events only move the
        deadline (a float), and the timer catches up when it fires, once per stall period at most.
        """
        self._timer = None
        if self.measurement is not None:
            return
        deadline = self._next_deadline()
        if self._loop.time() < deadline:
            self._timer = self._loop.call_at(deadline, self._on_deadline)
        elif self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(_DeadlinePassed())
        # nobody waiting: the consumer is busy elsewhere; its next _fill sees the deadline has passed

    def _timed_out(self) -> None:
        self._fail(FailureReason.TIMEOUT, detail="stalled" if self.content_started else "no first token")

    async def _fill(self) -> None:
        """Wait for the next read (it is parsed on arrival, by :meth:`on_read`) or the deadline."""
        if self._loop.time() >= self._next_deadline():
            self._timed_out()
            return
        if self._conn is not None:
            self._conn.resume_reading()  # everything queued was taken: read from the miner again
        await self._wait()
        if not self._pending and not self.finished and self._loop.time() >= self._next_deadline():
            self._timed_out()

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        except _DeadlinePassed:
            pass
        finally:
            self._waiter = None

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def on_read(self, conn: MinerConnection) -> None:
        """Called by the connection after every network read: parse and measure now, then wake the consumer."""
        if conn is self._conn and self._streaming and self.measurement is None:
            self._consume(conn)
            if self._push is not None and self._pending:
                self._hand_over(self._push)
                if self.measurement is None:
                    return  # nothing for a waiting consumer: it waits for the end (or the sink being full)
        self._wake()

    def _hand_over(self, sink: Callable[[list[ChunkInfo]], bool]) -> None:
        """Give the queued chunks to the push sink; one that is full stops the pushing and wakes the relay."""
        batch = list(self._pending)
        self._pending.clear()
        if not sink(batch):
            self._push = None  # the relay carries on with awaited writes
            self._wake()

    def _consume(self, conn: MinerConnection) -> None:
        data = conn.take_body()
        if data:
            try:
                events = self._parser.feed(data)
            except SSEGarbage as e:
                self._fail(FailureReason.GARBAGE, detail=str(e))
                return
            for ev in events:
                if not self._on_event(ev):
                    return
        if conn.error is not None:
            if isinstance(conn.error, MinerHTTPError):
                self._fail(FailureReason.GARBAGE, detail=str(conn.error))
            else:
                self._fail(FailureReason.DROPPED, detail=type(conn.error).__name__)
        elif conn.complete:
            self._on_eof()
        elif len(self._pending) > PAUSE_CHUNKS and self._push is None:
            conn.pause_reading()  # the consumer (a slow client) is behind: TCP pushes back on the miner

    def _on_event(self, data: str) -> bool:
        """Handle one event; False when the stream ended (done or failed)."""
        if data == DONE or (data[:1] != "{" and data.strip() == DONE):
            if self.tokens == 0:
                self._fail(FailureReason.EMPTY, detail="[DONE] without content")
            else:
                self._finish(None)
            return False
        try:
            chunk = self._decoder.decode(data)
        except SSEErrorEvent as e:
            self._fail(FailureReason.DROPPED, detail=str(e))
            return False
        except SSEGarbage as e:
            self._fail(FailureReason.GARBAGE, detail=str(e))
            return False
        now = self._loop.time()
        self._last_event = now
        if chunk.content:
            if self.tokens >= self.max_tokens:
                self._fail(FailureReason.OVERLONG, detail=f"more than max_tokens={self.max_tokens} tokens")
                return False
            self.tokens += 1
            if self.ttft_s is None:
                self.ttft_s = now - self.t0
            else:
                self._conc_area += self.lease.miner.in_flight * (now - self._last_content)
            self._last_content = now
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
        if chunk.usage is not None:
            self.usage = chunk.usage
        self._pending.append(chunk)
        return True

    def _on_eof(self) -> None:
        if self.finish_reason is not None and self.tokens > 0:
            self._finish(None)  # finished but forgot [DONE]: the answer is complete
        elif self.finish_reason is not None:
            self._fail(FailureReason.EMPTY, detail="finished without content")
        else:
            self._fail(FailureReason.DROPPED, detail="stream ended before finish")

    # -- closing ---------------------------------------------------------------------------------

    def close(self, reason: str = FailureReason.CLIENT_DISCONNECT) -> None:
        """Stop now (no-op when already finished): the miner connection is closed, its slot freed."""
        if not self.finished:
            self._finish(reason)

    async def __aenter__(self) -> UpstreamStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.close(FailureReason.CLIENT_DISCONNECT)
