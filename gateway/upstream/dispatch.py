"""What every dispatch shares: the pooled client, the signer, the measurement sink, the per-miner status figures."""

from __future__ import annotations

import asyncio
import secrets
import statistics
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from loguru import logger

from gateway.protocol.measurement import FailureReason, Measurement, MeasurementSink

from ..buckets import DECODE_BOUNDS_TOK_S, TTFT_BOUNDS_S, Buckets
from ..http.client import MinerClient
from ..metering import AnswerBudget
from ..protocol.miner_request import MinerRequest
from ..protocol.openai import SUBNET_SAMPLER
from ..protocol.signing import RequestSigner
from ..router import Lease, MinerState
from .config import UpstreamLimits, UpstreamTimeouts
from .connect import settle
from .refusals import CancelExcuses, UpstreamError
from .stream import UpstreamStream

# What a miner that is down looks like from here (its other failures are answers: wrong, but answers).
NOT_ANSWERING = frozenset({FailureReason.CONNECT, FailureReason.TIMEOUT, FailureReason.HTTP_STATUS,
                           FailureReason.DROPPED})


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
    # Its last dispatch found it not answering at all (refused connection, timeout, 5xx, broken stream): /ready
    # counts the routable miners that are answering, not merely listed (neurons.validator.readiness).
    silent: bool = False

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
        self.excuses = CancelExcuses(self.limits.drain_grace_s)  # 429s just after we cancelled are the miner draining
        self._draining: set[asyncio.Task[bytes]] = set()

    async def open(self, lease: Lease, request: MinerRequest | dict[str, Any], *, probe: bool = False,
                   timeouts: UpstreamTimeouts | None = None, capacity_check: bool = False,
                   held: bool = False) -> UpstreamStream:
        """Sign and POST ``request`` (made the miner body: streamed, with usage) to the lease's miner; a dict (a
        probe's body, a tool's) is read into a :class:`MinerRequest` here, once.

        Returns once the miner answered 200 with an event stream. Raises :class:`UpstreamError`
        (measurement recorded) for busy, connect errors, non-200, timeouts before headers. ``held``: the
        caller holds the whole answer (non-streamed), so its text counts against :attr:`answers`.
        """
        if not isinstance(request, MinerRequest):
            request = MinerRequest.of(request, self.limits.default_max_tokens)
        stream = UpstreamStream(self, lease, request, probe=probe, timeouts=timeouts or self.timeouts,
                                capacity_check=capacity_check, held=held)
        await stream.connect()
        return stream

    async def probe(self, lease: Lease, payload: MinerRequest | dict[str, Any], *,
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

    def answering(self, miners: Iterable[MinerState]) -> int:
        """How many of ``miners`` (not quarantined) are answering: untried, or their last dispatch got an answer."""
        return sum(1 for m in miners if not m.quarantined and not (m.uid in self.stats and self.stats[m.uid].silent))

    def record(self, m: Measurement) -> None:
        st = self.stats.get(m.uid)
        if st is None:
            st = self.stats[m.uid] = MinerStats()
        st.requests += 1
        if m.ok:
            st.ok += 1
            st.silent = False
        elif m.failure is not None:
            st.failures[m.failure] += 1
            if m.failure in NOT_ANSWERING:
                st.silent = True
            elif m.failure.blames_miner or m.failure == FailureReason.BUSY:  # it answered (wrongly, or busy)
                st.silent = False
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
