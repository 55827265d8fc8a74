"""The scorer: measurements in, round reports, routing credits and weights out.

Two numbers per miner and round, settled over the same trailing window: its **credit** (quality: mean
request credit, what routing follows) and its **value** (paid card-seconds of work x credit per round
second, :mod:`scoring.pay`, what weights follow). A slow card is sent less because of its credit and
so earns less; a card that serves nothing, or serves it split across hotkeys, earns by its work.

It is a :class:`~gateway.protocol.measurement.MeasurementSink`: ``record`` folds a measurement into the round
in progress in O(1) and never raises. ``close_round`` turns the round into a :class:`RoundReport` and
pushes it into the trailing :class:`Settlement`. The scorer does no I/O: the report carries what to
persist (``report.saved``), and the validator writes it with :meth:`ScoreStore.save_round` on the
store's own thread, so a synchronous SQLite commit never stalls the event loop that relays streams.

Routing scores, republished each round: a miner with measured requests in the round just closed is
routed by that round's score (the freshest evidence, so a card that slows down loses traffic within one
round); a miner with settled history but nothing measured this round (no requests, or only truthful
429s and clients that left, which say nothing of it) is routed by its settled credit,
which decays while it stays unmeasured (a miner that settled at 0 stays at 0) until it drops out
of the window; it is then routed at the router's prior again, like any unmeasured miner. Probes
reach every miner each round, so a miner routed at 0 still gets re-measured. Each is multiplied by
the miner's capacity (:mod:`scoring.capacity`: ~1 for one honest card, 0.25 for each of four hotkeys
sharing one, 2 for two cards behind one hotkey), so traffic follows hardware, not hotkeys.

Where the validator runs capacity checks (``capacity_checks``), a round a hotkey was routed in before any check
had read it is marked ``unmeasured`` and paid at its card share once one has (:class:`scoring.pay.PayWindow`).

Restore on start: with a store whose last round ended less than ``restore_max_age_s`` ago, the
settlement window, the capacity readings and the routing credits come back, so miners measured recently are
routable at once, at the card share their checks gave them. The downtime is not turned into rounds: rounds the
validator did not run are neither paid nor counted. An older store is left on disk but not used for settlement or
routing.

Example::

    scorer = Scorer(CreditConfig(), window=12)
    scorer.restore(ScoreStore(state_dir))         # once, at start (the validator runs it in a thread)
    scorer.record(measurement)                    # per request, drained from the measurement queue
    report = scorer.close_round(time.time())      # every round
    store.save_round(*report.saved)               # persisted off the event loop
    router.set_scores(scorer.routing_scores())
    weights = scorer.weights(hotkey_to_uid)       # {uid: weight}; empty -> do not set weights
    print(report.format_table(weights=weights))
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from loguru import logger

from gateway.protocol.measurement import Measurement
from scoring.capacity import CapacityBook, capacity_ratio, card_share, validator_lag
from scoring.credit import CreditConfig
from scoring.pay import PayWindow, RoundPay, round_value
from scoring.rounds import RoundAccumulator
from scoring.settlement import Settlement
from scoring.store import ScoreStore, StoredMiner, StoredRound
from scoring.weights import compute_weights, why_empty


@dataclass(frozen=True, slots=True)
class MinerReport:
    """One row of a round report."""

    uid: int
    hotkey: str
    requests: int
    measured: int
    ttft_p50: float | None
    ttft_p95: float | None
    credit: float  # mean credit this round (the round score)
    settled: float  # trailing-window score after this round
    failures: dict[str, int] = field(default_factory=dict)
    probes: int = 0
    organic: int = 0
    audited: int = 0
    work_s: float = 0.0  # card-seconds of paid work this round
    value: float = 0.0  # this round's value (card-equivalents)
    settled_value: float = 0.0  # trailing-window value after this round: what weights follow
    capacity: float = 1.0  # routing multiplier from the capacity checks (scoring.capacity)
    free_draws: int = 0  # sampled answers drawn without the subnet's sampler (the miner declared none): not paid
    skipped: int = 0  # answers no audit can check (tools, JSON mode, ...: protocol.auditable.audit_skip): not paid

    @property
    def audit_passed(self) -> int:
        return self.audited - self.failures.get("audit_failed", 0)


@dataclass(frozen=True, slots=True)
class RoundReport:
    """What one closed round produced: rows for miners with requests or settled history."""

    index: int
    ended_at: float
    rows: list[MinerReport]
    dropped: int = 0  # measurements that could not be recorded (should stay 0)
    # What ScoreStore.save_round takes: the round, the routing credits republished with it, their uids.
    saved: tuple[StoredRound, dict[str, float], dict[str, int]] | None = None

    def by_hotkey(self) -> dict[str, MinerReport]:
        return {r.hotkey: r for r in self.rows}

    def format_table(self, weights: Mapping[int, float] | None = None,
                     quarantined: AbstractSet[str] = frozenset()) -> str:
        """A fixed-width table, one miner per line, for the per-round log.

        ``credit``/``settled``: quality this round and over the window (routing follows it); ``cards``: the
        capacity multiplier of routing (:mod:`scoring.capacity`); ``work_s``: paid
        card-seconds this round; ``value``: settled card-equivalents (weights follow it); ``audit``:
        passed/audited answers this round; ``Q`` marks a quarantined miner; ``free``: sampled answers drawn without
        the subnet's sampler (the miner declared none), audited for plausibility only and not paid; ``skip``: answers
        no audit can check (tools, JSON mode, ...; ``/v1/status`` names the rules), not paid either.
        """
        w = weights or {}
        head = f"{'uid':>5} {'hotkey':<12} {'req':>5} {'meas':>5} {'ttft50':>7} {'ttft95':>7} " \
               f"{'credit':>6} {'settled':>7} {'cards':>5} {'work_s':>7} {'value':>7} {'weight':>6} " \
               f"{'audit':>7} {'free':>5} {'skip':>5}  failures"
        lines = [f"round {self.index}: {len(self.rows)} miners", head]
        for r in sorted(self.rows, key=lambda r: (r.uid, r.hotkey)):
            fails = ",".join(f"{k}={v}" for k, v in sorted(r.failures.items())) or "-"
            weight = f"{w[r.uid]:6.3f}" if r.uid in w else f"{'-':>6}"
            audit = f"{r.audit_passed}/{r.audited}" + ("Q" if r.hotkey in quarantined else "")
            lines.append(
                f"{r.uid:>5} {_short(r.hotkey):<12} {r.requests:>5} {r.measured:>5} {_secs(r.ttft_p50):>7} "
                f"{_secs(r.ttft_p95):>7} {r.credit:6.3f} {r.settled:7.3f} {r.capacity:5.2f} {r.work_s:7.2f} "
                f"{r.settled_value:7.4f} {weight} {audit:>7} {r.free_draws:>5} {r.skipped:>5}  {fails}"
            )
        if self.dropped:
            lines.append(f"({self.dropped} measurements could not be recorded)")
        return "\n".join(lines)


def _short(hotkey: str) -> str:
    return hotkey if len(hotkey) <= 12 else f"{hotkey[:5]}..{hotkey[-5:]}"


def _secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


class Scorer:
    """Owns the round in progress, the settlement window and (optionally) their persistence."""

    def __init__(
        self,
        config: CreditConfig | None = None,
        window: int = 12,
        clock: Callable[[], float] = time.time,
        *,
        restore_max_age_s: float = 3600.0,
        audits: bool = False,
        capacity_checks: bool = False,
    ) -> None:
        self.config = config or CreditConfig()
        self.clock = clock
        self.restore_max_age_s = restore_max_age_s
        self.audits = audits  # the validator audits answers: early stops are paid only when audited
        self.capacity_checks = capacity_checks  # the validator checks capacity: unmeasured rounds pay at card share
        self.settlement = Settlement(window)  # credits: routing
        self.values = PayWindow(window)  # values, verified or held: weights
        self.capacity = CapacityBook(window)  # routing credit x best recent capacity ratio
        self._round = RoundAccumulator(self.config, audits=audits)
        self._round_started = clock()
        self._routing: dict[str, float] = {}
        self._uids: dict[str, int] = {}  # last uid seen per hotkey, for display
        self._next_index = 1
        self._dropped = 0
        self.restored = False

    # -- restore ---------------------------------------------------------------------------------

    def restore(self, store: ScoreStore) -> bool:
        """Take round numbering, and when recent enough the window and routing credits, from ``store``.

        Blocking (SQLite reads): call it before serving, or on a worker thread.
        """
        self._next_index = store.next_round_index()
        last = store.last_round_at()
        if last is None:
            return False
        age = self.clock() - last
        if age > self.restore_max_age_s:
            logger.info("scoring state in {} is {:.0f} s old (> {:.0f} s): starting a fresh settlement window",
                        store.path, age, self.restore_max_age_s)
            return False
        rounds = store.load_rounds(self.settlement.window)
        for r in rounds:
            self.settlement.push(r.scores())
            self.values.push(r.pays())
            for m in r.miners:
                self._uids[m.hotkey] = m.uid
                if m.capacity is not None:
                    self.capacity.push(m.hotkey, m.capacity)
        routing, _ = store.routing_credits()
        self._routing = routing
        self.restored = True
        logger.info("scoring state restored from {}: {} rounds, routing credits for {} miners ({:.0f} s old)",
                    store.path, len(rounds), len(routing), age)
        return True

    # -- the sink --------------------------------------------------------------------------------

    def record(self, m: Measurement) -> None:
        """Fold one measurement into the round in progress. Cheap; never raises."""
        try:
            self._round.add(m)
        except Exception as e:  # a malformed measurement must not reach the serving path
            self._dropped += 1
            if self._dropped == 1 or self._dropped % 1000 == 0:
                logger.warning("scorer: could not record a measurement ({} so far): {!r}", self._dropped, e)

    # -- rounds ----------------------------------------------------------------------------------

    def close_round(self, now: float | None = None, *, round_s: float | None = None,
                    quarantined: AbstractSet[str] = frozenset()) -> RoundReport:
        """Close the round in progress: settle it and republish routing scores (``report.saved`` to persist).

        ``round_s``: the round's length, for its value (default: the time since the last close, or start).
        ``quarantined``: hotkeys quarantined by their audits now; their whole pay window settles at 0
        (:class:`~scoring.pay.PayWindow`).
        """
        ended_at = self.clock() if now is None else now
        length = round_s if round_s is not None else ended_at - self._round_started
        self._round_started = ended_at
        acc = self._round
        self._round = acc.next_round()
        dropped, self._dropped = self._dropped, 0
        round_scores = acc.scores()
        pays = self._round_pays(acc, length, quarantined)
        self.settlement.push(round_scores)
        self.values.push(pays)
        settled = self.settlement.settled()
        for hk, played in acc.miners.items():
            self._uids[hk] = played.uid
        readings = self._read_capacity(acc)
        self.capacity.forget(set(settled))
        settled_values = self.settled_values()
        measured = {hk: row.score for hk, row in acc.miners.items() if row.measured}
        self._routing = {hk: s for hk, s in settled.items() if hk not in measured}
        self._routing.update(measured)
        self._routing = {hk: s * self.capacity.multiplier(hk) for hk, s in self._routing.items()}
        self._uids = {hk: uid for hk, uid in self._uids.items() if hk in settled}

        rows: list[MinerReport] = []
        stored: list[StoredMiner] = []
        for hk in sorted(settled):
            row = acc.miners.get(hk)
            uid = self._uids.get(hk, -1)
            sv = settled_values.get(hk, 0.0)
            if row is None:
                rows.append(MinerReport(uid, hk, 0, 0, None, None, 0.0, settled[hk], settled_value=sv,
                                        capacity=self.capacity.multiplier(hk)))
                continue
            p50, p95 = row.ttft_p50, row.ttft_p95
            pay = pays[hk]
            rows.append(MinerReport(uid, hk, row.requests, row.measured, p50, p95, row.score, settled[hk],
                                    dict(row.failures), row.probes, row.organic, row.audited, row.work_s, pay.total,
                                    sv, self.capacity.multiplier(hk), row.free_draws, row.skipped))
            stored.append(StoredMiner(hk, uid, row.score, row.requests, row.measured, row.credit_sum, p50, p95,
                                      dict(row.failures), work_s=row.work_s, value=pay.verified,
                                      unverified=pay.unverified, audits_passed=pay.passed, audits_failed=pay.failed,
                                      quarantined=pay.quarantined, unmeasured=pay.unmeasured,
                                      capacity=readings.get(hk)))
        saved = (StoredRound(self._next_index, ended_at, stored), dict(self._routing), dict(self._uids))
        report = RoundReport(self._next_index, ended_at, rows, dropped, saved)
        self._next_index += 1
        return report

    def _round_pays(self, acc: RoundAccumulator, length: float, quarantined: AbstractSet[str]) -> dict[str, RoundPay]:
        """What the round is worth to each hotkey, before settlement. A hotkey no check had read before this round's
        close was routed unmeasured all round (a reading taken in it applies from the next)."""
        unmeasured = {hk for hk in acc.miners if not self.capacity.measured(hk)} if self.capacity_checks else set()
        pays = {hk: RoundPay(verified=round_value(row.verified_work_s, row.score, length),
                             unverified=round_value(row.work_s - row.verified_work_s, row.score, length),
                             passed=row.audits_passed, failed=row.audits_failed, quarantined=hk in quarantined,
                             unmeasured=hk in unmeasured)
                for hk, row in acc.miners.items()}
        pays.update({hk: RoundPay(quarantined=True) for hk in quarantined if hk not in pays})
        return pays

    def _read_capacity(self, acc: RoundAccumulator) -> dict[str, float]:
        """Push the round's capacity check, each reading against the check's best card (:func:`scoring.capacity.
        validator_lag`): all of them slow at once is the validator's lag, not the miners'. Returns what it pushed."""
        readings = {hk: ratio for hk, played in acc.miners.items()
                    if (ratio := capacity_ratio(played.capacity_rates, played.capacity_concurrency, self.config))
                    is not None}
        lag = validator_lag(list(readings.values()))
        if lag < 1.0:
            logger.info("capacity check: its best card read {:.2f} of a card, every reading lifted by {:.2f} (the "
                        "validator read the cards late)", max(readings.values()), 1.0 / lag)
        pushed = {hk: ratio / lag for hk, ratio in readings.items()}
        for hk, ratio in pushed.items():
            self.capacity.push(hk, ratio)
        return pushed

    # -- outputs ---------------------------------------------------------------------------------

    def routing_scores(self) -> dict[str, float]:
        """Routing credit per hotkey (see the module docstring for the policy)."""
        return {hk: s for hk, s in self._routing.items() if math.isfinite(s)}

    def routing_shares(self) -> dict[str, float]:
        """The share of its declared slots each routed hotkey's measured card backs (:func:`scoring.capacity.
        card_share` of its multiplier): the router counts a hotkey's declared slots only as far as a card backs
        them."""
        return {hk: card_share(self.capacity.multiplier(hk)) for hk in self._routing}

    def settled(self) -> dict[str, float]:
        return self.settlement.settled()

    def settled_values(self) -> dict[str, float]:
        """The pay window settled, unmeasured rounds at each hotkey's card share (0 before its first check)."""
        return self.values.settled(self.capacity.card_shares())

    def payable(self, exclude: AbstractSet[str] = frozenset()) -> dict[str, float]:
        """Settled values with ``exclude`` (hotkeys quarantined by their audits) paid 0: what weights come from."""
        return {hk: (0.0 if hk in exclude else v) for hk, v in self.settled_values().items()}

    def weights(self, hotkey_to_uid: Mapping[str, int], exclude: AbstractSet[str] = frozenset()) -> dict[int, float]:
        """``{uid: weight}`` for the current metagraph from :meth:`payable`; empty (with a logged reason) when
        nothing is payable."""
        settled = self.payable(exclude)
        w = compute_weights(settled, hotkey_to_uid)
        if not w:
            logger.debug("no weights: {}", why_empty(settled, hotkey_to_uid))
        return w

    @property
    def pending(self) -> int:
        """Miners with at least one request in the round in progress."""
        return len(self._round)
