"""One scoring round: accumulate measurements per miner, then reduce them to a round score.

Keyed by hotkey, never by UID: a UID that is re-registered to a new hotkey is a different miner and
must not inherit anything. The UID is kept only for display.

A miner's round score (its quality) is the mean credit of its *measured* requests (those not
excluded, see :data:`scoring.credit.EXCLUDED_FAILURES`). A miner that was dispatched to but completed
nothing measurable scores 0; a miner that received no request at all is simply absent from the round.
Next to it the round adds up the card-seconds of paid work (:mod:`scoring.pay`), the part of it an audit
verified, and the audits passed and failed; the scorer turns them into the round's :class:`~scoring.pay.RoundPay`.

Load this validator cannot see: a card also serving other validators decodes slower than this
validator's own in-flight count predicts. A miner that has shown its full speed in the round (at
least :data:`SHOWN_SPEED_MIN` requests at full decode credit by this validator's count, counted over this
round and the one before) is judged as if it ran all the slots it declares (``request_credit(...,
loaded=True)``); one that has not is judged by what this validator sees. A slow card cannot hide behind the
allowance: it never shows full speed. What a miner that is fast only at times can hide is bounded by the
slots it declares. The round before counts too because a round's few requests to a loaded card may not find
it free twice (issue 38: a round of 2 user requests credited an honest card carrying others' load 0.33, 0.06
off its settled credit, where the round before had shown its speed four times; and the first rounds, of 4
requests and of probes alone, credited 0.37 and 0.5 and routed it 0 and 1 requests against 6 and 15); no
further, so a card keeps the allowance only by showing its speed every other round.

A capacity-check stream is read once, by the capacity reading (:mod:`scoring.capacity`), not by credit too: it
fills the card on purpose, so its speed says how much the card delivers, and the reading already prices that. Credited
as well, a card carrying other validators' load paid twice for the same slow check streams (issue 38: a round of
probes alone, three of them check streams, credited 0.41 beside an unloaded card's 0.9, and routing followed). Its
failures still show (a refused check stream reads 0 cards) and its audit still counts; like every probe, it is not
paid (:func:`scoring.pay.paid_tokens`).

Example::

    acc = RoundAccumulator(CreditConfig())
    acc.add(measurement)                 # any number of times
    stats = acc.miners["5F..."]          # MinerRound: requests, measured, ttft_p50, score, ...
    scores = acc.scores()                # {hotkey: round score}
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gateway.protocol.measurement import FailureReason, Measurement
from scoring.credit import (
    CreditConfig,
    aggregate_rate,
    decode_start_s,
    on_time_credit,
    on_time_rate,
    request_credit,
    ttft_credit,
)
from scoring.pay import work_s

SHOWN_SPEED_MIN = 2  # requests at full decode credit (by this validator's count) that earn the load allowance


def percentile(samples: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (``q`` in [0, 100]) of ``samples``; None when empty."""
    if not samples:
        return None
    xs = sorted(samples)
    pos = (len(xs) - 1) * min(100.0, max(0.0, q)) / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(slots=True)
