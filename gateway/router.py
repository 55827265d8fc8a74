"""Weighted-random least-in-flight routing: pure logic, no I/O.

Among eligible miners keep those with the lowest load (this validator's requests in flight, divided
by the miner's slot count), then pick one at random with probability proportional to its routing
score. A deterministic tie-break is the bug this module exists to avoid: when requests never
overlap every miner has zero in flight, and "highest score wins" sends every request to one card,
whose TTFT then rises while it is paid less.

Two refinements, both measured by ``scripts/soak.py``:

* *Two weighted draws, less-served wins.* Each pick draws two miners at random in proportion to
  score and keeps the one that is behind on its score-proportional share (stride-scheduling "pass":
  +work/score per dispatch, work in typical requests, :func:`request_work`). Every pick stays random,
  shares stay proportional to score, but the luck of the draw no longer lets one of two identical cards
  carry 55-60 % of a light hour's traffic and come out with a worse TTFT for it (the "power of two
  choices" effect). Work, not a count: cards are paid for work, and with requests of 400, 16 and 16
  tokens in turn counting let the large ones gather on one card (1.13x the other's work, 1.50x at worst).
* *Zero scores last.* A miner scored 0 (dead, lying, hopeless) is chosen only when no miner with a
  positive score is eligible at any load, so a card that died leaves organic routing as soon as a
  round has scored it; probes keep measuring it and bring it back when it recovers.
* *Only miners that serve the request.* A request for a model goes only to miners that declared it (a miner that
  declared nothing serves the default model), and one using a feature (tools, logprobs, ...) only to miners that
  declared that feature too. When every miner serves what is asked (the usual subnet of one model) the pick
  takes the same path as before: the check is cached per (model, features) until an offer or the membership
  changes.
* *Sampled requests to a sampler first.* A sampled request (``sampled=True``) goes to a miner that declares the
  subnet's sampler and has a free slot when there is one, by the same weighted least-in-flight draw among those;
  only when none is free does it go to any miner. A stock runtime (SGLang, llama-server, vLLM without the plugin)
  answers it with its own RNG: a free draw no audit can check token by token, so its tokens are not paid and the
  user's answer is unverified. Greedy requests, which every runtime serves verifiably, go anywhere.
* *Slots a card backs, loads in halves.* Least-in-flight divides a miner's streams by the slots it declares times the
  share its measured card backs (:attr:`MinerState.share`, :func:`scoring.capacity.card_share`), in halves
  (:attr:`MinerState.load`; issue 38: declared at their word, and counted exactly, one card as two hotkeys took
  1.15-1.57x an honest card's requests). Within a half the weighted draw decides: the scores set the shares.
* *Quarantine is out.* A miner whose answers failed their audits (:meth:`Router.set_quarantined`)
  is never picked for organic traffic, not even as a last resort: a user must not get an answer
  the validator knows to be wrong. Probes still reach it (:meth:`Router.acquire_uid`).

Example::

    import random
    r = Router(rng=random.Random(7))
    r.sync([Candidate(uid=1, hotkey="a", endpoint="127.0.0.1:8091"),
            Candidate(uid=2, hotkey="b", endpoint="127.0.0.1:8092")])
    r.set_scores({"a": 0.9, "b": 0.3})
    lease = r.acquire()          # uid 1 about 75 % of the time
    ...
    r.release(lease)             # exactly once, on every path

Loads are bucketed so a pick costs O(distinct loads + log n), not O(n): with 256 miners the choice
stays in the microseconds even though it runs on every request.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet

from .miner_state import Candidate, Lease, MinerState
from .weighted_bucket import WeightedBucket, weighted_choice

__all__ = ["Candidate", "Lease", "MinerState", "Router", "request_work"]  # the records live in gateway.miner_state


SAMPLER_RECHECK = 64  # sampled requests between two looks at which miners declare the sampler


def _clean_score(value: float) -> float:
    value = float(value)
    if math.isnan(value) or value < 0.0:
        return 0.0
    return min(value, 1e9)


MAX_SLOTS = 64  # the most concurrent requests a miner's advertised slot count can claim
HORIZON = 4.0  # dispatches of memory each way, in units of a miner's own stride
WORK_MEMORY = 64  # dispatches the running mean of a request's work (the unit of a stride) follows
# A prompt token's card time against an output token's: a 5090's prefill (24,000 tok/s) against its peak decode
# (440 tok/s), scoring.credit's defaults. An estimate for balancing, not pay: pay counts what was measured.
PROMPT_TOKEN_WORK = 440.0 / 24000.0


def request_work(max_tokens: int, prompt_tokens: int = 0) -> float:
    """What a request will cost a card, in output tokens, as far as dispatch can tell: its ``max_tokens`` (an
    answer may stop sooner) and its prompt at prefill speed. The less-served draw balances this, so identical
    cards end with the same work, which is what they are paid for, not merely the same number of requests."""
    return max(0, max_tokens) + max(0, prompt_tokens) * PROMPT_TOKEN_WORK


class Router:
    """Chooses a miner per request; tracks this validator's in-flight requests exactly.

    ``prior`` is the routing score of a miner that has not been measured yet; by default the median
    of the known scores (1.0 when none is known), so a newcomer is treated as a typical card until
    probes have measured it.
    """

    def __init__(self, rng: random.Random | None = None, prior: float | None = None) -> None:
        self._rng = rng if rng is not None else random.Random()
        self._fixed_prior = prior
        self._prior = 1.0 if prior is None else _clean_score(prior)
        self._miners: dict[int, MinerState] = {}
        self._buckets: dict[float, WeightedBucket[MinerState]] = {}
        # the same, of the miners declaring the subnet's sampler
        self._sampler_buckets: dict[float, WeightedBucket[MinerState]] = {}
        # Virtual time: advances 1/(sum of weights) per dispatch, so a miner served exactly its share
        # keeps its pass level with it. Passes are held within HORIZON dispatches of it, so a burst of
        # forced picks (everyone else busy) is not repaid by starving that miner for an hour after.
        self._vt = 0.0
        self._wsum = 1.0
        self._mean_work = 0.0  # running mean of the work dispatches named (_stride); 0: none named yet
        self.default_model: str | None = None  # what a miner that declared no models serves (None: any)
        self._everyone: dict[tuple[str | None, frozenset[str]], bool] = {}  # (model, needs) every miner serves
        self._mixed = False  # some miners declare the subnet's sampler and some do not (_mixed_samplers)
        self._sampler_check = 0
        # Called whenever room may have freed (a release, a miner's slots or the membership changed): the gateway
        # wires its admission queue's wake here (gateway.admission), which lets waiting requests go. None: no one.
        self.on_room: Callable[[], None] | None = None
        # Told of each release and each lease's first content (gateway.shared.leases mirrors them in Redis).
        self.on_release: Callable[[Lease], None] | None = None
        self.on_deliver: Callable[[Lease], None] | None = None

    # -- membership and scores -------------------------------------------------------------------

    def sync(self, candidates: Iterable[Candidate]) -> None:
        """Replace the eligible set. A UID whose hotkey or endpoint changed starts from nothing.

        ``Candidate.slots`` is the starting slot count of a new miner; a count learned since
        (:meth:`learn_slots`) is kept across syncs while hotkey and endpoint stay the same.

        In-flight requests of a removed or replaced miner keep their lease; releasing it later
        touches only that old state object.
        """
        wanted = {c.uid: c for c in candidates}
        for uid in list(self._miners):
            c = wanted.get(uid)
            m = self._miners[uid]
            if c is None or c.hotkey != m.hotkey or c.endpoint != m.endpoint:
                self._unbucket(m)
                del self._miners[uid]
        for uid, c in wanted.items():
            if uid not in self._miners:
                m = MinerState(uid=c.uid, hotkey=c.hotkey, endpoint=c.endpoint, slots=max(1, int(c.slots)),
                               passes=self._vt)  # joins level with the others: no catch-up burst
                self._miners[uid] = m
                self._bucket_in(m)
        self._reweigh()
        self._everyone.clear()
        self._sampler_check = 0  # new members: look at who declares the sampler on the next sampled request
        if self.on_room is not None:  # new miners: room for those waiting
            self.on_room()

    def set_scores(self, scores: Mapping[str, float], shares: Mapping[str, float] | None = None) -> None:
        """Routing scores keyed by hotkey (so a re-registered UID cannot inherit a score), and with ``shares`` the
        share of a card each hotkey's capacity checks measured (:attr:`MinerState.share`: least-in-flight counts its
        declared slots only as far as a card backs them; a hotkey not in it counts them all)."""
        for m in self._miners.values():
            s = scores.get(m.hotkey)
            m.score = None if s is None else _clean_score(s)
            if shares is not None:
                share = shares.get(m.hotkey, 1.0)
                m.share = min(1.0, share) if share > 0 else 0.0
        if self._fixed_prior is None:
            known = sorted(m.score for m in self._miners.values() if m.score is not None)
            self._prior = known[len(known) // 2] if known else 1.0
        for m in list(self._miners.values()):  # weights changed: re-bucket everyone (once a round)
            self._unbucket(m)
            self._bucket_in(m)
        self._reweigh()

    def set_quarantined(self, hotkeys: AbstractSet[str]) -> None:
        """Take these hotkeys out of organic routing (and put back those no longer listed)."""
        for m in list(self._miners.values()):
            q = m.hotkey in hotkeys
            if q != m.quarantined:
                self._unbucket(m)
                m.quarantined = q
                self._bucket_in(m)
        self._reweigh()

    def _reweigh(self) -> None:
        self._wsum = sum(self._weight(m) for m in self._miners.values() if not m.quarantined) or 1.0

    def _weight(self, m: MinerState) -> float:
        return self._prior if m.score is None else m.score

    # -- choice ----------------------------------------------------------------------------------

    def learn_offer(self, m: MinerState, models: frozenset[str], features: frozenset[str]) -> None:
        """What a miner declared it serves (gateway.offers); no models: the default model."""
        if m.models != models or m.features != features:
            m.models, m.features = models, features
            self._everyone.clear()
            if self.on_room is not None:
                self.on_room()

    def serves(self, m: MinerState, model: str | None, needs: AbstractSet[str] = frozenset()) -> bool:
        """Whether ``m`` declared ``model`` (None: any) and every feature in ``needs``."""
        if model is not None and model not in m.models and (m.models or model != (self.default_model or model)):
            return False
        return needs <= m.features

    def offered(self) -> set[str]:
        """The models some routable miner serves now (``/v1/models``)."""
        out: set[str] = set()
        for m in self._miners.values():
            if not m.quarantined:
                out |= m.models or ({self.default_model} if self.default_model else set())
        return out

    def can_serve(self, model: str, needs: AbstractSet[str] = frozenset()) -> bool:
        """Some routable miner serves ``model`` with ``needs`` (busy or not). On every request: when every miner
        serves it (cached) and one is routable (a bucket exists), that is the whole check."""
        needs = frozenset(needs)
        if self._buckets and self._for_everyone(model, needs):
            return True
        return any(not m.quarantined and self.serves(m, model, needs) for m in self._miners.values())

    def _for_everyone(self, model: str | None, needs: frozenset[str]) -> bool:
        key = (model, needs)
        hit = self._everyone.get(key)
        if hit is None:
            hit = self._everyone[key] = all(self.serves(m, model, needs) for m in self._miners.values())
        return hit

    def pick(self, exclude: AbstractSet[int] = frozenset(), model: str | None = None,
             needs: frozenset[str] = frozenset(), *, free_sampler: bool = False) -> MinerState | None:
        """The miner the next request should go to, or None when nothing is eligible (``free_sampler``: among the
        miners declaring the subnet's sampler with a slot free, and never one scored 0)."""
        zero_only: list[MinerState] | None = None  # the least-loaded miners, if all scored 0
        everyone = (model is None and not needs) or self._for_everyone(model, needs)
        buckets = self._sampler_buckets if free_sampler else self._buckets
        for load in sorted(buckets):
            if free_sampler and load >= 1.0:
                return None
            bucket = buckets[load]
            if not exclude and everyone:
                if bucket.positive:
                    return self._less_served(bucket.pick(self._rng), bucket.pick(self._rng))
                if zero_only is None and not free_sampler:
                    zero_only = bucket.order
                continue
            rest = [m for m in bucket.order if m.uid not in exclude and (everyone or self.serves(m, model, needs))]
            scored = [m for m in rest if self._weight(m) > 0.0]
            if scored:
                weights = [self._weight(m) for m in scored]
                return self._less_served(weighted_choice(scored, weights, self._rng),
                                         weighted_choice(scored, weights, self._rng))
            if rest and zero_only is None and not free_sampler:
                zero_only = rest
        if zero_only:
            return zero_only[self._rng.randrange(len(zero_only))]
        return None

    def _pass(self, m: MinerState) -> float:
        """The miner's pass, held within HORIZON of its own strides around the virtual time."""
        w = self._weight(m) or self._prior or 1.0
        lo, hi = self._vt - HORIZON / w, self._vt + HORIZON / w
        return lo if m.passes < lo else hi if m.passes > hi else m.passes

    def _less_served(self, a: MinerState, b: MinerState) -> MinerState:
        if a is b:
            return a
        pa, pb = self._pass(a), self._pass(b)
        return b if pb < pa else a  # equal: a, itself a random draw

    def acquire(self, exclude: AbstractSet[int] = frozenset(), model: str | None = None,
                needs: frozenset[str] = frozenset(), *, sampled: bool = False, work: float | None = None
                ) -> Lease | None:
        """Pick a miner (among those serving ``model`` with ``needs``; for a ``sampled`` request, a free one that
        declares the subnet's sampler when there is one) and count one request in flight on it. ``work``: what
        the request will cost a card (:func:`request_work`), so the less-served draw balances work, not counts."""
        m = self.pick(exclude, model, needs, free_sampler=True) if sampled and self._mixed_samplers() else None
        if m is None:
            m = self.pick(exclude, model, needs)
        if m is None:
            return None
        lease = self.acquire_uid(m.uid)
        stride = self._stride(work)  # only the draw's own picks move the less-served pass
        m.passes = self._pass(m) + stride / (self._weight(m) or self._prior or 1.0)
        self._vt += stride / self._wsum
        return lease

    def _mixed_samplers(self) -> bool:
        """Whether some miners declare the sampler and some do not (else the preference changes nothing, and the
        pick keeps its fast path). Learned from answers as they come (``MinerState.declares_sampler``), so it is
        looked at again every :data:`SAMPLER_RECHECK` sampled requests: a preference, a few requests late at most."""
        self._sampler_check -= 1
        if self._sampler_check <= 0:
            self._sampler_check = SAMPLER_RECHECK
            declaring = 0
            for m in list(self._miners.values()):
                declaring += m.declares_sampler
                if m.declares_sampler != (m.sampler_load is not None) and not m.quarantined:
                    self._unbucket(m)  # learnt since it was last bucketed (each lease re-buckets it too)
                    self._bucket_in(m)
            self._mixed = 0 < declaring < len(self._miners)
        return self._mixed

    def learn_slots(self, m: MinerState, slots: int) -> None:
        """A miner told us how many requests it serves at once. Advisory, so clamped to
        ``1..MAX_SLOTS``: a miner overstating it gets more traffic only until it answers 429."""
        n = min(MAX_SLOTS, max(1, int(slots)))
        if n == m.slots:
            return
        self._reload(m, n, m.elsewhere)
        if self.on_room is not None:
            self.on_room()

    def acquire_uid(self, uid: int) -> Lease | None:
        """Count one request in flight on a specific miner (probes), so organic routing sees it too. It does not move
        the less-served pass (:meth:`acquire` does): a probe is not paid, and a capacity check's 130 streams at once
        had levelled every pass at HORIZON twice a round (issue 38)."""
        m = self._miners.get(uid)
        if m is None:
            return None
        lease = Lease(miner=m, in_flight_at_dispatch=m.in_flight + m.elsewhere, slots_at_dispatch=m.slots,
                      on_deliver=self.on_deliver)
        self._unbucket(m)
        m.in_flight += 1
        self._bucket_in(m)
        return lease

    def _stride(self, work: float | None) -> float:
        """A dispatch's advance of the pass, in typical requests: ``work`` over the running mean of the work named,
        at most HORIZON (a request of 40 typical ones is repaid as 4, the memory the passes keep anyway)."""
        if work is None or not math.isfinite(work) or work <= 0.0:
            return 1.0
        if self._mean_work <= 0.0:
            self._mean_work = work
        else:
            self._mean_work += (work - self._mean_work) / WORK_MEMORY
        return min(work / self._mean_work, HORIZON)

    def release(self, lease: Lease, served: bool = False) -> None:
        """Give the in-flight unit back. Idempotent, so a double release cannot corrupt counts."""
        if lease.released:
            return
        lease.released = True
        m = lease.miner
        live = self._miners.get(m.uid) is m
        if live:
            self._unbucket(m)
        m.in_flight -= 1
        if lease.delivering:
            m.delivering -= 1
        if served:
            m.served += 1
        if live:
            self._bucket_in(m)
        if self.on_release is not None:
            self.on_release(lease)
        if self.on_room is not None:
            self.on_room()

    def set_elsewhere(self, counts: Mapping[str, tuple[int, int]]) -> None:
        """The other gateway processes' ``(in flight, delivering)`` per hotkey (absent: 0, 0): shared leases."""
        roomier = False
        for m in self._miners.values():
            roomier |= self._elsewhere(m, *counts.get(m.hotkey, (0, 0)))
        if roomier and self.on_room is not None:
            self.on_room()

    def note_elsewhere(self, m: MinerState, in_flight: int) -> None:
        """What one shared lease call just said about the other processes' requests on ``m``."""
        if self._elsewhere(m, in_flight, m.elsewhere_delivering) and self.on_room is not None:
            self.on_room()

    def _elsewhere(self, m: MinerState, n: int, d: int) -> bool:
        """Set ``m``'s counts from elsewhere; True when it now has more room."""
        n, d = max(0, int(n)), max(0, int(d))
        m.elsewhere_delivering = d
        if n == m.elsewhere:
            return False
        roomier = n < m.elsewhere
        self._reload(m, m.slots, n)
        return roomier

    def _reload(self, m: MinerState, slots: int, elsewhere: int) -> None:
        """Change what ``m``'s load is made of, moving it to its new load's bucket (a replaced miner has none)."""
        live = self._miners.get(m.uid) is m
        if live:
            self._unbucket(m)
        m.slots, m.elsewhere = slots, elsewhere
        if live:
            self._bucket_in(m)

    # -- inspection ------------------------------------------------------------------------------

    def miners(self) -> list[MinerState]:
        return sorted(self._miners.values(), key=lambda m: m.uid)

    def get(self, uid: int) -> MinerState | None:
        return self._miners.get(uid)

    def total_in_flight(self) -> int:
        return sum(m.in_flight for m in self._miners.values())

    def has_room(self) -> bool:
        """Some routable miner has a declared slot free for this validator (its load under 1): a request sent now
        is not refused for our own streams. One pass over the distinct loads, not the miners."""
        return any(load < 1.0 for load in self._buckets)

    def free_slots(self) -> int:
        """Slots free on routable miners, in all, as least-in-flight counts them (:attr:`MinerState.backed_slots`),
        for the admission queue, only while requests wait."""
        return sum(max(0, math.ceil(m.backed_slots) - m.in_flight - m.elsewhere)
                   for m in self._miners.values() if not m.quarantined)

    def routable(self) -> int:
        """Miners organic requests may go to (every one but the quarantined): what ``/ready`` needs above 0."""
        return sum(1 for m in self._miners.values() if not m.quarantined)

    def __len__(self) -> int:
        return len(self._miners)

    # -- buckets ---------------------------------------------------------------------------------

    def _bucket_in(self, m: MinerState) -> None:
        if m.quarantined:
            return  # buckets are what pick() sees: a quarantined miner is reachable by uid only
        load = m.load
        b = self._buckets.get(load)
        if b is None:
            b = self._buckets[load] = WeightedBucket[MinerState]()
        b.add(m, self._weight(m))
        m.bucket_load = load
        if m.declares_sampler:
            s = self._sampler_buckets.get(load)
            if s is None:
                s = self._sampler_buckets[load] = WeightedBucket[MinerState]()
            s.add(m, self._weight(m))
            m.sampler_load = load

    def _unbucket(self, m: MinerState) -> None:
        if m.sampler_load is not None:
            s = self._sampler_buckets.get(m.sampler_load)
            if s is not None and s.holds(m):
                s.remove(m)
                if not len(s):
                    del self._sampler_buckets[m.sampler_load]
            m.sampler_load = None
        b = self._buckets.get(m.bucket_load)
        if b is None or not b.holds(m):
            return
        b.remove(m)
        if not len(b):
            del self._buckets[m.bucket_load]
