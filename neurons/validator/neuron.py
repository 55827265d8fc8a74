"""The validator neuron: metagraph sync, gateway, probes, scoring rounds and periodic weights.

One asyncio process. Data flows one way: chain -> metagraph -> router -> upstream -> measurement ->
scoring -> weights. Each loop is a supervised task (``neurons.supervise``): an exception is logged
with context and the loop restarted, never silently lost.

The parts come wired from :func:`neurons.validator.build.build_parts`; the constructor does no I/O.
:meth:`Validator.start` opens the state (SQLite, on a thread of its own: a ``synchronous=FULL``
commit must never stall the event loop that relays streams), reads the chain and binds the gateway.
Measurements reach the scorer through a bounded queue drained a few times a second, not from inside
the socket read callback that produced them. Two jobs live in modules of their own: what must not be lost
(:mod:`.state`: the state file and the exactly-once intake) and setting weights (:mod:`.weights_setter`).
History kept in memory is bounded (``RECENT``); the complete record is the state database.

Run against a real subnet::

    python -m neurons.validator --netuid 7 --network test --wallet.name vali --wallet.hotkey default

or the embedded local subnet (no chain, no GPU)::

    python -m neurons.validator --local
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loguru import logger

from gateway.offers import refresh_offers
from gateway.protocol.measurement import Measurement
from gateway.router import Candidate
from gateway.shared.measurements import MeasurementReader
from gateway.shared.routing import publish, view
from scoring.weights import why_empty

from ..chain.base import Chain, NeuronInfo
from ..reference.bands import describe
from ..supervise import every, supervise
from .config import ValidatorConfig
from .corpus import stdlib_passages
from .metrics import validator_families
from .readiness import not_ready
from .state import StateKeeper
from .weights_setter import WeightsSetter
from .workers import WorkerPool

if TYPE_CHECKING:
    from .build import ValidatorParts

RECENT = 64  # closed rounds kept in memory (for the live table and tests)
DRAIN_EVERY_S = 0.25  # how often measurements move from the queue into the scorer
ROUTING_EVERY_S = 1.0  # how often the router's view is compared with the one published to the other gateways
STOP_LOOPS_S = 15.0  # how long a stop waits for its cancelled loops before it names the ones left and goes on


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
        shared = parts.shared
        self.state = StateKeeper(cfg.state_dir, parts.measurements,
                                 MeasurementReader(shared.link) if shared is not None else None)
        self.weights = WeightsSetter(chain, hotkey=self.hotkey, interval_blocks=cfg.weights_interval_blocks,
                                     dry_run=cfg.weights_dry_run, weigh=self._weigh, record=self.state.record_weights)
        self.hotkey_to_uid: dict[str, int] = {}
        self.my_uid: int | None = None
        self.rounds_closed = 0
        self.recent_rounds: deque[RoundLog] = deque(maxlen=RECENT)
        self.restarts: dict[str, int] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._corpus_task: asyncio.Task[None] | None = None
        self._synced_at: float | None = None  # when the metagraph was last read (monotonic)
        self._max_metagraph_age_s = 600.0  # set from the chain's block time at start
        self._published_routing: str | None = None
        self.workers: WorkerPool | None = None  # --gateway.workers above 1: the other gateway processes

    async def open_state(self) -> None:
        """Open the state database and restore scoring from it (idempotent)."""
        if self.state.store is not None:
            return
        await self.state.open(self.scorer, self.gateway.quota, self.auditor)
        self.weights.last_block = await self.state.last_weights_block()
        self.gateway.plug(save_usage=self.state.save_usage)  # a key's claim on its day, before its request is served

    def _score(self, m: Measurement) -> None:
        self.scorer.record(m)
        self.state.hold(m)

    def _weigh(self) -> tuple[dict[int, float], str]:
        """What the weights loop sets: payable values over the metagraph (quarantined miners at 0), and why none."""
        quarantined = self.quarantined()
        weights = self.scorer.weights(self.hotkey_to_uid, exclude=quarantined)
        return weights, ("" if weights else why_empty(self.scorer.payable(quarantined), self.hotkey_to_uid))

    async def maybe_set_weights(self) -> None:
        await self.weights.maybe_set(self.rounds_closed, self.my_uid)

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
        self.gateway.plug(readiness=self.readiness, metrics=(lambda: validator_families(self),))
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
        if self._tasks:
            _, stuck = await asyncio.wait(self._tasks, timeout=STOP_LOOPS_S)
            if stuck:  # named, so a loop that will not stop is found from the log, and the stop goes on
                logger.error("stopping: {} did not stop within {:.0f} s of being cancelled; going on without them",
                             ", ".join(sorted(t.get_name() for t in stuck)), STOP_LOOPS_S)
        self._tasks = []
        if self.workers is not None:
            await self.workers.stop()  # each drains its streams like this one, and sends its measurements
            self.workers = None
        await self.parts.aclose(keep_link=True)  # streams in progress end within the drain time and are measured
        await self._save_partial_round()
        if self.parts.shared is not None:
            await self.parts.shared.link.aclose()
        await self.state.close()

    async def _save_partial_round(self) -> None:
        """At stop, the round in progress is scored as it stands and saved (a shorter round), not lost.

        Answers still waiting for an audit are paid as measured: the reference stopping is never the
        miner's fault (an early stop among them stays unpaid, as any unaudited early stop).
        """
        if self.state.store is None:
            return
        for m in await self.state.intake():  # with Redis: this process's last ones, sent as its gateway stopped
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
        self.router.set_scores(self.scorer.routing_scores(), self.scorer.routing_shares())
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
        for m in await self.state.intake():
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
        report = self.scorer.close_round(time.time(), quarantined=quarantined)
        if self.auditor is not None:
            self.auditor.new_round()
        self.router.set_scores(self.scorer.routing_scores(), self.scorer.routing_shares())
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
        await self.state.save_round(report)  # with the refs it holds: out of the journal, or acknowledged
        await self.publish_routing()
        await self.state.save_audits(self.auditor)
        await self.state.save_key_usage(self.gateway.quota)
        return entry

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

