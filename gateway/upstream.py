"""The one path every dispatched request takes, organic or probe: sign, POST, stream, measure.

Everything is measured on the validator's clock. The TTFT clock starts at dispatch, before signing
and connecting (a slow accept queue is the miner's latency too, never hidden by timing from response
headers); the rules of what counts are :class:`gateway.metering.StreamMeter`'s, fed each network read
with the time it was taken. Whatever the miner does — refuse (429), hang, stall, send garbage, NaN,
too-long lines, more tokens than ``max_tokens``, drop the connection — the stream is bounded, stopped
and recorded as exactly one :class:`~scoring.measurement.Measurement`.

Deadlines only run while the validator waits on the miner: the first token within ``first_token`` of
dispatch, then each read within ``stall`` of the last event, all within ``total``. While the relay
waits on a slow *client*, no read is pending and no miner deadline runs: a client's back-pressure is
never booked as the miner's stall.

Example::

    up = Upstream(MinerClient(), RequestSigner(keypair), sink=MeasurementQueue())
    lease = router.acquire()
    try:
        async with await up.open(lease, {"model": m, "messages": msgs, "max_tokens": 64}) as stream:
            while batch := await stream.next_batch():      # the chunks of one network read
                print("".join(c.content for c in batch), end="")
    except UpstreamError as e:
        e.reason                                # a FailureReason; e.measurement was already recorded
    finally:
        router.release(lease)

    m = await up.probe(lease, payload)          # the same code path, consumed to the end
"""

from __future__ import annotations

import asyncio
import errno
import json
import secrets
import statistics
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import TracebackType
from typing import Any

import aiohttp
from loguru import logger

from scoring.audit.policy import audit_skip
from scoring.measurement import Answer, FailureReason, Measurement, MeasurementSink

from .buckets import DECODE_BOUNDS_TOK_S, TTFT_BOUNDS_S, Buckets
from .http.client import MinerClient
from .metering import AnswerBudget, MeterFailure, StreamMeter
from .protocol.errors import CLIENT_FAULT_CODES
from .protocol.openai import (
    CHAT_PATH,
    DEFAULT_MAX_TOKENS,
    SAMPLER_HEADER,
    SLOTS_HEADER,
    SUBNET_SAMPLER,
    encode_body,
    miner_body,
    requested_max_tokens,
)
from .protocol.sampling import SamplingParams, wire_seed
from .protocol.signing import RequestSigner
from .protocol.sse import ChunkInfo
from .protocol.tokens import estimate_prompt_tokens
from .protocol.tools import prompt_messages
from .router import Lease, MinerState

MAX_ERROR_BODY = 64 * 1024  # what is read of a refusal's body so its connection can be reused
_STALE = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)  # a pooled connection the miner had closed
# The validator's own limits (open files, buffers, memory): a connect failing with these is never the miner's.
_LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


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
    keep_answers: bool = False  # keep each complete answer (text, token ids) on its measurement, for audits
    max_held_chars: int = 64_000_000  # answer text held at once across streams (metering.AnswerBudget)
    # Send each request the subnet sampler's seed (gateway.protocol.sampling): sampled answers are then
    # audited token by token. False: free draws, audited by plausibility only (for miners on stock runtimes).
    seeded_sampling: bool = True
    # The model the reference audits (None: any). Answers on another model are not audited (``skipped="model"``):
    # a reference per model is not built yet.
    audited_model: str | None = None
    # The reference renders tools in the subnet's tool format (gateway.protocol.tools): tool answers are audited.
    # False (the toy reference of the simulated cards): they are skipped (rule "tools").
    audit_tools: bool = False


REFUSAL_SLACK = 1  # free slots a miner may still show when it refuses: our release can race its own