class MinerRound:
    """Everything one round saw of one miner."""

    hotkey: str
    uid: int
    requests: int = 0  # dispatched, whatever the outcome
    measured: int = 0  # requests that count toward credit (not busy / client_disconnect)
    credit_sum: float = 0.0  # judged by this validator's own in-flight count
    loaded_sum: float = 0.0  # judged with the allowance for load this validator cannot see
    shown_speed: int = 0  # requests at full decode credit by this validator's own count
    shown_before: int = 0  # requests at full decode credit in the round before (they count toward the allowance)
    work_s: float = 0.0  # card-seconds of paid work (scoring.pay), verified or not
    verified_work_s: float = 0.0  # of which an audit passed (all of it where the validator audits nothing)
    audits_passed: int = 0  # organic answers whose audit passed: what releases unverified pay
    audits_failed: int = 0  # any audit failed, probe or organic: forfeits it
    capacity_rates: list[float] = field(default_factory=list)  # per capacity-check stream (scoring.capacity)
    capacity_load: list[float] = field(default_factory=list)  # this validator's streams on it meanwhile
    probes: int = 0
    organic: int = 0
    audited: int = 0  # answers teacher-forced on the reference (failed ones also count in failures)
    free_draws: int = 0  # sampled answers from a miner that declared no subnet sampler (not paid where audited)
    skipped: int = 0  # answers no audit can check (gateway.protocol.auditable.audit_skip; not paid where audited)
    ttft_samples: list[float] = field(default_factory=list)  # successful requests only
    failures: Counter[str] = field(default_factory=Counter)

    @property
    def allowed_load(self) -> bool:
        """Whether the miner showed its full speed often enough to be judged at its declared slots."""
        return self.shown_speed + self.shown_before >= SHOWN_SPEED_MIN

    @property
    def score(self) -> float:
        """Mean credit of measured requests; 0 for a miner asked that completed nothing measurable."""
        if not self.measured:
            return 0.0
        return (self.loaded_sum if self.allowed_load else self.credit_sum) / self.measured

    @property
    def capacity_concurrency(self) -> float:
        """Mean of this validator's delivering streams on the miner during its capacity-check streams that
        delivered (1 when none did: its rates are then all 0)."""
        return sum(self.capacity_load) / len(self.capacity_load) if self.capacity_load else 1.0

    @property
    def ttft_p50(self) -> float | None:
        return percentile(self.ttft_samples, 50)

    @property
    def ttft_p95(self) -> float | None:
        return percentile(self.ttft_samples, 95)


# Check-stream outcomes that say nothing of the miner's capacity: those credit does not blame it for, but for its own
# refusals. A 429 "busy" and a 400 delivered nothing and read 0: a check stream goes only into a slot this validator
# counts free, and a card whose slots other traffic fills has no capacity for this validator's users either
# (scoring.capacity). What is left are the validator's own faults and its own cancels.
NOT_THE_MINERS_CHECK = frozenset(r for r in FailureReason if not r.blames_miner) - {
    FailureReason.BUSY, FailureReason.CLIENT_REJECTED}


def delivered_rate(m: Measurement, cfg: CreditConfig) -> float:
    """What one capacity-check stream delivered, tok/s, on the validator's clock (:func:`on_time_rate`):
    0 for a failure; tokens over the whole latency for an answer too short to time (so stopping after two
    tokens shows no capacity either); never more than one stream of an honest card can decode (the
    single-stream peak of the profile), so no answer, however it is timed, reads as more than that.

    0 too for a stream whose first token came after the TTFT band's zero (it earned no TTFT credit): a check
    served one hotkey at a time reads as more cards than the card (issue 38's ``check-second``: two hotkeys on one
    card, one starting its check streams once the other's were done, read 1.0 + 0.11 cards and weighed up to 1.09x
    an honest card beside two CPU hogs). Started late, those streams now deliver nothing."""
    if not m.ok or not math.isfinite(m.latency_s) or m.latency_s <= 0:
        return 0.0
    if ttft_credit(m.ttft_s, m.prompt_tokens, cfg) == 0.0:
        return 0.0
    rate = on_time_rate(m, cfg)
    if rate is None:
        rate = m.completion_tokens / m.latency_s
    by_deadline = rate_by_deadline(m, cfg)
    if by_deadline is not None:
        rate = min(rate, by_deadline)
    return min(rate, aggregate_rate(1, cfg))


def check_deadline_s(m: Measurement, cfg: CreditConfig) -> float:
    """When an honest card has decoded a check stream, seconds after dispatch: its decode clock's start
    (:func:`scoring.credit.decode_start_s`) plus its tokens at one stream's share of an honest card's aggregate rate
    with the check's streams on it (the miner's slots but one, at least one). The same for every stream of a check."""
    k = max(1, (m.slots if isinstance(m.slots, int) else 1) - 1)
    per_stream = aggregate_rate(k, cfg) / k
    return decode_start_s(m, cfg) + max(0, m.max_tokens - 1) / per_stream


