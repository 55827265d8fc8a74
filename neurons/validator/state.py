"""The validator's state file, and every measurement counted exactly once across a kill -9 (issue 39).

One job: what the validator must not lose. The state database (:class:`scoring.store.ScoreStore`) is written on a
thread of its own, one call at a time: a ``synchronous=FULL`` commit must never stall the event loop that relays
streams. Measurements reach scoring through :meth:`StateKeeper.intake`, and the refs of those a round holds are
acknowledged (Redis) or leave the journal (no Redis) in the transaction that saves that round, so a kill at any
point loses none and counts none twice.

Example::

    state = StateKeeper(cfg.state_dir, parts.measurements, reader=None)
    await state.open(scorer, gateway.quota, auditor)      # restores scoring, usage and strikes
    for m in await state.intake():
        scorer.record(m); state.hold(m)
    await state.save_round(report)                        # the round, its refs out of the journal
    await state.close()
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from loguru import logger

from gateway.protocol.measurement import Measurement, MeasurementQueue
from gateway.quota import QuotaBook, utc_day
from gateway.shared.measurements import MeasurementReader, decode, encode
from scoring.audit import StrikeBook
from scoring.scorer import RoundReport, Scorer
from scoring.store import CorruptStateError, ScoreStore

if TYPE_CHECKING:
    from .auditor import Auditor

_T = TypeVar("_T")


class StateKeeper:
    """Owns the state database, its thread, and the intake's journal and acknowledgements."""

    def __init__(self, state_dir: Path, queue: MeasurementQueue, reader: MeasurementReader | None) -> None:
        self.state_dir = state_dir
        self.queue = queue  # this process's measurements (no Redis)
        # Gateways sharing Redis (--redis.url): every process's measurements come from the shared stream, and each
        # is acknowledged once the round holding it is saved. None: this process's queue alone.
        self.reader = reader
        self.store: ScoreStore | None = None  # opened by open()
        self._thread: ThreadPoolExecutor | None = None
        self._unacked: list[str] = []  # refs (stream entries, or intake journal ids) in the round in progress
        self._saved_unacked: list[str] = []  # refs of rounds whose save or acknowledgement failed: sent again
        self._counted: set[str] = set()  # entries saved rounds hold, maybe unacknowledged: read again, never recounted
        self._restored: list[Measurement] = []  # journaled before a restart, no saved round holds them

    async def io(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run a blocking state call on the store's single thread (calls stay serialised)."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="state")
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def open(self, scorer: Scorer, quota: QuotaBook, auditor: Auditor | None) -> None:
        """Open the state database and restore scoring, today's key usage and the strike book (idempotent)."""
        if self.store is not None:
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.state_dir / "validator.sqlite"
        if await asyncio.to_thread(path.is_dir):  # the store would open a new file inside it: history lost
            raise CorruptStateError(path, "a directory is where the state file should be")
        self.store = store = await self.io(ScoreStore, path)
        await self.io(scorer.restore, store)
        self._counted = await self.io(store.counted_refs)
        self._restored = [dataclasses.replace(decode(raw), ref=str(i)) for i, raw in await self.io(store.taken_in)]
        if self._restored:
            logger.info("{} measurements taken in before the restart, in no saved round: scored now",
                        len(self._restored))
        for row in await self.io(store.load_key_usage, utc_day(time.time())):
            quota.restore(*row)  # today's API key usage survives a restart: no fresh day by restarting
        if auditor is not None:
            saved = await self.io(store.load_strikes)
            try:
                book = StrikeBook.from_json(auditor.book.policy, saved)
            except ValueError as e:
                raise CorruptStateError(store.path, f"the strike book is unreadable ({e})") from e
            auditor.book = book
            if book.quarantined():
                logger.info("{} miners still quarantined from earlier audits", len(book.quarantined()))

    async def last_weights_block(self) -> int | None:
        return None if self.store is None else await self.io(self.store.last_weights_block)

    async def save_usage(self, row: tuple[str, str, int, int]) -> None:
        """A key's claim on its day, written before its request is served (the gateway's ``save_usage``)."""
        if self.store is not None:
            await self.io(self.store.save_key_usage, [row])

    def hold(self, m: Measurement) -> None:
        """``m`` is in the round in progress: its ref is acknowledged once that round is saved."""
        if m.ref is not None:
            self._unacked.append(m.ref)

    async def intake(self) -> list[Measurement]:
        """New measurements, each to be counted exactly once across kill -9.

        With Redis, an entry a saved round already holds (read again because the kill came between the save and
        the acknowledgement, or Redis was down then) is not counted again, only acknowledged. Without Redis, each
        measurement is journaled in the state file (its ``ref`` the journal id) until a saved round holds it, so a
        kill before the save loses none.
        """
        if self.reader is not None:
            fresh = []
            for m in await self.reader.pull():
                if m.ref in self._counted:
                    self._saved_unacked.append(m.ref)  # acknowledged with the next saved round's entries
                else:
                    fresh.append(m)
            return fresh
        restored, self._restored = self._restored, []
        taken = self.queue.drain()
        if self.store is None or not taken:
            return [*restored, *taken]
        try:
            ids = await self.io(self.store.take_in, [encode(m) for m in taken])
        except Exception as e:  # scored all the same; only a kill before the round's save would lose them
            logger.error("scoring state: could not journal {} measurements in {}: {}", len(taken), self.store.path, e)
            return [*restored, *taken]
        return [*restored, *(dataclasses.replace(m, ref=str(i)) for m, i in zip(taken, ids, strict=True))]

    async def save_round(self, report: RoundReport) -> None:
        """Persist a closed round with what it holds (out of the journal, or listed as counted, in the round's own
        transaction), then acknowledge its refs; a failed save keeps scoring in memory and the next round saves
        them."""
        refs, self._unacked = self._unacked, []
        saved = True
        if self.store is not None and report.saved is not None:
            held = [*self._saved_unacked, *refs]
            shared = self.reader is not None
            try:
                await self.io(functools.partial(self.store.save_round, *report.saved,
                                                intake=[] if shared else [int(r) for r in held],
                                                counted=held if shared else []))
            except Exception as e:
                saved = False
                logger.error("scoring state: could not save round {} to {}: {}", report.index, self.store.path, e)
        await self._acknowledge(refs, saved)

    async def _acknowledge(self, refs: list[str], saved: bool) -> None:
        """The round holding ``refs`` is saved (or not): acknowledge them, with earlier ones still owed (without
        Redis, the journal rows left with the save: nothing to acknowledge)."""
        if not saved:
            self._saved_unacked.extend(refs)  # the next round's save writes the state holding them
            return
        owed, self._saved_unacked = [*self._saved_unacked, *refs], []
        if self.reader is None:
            return
        self._counted.update(owed)
        if not await self.reader.ack(owed):
            self._saved_unacked = owed
            return
        self._counted.difference_update(owed)
        if self.store is not None:
            try:
                await self.io(self.store.forget_counted, owed)
            except Exception as e:  # listed a while longer: harmless, Redis will not deliver them again
                logger.warning("scoring state: could not forget {} acknowledged entries: {}", len(owed), e)

    async def save_key_usage(self, quota: QuotaBook) -> None:
        """Today's usage per API key (for the limits to survive a restart, and for the operator)."""
        rows = quota.snapshot() if self.store is not None else []
        if self.store is None or not rows:
            return
        try:
            await self.io(self.store.save_key_usage, rows)
        except Exception as e:  # the next round saves the totals again
            logger.error("scoring state: could not save API key usage to {}: {}", self.store.path, e)

    async def save_audits(self, auditor: Auditor | None) -> None:
        """Append the round's audit outcomes and the strike book to the state database."""
        if auditor is None or self.store is None:
            return
        pending = auditor.outcomes
        outcomes = list(pending)
        try:
            await self.io(self.store.save_audits, outcomes, auditor.book.to_json())
        except Exception as e:  # kept in memory (bounded) for the next round's save
            logger.error("scoring state: could not save {} audit outcomes to {}: {}", len(outcomes),
                         self.store.path, e)
            return
        for _ in range(min(len(outcomes), len(pending))):
            pending.popleft()  # saved; outcomes that arrived during the save stay for the next round

    async def record_weights(self, block: int, weights: dict[int, float]) -> None:
        if self.store is not None:
            await self.io(self.store.record_weights, block, weights)

    async def close(self) -> None:
        if self.store is not None:
            await self.io(self.store.close)
            self.store = None
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