def refusal(in_flight: int, slots: int) -> FailureReason:
    """What a 429 is: the truth (``busy``) when this validator's streams fill the slots the miner declared
    *before* the request, a refusal the miner is booked for (``refused``) when at least two of them were free,
    or when none of this validator's streams was on it (whatever it declares: one slot is still one slot).

    ``slots`` is what the miner declared at dispatch, never the refusing response's own header: a miner
    declaring 4 slots on answers and 1 on each 429 turned every refusal into the truth (issue 23: 1.34-1.47x).
    The slack of one: the gateway releases a stream when it reads ``[DONE]``, a moment before the miner's
    handler returns, so a back-to-back dispatch can find an honest miner still counting the last one (the
    reference miner frees its slot before it sends ``[DONE]``, so it never refuses that way).
    """
    if in_flight <= 0:
        return FailureReason.REFUSED
    return FailureReason.REFUSED if in_flight + REFUSAL_SLACK < slots else FailureReason.BUSY


def client_fault(status: int, body: bytes) -> str | None:
    """The runtime's message when a miner's refusal says the *request* cannot be served, else None.

    Only a 400 naming one of :data:`~gateway.protocol.errors.CLIENT_FAULT_CODES` counts: anything else
    a miner refuses with stays its failure. A miner gains nothing by abusing it: a refused request
    earns no credit.
    """
    if status != 400:
        return None
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    if not isinstance(err, dict) or err.get("code") not in CLIENT_FAULT_CODES:
        return None
    message = err.get("message")
    return str(message)[:500] if isinstance(message, str) and message else str(err.get("code"))


class UpstreamError(Exception):
    """The dispatch failed; ``measurement`` (already handed to the sink) says how."""

    def __init__(self, reason: FailureReason, measurement: Measurement, *, status: int | None = None,
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
    ttft_s: Buckets = field(default_factory=lambda: Buckets(TTFT_BOUNDS_S))  # for /metrics' histograms
    decode_tok_s: Buckets = field(default_factory=lambda: Buckets(DECODE_BOUNDS_TOK_S))
    requests: int = 0
    ok: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)  # answers no audit can check, by rule (/v1/status)

    def ttft_p50(self) -> float | None:
        return statistics.median(self.ttfts) if self.ttfts else None


