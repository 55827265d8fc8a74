"""The capacity check (issue 14): one card registered as several hotkeys routes as one card."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from neurons.validator.probes import CAPACITY_MIN_TOKENS, ProbeRunner
from neurons.validator.prompts import PromptGenerator
from scoring.capacity import SHARED_BELOW, UNMEASURED, CapacityBook, capacity_ratio
from scoring.credit import CreditConfig
from scoring.scorer import Scorer

CFG = CreditConfig()


def test_ratio_is_delivered_over_an_honest_cards_aggregate() -> None:
    assert capacity_ratio([75.0] * 4, 4.0, CFG) == pytest.approx(1.0)  # one 5090: 300 tok/s over 4 streams
    assert capacity_ratio([440.0], 1.0, CFG) == pytest.approx(1.0)
    assert capacity_ratio([150.0] * 8, 8.0, CFG) == pytest.approx(4.0)  # a miner with 4 cards behind it
    assert capacity_ratio([19.0] * 4, 4.0, CFG) == pytest.approx(0.25, abs=0.01)  # a quarter of one card
    assert capacity_ratio([75.0, 0.0, 75.0, 0.0], 4.0, CFG) == pytest.approx(0.5)  # refusals deliver nothing
    assert capacity_ratio([float("nan"), -3.0], 2.0, CFG) == 0.0
    assert capacity_ratio([], 4.0, CFG) is None


def test_routing_multiplier_reads_whole_cards_from_the_median_recent_check() -> None:
    book = CapacityBook(window=3)
    assert book.multiplier("new") == UNMEASURED == 0.5  # never measured: no card's worth of routing yet
    for r in (0.74, 1.31, 0.9):  # an honest card, measured noisily: exactly one card
        book.push("honest", r)
    assert book.multiplier("honest") == 1.0
    for r in (0.22, 0.27, 0.25):
        book.push("shared", r)
    assert book.multiplier("shared") == pytest.approx(0.25)  # a share of a card is taken as it is
    book.push("two", 1.8)
    assert book.multiplier("two") == 2.0
    book.push("loaded", 0.55)  # a check during someone else's burst ...
    book.push("loaded", 1.0)  # ... does not hold an honest card below one card
    assert book.multiplier("loaded") == 1.0
    for r in (0.2, 16.0, 0.2):  # one lucky (or gamed) check among a sharer's: the median ignores it
        book.push("lucky", r)
    assert book.multiplier("lucky") == pytest.approx(0.2) and 0.2 < SHARED_BELOW
    book.forget({"honest"})
    assert book.multiplier("shared") == UNMEASURED  # forgotten: unmeasured again



async def test_one_card_as_four_hotkeys_routes_as_one_card(make_sim_miner, make_gateway) -> None:
    """Real miners on loopback: four hotkeys on one simulated card, next to an honest card; one capacity check."""
    profile = "rtx5090:time_scale=2,jitter=0,stop_rate=0"
    honest = await make_sim_miner(profile, slots=4, tag="honest")
    first = await make_sim_miner(profile, slots=4, tag="s0")
    shared = [first] + [await make_sim_miner(slots=4, tag=f"s{i}", runtime=first.server.runtime) for i in (1, 2, 3)]
    h = await make_gateway([honest, *shared], seed=1)
    probes = ProbeRunner(h.router, h.upstream.probe, PromptGenerator(random.Random(2)), "m", random.Random(3))
    sent = probes.check_capacity()
    assert sent == 5 * 3  # every miner's slots but one, all at once
    for _ in range(200):
        if h.router.total_in_flight() == 0:
            break
        await asyncio.sleep(0.05)
    measured = h.measurements()
    assert len(measured) == sent and all(m.capacity_check and m.ok for m in measured)
    assert all(m.max_tokens >= CAPACITY_MIN_TOKENS for m in measured)  # ordinary shapes, long enough to time
    assert len({m.max_tokens for m in measured}) > 1  # not one fixed length a miner could key on
    scaled = dataclasses.replace(CFG, decode_curve=tuple((n, a * 2) for n, a in CFG.decode_curve),
                                 full_band_s=CFG.full_band_s / 2, prefill_tok_s=CFG.prefill_tok_s * 2)
    scorer = Scorer(scaled)
    for m in measured:
        scorer.record(m)
    scorer.close_round(round_s=60.0)
    assert scorer.capacity.multiplier(honest.hotkey) == 1.0
    shares = [scorer.capacity.multiplier(m.hotkey) for m in shared]
    assert all(0.15 < s < 0.4 for s in shares), shares  # 12 streams on one card: ~0.25 each
    assert sum(shares) < 1.3
