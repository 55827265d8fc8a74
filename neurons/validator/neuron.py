"""The validator neuron: metagraph sync, gateway, probes, scoring rounds and periodic weights.

One asyncio process. Data flows one way: chain -> metagraph -> router -> upstream -> measurement ->
scoring -> weights. Each loop is a supervised task (``neurons.supervise``): an exception is logged
with context and the loop restarted, never silently lost.

The parts come wired from :func:`neurons.validator.build.build_parts`; the constructor does no I/O.
:meth:`Validator.start` opens the state (SQLite, on a thread of its own: a ``synchronous=FULL``
commit must never stall the event loop that relays streams), reads the chain and binds the gateway.
Measurements reach the scorer through a bounded queue drained a few times a second, not from inside
the socket read callback that produced them. History kept in memory is bounded (``RECENT``); the
complete record is the state database.

Run against a real subnet::

    python -m neurons.validator --netuid 7 --network test --wallet.name vali --wallet.hotkey default

or the embedded local subnet (no chain, no GPU)::

    python -m neurons.validator --local
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import random
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from loguru import logger

from gateway.offers import refresh_offers
from gateway.protocol.measurement import Measurement
from gateway.quota import utc_day
from gateway.router import Candidate
from gateway.shared.measurements import MeasurementReader, decode, encode
from gateway.shared.routing import publish, view
from scoring.audit import StrikeBook
from scoring.store import CorruptStateError, ScoreStore
from scoring.weights import why_empty

from ..chain.base import Chain, NeuronInfo
from ..reference.bands import describe
from ..supervise import every, supervise
from .config import ValidatorConfig
from .corpus import stdlib_passages
from .metrics import validator_families
from .readiness import not_ready
from .workers import WorkerPool

if TYPE_CHECKING:
    from .build import ValidatorParts

RECENT = 64  # closed rounds and weight submissions kept in memory (for the live table and tests)
DRAIN_EVERY_S = 0.25  # how often measurements move from the queue into the scorer
ROUTING_EVERY_S = 1.0  # how often the router's view is compared with the one published to the other gateways
_T = TypeVar("_T")


def candidates(neurons: list[NeuronInfo], self_hotkey: str, min_validator_stake: float) -> list[Candidate]:
    """Routable miners: neurons serving an endpoint, minus this validator, minus validators."""
    out = []
    for n in neurons:
        if not n.endpoint or n.hotkey == self_hotkey or n.acts_as_validator(min_validator_stake):
            continue
        out.append(Candidate(uid=n.uid, hotkey=n.hotkey, endpoint=n.endpoint))
    return out


@dataclass
class RoundLog:
    """What one closed round produced, for the live table and the tests."""

    index: int
    table: str
    weights: dict[int, float] = field(default_factory=dict)


class Validator:
    """The neuron's lifecycle and loops over parts wired by :func:`~neurons.validator.build.build_parts`."""

    def __init__(self, cfg: ValidatorConfig, chain: Chain, parts: ValidatorParts) -> None:
        self.cfg = cfg
        self.chain = chain
        self.parts = parts
        self.keypair = parts.keypair
        self.hotkey: str = parts.keypair.ss58_address
        self.router = parts.router
        self.upstream = parts.upstream
        self.gateway = parts.gateway
        self.scorer = parts.scorer
        self.auditor = parts.auditor
        self.store: ScoreStore | None = None  # opened in start()
        self.hotkey_to_uid: dict[str, int] = {}
        self.my_uid: int | None = None
        self.rounds_closed = 0
        self.recent_rounds: deque[RoundLog] = deque(maxlen=RECENT)
        self.weights_set: deque[tuple[int, dict[int, float]]] = deque(maxlen=RECENT)  # (block, weights)
        self.weights_submitted = 0
        self.restarts: dict[str, int] = {}
        self._last_weights_block: int | None = None
        self._nothing_to_set_at_round: int | None = None  # rounds_closed when the last try found no weights to set
        self._tasks: list[asyncio.Task[None]] = []
        self._corpus_task: asyncio.Task[None] | None = None
        self._weights_failures = 0  # refusals in a row (backoff: next block, then 2, 4, ... up to an interval)
        self._retry_weights_at = 0
        self._store_thread: ThreadPoolExecutor | None = None
        self._synced_at: float | None = None  # when the metagraph was last read (monotonic)
        self._max_metagraph_age_s = 600.0  # set from the chain's block time at start
        # Gateways sharing Redis (--redis.url): every process's measurements come from the shared stream, and each
        # is acknowledged once the round holding it is saved. None: this process's queue alone.
        shared = parts.shared
        self.reader = MeasurementReader(shared.link) if shared is not None else None
        self._unacked: list[str] = []  # refs (stream entries, or intake journal ids) in the round in progress
        self._saved_unacked: list[str] = []  # refs of rounds whose save or acknowledgement failed: sent again
        self._counted: set[str] = set()  # entries saved rounds hold, maybe unacknowledged: read again, never recounted
        self._restored_intake: list[Measurement] = []  # journaled before a restart, no saved round holds them
        self._published_routing: str | None = None
        self.workers: WorkerPool | None = None  # --gateway.workers above 1: the other gateway processes

    # -- state I/O, off the event loop ------------------------------------------------------------

    async def _io(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run a blocking state call on the store's single thread (calls stay serialised)."""
        if self._store_thread is None:
            self._store_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="state")
        return await asyncio.get_running_loop().run_in_executor(self._store_thread, fn, *args)

    async def open_state(self) -> None:
        """Open the state database and restore scoring from it (idempotent)."""
        if self.store is not None:
            return
        self.cfg.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.cfg.state_dir / "validator.sqlite"
        if await asyncio.to_thread(path.is_dir):  # the store would open a new file inside it: history lost
            raise CorruptStateError(path, "a directory is where the state file should be")
        self.store = await self._io(ScoreStore, path)
        await self._io(self.scorer.restore, self.store)
        self._counted = await self._io(self.store.counted_refs)
        self._restored_intake = [dataclasses.replace(decode(raw), ref=str(i))
                                 for i, raw in await self._io(self.store.taken_in)]
        if self._restored_intake:
            logger.info("{} measurements taken in before the restart, in no saved round: scored now",
                        len(self._restored_intake))
        self._last_weights_block = await self._io(self.store.last_weights_block)
        quota = self.gateway.quota
        for row in await self._io(self.store.load_key_usage, utc_day(time.time())):
            quota.restore(*row)  # today's API key usage survives a restart: no fresh day by restarting
        store = self.store

        async def save_usage(row: tuple[str, str, int, int]) -> None:
            await self._io(store.save_key_usage, [row])

        self.gateway.save_usage = save_usage  # a key's claim on its day, written before its request is served
        if self.auditor is not None:
            saved = await self._io(self.store.load_strikes)
            try:
                book = StrikeBook.from_json(self.auditor.book.policy, saved)
            except ValueError as e:
                raise CorruptStateError(self.store.path, f"the strike book is unreadable ({e})") from e
            self.auditor.book = book
            if book.quarantined():
                logger.info("{} miners still quarantined from earlier audits", len(book.quarantined()))

    def _score(self, m: Measurement) -> None:
        self.scorer.record(m)
        if m.ref is not None:
            self._unacked.append(m.ref)

    async def _intake(self) -> list[Measurement]:
        """New measurements, each to be counted exactly once across kill -9 (issue 39).

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
        restored, self._restored_intake = self._restored_intake, []
        taken = self.parts.measurements.drain()
        if self.store is None or not taken:
            return [*restored, *taken]
        try:
            ids = await self._io(self.store.take_in, [encode(m) for m in taken])
        except Exception as e:  # scored all the same; only a kill before the round's save would lose them
            logger.error("scoring state: could not journal {} measurements in {}: {}", len(taken), self.store.path, e)
            return [*restored, *taken]
        return [*restored, *(dataclasses.replace(m, ref=str(i)) for m, i in zip(taken, ids, strict=True))]

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
                await self._io(self.store.forget_counted, owed)
            except Exception as e:  # listed a while longer: harmless, Redis will not deliver them again
                logger.warning("scoring state: could not forget {} acknowledged entries: {}", len(owed), e)

    async def publish_routing(self) -> None:
        """The router's view for the other gateway processes (gateway.shared.routing), when it changed."""
        if self.parts.shared is None:
            return
        routing = view(self.router)
        if routing != self._published_routing and await publish(self.parts.shared.link, routing):
            self._published_routing = routing

    def quarantined(self) -> set[str]:
        """Hotkeys out of routing and paid 0 because their answers failed audits."""
        return self.auditor.book.quarantined() if self.auditor is not None else set()

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the state, sync once (restored credits reach the router), open the gateway, start the loops."""
        await self.open_state()
        if self.auditor is not None:
            await self.auditor.reference.start()  # loads the model (a second for the packaged one)
            logger.info("auditing {:.0%} of organic answers and every probe on {}; bands {}: {}", self.auditor.rate,
                        self.auditor.reference.name, self.cfg.audit_bands or "(defaults, measured CPU against CPU)",
                        describe(self.auditor.bands, self.auditor.book.policy.sequential))
        await self.sync_metagraph()
        await self.refresh_offers()  # which miner serves which model, before the first request
        if self.scorer.restored:
            logger.info("routing restored at once for {} miners from {}", len(self.scorer.routing_scores()),
                        self.cfg.state_dir)
        self.gateway.readiness = self.readiness
        self.gateway.metrics.add(lambda: validator_families(self))
        await self.publish_routing()
        await self.gateway.start()
        if self.cfg.gateway_workers > 1:
            self.workers = WorkerPool(self.cfg, self.gateway.port, api_keys=self.parts.api_keys)
            await self.workers.start()
        self._corpus_task = asyncio.create_task(self._load_corpus(), name="probe-corpus")
        params = await self.chain.params()
        block_s = max(0.05, params.block_time)
        sync_s = self.cfg.sync_interval_blocks * block_s
        self._max_metagraph_age_s = 3 * sync_s + 60.0  # three missed syncs and a minute: the chain is not answering
        self._tasks = [
            supervise("metagraph-sync", lambda: every(sync_s, self.sync_metagraph, first_delay_s=sync_s),
                      restarts=self.restarts),
            supervise("offers", lambda: every(self.cfg.offers_s, self.refresh_offers, first_delay_s=self.cfg.offers_s),
                      restarts=self.restarts),
            supervise("measurements", lambda: every(DRAIN_EVERY_S, self._drain, first_delay_s=DRAIN_EVERY_S),
                      restarts=self.restarts),
            supervise("rounds", self._rounds_forever, restarts=self.restarts),
            supervise("weights", lambda: every(block_s, self.maybe_set_weights, first_delay_s=block_s),
                      restarts=self.restarts),
        ]
        if self.auditor is not None:
            self._tasks.append(supervise("audits", self.auditor.run, restarts=self.restarts))
        if self.parts.shared is not None:
            self._tasks += [supervise(name, loop, restarts=self.restarts)
                            for name, loop in self.parts.shared.loops().items()]
            self._tasks.append(supervise("routing-publish", lambda: every(ROUTING_EVERY_S, self.publish_routing),
                                         restarts=self.restarts))
        if self.workers is not None:
            self._tasks.append(supervise("gateway-workers", self.workers.watch, restarts=self.restarts))
        logger.info("validator {} (uid {}) on netuid {} via {}; gateway on http://{}:{}", self.hotkey,
                    self.my_uid, self.chain.netuid, self.cfg.network, self.cfg.gateway_host, self.gateway.port)

    async def stop(self) -> None:
        if self._corpus_task is not None:
            self._corpus_task.cancel()
            await asyncio.gather(self._corpus_task, return_exceptions=True)
            self._corpus_task = None
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.workers is not None:
            await self.workers.stop()  # each drains its streams like this one, and sends its measurements
            self.workers = None
        await self.parts.aclose(keep_link=True)  # streams in progress end within the drain time and are measured
        await self._save_partial_round()
        if self.parts.shared is not None:
            await self.parts.shared.link.aclose()
        if self.store is not None:
            await self._io(self.store.close)
            self.store = None
        if self._store_thread is not None:
            self._store_thread.shutdown(wait=True)
            self._store_thread = None

    async def _save_partial_round(self) -> None:
        """At stop, the round in progress is scored as it stands and saved (a shorter round), not lost.

        Answers still waiting for an audit are paid as measured: the reference stopping is never the
        miner's fault (an early stop among them stays unpaid, as any unaudited early stop).
        """
        if self.store is None:
            return
        for m in await self._intake():  # with Redis: this process's last ones, sent as its gateway stopped
            self._score(m)
        if self.auditor is not None:
            for m in [*self.auditor.ready(), *self.auditor.abandon()]:
                self._score(m)
        if not self.scorer.pending:
            return
        entry = await self.close_round()
        logger.info("round {} (in progress at stop) saved", entry.index)

    async def _load_corpus(self) -> None:
        """Probe material from the standard library's documentation, read on a thread (~2 s); probes use
        the built-in templates until it is in."""
        try:
            passages = await asyncio.to_thread(stdlib_passages, random.Random(self.cfg.seed))
        except Exception as e:  # probes still work on the templates
            logger.warning("probe corpus not loaded ({!r}): probes use the built-in templates", e)
            return
        self.parts.prompts.corpus = passages
        logger.info("probe corpus: {} passages of the standard library's documentation", len(passages))

    def readiness(self) -> str | None:
        """Why the validator should not be sent traffic now, or None (``/ready``)."""
        age = None if self._synced_at is None else time.monotonic() - self._synced_at
        auditor = self.auditor
        return not_ready(routable=self.router.routable(), metagraph_age_s=age,
                         answering=self.upstream.answering(self.router.miners()),
                         max_age_s=self._max_metagraph_age_s,
                         reference_errors=auditor.reference_errors if auditor is not None else 0,
                         reference_error=auditor.reference_error if auditor is not None else "")

    async def sync_metagraph(self) -> None:
        neurons = await self.chain.metagraph()
        self._synced_at = time.monotonic()
        self.hotkey_to_uid = {n.hotkey: n.uid for n in neurons}
        self.my_uid = self.hotkey_to_uid.get(self.hotkey)
        cands = candidates(neurons, self.hotkey, self.cfg.min_validator_stake)
        before = {id(m) for m in self.router.miners()}
        self.router.sync(cands)
        joined = [m for m in self.router.miners() if id(m) not in before]
        # A UID whose hotkey changed starts from nothing: scores are keyed by hotkey.
        self.router.set_scores(self.scorer.routing_scores())
        self.router.set_quarantined(self.quarantined())
        logger.debug("metagraph: {} neurons, {} routable miners", len(neurons), len(cands))
        if joined and self._tasks:  # a miner new to the router: what it serves before its first request
            await refresh_offers(self.router, self.parts.client, miners=joined)

    async def refresh_offers(self) -> None:
        """Every miner's declared models and features (its signed /health) into the router."""
        counts = await refresh_offers(self.router, self.parts.client)
        logger.debug("offers: {}", counts)

    async def _drain(self) -> None:
        """Measurements into the scorer; those the audit samples wait for their verdict first."""
        auditor = self.auditor
        for m in await self._intake():
            if auditor is None or not auditor.take(m):
                self._score(m)
        if auditor is not None:
            for m in auditor.ready():
                self._score(m)
            if auditor.quarantine_changed:
                auditor.quarantine_changed = False
                self.router.set_quarantined(self.quarantined())

    async def _rounds_forever(self) -> None:
        while True:
            await self.parts.probes.run_round(self.cfg.probes_per_round, self.cfg.round_s)
            await self.close_round()

    async def close_round(self) -> RoundLog:
        """Score the round, republish routing, persist it (on the store thread), log the table."""
        await self._drain()
        quarantined = self.quarantined()
        refs, self._unacked = self._unacked, []  # what this round holds: acknowledged once it is saved
        report = self.scorer.close_round(time.time(), quarantined=quarantined)
        if self.auditor is not None:
            self.auditor.new_round()
        self.router.set_scores(self.scorer.routing_scores())
        weights = self.scorer.weights(self.hotkey_to_uid, exclude=quarantined)
        table = report.format_table(weights=weights, quarantined=quarantined)
        if self.auditor is not None:
            c = self.auditor.counts
            table += (f"\naudits: {c['passed']} passed, {c['failed']} failed, {c['dropped']} dropped (queue full), "
                      f"{c['unauditable']} too long, {c['errors']} reference errors; backlog {self.auditor.backlog}; "
                      f"quarantined: {len(quarantined)}")
        elif self.cfg.audit_off:
            table += "\naudits: OFF (--audit.off): no answer is verified, every answer is paid as measured"
        self.rounds_closed += 1
        entry = RoundLog(index=self.rounds_closed, table=table, weights=weights)
        self.recent_rounds.append(entry)
        logger.info("round {} closed\n{}", entry.index, table)
        saved = True
        if self.store is not None and report.saved is not None:
            try:
                # what this round holds and what earlier rounds whose save failed held: out of the journal, or
                # listed as counted, in the round's own transaction
                held = [*self._saved_unacked, *refs]
                shared = self.reader is not None
                await self._io(functools.partial(self.store.save_round, *report.saved,
                                                 intake=[] if shared else [int(r) for r in held],
                                                 counted=held if shared else []))
            except Exception as e:  # keep scoring in memory; the next round saves its own
                saved = False
                logger.error("scoring state: could not save round {} to {}: {}", report.index, self.store.path, e)
        await self._acknowledge(refs, saved)
        await self.publish_routing()
        await self._save_audits()
        await self._save_key_usage()
        return entry

    async def _save_key_usage(self) -> None:
        """Today's usage per API key (for the limits to survive a restart, and for the operator)."""
        if self.store is None:
            return
        rows = self.gateway.quota.snapshot()
        if not rows:
            return
        try:
            await self._io(self.store.save_key_usage, rows)
        except Exception as e:  # the next round saves the totals again
            logger.error("scoring state: could not save API key usage to {}: {}", self.store.path, e)

    async def _save_audits(self) -> None:
        """Append the round's audit outcomes and the strike book to the state database."""
        if self.auditor is None or self.store is None:
            return
        pending = self.auditor.outcomes
        outcomes = list(pending)
        try:
            await self._io(self.store.save_audits, outcomes, self.auditor.book.to_json())
        except Exception as e:  # kept in memory (bounded) for the next round's save
            logger.error("scoring state: could not save {} audit outcomes to {}: {}", len(outcomes),
                         self.store.path, e)
            return
        for _ in range(min(len(outcomes), len(pending))):
            pending.popleft()  # saved; outcomes that arrived during the save stay for the next round

    def _interval_holds(self, block: int) -> bool:
        """Whether the weights interval since the last try still holds at ``block``.

        A try that found nothing to set holds it (one log line an interval) only until another round closes: the
        first round with work to pay is paid at once, not up to an interval later (a local subnet asked for a few
        rounds could stop before then, beside a CPU hog, with no weights at all).
        """
        last = self._last_weights_block
        if last is None or block - last >= self.cfg.weights_interval_blocks:
            return False
        empty_at = self._nothing_to_set_at_round
        return empty_at is None or self.rounds_closed <= empty_at

    async def maybe_set_weights(self) -> None:
        """Set weights when the interval has passed and the chain's rate limit allows; never fatal."""
        if not self.rounds_closed:
            return
        block = await self.chain.block()
        if self._interval_holds(block):
            return
        if block < self._retry_weights_at:
            return
        if self.my_uid is None:
            logger.warning("hotkey {} is not registered on netuid {}; not setting weights",
                           self.hotkey, self.chain.netuid)
            self._last_weights_block = block  # say so once an interval, not every block
            return
        params = await self.chain.params()
        since = await self.chain.blocks_since_last_update(self.my_uid)
        if since < params.weights_rate_limit:
            return
        quarantined = self.quarantined()
        weights = self.scorer.weights(self.hotkey_to_uid, exclude=quarantined)
        if not weights:
            logger.info("not setting weights: {}", why_empty(self.scorer.payable(quarantined), self.hotkey_to_uid))
            self._last_weights_block = block
            self._nothing_to_set_at_round = self.rounds_closed
            return
        self._nothing_to_set_at_round = None
        if self.cfg.weights_dry_run:
            logger.info("dry run: would set weights at block {}: {}", block, _fmt_weights(weights))
            self._last_weights_block = block
            return
        outcome = await self.chain.set_weights(weights)
        if outcome.ok:
            self._weights_failures = 0
            self._retry_weights_at = 0
            self._last_weights_block = block
            self.weights_set.append((block, weights))
            self.weights_submitted += 1
            if self.store is not None:
                await self._io(self.store.record_weights, block, weights)
            how = "committed (commit-reveal)" if outcome.commit_reveal else "set"
            logger.info("weights {} at block {}: {}", how, block, _fmt_weights(weights))
        else:
            # A transient failure is retried at the next block; one the chain keeps refusing (a stale version
            # key, a permit lost) backs off, doubling, to one attempt an interval: never a refusal every block.
            self._weights_failures += 1
            wait = min(self.cfg.weights_interval_blocks, 2 ** (self._weights_failures - 1))
            self._retry_weights_at = block + wait
            logger.warning("setting weights failed at block {} (attempt {}, next in {} blocks): {}", block,
                           self._weights_failures, wait, outcome.message)

    async def run(self, rounds: int | None = None) -> None:
        try:
            await self.start()
            while rounds is None or self.rounds_closed < rounds:
                await asyncio.sleep(0.2)
                dead = [t for t in self._tasks if t.done()]
                if dead:
                    raise RuntimeError(f"supervised task ended: {[t.get_name() for t in dead]}")
        finally:
            await self.stop()


def _fmt_weights(weights: dict[int, float]) -> str:
    return ", ".join(f"{uid}:{w:.3f}" for uid, w in sorted(weights.items()))