class Upstream:
    """Dispatches requests to miners over one shared :class:`MinerClient`."""

    def __init__(
        self,
        client: MinerClient,
        signer: RequestSigner,
        sink: MeasurementSink,
        timeouts: UpstreamTimeouts | None = None,
        limits: UpstreamLimits | None = None,
    ) -> None:
        self.client = client
        self.signer = signer
        self.sink = sink
        self.timeouts = timeouts or UpstreamTimeouts()
        self.limits = limits or UpstreamLimits()
        self.stats: dict[int, MinerStats] = {}
        self.dispatched = 0
        # Called with (miner, n) when a miner advertises its slot count (``X-Miner-Slots``) in an answer;
        # the wiring connects it to ``Router.learn_slots`` so least-in-flight compares in_flight / slots.
        self.on_slots: Callable[[MinerState, int], None] | None = None
        self.answers = AnswerBudget(self.limits.max_held_chars)
        self.seed_key = secrets.randbits(64)  # keys clients' own seeds (sampling.wire_seed); never leaves here
        self._draining: set[asyncio.Task[bytes]] = set()

    async def open(self, lease: Lease, payload: dict[str, Any], *, probe: bool = False,
                   timeouts: UpstreamTimeouts | None = None, capacity_check: bool = False,
                   held: bool = False) -> UpstreamStream:
        """Sign and POST ``payload`` (made the miner body: streamed, with usage) to the lease's miner.

        Returns once the miner answered 200 with an event stream. Raises :class:`UpstreamError`
        (measurement recorded) for busy, connect errors, non-200, timeouts before headers. ``held``: the
        caller holds the whole answer (non-streamed), so its text counts against :attr:`answers`.
        """
        stream = UpstreamStream(self, lease, payload, probe=probe, timeouts=timeouts or self.timeouts,
                                capacity_check=capacity_check, held=held)
        await stream.connect()
        return stream

    async def probe(self, lease: Lease, payload: dict[str, Any], *,
                    timeouts: UpstreamTimeouts | None = None, capacity_check: bool = False) -> Measurement:
        """A probe: the organic code path, consumed to the end. Never raises for miner failures.

        ``capacity_check``: one of the probes that fill every miner's slots at once (see ``ProbeRunner``).
        """
        try:
            stream = await self.open(lease, payload, probe=True, timeouts=timeouts, capacity_check=capacity_check)
        except UpstreamError as e:
            return e.measurement
        async with stream:
            try:
                while await stream.next_batch():
                    pass
            except UpstreamError as e:
                return e.measurement
        assert stream.measurement is not None
        return stream.measurement

    @staticmethod
    def learn_sampler(miner: MinerState, declared: str | None) -> None:
        """What an answer's ``X-Miner-Sampler`` said, for the requests dispatched from now on (never the one it came
        on: its audit and pay were fixed at dispatch, so a miner cannot declare per answer)."""
        miner.declares_sampler = declared == SUBNET_SAMPLER

    def record(self, m: Measurement) -> None:
        st = self.stats.get(m.uid)
        if st is None:
            st = self.stats[m.uid] = MinerStats()
        st.requests += 1
        if m.ok:
            st.ok += 1
        elif m.failure is not None:
            st.failures[m.failure] += 1
        if m.skipped is not None:
            st.skipped[m.skipped] += 1
        if m.ttft_s is not None:
            st.ttfts.append(m.ttft_s)
            st.ttft_s.observe(m.ttft_s)
            if m.ok and m.completion_tokens >= 2 and m.latency_s > m.ttft_s:  # one stream's rate, as it was sent
                st.decode_tok_s.observe((m.completion_tokens - 1) / (m.latency_s - m.ttft_s))
        try:
            self.sink.record(m)
        except Exception:  # the sink must never break serving
            logger.opt(exception=True).error("measurement sink raised; measurement for uid {} lost", m.uid)

    async def aclose(self) -> None:
        """Stop the background drains of finished answers (their connections close with the client)."""
        for task in list(self._draining):
            task.cancel()
        await asyncio.gather(*self._draining, return_exceptions=True)

    def drain_then_release(self, resp: aiohttp.ClientResponse, within_s: float = 2.0) -> None:
        """In the background, read the rest of a finished answer (the chunked terminator after ``[DONE]``) so
        its connection is reused; a miner that sends more, or too late, has the connection closed."""
        task = asyncio.create_task(settle(resp, within_s, content_ok=False))
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)


async def settle(resp: aiohttp.ClientResponse, within_s: float, *, content_ok: bool) -> bytes:
    """Read what is left of an answer so its connection can be reused; returns what was read.

    Released when the answer ends within ``within_s`` with at most :data:`MAX_ERROR_BODY` left (and, unless
    ``content_ok``, nothing but whitespace: bytes after ``[DONE]`` are a miner breaking the protocol);
    otherwise the connection is closed.
    """
    rest = b""
    try:
        async with asyncio.timeout(max(0.0, within_s)):
            rest = await resp.content.read(MAX_ERROR_BODY)
        if resp.content.at_eof() and (content_ok or not rest.strip()):
            resp.release()
            return rest
    except (TimeoutError, aiohttp.ClientError, OSError):
        pass
    resp.close()
    return rest


