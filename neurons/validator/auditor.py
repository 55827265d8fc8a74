"""Audits off the hot path: a bounded queue of sampled answers, one reference job at a time.

The validator hands every drained measurement to :meth:`Auditor.take`. An answer picked by the hidden
sample (:func:`scoring.audit.should_audit`) is held back from the scorer until its verdict is in, so
a failed audit pays nothing for that request; the others go straight to the scorer. The queue is
bounded: when the reference falls behind, a sampled answer is paid as measured and the drop is
counted (and logged), never silently lost. A reference that errs or cannot replay an answer (too
long for its context) is the validator's problem: the answer is paid as measured, the miner is
never blamed.

Until one of a hotkey's organic answers has passed an audit in the round, its organic answers are
sampled at :data:`EAGER_RATE` instead of ``rate``: that pass is what releases the hotkey's unaudited pay
(:class:`scoring.pay.PayWindow`), so an honest miner is confirmed every round it serves users, and one
that serves users junk meets an audit among its first answers. The validator calls :meth:`new_round`
at each round's close. Nothing of it shows on the wire.

Verdicts feed the :class:`~scoring.audit.StrikeBook`; each outcome is kept for the store
(:attr:`Auditor.outcomes`, drained with the round) and counted for ``/v1/status``.

Example::

    auditor = Auditor(reference, AuditBands(), StrikeBook(), rate=0.1, rng=random.Random())
    task = asyncio.create_task(auditor.run())
    for m in queue.drain():
        if not auditor.take(m):
            scorer.record(m)
    for m in auditor.ready():          # audited measurements, paid as their verdict says
        scorer.record(m)
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter, deque

from loguru import logger

from gateway.protocol.measurement import Measurement
from scoring.audit import AuditBands, StrikeBook, Verdict, apply_verdict, should_audit
from scoring.store import StoredAudit

from ..reference.base import Reference

EAGER_RATE = 0.5  # organic answers of a hotkey not yet confirmed this round: audited at this rate


class Auditor:
    """Samples answers, replays them on the reference, books verdicts and strikes."""

    def __init__(self, reference: Reference, bands: AuditBands, book: StrikeBook, *, rate: float,
                 max_queue: int = 256, rng: random.Random | None = None) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"audit rate must be within [0, 1], got {rate}")
        self.reference = reference
        self.bands = bands
        self.book = book
        self.rate = rate
        self._rng = rng if rng is not None else random.SystemRandom()
        self._queue: asyncio.Queue[Measurement] = asyncio.Queue(maxsize=max(1, max_queue))
        self._ready: list[Measurement] = []
        self.outcomes: deque[StoredAudit] = deque(maxlen=10_000)  # drained by the validator into the store
        self.last_failure: dict[str, str] = {}  # each hotkey's latest failed audit's reason (the local run's summary)
        self.counts: Counter[str] = Counter()  # sampled, passed, failed, dropped, unauditable, errors
        self.reference_errors = 0  # reference failures in a row (a verdict resets it)
        self.reference_error = ""  # the last one, for /ready
        self.quarantine_changed = False
        self._confirmed: set[str] = set()  # hotkeys with an organic answer that passed its audit this round

    def take(self, m: Measurement) -> bool:
        """Hold ``m`` for an audit (True) or leave it to the caller to record as measured (False)."""
        rate = self.rate if m.hotkey in self._confirmed else max(self.rate, EAGER_RATE)
        if not should_audit(m, rate=rate, quarantined=self.book.is_quarantined(m.hotkey), draw=self._rng.random()):
            return False
        try:
            self._queue.put_nowait(m)
        except asyncio.QueueFull:
            self.counts["dropped"] += 1
            if self.counts["dropped"] == 1 or self.counts["dropped"] % 100 == 0:
                logger.warning("audit queue full ({}): {} sampled answers paid unaudited so far",
                               self._queue.maxsize, self.counts["dropped"])
            return False
        self.counts["sampled"] += 1
        return True

    def new_round(self) -> None:
        """A round closed: every hotkey's organic answers are sampled eagerly again until one passes."""
        self._confirmed.clear()

    def ready(self) -> list[Measurement]:
        """Audited measurements since the last call, as their verdicts pay them."""
        out, self._ready = self._ready, []
        return out

    def abandon(self) -> list[Measurement]:
        """Empty the queue without auditing (at stop): the caller pays these as measured."""
        out: list[Measurement] = []
        while not self._queue.empty():
            out.append(self._queue.get_nowait())
            self._queue.task_done()
        self.counts["abandoned"] += len(out)
        return out

    @property
    def backlog(self) -> int:
        return self._queue.qsize()

    async def run(self) -> None:
        """Audit forever (a supervised task)."""
        while True:
            m = await self._queue.get()
            try:
                await self._audit_one(m)
            finally:
                self._queue.task_done()

    async def _audit_one(self, m: Measurement) -> None:
        assert m.answer is not None
        try:
            verdict = await self.reference.audit(m.answer, self.bands)
        except asyncio.CancelledError:
            self._ready.append(m)
            raise
        except Exception as e:  # the reference's fault, never the miner's
            self.counts["errors"] += 1
            self.reference_errors += 1  # in a row: /ready says so past a few
            self.reference_error = f"{type(e).__name__}: {e}"[:200]
            logger.opt(exception=e).warning("reference failed on an answer of uid {}: paid unaudited", m.uid)
            self._ready.append(m)
            return
        self.reference_errors = 0
        if verdict is None:
            self.counts["unauditable"] += 1
            self._ready.append(m)
            return
        self._book(m, verdict)

    def _book(self, m: Measurement, verdict: Verdict) -> None:
        now = time.time()
        self.counts["passed" if verdict.passed else "failed"] += 1
        if verdict.passed and not m.probe:
            self._confirmed.add(m.hotkey)
        if not verdict.passed:
            logger.info("audit failed: uid {} {} ({}): {}", m.uid, m.hotkey[:10], verdict.failure, verdict.detail)
            self.last_failure[m.hotkey] = str(verdict.failure)
        alarms = self.book.records[m.hotkey].alarms if m.hotkey in self.book.records else 0
        if self.book.record(m.hotkey, passed=verdict.passed, at=now, positions=verdict.positions,
                            misses=verdict.misses):
            self.quarantine_changed = True
            r = self.book.records[m.hotkey]
            state = "quarantined" if r.quarantined_at is not None else "released from quarantine"
            why = "the sequential test over its audited tokens alarmed" if r.alarms > alarms else \
                f"{r.strikes} strikes in its last {self.book.policy.window} audits"
            logger.warning("uid {} {} {} ({}; {} positions audited)", m.uid, m.hotkey[:10], state, why, r.positions)
        self.outcomes.append(StoredAudit(now, m.hotkey, m.uid, m.probe, verdict.passed,
                                         None if verdict.failure is None else str(verdict.failure),
                                         verdict.detail, verdict.tokens))
        self._ready.append(apply_verdict(m, verdict))
