"""What the validator measured about one request, and the one narrow hand-off from the gateway to scoring.

Data flows one way: the gateway's upstream code produces a :class:`Measurement` per dispatched
request (organic or probe, success or failure) and calls ``sink.record(m)``. Scoring consumes them.
Everything here is measured on the validator's own clock; nothing the miner claims is trusted.

Example::

    q = MeasurementQueue(maxsize=10_000)
    q.record(Measurement(uid=1, hotkey="5F...", in_flight=0, prompt_tokens=12, max_tokens=64,
                         ttft_s=0.46, latency_s=0.61, completion_tokens=64, ok=True))
    batch = q.drain()
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from loguru import logger

from gateway.protocol.sampling import SamplingParams
from gateway.protocol.structure import Structure


class FailureReason(StrEnum):
    """Why a dispatch did not produce a complete answer; all but five are the miner's failure.

    A ``StrEnum`` so the value is the stable string persisted in SQLite and shown in round tables and
    ``/v1/status``, while code compares members, never loose strings.
    """

    BUSY = "busy"  # miner answered 429 with this validator's streams filling its declared slots: the truth
    REFUSED = "refused"  # miner answered 429 while this validator used fewer streams than it declares slots
    CONNECT = "connect"  # could not connect / connection refused
    HTTP_STATUS = "http_status"  # non-200 answer other than 429
    TIMEOUT = "timeout"  # no first token, or stalled, within the deadline
    DROPPED = "dropped"  # stream ended before [DONE] / finish
    GARBAGE = "garbage"  # invalid JSON, invalid UTF-8, wrong shape, oversized chunk, NaN
    OVERLONG = "overlong"  # more tokens than max_tokens
    EMPTY = "empty"  # finished without any content
    CLIENT_DISCONNECT = "client_disconnect"  # not the miner's fault: recorded for accounting, excluded from credit
    LOCAL_RESOURCES = "local_resources"  # the validator ran out of file descriptors or memory: not the miner's fault
    CLIENT_REJECTED = "client_rejected"  # the miner's runtime refused the request as the client's fault (400)
    AUDIT_FAILED = "audit_failed"  # complete, but the reference says the tokens are not the model's answer
    SHUTDOWN = "shutdown"  # the validator stopped (SIGTERM) while the stream outlived the drain: not the miner's fault

    @property
    def blames_miner(self) -> bool:
        """Whether this outcome costs the miner credit (a truthful 429 and a client leaving do not)."""
        return self not in (FailureReason.BUSY, FailureReason.CLIENT_DISCONNECT, FailureReason.CLIENT_REJECTED,
                            FailureReason.LOCAL_RESOURCES, FailureReason.SHUTDOWN)


@dataclass(frozen=True, slots=True)
class Answer:
    """What a miner returned for one complete request, kept so an audit can replay it on the reference.

    ``text`` is exactly what the client received; ``token_ids`` the ids the miner said it produced
    (None when any content chunk came without them). ``stop`` is the client's own stop strings.
    """

    messages: list[dict[str, Any]]
    sampling: SamplingParams
    max_tokens: int
    stop: tuple[str, ...]
    text: str
    token_ids: tuple[int, ...] | None
    finish_reason: str | None
    # the tool calls the client received, (name, arguments), in order: ``token_ids`` must spell them in the subnet's
    # tool format (gateway.protocol.tools); ``messages`` are then already the tool-rendered turns
    tool_calls: tuple[tuple[str, str], ...] | None = None
    # the shape the request bound the answer to (JSON, a schema's instance, a forced tool call): the miner decoded
    # under its grammar, the audit forces the ids under the same one (gateway.protocol.structure)
    structure: Structure | None = None
    # the request asked for logprobs: the raw log-probability the miner reported for each id, in order (fewer than
    # the ids when some chunks named none); the audit recomputes them. None: not asked
    logprobs: tuple[float, ...] | None = None

    @property
    def temperature(self) -> float:
        return self.sampling.temperature

    @property
    def penalised(self) -> bool:
        return self.sampling.penalised


@dataclass(frozen=True, slots=True)
class Measurement:
    """One dispatched request as the validator saw it.

    ``in_flight`` is the number of this validator's requests already in flight to that miner when
    this one was dispatched (so the request ran at concurrency ``in_flight + 1``).
    ``prompt_tokens`` is the validator's own estimate, never the miner's usage report.
    ``concurrency`` is the time-weighted mean of this validator's streams on that miner that were
    delivering tokens while this one decoded (itself included): requests that join or leave mid-stream
    change the rate an honest card can give, so the dispatch-time count alone would misjudge honest
    cards, and a stream left hanging before its first byte does not count as load.
    Rates are judged on the validator's clock (:func:`scoring.credit.on_time_rate`), never from the
    miner's first token.
    """

    uid: int
    hotkey: str
    in_flight: int
    prompt_tokens: int
    max_tokens: int
    ttft_s: float | None
    latency_s: float
    completion_tokens: int
    ok: bool
    failure: FailureReason | None = None
    probe: bool = False
    concurrency: float | None = None
    at: float = field(default_factory=time.time)
    answer: Answer | None = field(default=None, repr=False, compare=False)  # complete answers only
    audited: bool = False  # teacher-forced on the reference (passed, or failed with AUDIT_FAILED)
    finish_reason: str | None = None  # the miner's, for complete answers: "stop" before max_tokens is an early stop
    slots: int = 1  # streams the miner declared it serves this validator at once, as known at dispatch
    capacity_check: bool = False  # a probe of the round's capacity check: every miner's slots filled at once
    # A capacity-check stream's tokens as they came: (seconds after dispatch, tokens so far) at each read that
    # brought some. What was delivered by a common deadline is read from it (scoring.rounds.delivered_rate).
    arrivals: tuple[tuple[float, int], ...] | None = field(default=None, repr=False)
    free_draw: bool = False  # sampled, by a miner that declared no subnet sampler: plausibility only, not paid
    # the rule by which no audit can check it (gateway.protocol.auditable.audit_skip): not paid
    skipped: str | None = None
    ref: str | None = field(default=None, repr=False, compare=False)  # its entry on the shared stream, to acknowledge

    @property
    def stopped_early(self) -> bool:
        """Complete, shorter than asked, and not cut by ``max_tokens``: only the model may choose that."""
        return self.ok and self.finish_reason != "length" and self.completion_tokens < self.max_tokens

    @property
    def decode_concurrency(self) -> float:
        """Streams sharing the card while this one decoded (dispatch-time count when not measured)."""
        return self.concurrency if self.concurrency is not None else float(self.in_flight + 1)


class MeasurementSink(Protocol):
    """Anything that accepts measurements. Must never block or raise into the serving path."""

    def record(self, m: Measurement) -> None: ...


class MeasurementQueue:
    """A bounded in-memory hand-off. Overflow drops the oldest and is counted and logged, never silent."""

    def __init__(self, maxsize: int = 100_000) -> None:
        self._items: deque[Measurement] = deque()
        self._maxsize = maxsize
        self.recorded = 0
        self.overflowed = 0

    def record(self, m: Measurement) -> None:
        if len(self._items) >= self._maxsize:
            self._items.popleft()
            self.overflowed += 1
            if self.overflowed == 1 or self.overflowed % 1000 == 0:
                logger.warning("measurement queue full ({}): {} dropped so far", self._maxsize, self.overflowed)
        self._items.append(m)
        self.recorded += 1

    def drain(self) -> list[Measurement]:
        items = list(self._items)
        self._items.clear()
        return items

    def __len__(self) -> int:
        return len(self._items)