class UpstreamStream:
    """One dispatch, recorded exactly once when it ends.

    Use it as ``async with``: leaving the block before the stream finished (client gone, task
    cancelled) closes the miner connection at once and records ``client_disconnect``.
    """

    def __init__(self, upstream: Upstream, lease: Lease, payload: dict[str, Any], *, probe: bool,
                 timeouts: UpstreamTimeouts, capacity_check: bool = False, held: bool = False) -> None:
        self._up = upstream
        self._loop = asyncio.get_running_loop()
        self.t0 = self._loop.time()  # the TTFT clock starts at dispatch, before anything else
        self.lease = lease
        self.uid = lease.miner.uid
        self.hotkey = lease.miner.hotkey
        self.probe = probe
        self.capacity_check = capacity_check
        self._tmo = timeouts
        limits = upstream.limits
        self.max_tokens = requested_max_tokens(payload, limits.default_max_tokens)
        seed = wire_seed(payload.get("seed"), upstream.seed_key, secrets.randbits(64)) \
            if limits.seeded_sampling else None
        body = miner_body(payload, self.max_tokens, seed)
        # What the miner was asked for. Every miner gets the seed (so a seed marks no traffic, and a stock runtime
        # honours a client's seed with its own RNG), but only one that declared the subnet's sampler draws with it:
        # the others' sampled answers are free draws (no seed here), audited for plausibility and not paid.
        sampling = SamplingParams.of(body)
        self.sampling = sampling if lease.miner.declares_sampler else replace(sampling, seed=None)
        self.prompt_tokens = estimate_prompt_tokens(body.get("messages"))
        self.skipped = audit_skip(body, sampling.greedy, tools=limits.audit_tools) or (
            "model" if limits.audited_model not in (None, body.get("model")) else None)
        self._body = encode_body(body)
        keep = limits.keep_answers and self.skipped is None  # an answer no audit can check is not kept for one
        self.meter = StreamMeter(self.max_tokens, self.t0, max_line_bytes=limits.max_line_bytes,
                                 max_content_chars=limits.max_content_chars, keep_answer=keep,
                                 budget=upstream.answers if held or keep else None, must_hold=held)
        self._payload = payload
        self._resp: aiohttp.ClientResponse | None = None
        self._timer: asyncio.TimerHandle | None = None  # the one deadline timer of the streaming phase
        self._deadline_passed = False
        self._waiting = False  # a read from the miner is pending: only then may a deadline end the stream
        self._wait_from = self.t0  # when the consumer last came back for more (after a slow client, say)
        self.measurement: Measurement | None = None
        self._error: UpstreamError | None = None
        upstream.dispatched += 1

    # -- state -----------------------------------------------------------------------------------

    @property
    def tokens(self) -> int:
        return self.meter.tokens

    @property
    def ttft_s(self) -> float | None:
        return self.meter.ttft_s

    @property
    def finish_reason(self) -> str | None:
        return self.meter.finish_reason

    @property
    def usage(self) -> dict[str, int] | None:
        return self.meter.usage

    @property
    def content_started(self) -> bool:
        return self.meter.content_started

    @property
    def finished(self) -> bool:
        return self.measurement is not None

    @property
    def ok(self) -> bool:
        return self.measurement is not None and self.measurement.ok

    def _deadline(self) -> float:
        t = self._tmo
        if self.meter.content_started:
            # silence counts from the last event, or from when the validator came back to read, whichever is
            # later: time spent waiting on a slow client is never the miner's stall
            deadline = max(self.meter.last_event_at, self._wait_from) + t.stall
        else:
            deadline = self.t0 + t.first_token
        return min(deadline, self.t0 + t.total)

    def _finish(self, failure: FailureReason | None, *, status: int | None = None, detail: str = "") -> Measurement:
        """Record the one measurement of this dispatch and let the connection go (idempotent)."""
        if self.measurement is not None:
            return self.measurement
        meter = self.meter
        m = Measurement(
            uid=self.uid,
            hotkey=self.hotkey,
            in_flight=self.lease.in_flight_at_dispatch,
            prompt_tokens=self.prompt_tokens,
            max_tokens=self.max_tokens,
            ttft_s=meter.ttft_s,
            latency_s=max(0.0, self._loop.time() - self.t0),
            completion_tokens=meter.countable_tokens,
            ok=failure is None,
            failure=failure,
            probe=self.probe,
            concurrency=meter.decode_concurrency(),
            answer=self._answer() if failure is None and meter.keep_answer else None,
            finish_reason=meter.finish_reason if failure is None else None,
            slots=self.lease.slots_at_dispatch,
            capacity_check=self.capacity_check,
            free_draw=not self.sampling.greedy and self.sampling.seed is None,
            skipped=self.skipped,
        )
        self.measurement = m
        meter.release()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        resp, self._resp = self._resp, None
        if resp is not None:
            if failure is None:
                self._up.drain_then_release(resp)
            else:
                resp.close()  # frees the miner's slot now, not when the socket times out
        if failure is not None and failure != FailureReason.CLIENT_DISCONNECT:
            self._error = UpstreamError(failure, m, status=status, after_content=meter.content_started,
                                        detail=detail)
            logger.debug("uid {} {}{}", self.uid, failure, f" ({detail})" if detail else "")
        self._up.record(m)
        return m

    def _answer(self) -> Answer:
        meter, payload = self.meter, self._payload
        stop = payload.get("stop")
        return Answer(
            messages=prompt_messages(payload),  # the prompt the runtime conditioned on
            sampling=self.sampling,
            max_tokens=self.max_tokens,
            stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
            text="".join(meter.text),
            token_ids=tuple(meter.ids) if meter.ids_complete and meter.ids else None,
            finish_reason=meter.finish_reason,
            tool_calls=tuple((c[0], c[1]) for _, c in sorted(meter.calls.items())) if meter.calls else None,
        )

    def _fail(self, failure: FailureReason, *, status: int | None = None, detail: str = "") -> UpstreamError:
        self._finish(failure, status=status, detail=detail)
        assert self._error is not None
        return self._error

    # -- connect ---------------------------------------------------------------------------------

    async def connect(self) -> None:
        """Send the signed request and check the answer's head; raises :class:`UpstreamError`."""
        try:
            resp = await self._send()
            try:
                await self._check_head(resp)
            finally:
                if self._resp is not resp:  # refused (any status, a 200 with a head we refuse too) or cancelled:
                    resp.close()  # the miner's slot is freed now (a no-op for a refusal already released to the pool)
        except UpstreamError:
            raise
        except BaseException:
            # cancelled (client gone, shutdown) or an unexpected bug: still exactly one measurement
            self._finish(FailureReason.CLIENT_DISCONNECT)
            raise

    async def _send(self) -> aiohttp.ClientResponse:
        """POST (once more, re-signed, when a pooled connection turns out closed); the head within the deadline."""
        miner = self.lease.miner
        for attempt in (1, 2):
            headers = self._up.signer.sign(path=CHAT_PATH, body=self._body, receiver_ss58=miner.hotkey)
            headers["Content-Type"] = "application/json"
            headers["Accept"] = "text/event-stream"
            connect_s = max(0.0, min(self._tmo.connect, self._deadline() - self._loop.time()))
            try:
                async with asyncio.timeout_at(self._deadline()):
                    return await self._up.client.post(miner.endpoint, CHAT_PATH, self._body, headers,
                                                      connect_timeout=connect_s)
            except TimeoutError:
                raise self._fail(FailureReason.TIMEOUT, detail="no response headers before the first-token deadline")\
                    from None
            except aiohttp.ClientConnectorError as e:
                if e.os_error.errno in _LOCAL_ERRNOS:  # our own limits, not the miner's
                    raise self._fail(FailureReason.LOCAL_RESOURCES, detail=str(e.os_error)) from None
                raise self._fail(FailureReason.CONNECT, detail=type(e).__name__) from None
            except aiohttp.ClientResponseError as e:  # bytes that are not an HTTP response (or too large a head)
                raise self._fail(FailureReason.GARBAGE, detail=f"bad HTTP response: {e.message}") from None
            except _STALE as e:
                if attempt == 1:
                    continue  # a pooled connection the miner (or its runtime's keep-alive timer) had closed
                raise self._fail(FailureReason.CONNECT, detail=type(e).__name__) from None
            except (aiohttp.ClientError, OSError, ValueError) as e:
                if isinstance(e, OSError) and e.errno in _LOCAL_ERRNOS:
                    raise self._fail(FailureReason.LOCAL_RESOURCES, detail=str(e)) from None
                raise self._fail(FailureReason.CONNECT, detail=type(e).__name__) from None
        raise AssertionError("unreachable")

    async def _check_head(self, resp: aiohttp.ClientResponse) -> None:
        advertised = resp.headers.get(SLOTS_HEADER)
        if advertised is not None and self._up.on_slots is not None and advertised.isascii() and advertised.isdigit():
            self._up.on_slots(self.lease.miner, int(advertised))
        status = resp.status
        if status != 200:
            # read a refusal's small body so the connection can be reused (a refusal is often a 429)
            body = await settle(resp, self._deadline() - self._loop.time(), content_ok=True)
            if status == 429:
                raise self._fail(refusal(self.lease.in_flight_at_dispatch, self.lease.slots_at_dispatch), status=status)
            rejected = client_fault(status, body)
            if rejected is not None:  # the request's fault (too long for the model): not the miner's
                raise self._fail(FailureReason.CLIENT_REJECTED, status=status, detail=rejected)
            raise self._fail(FailureReason.HTTP_STATUS, status=status, detail=f"HTTP {status}")
        ctype = resp.headers.get("Content-Type", "").partition(";")[0].strip().lower()
        if ctype != "text/event-stream":
            raise self._fail(FailureReason.GARBAGE, status=200, detail=f"content type {ctype!r}")
        encoding = resp.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding != "identity":
            raise self._fail(FailureReason.GARBAGE, status=200, detail=f"content encoding {encoding!r}")
        self._up.learn_sampler(self.lease.miner, resp.headers.get(SAMPLER_HEADER))
        self._resp = resp


    # -- streaming -------------------------------------------------------------------------------

    async def next_batch(self) -> list[ChunkInfo]:
        """The chunks of the next network read (waiting for it); ``[]`` once the stream ended.

        Raises :class:`UpstreamError` when the stream failed (the measurement is already recorded).
        """
        self._wait_from = self._loop.time()
        while True:
            if self._error is not None:
                raise self._error
            if self.meter.pending is not None:
                e = self.meter.pending
                raise self._fail(e.reason, detail=e.detail)
            resp = self._resp
            if resp is None or self.meter.done:
                if self.measurement is None:
                    self._finish(None)
                return []
            if self._timer is None:
                self._timer = self._loop.call_at(self._deadline(), self._on_deadline)
            self._waiting = True
            try:
                data = await resp.content.readany()
            except (aiohttp.ClientError, OSError) as e:  # reset, or the bytes stopped being HTTP
                if self._deadline_passed:
                    raise self._timed_out() from None
                raise self._fail(FailureReason.DROPPED, detail=type(e).__name__) from None
            finally:
                self._waiting = False
            if self._deadline_passed:
                raise self._timed_out()
            try:
                if not data:
                    self.meter.end()
                    self._finish(None)
                    return []
                lease = self.lease
                batch = self.meter.feed(data, self._loop.time(), lease.miner.delivering + (not lease.delivering))
            except MeterFailure as e:
                raise self._fail(e.reason, detail=e.detail) from None
            if self.meter.content_started:
                lease.start_delivering()
            if self.meter.done:
                self._finish(None)
            if batch or self.meter.done:
                return batch

    def _on_deadline(self) -> None:
        """The deadline timer: re-armed when events moved the deadline, else it ends the pending read.

        One timer per stream instead of a timeout per read (17 a request here): events only move the
        deadline (a float), and the timer catches up when it fires, once per stall period at most. It
        ends a read by closing the miner's connection, which the read then reports.
        """
        self._timer = None
        if self.measurement is not None or self._resp is None or not self._waiting:
            return  # not reading now: the next read re-arms the timer from its own start
        deadline = self._deadline()
        if self._loop.time() < deadline:
            self._timer = self._loop.call_at(deadline, self._on_deadline)
            return
        self._deadline_passed = True
        self._resp.close()

    def _timed_out(self) -> UpstreamError:
        return self._fail(FailureReason.TIMEOUT, detail="stalled" if self.content_started else "no first token")

    # -- closing ---------------------------------------------------------------------------------

    def close(self, reason: FailureReason = FailureReason.CLIENT_DISCONNECT) -> None:
        """Stop now (no-op when already finished): the miner connection is closed, its slot freed."""
        if not self.finished:
            self._finish(reason)

    async def __aenter__(self) -> UpstreamStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.close(FailureReason.CLIENT_DISCONNECT)
