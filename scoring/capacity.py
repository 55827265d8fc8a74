"""Capacity: how many honest cards' worth of decode a hotkey delivers when every miner is filled at once.

Routing shares traffic in proportion to routing credit, so a card registered as four hotkeys would
be sent four cards' traffic and, paid for work, earn four cards' pay whenever the traffic is light
enough that its one card keeps up. Nothing in one hotkey's own answers shows the sharing: its
siblings' streams look like load from other validators. It shows when they all run at once.

So once a round the validator fills every miner's declared slots but one at the same moment (the
*capacity check*, :class:`neurons.validator.probes.ProbeRunner`; the slot left free keeps users
served meanwhile) with ordinary probes, and measures what each hotkey delivers: the mean rate of its
check streams on the validator's clock (:func:`scoring.credit.on_time_rate`: holding the first token
back and sending the rest in one burst no longer reads as speed; a blamed failure counts 0, and no
stream counts faster than one stream of an honest card) times this validator's streams that were
delivering on it meanwhile (a stream left hanging is not load), against the aggregate an honest card
of the class sustains at that many streams. An honest card scores ~1, a miner with two cards behind
one hotkey ~2, each of four hotkeys sharing one card ~0.25.

Routing credit is multiplied by the hotkey's **median** ratio over the settlement window (issue 23: the
best of the window let one lucky or gamed check stand for twelve rounds), read by :func:`cards`: exactly 1
between :data:`ONE_CARD` ``(0.75, 1.25)``, where an honest card's checks fall (measured rates are noisy: the
local subnet on 2 cores measured honest cards between ~0.7 and ~1.3 when 16 streams start at once, and an
honest card must route at exactly 1, not at the luck of its checks); as it is at or under 0.5 and from 2 cards
on; linear between. It is continuous (issue 38: a threshold at 0.6 read a card carrying other validators'
load at 0.57-0.59 as 0.57 and one reading 0.61 as a whole card, and a cheat that moved its reading over the
threshold doubled its routing). The price of a continuous reading: a hotkey whose median lands in a ramp reads
up to twice as steep as measured there (two hotkeys on one card each measured at 0.55 route at 0.6), the same
noise an honest card's reading has.

Where the band starts is a trade, and no start passes both sides (issue 38, adversarial soak, 2026-12-07, least-in-
flight in halves). A card carrying other validators' load (0.6 requests/s of them) reads 0.47-0.77 a check, a
median of 0.66, and weighed 0.78 / 0.83x an unloaded card from 0.75 (the issue asks 0.85x), 1.00 / 0.83x from 0.7.
One card split unevenly (the soak's ``split-uneven``: one hotkey runs one check stream beside its sibling's three
and stalls the rest) reads 0.62-0.65 + 0.17, as the loaded card does plus a sliver, and weighed 0.93 / 0.96x from
0.75, 1.11 / 1.03x from 0.7 and up to 1.11x from 0.65 (the bound is 1.05x). A band wide enough to cover the loaded
card pays the split more than one card's; the band stays at 0.75, where no cheat pays.

A check stream the miner refused (a 429 for "busy", a 400, any failure that is its own) delivered nothing and
counts 0 (issue 38: four 1-slot hotkeys on one card refused their siblings' check streams, so each was read
only from the check it won, as a whole card, or never and routed as unmeasured); so does one whose first token
came after the TTFT band's zero (:func:`scoring.rounds.delivered_rate`: a check served one hotkey at a time).
A hotkey never measured routes at :data:`UNMEASURED`, half a card: registering hotkeys faster than checks
measure them must not be worth a card each.

A check is read against itself (:func:`validator_lag`): every miner is filled at the same moment, so a slowdown
that every card shows at once is the validator's (its CPU or its link could not read them all), not theirs.
Beside two CPU hogs the local soak's validator read every honest card at 0.23-0.46 for five rounds (issue 38),
and a miner must not be blamed for that. The reference is the check's highest reading: where even the best card
read under one card, every reading of that check is lifted alike, so that the best reads one card. Not the median
nor any rank below the top: hotkeys sharing a card read low together and may outnumber the honest cards (the
adversarial soak's 30 sybil hotkeys against 17 cards; two honest cards beside four sybils would put a sybil third),
but no one can lower the best card's reading, and a reading pushed up (two cards behind one hotkey, a lucky
stream) only lessens everyone's lift. A check of fewer than :data:`LAG_COMPARED` hotkeys is not lifted (a hotkey
is not its own reference), and none is lifted more than ``1 / LAG_FLOOR``: a check in which no one delivered
(every stream refused) reads 0 as before, not the validator's lag.

Example::

    book = CapacityBook(window=12)
    book.push("hk", capacity_ratio([75.0, 74.0, 76.0, 75.0], concurrency=4.0, cfg=CreditConfig()))  # 1.0
    book.multiplier("hk")        # 1.0; "never-checked" -> 0.5; a median of 0.27 -> 0.27; 1.1 -> 1.0; 1.8 -> ~1.73
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence

from scoring.credit import CreditConfig, aggregate_rate

DECODE_OVER_BAND = 5.0  # a check stream's decode lasts at least this many TTFT bands (see check_tokens)
CHECK_TOKENS_FLOOR = 64  # ... and asks for at least this many tokens where the mix has answers that long
MAX_RATIO = 16.0  # no single endpoint is credited with more than 16 cards, whatever it delivers
SHARE_UP_TO = 0.5  # a median ratio at or under this is a share of a card, taken as it is (two hotkeys on one: 0.5)
ONE_CARD = (0.75, 1.25)  # a median ratio in this band is one card, exactly
WHOLE_FROM = 2.0  # from here on a ratio is taken as it is (two cards behind one hotkey: 2)
UNMEASURED = 0.5  # the routing multiplier of a hotkey no capacity check has measured yet
LAG_COMPARED = 3  # the fewest hotkeys in one capacity check that are read against each other (validator_lag)
LAG_FLOOR = 0.2  # ... and the lowest reference they are read against: no reading is lifted more than 5x


def capacity_ratio(rates: Sequence[float], concurrency: float, cfg: CreditConfig) -> float | None:
    """Delivered aggregate / an honest card's aggregate at ``concurrency`` streams (this validator's, on
    that miner, while the check ran); None without a stream to judge."""
    good = [r if isinstance(r, int | float) and math.isfinite(r) and r > 0 else 0.0 for r in rates]
    if not good or not math.isfinite(concurrency):
        return None
    n = max(1.0, concurrency)
    return min(MAX_RATIO, sum(good) / len(good) * n / aggregate_rate(n, cfg))


def validator_lag(ratios: Sequence[float]) -> float:
    """What every reading of one capacity check is divided by: its highest reading where that is under one card
    (every card read slow at once: the validator read them late), at least :data:`LAG_FLOOR`; 1 where fewer than
    :data:`LAG_COMPARED` hotkeys were read, or where some card read one card or more."""
    good = [r for r in ratios if isinstance(r, int | float) and math.isfinite(r)]
    if len(good) < LAG_COMPARED:
        return 1.0
    return min(1.0, max(LAG_FLOOR, max(good)))


def check_tokens(streams: int, cfg: CreditConfig, *, longest: int) -> int:
    """The fewest tokens a capacity-check stream asks for when ``streams`` of them share a card.

    A stream's rate is timed from the end of the TTFT band (:func:`scoring.credit.on_time_rate`), so a card whose
    first token comes at once reads faster by up to ``decode / (decode - band)``: at 64 tokens over 3 streams, 3.6
    cards for one (issue 38). Asking for a decode of :data:`DECODE_OVER_BAND` bands at an honest card's rate bounds
    that at 5/4, which :func:`cards` reads as exactly one card, and costs about the same card time at any slot count
    (an honest card's ``DECODE_OVER_BAND x band x aggregate`` tokens a check, 750 at the default profile). Bounded by
    the mix's ``longest`` answer (a check is made of ordinary shapes); one stream needs none of it (capped at one
    stream's rate, it never reads over one card)."""
    floor = min(CHECK_TOKENS_FLOOR, longest)
    if streams <= 1:
        return floor
    want = 1 + math.ceil(DECODE_OVER_BAND * cfg.full_band_s * aggregate_rate(streams, cfg) / streams)
    return max(floor, min(want, longest))


def cards(ratio: float) -> float:
    """The routing multiplier of a median capacity ratio: continuous, non-decreasing, exactly 1 across
    :data:`ONE_CARD`, the ratio itself at or under :data:`SHARE_UP_TO` and from :data:`WHOLE_FROM` on."""
    if not math.isfinite(ratio) or ratio <= 0:
        return 0.0
    lo, hi = ONE_CARD
    if ratio <= SHARE_UP_TO or ratio >= WHOLE_FROM:
        return min(MAX_RATIO, ratio)
    if ratio < lo:
        return SHARE_UP_TO + (ratio - SHARE_UP_TO) * (1.0 - SHARE_UP_TO) / (lo - SHARE_UP_TO)
    if ratio <= hi:
        return 1.0
    return 1.0 + (ratio - hi) * (WHOLE_FROM - 1.0) / (WHOLE_FROM - hi)


def card_share(multiplier: float) -> float:
    """How much of one card a hotkey's card is, from its routing multiplier: 1 from one card on, the multiplier below
    it. Two rules read it, so that a hotkey's slots, its score and its pay say the same:

    * least-in-flight counts a hotkey's declared slots only this far (:attr:`gateway.router.MinerState.share`). One
      card as two hotkeys, each read at 0.41 of a card, backs 0.41 of each one's 4 slots: 3.3 streams for the pair
      where an honest card holds 4 (issue 38: at 0.55 of them each, the share before 2026-12-07, it held 4.4 and,
      with least-in-flight's exact counts, took 1.26-1.57x an honest card's requests from 30 % of the slots busy on,
      ``scripts/sim_routing_share.py``; counting loads in halves and slots at the multiplier, 0.82x, its scores'
      share, at every load from 6 to 88 %);
    * the rounds a hotkey was routed in before its first check are paid this far (:class:`scoring.pay.PayWindow`).
    """
    if not math.isfinite(multiplier) or multiplier <= 0:
        return 0.0
    return min(1.0, multiplier)


class CapacityBook:
    """Each hotkey's capacity ratios over the last ``window`` checks; routing follows their median."""

    def __init__(self, window: int = 12) -> None:
        self.window = max(1, window)
        self._ratios: dict[str, deque[float]] = {}

    def push(self, hotkey: str, ratio: float) -> None:
        self._ratios.setdefault(hotkey, deque(maxlen=self.window)).append(ratio)

    def measured(self, hotkey: str) -> bool:
        """Whether any capacity check in the window has read ``hotkey``."""
        return bool(self._ratios.get(hotkey))

    def card_shares(self) -> dict[str, float]:
        """:func:`card_share` of each measured hotkey's multiplier (what its unmeasured rounds are paid at)."""
        return {hk: card_share(self.multiplier(hk)) for hk, ratios in self._ratios.items() if ratios}

    def multiplier(self, hotkey: str) -> float:
        """The median recent ratio read by :func:`cards`; :data:`UNMEASURED` when not checked yet."""
        ratios = self._ratios.get(hotkey)
        if not ratios:
            return UNMEASURED
        return cards(statistics.median(ratios))

    def forget(self, keep: set[str]) -> None:
        """Drop hotkeys no longer scored (deregistered, settled out)."""
        for hk in [hk for hk in self._ratios if hk not in keep]:
            del self._ratios[hk]