def rate_by_deadline(m: Measurement, cfg: CreditConfig) -> float | None:
    """What a check stream still running at its deadline (:func:`check_deadline_s`) had delivered by then, tok/s
    from its decode clock's start; None for a stream done by then or one without its token arrivals.

    Timing from the decode clock to the stream's own end lets a card serve its hotkeys in turn: one card as two
    hotkeys, first token on time for both, decodes one hotkey's check streams and then the other's. Each stream then
    shows the card's full rate or half of it, 1.5 cards for one (issue 38's open hole). By a common deadline the
    second hotkey's streams have delivered their first token and little else, and the card reads as one card. A card
    that streams at its own pace shows that pace either way."""
    if not m.arrivals:
        return None
    deadline = check_deadline_s(m, cfg)
    if m.latency_s <= deadline:
        return None
    start = decode_start_s(m, cfg)
    if deadline <= start:
        return None
    delivered = 0
    for t, tokens in m.arrivals:
        if t > deadline:
            break
        delivered = tokens
    return max(0, delivered - 1) / (deadline - start)


class RoundAccumulator:
    """Per-hotkey accumulation for the round in progress. ``add`` is O(1) and cheap."""

    def __init__(self, cfg: CreditConfig, *, audits: bool = False,
                 shown_before: Mapping[str, int] | None = None) -> None:
        self.cfg = cfg
        self.audits = audits  # answers are audited: an early stop is paid only when its audit confirmed it
        self.shown_before = dict(shown_before or {})  # requests at full speed in the round before, by hotkey
        self.miners: dict[str, MinerRound] = {}

    def next_round(self) -> RoundAccumulator:
        """The accumulator of the round after this one, which counts this round's requests at full speed toward
        the load allowance (this round's own: never carried twice)."""
        shown = {hk: row.shown_speed for hk, row in self.miners.items() if row.shown_speed}
        return RoundAccumulator(self.cfg, audits=self.audits, shown_before=shown)

    def add(self, m: Measurement) -> float | None:
        """Fold one measurement in; returns its credit (None when excluded)."""
        row = self.miners.get(m.hotkey)
        if row is None:
            row = self.miners[m.hotkey] = MinerRound(hotkey=m.hotkey, uid=m.uid,
                                                     shown_before=self.shown_before.get(m.hotkey, 0))
        row.uid = m.uid
        row.requests += 1
        if m.probe:
            row.probes += 1
        else:
            row.organic += 1
        if m.free_draw:
            row.free_draws += 1
        if m.skipped is not None:
            row.skipped += 1
        if m.audited:
            row.audited += 1
            if m.ok and not m.probe:  # a probe passing says nothing of how users are served
                row.audits_passed += 1
            elif m.failure == FailureReason.AUDIT_FAILED:
                row.audits_failed += 1
        if not m.ok:
            row.failures[m.failure or "unknown"] += 1
        # An answer no audit can check is not paid (scoring.pay), and not credited either where audits run: junk sent
        # fast on exactly those requests (they say what they are) would raise the quality that multiplies the pay of
        # every other answer. A failure on one still counts: the user saw it.
        unchecked = self.audits and m.ok and m.skipped is not None
        credit = None if unchecked or m.capacity_check else request_credit(m, self.cfg)
        if credit is not None:
            row.measured += 1
            row.credit_sum += credit
            row.loaded_sum += max(credit, request_credit(m, self.cfg, loaded=True) or 0.0)
            if credit > 0 and on_time_credit(m, m.decode_concurrency, self.cfg) == 1.0:
                row.shown_speed += 1
        work = work_s(m, self.cfg, audits=self.audits)
        row.work_s += work
        if m.audited or not self.audits:
            row.verified_work_s += work
        if m.capacity_check and (m.ok or m.failure not in NOT_THE_MINERS_CHECK):  # a refused check stream counts 0
            row.capacity_rates.append(delivered_rate(m, self.cfg))
            if m.ok:  # only streams that delivered are load: one left hanging is a 0 rate, not a card's work
                row.capacity_load.append(m.decode_concurrency)
        if m.ok and m.ttft_s is not None and math.isfinite(m.ttft_s) and m.ttft_s >= 0:
            row.ttft_samples.append(float(m.ttft_s))
        return credit

    def scores(self) -> dict[str, float]:
        """Round score per hotkey that received at least one request."""
        return {hk: row.score for hk, row in self.miners.items()}

    def __len__(self) -> int:
        return len(self.miners)
