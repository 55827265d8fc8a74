"""What the router knows of each miner: a candidate from the metagraph, its live routing state, and a lease (one
request's hold on one of its slots). Plain records; :class:`gateway.router.Router` is their one writer."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Candidate:
    """A routable miner as the metagraph describes it."""

    uid: int
    hotkey: str
    endpoint: str
    slots: int = 1


LOAD_STEP = 0.5  # least-in-flight's unit of load: half the slots a card backs (MinerState.load)


@dataclass(slots=True, eq=False)
class MinerState:
    """Live routing state of one miner. Identity matters: a lease points at the exact object."""

    uid: int
    hotkey: str
    endpoint: str
    slots: int
    score: float | None = None  # None: not measured yet, routed at the prior
    in_flight: int = 0
    delivering: int = 0  # streams in flight that have sent content: the load a miner cannot fake by hanging
    # The other gateway processes' requests on it, and how many of those deliver (gateway.shared.leases; 0 with one
    # process): least-in-flight, declared slots and the decode concurrency a rate is judged at are subnet-wide.
    elsewhere: int = 0
    elsewhere_delivering: int = 0
    served: int = 0
    passes: float = 0.0  # stride-scheduling pass: grows by 1/score per dispatch
    quarantined: bool = False  # failed its audits: out of organic routing, reachable by probes only
    declares_sampler: bool = False  # its last answer declared the subnet's sampler (Upstream.learn_sampler)
    # What it declared it serves (its signed /health, gateway.offers): the models, and the request features beyond
    # plain chat (gateway.protocol.openai.FEATURES). No models declared: the router's default model, no features.
    models: frozenset[str] = frozenset()
    features: frozenset[str] = frozenset()
    # The share of a card the capacity checks measured behind it, at most 1 (scoring.capacity; 1 until known): the
    # slots it declares count only as far as a card backs them.
    share: float = 1.0
    bucket_load: float = field(default=0.0, repr=False)  # the router's bookkeeping: the load bucket it sits in
    sampler_load: float | None = field(default=None, repr=False)  # and its sampler bucket (None: in none)

    @property
    def backed_slots(self) -> float:
        """The slots it declares as far as its measured share of a card backs them (at least one)."""
        return max(1.0, self.slots * self.share)

    @property
    def load(self) -> float:
        """Streams on it over the slots its card backs, in steps of :data:`LOAD_STEP` (rounded down): under half
        full, half full or more, full, ...

        Exact counts made an idle hotkey win every pick over a card serving one stream, whatever their scores: one
        card registered as two hotkeys, each carrying half its traffic, is idle about twice as often as an honest
        card and so took 1.26-1.57x an honest card's requests from 30 % of the subnet's slots busy on, though each
        hotkey was measured at 0.41 of a card (issue 38, ``scripts/sim_routing_share.py``). In steps, miners
        within the same half are chosen by score (the router's weighted draw), and least-in-flight still keeps a
        request off a card that is half full while another is not."""
        return math.floor((self.in_flight + self.elsewhere) / self.backed_slots / LOAD_STEP) * LOAD_STEP


@dataclass(slots=True, eq=False)
class Lease:
    """Proof that one request holds one in-flight unit on ``miner``; release it exactly once."""

    miner: MinerState
    in_flight_at_dispatch: int
    released: bool = False
    slots_at_dispatch: int = 1  # what the miner had declared when this request was sent: refusals are judged on it
    delivering: bool = False  # the stream has sent content (counted in ``miner.delivering`` until released)
    token: str | None = None  # its name among the shared leases (gateway.shared.leases); None: this process only
    on_deliver: Callable[[Lease], None] | None = field(default=None, repr=False)  # Router.on_deliver at dispatch

    def start_delivering(self) -> None:
        """The stream sent its first content: from now on it is load on the miner (once)."""
        if not self.delivering and not self.released:
            self.delivering = True
            self.miner.delivering += 1
            if self.on_deliver is not None:
                self.on_deliver(self)
