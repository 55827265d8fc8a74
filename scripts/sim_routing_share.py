#!/usr/bin/env python3
"""Whose requests least-in-flight hands to whom: the product router in an event simulation, no I/O.

Pay follows work served, and the router decides the work. Scores say what each miner should get (credit times the
measured cards); least-in-flight says who is free. This runs :class:`gateway.router.Router` exactly as wired (routing
scores from :func:`scoring.capacity.cards`, slots backed by :func:`scoring.capacity.card_share`) over a field of
4-slot miners: honest cards read at one card, one card split into two hotkeys each read at 0.41 of a card (issue 38's
pair), an honest half-speed card (read 0.4) and cards carrying other validators' load (read 0.6 and 0.7). Requests
arrive at random (Poisson) and each holds its miner for the same time, at several levels of the field's slots busy;
it prints each miner's requests against an honest card's, beside what its score alone would give it.

What it showed (issue 38, 2026-12-07): at 6-15 % of the slots busy the pair gets its scores' share (0.82x an honest
card's requests), but from 30 % on 1.26-1.57x: each hotkey of the split card is idle more often than an honest card,
and exact least-in-flight hands the idle one the pick whatever its score. The adversarial soak sits between (its
pair served 0.92-1.10x an honest card's requests in six runs). With loads counted in halves of the backed slots and
slots backed at the multiplier (the router since), every miner gets its scores' share at every level, the pair 0.82x.

It also prints how often a capacity check (:func:`neurons.validator.probes.check_streams`: every free slot but one)
finds a miner with no slot to check (2026-12-07): an honest card 0.0-0.6 % of the time up to 30 % busy, 20 % at 45,
62 % at 60, 90 % at 75 and 98 % at 88 %, so under heavy traffic a card's readings are seldom renewed (its window's
median stands); a hotkey no check has read yet, routed at half a card, 0 % up to 60 %, 2.4 % at 75 and 16 % at 88 %,
so its first reading (and the pay held until then) comes within a round or two even then.

    .venv/bin/python scripts/sim_routing_share.py            # 20,000 requests a level, 2 seeds
    .venv/bin/python scripts/sim_routing_share.py --smoke    # seconds
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_lib.router_sim import arrivals  # noqa: E402

from gateway.router import Candidate, Router  # noqa: E402
from neurons.validator.probes import check_streams  # noqa: E402
from scoring.capacity import UNMEASURED, card_share, cards  # noqa: E402

HONEST = 13  # honest 4-slot cards beside the miners under study
# None: a new hotkey no capacity check has read yet (it routes at UNMEASURED)
READINGS: dict[str, float | None] = {"pair/0": 0.41, "pair/1": 0.41, "half-speed": 0.4, "loaded 0.6": 0.6,
                                     "loaded 0.7": 0.7, "new": None}
GROUPS = {"pair (2 hotkeys)": ("pair/0", "pair/1"), "half-speed": ("half-speed",),
          "loaded 0.6": ("loaded 0.6",), "loaded 0.7": ("loaded 0.7",), "new (unread)": ("new",)}
SLOTS = 4
HOLD_S = 2.0  # every request holds its miner this long
SAMPLE_EVERY = 50  # arrivals between two looks at what a capacity check would find


def score(reading: float | None) -> float:
    """The routing multiplier of a reading, as the scorer gives it (an unread hotkey's: :data:`UNMEASURED`)."""
    return UNMEASURED if reading is None else cards(reading)


def simulate(busy: float, seed: int, requests: int) -> tuple[dict[str, float], dict[str, float]]:
    """Requests served by each group over an honest card's mean, ``busy`` of all declared slots in use on average; and
    how often a capacity check would find an honest card, and the new hotkey, with no slot to check
    (:func:`check_streams`), looked at every :data:`SAMPLE_EVERY` th arrival once the first tenth has filled the
    slots."""
    readings = {**READINGS, **{f"honest{i}": 1.0 for i in range(HONEST)}}
    names = list(readings)
    router = Router(rng=random.Random(seed))
    router.sync([Candidate(uid=i, hotkey=k, endpoint=k, slots=SLOTS) for i, k in enumerate(names)])
    scores = {k: score(v) for k, v in readings.items()}
    router.set_scores(scores, {k: card_share(score) for k, score in scores.items()})
    served: Counter[str] = Counter()
    looked_at = {"honest": [m for m in router.miners() if m.hotkey.startswith("honest")],
                 "new": [m for m in router.miners() if m.hotkey == "new"]}
    unchecked = dict.fromkeys(looked_at, 0.0)
    looks = 0
    for n, lease in enumerate(arrivals(router, rate=busy * SLOTS * len(names) / HOLD_S, requests=requests,
                                       rng=random.Random(seed + 1), acquire=router.acquire, hold=lambda: HOLD_S)):
        if lease is not None:  # None: every slot full, the gateway would queue it; not a pick
            served[lease.miner.hotkey] += 1
        if n >= requests // 10 and n % SAMPLE_EVERY == 0:
            looks += 1
            for kind, miners in looked_at.items():
                unchecked[kind] += sum(check_streams(m.slots, m.in_flight) == 0 for m in miners) / len(miners)
    honest = sum(served[f"honest{i}"] for i in range(HONEST)) / HONEST
    return ({group: sum(served[k] for k in keys) / honest for group, keys in GROUPS.items()},
            {kind: unchecked[kind] / max(1, looks) for kind in looked_at})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="2,000 requests a level, one seed")
    p.add_argument("--requests", type=int, default=20_000, help="requests a level and seed")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--busy", default="0.06,0.15,0.3,0.45,0.6,0.75,0.88", help="comma list: share of the slots busy")
    a = p.parse_args(argv)
    requests, seeds = (2_000, 1) if a.smoke else (a.requests, a.seeds)
    levels = [float(x) for x in a.busy.split(",")]
    fair = {group: sum(score(READINGS[k]) for k in keys) for group, keys in GROUPS.items()}
    print(f"{HONEST} honest {SLOTS}-slot cards + {', '.join(GROUPS)}; each request holds its miner {HOLD_S:g} s; "
          f"{requests} requests a level, {seeds} seed(s)")
    print("requests served against an honest card's (its scores' share in brackets); 'no check': how often a capacity "
          "check finds an honest card, or the new hotkey, with at most one slot free, so none to check")
    print(f"{'busy':>5}  " + "  ".join(f"{g:>16}" for g in GROUPS) + f"  {'no check':>8}  {'(new)':>6}")
    print(f"{'-----':>5}  " + "  ".join(f"{'-' * 16:>16}" for _ in GROUPS) + f"  {'-' * 8:>8}  {'-' * 6:>6}")
    for busy in levels:
        runs = [simulate(busy, seed, requests) for seed in range(1, seeds + 1)]
        cells = [f"{sum(r[g] for r, _ in runs) / len(runs):.2f} ({fair[g]:.2f})" for g in GROUPS]
        honest, new = (sum(u[kind] for _, u in runs) / len(runs) for kind in ("honest", "new"))
        print(f"{busy:5.0%}  " + "  ".join(f"{c:>16}" for c in cells) + f"  {honest:8.1%}  {new:6.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
