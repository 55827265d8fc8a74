"""One dispatch to one miner: connect, read and meter its stream under one deadline, end as one measurement.

The jobs are each their own module: signing and the POST with its one retry (:mod:`.connect`), the head's checks
(:mod:`.connect`), the deadline (:mod:`.deadline`), the metering (:mod:`gateway.metering`), the measurement
(:mod:`.record`). :class:`UpstreamStream` runs them in order and holds what they share: the lease, the body, the
response, and the rule that a dispatch is recorded exactly once, whatever happens.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import replace
from types import TracebackType
from typing import TYPE_CHECKING

import aiohttp
from loguru import logger

from gateway.protocol.auditable import audit_skip
from gateway.protocol.measurement import FailureReason, Measurement

from ..metering import MeterFailure, StreamMeter
from ..protocol.miner_request import MinerRequest
from ..protocol.openai import GRAMMAR, SAMPLER_HEADER, SLOTS_HEADER, encode_body, miner_body
from ..protocol.sampling import wire_seed
from ..protocol.sse import ChunkInfo
from ..router import Lease
from .config import UpstreamTimeouts
from .connect import ConnectFailed, check_head, post_signed
from .deadline import StreamDeadline
from .record import measurement_of
from .refusals import UpstreamError, may_not_fit

if TYPE_CHECKING:
    from .dispatch import Upstream


class UpstreamStream:
    """One dispatch, recorded exactly once when it ends.

    Use it as ``async with``: leaving the block before the stream finished (client gone, task
    cancelled) closes the miner connection at once and records ``client_disconnect``.
    """

    def __init__(self, upstream: Upstream, lease: Lease, request: MinerRequest, *, probe: bool,
                 timeouts: UpstreamTimeouts, capacity_check: bool = False, held: bool = False) -> None:
        self._up = upstream
        self._loop = asyncio.get_running_loop()
        self.t0 = self._loop.time()  # the TTFT clock starts at dispatch, before anything else
        self.lease = lease
        self.uid = lease.miner.uid
        self.hotkey = lease.miner.hotkey
        self.probe = probe
        self.capacity_check = capacity_check
        self.request = request
        self._tmo = timeouts
        limits = upstream.limits
        self.max_tokens = request.max_tokens
        seed = wire_seed(request.client_seed, upstream.seed_key, secrets.randbits(64)) \
            if limits.seeded_sampling else None
        # What the miner was asked for. Every miner gets the seed (so a seed marks no traffic, and a stock runtime
        # honours a client's seed with its own RNG), but only one that declared the subnet's sampler draws with it:
        # the others' sampled answers are free draws (no seed here), audited for plausibility and not paid.
        sampling = request.sampling if seed is None else replace(request.sampling, seed=seed)
        self.sampling = sampling if lease.miner.declares_sampler else replace(sampling, seed=None)
        self.prompt_tokens = request.prompt_tokens
        self.skipped = audit_skip(request.fields, sampling.greedy, tools=limits.audit_tools,
                                  grammars=limits.audit_grammars and GRAMMAR in lease.miner.features,
                                  model=limits.audited_model)
        self._body = encode_body(miner_body(request.fields, self.max_tokens, seed))
        keep = limits.keep_answers and self.skipped is None  # an answer no audit can check is not kept for one
        self.meter = StreamMeter(self.max_tokens, self.t0, max_line_bytes=limits.max_line_bytes,
                                 max_content_chars=limits.max_content_chars, keep_answer=keep,
                                 budget=upstream.answers if held or keep else None, must_hold=held,
                                 timeline=capacity_check)
        self._resp: aiohttp.ClientResponse | None = None
        self._deadline = StreamDeadline(self._loop, self.t0, timeouts, self.meter, expire=self._cut)
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

    def _finish(self, failure: FailureReason | None, *, status: int | None = None, detail: str = "") -> Measurement:
        """Record the one measurement of this dispatch and let the connection go (idempotent)."""
        if self.measurement is not None:
            return self.measurement
        m = self.measurement = measurement_of(self, failure, self._loop.time() - self.t0)
        self.meter.release()
        self._deadline.close()
        resp, self._resp = self._resp, None
        if resp is not None:
            if failure is None:
                self._up.drain_then_release(resp)
            else:
                resp.close()  # frees the miner's slot now, not when the socket times out
        if failure == FailureReason.CLIENT_DISCONNECT:
            self._up.excuses.cancelled(self.uid, self._loop.time())
        if failure is not None and failure != FailureReason.CLIENT_DISCONNECT:
            self._error = UpstreamError(failure, m, status=status, after_content=self.meter.content_started,
                                        detail=detail)
            logger.debug("uid {} {}{}", self.uid, failure, f" ({detail})" if detail else "")
        self._up.record(m)
        return m

    def _fail(self, failure: FailureReason, *, status: int | None = None, detail: str = "") -> UpstreamError:
        self._finish(failure, status=status, detail=detail)
        assert self._error is not None
        return self._error

    def _cut(self) -> None:
        """The deadline passed while reading: closing the connection ends the pending read."""
        if self._resp is not None:
            self._resp.close()

    # -- connect ---------------------------------------------------------------------------------

    async def connect(self) -> None:
        """Send the signed request and check the answer's head; raises :class:`UpstreamError`."""
        resp: aiohttp.ClientResponse | None = None
        try:
            try:
                resp = await post_signed(self._up.client, self._up.signer, self.lease.miner, self._body,
                                         deadline_at=self._deadline.at(), connect_s=self._tmo.connect)
                self._learn_slots(resp)
                await check_head(resp, within_s=self._deadline.at() - self._loop.time(),
                                 in_flight=self.lease.in_flight_at_dispatch, slots=self.lease.slots_at_dispatch,
                                 may_not_fit=may_not_fit(self.prompt_tokens, self.max_tokens,
                                                         self._up.limits.model_context))
            except ConnectFailed as e:
                if e.reason == FailureReason.REFUSED and self._up.excuses.excuse(self.uid, self._loop.time()):
                    raise self._fail(FailureReason.BUSY, status=e.status, detail="429 while draining a stream we "
                                     "cancelled") from None
                raise self._fail(e.reason, status=e.status, detail=e.detail) from None
            self._up.learn_sampler(self.lease.miner, resp.headers.get(SAMPLER_HEADER))
            self._resp = resp
        except UpstreamError:
            raise
        except BaseException:
            # cancelled (client gone, shutdown) or an unexpected bug: still exactly one measurement
            self._finish(FailureReason.CLIENT_DISCONNECT)
            raise
        finally:
            if resp is not None and self._resp is not resp:  # refused (any status, or a 200 with a head we refuse)
                resp.close()  # or cancelled: the slot is freed now (a no-op for a refusal already released to the pool)

    def _learn_slots(self, resp: aiohttp.ClientResponse) -> None:
        """The miner's ``X-Miner-Slots``, on any answer (a 429 too), for least-in-flight's in_flight / slots."""
        advertised = resp.headers.get(SLOTS_HEADER)
        if advertised is not None and self._up.on_slots is not None and advertised.isascii() and advertised.isdigit():
            self._up.on_slots(self.lease.miner, int(advertised))

    # -- streaming -------------------------------------------------------------------------------

    async def next_batch(self) -> list[ChunkInfo]:
        """The chunks of the next network read (waiting for it); ``[]`` once the stream ended.

        Raises :class:`UpstreamError` when the stream failed (the measurement is already recorded).
        """
        deadline = self._deadline
        deadline.wait_from = self._loop.time()
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
            deadline.arm()
            deadline.waiting = True
            try:
                data = await resp.content.readany()
            except (aiohttp.ClientError, OSError) as e:  # reset, or the bytes stopped being HTTP
                if deadline.passed:
                    raise self._timed_out() from None
                raise self._fail(FailureReason.DROPPED, detail=type(e).__name__) from None
            finally:
                deadline.waiting = False
            if deadline.passed:
                raise self._timed_out()
            try:
                if not data:
                    self.meter.end()
                    self._finish(None)
                    return []
                lease, m = self.lease, self.lease.miner  # every process's delivering streams, this one counted once
                sharing = m.delivering + m.elsewhere_delivering + (not lease.delivering)
                batch = self.meter.feed(data, self._loop.time(), sharing)
            except MeterFailure as e:
                raise self._fail(e.reason, detail=e.detail) from None
            if self.meter.content_started:
                lease.start_delivering()
            if self.meter.done:
                self._finish(None)
            if batch or self.meter.done:
                return batch

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
