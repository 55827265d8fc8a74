"""The capacity check (issue 14): one card registered as several hotkeys routes as one card."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest

from gateway.protocol.measurement import FailureReason, Measurement
from neurons.validator.probes import ProbeRunner, check_streams
from neurons.validator.prompts import MIXES, PromptGenerator
from scoring.capacity import (
    LAG_FLOOR,
    ONE_CARD,
    UNMEASURED,
    CapacityBook,
    capacity_ratio,
    cards,
    check_tokens,
    validator_lag,
)
from scoring.credit import CreditConfig
from scoring.rounds import delivered_rate
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


def test_routing_multiplier_reads_one_card_across_the_honest_band_from_the_median_recent_check() -> None:
    book = CapacityBook(window=3)
    assert book.multiplier("new") == UNMEASURED == 0.5  # never measured: no card's worth of routing yet
    for r in (0.76, 1.24, 0.9):  # an honest card, measured noisily: exactly one card
        book.push("honest", r)
    assert book.multiplier("honest") == 1.0
    for r in (0.22, 0.27, 0.25):
        book.push("shared", r)
    assert book.multiplier("shared") == pytest.approx(0.25)  # a share of a card is taken as it is
    book.push("two", 2.0)
    assert book.multiplier("two") == 2.0
    book.push("loaded", 0.55)  # a check during someone else's burst ...
    book.push("loaded", 1.0)  # ... does not hold an honest card below one card
    assert book.multiplier("loaded") == 1.0
    for r in (0.2, 16.0, 0.2):  # one lucky (or gamed) check among a sharer's: the median ignores it
        book.push("lucky", r)
    assert book.multiplier("lucky") == pytest.approx(0.2)
    book.forget({"honest"})
    assert book.multiplier("shared") == UNMEASURED  # forgotten: unmeasured again


def test_card_reading_has_no_cliff() -> None:
    """Issue 38: a threshold at 0.6 read 0.59 as 0.59 and 0.61 as a whole card; the reading is continuous now."""
    grid = [i / 1000 for i in range(1, 4000)]
    steps = [cards(b) - cards(a) for a, b in zip(grid, grid[1:], strict=False)]
    assert all(0.0 <= d <= 0.0021 for d in steps), max(steps)  # non-decreasing, slope at most 2: no jump
    assert cards(0.61) - cards(0.59) < 0.05  # where the threshold was: 0.04, not 0.41
    assert cards(0.57) == pytest.approx(0.64)  # a card carrying others' load, read 0.57, is not cut to 0.57
    assert cards(0.65) + cards(0.17) < 1.0  # one card split unevenly, as the soak's split-uneven reads: under one
    lo, hi = ONE_CARD
    assert cards(lo) == cards(1.0) == cards(hi) == 1.0
    assert cards(0.25) == 0.25 and cards(2.0) == 2.0 and cards(3.1) == 3.1
    assert cards(float("nan")) == 0.0 and cards(-1.0) == 0.0 and cards(1e9) == 16.0


def test_check_streams_decode_for_five_ttft_bands_at_an_honest_cards_rate() -> None:
    assert check_tokens(3, CFG, longest=512) == 251  # 5 x 0.5 s x 100 tok/s a stream, + the first token
    assert check_tokens(7, CFG, longest=512) == 109
    assert check_tokens(39, CFG, longest=512) == 64  # many slots: the floor
    assert check_tokens(2, CFG, longest=256) == 256  # bounded by the mix's longest answer
    assert check_tokens(1, CFG, longest=512) == 64  # one stream is capped at one stream's rate: never over a card
    assert check_tokens(5, CFG, longest=48) == 48  # a CPU mix: its longest answer
    for n in range(2, 64):  # the check's card time is about the same at any slot count
        tokens = check_tokens(n, CFG, longest=10_000)
        assert n * tokens <= 5 * 0.5 * 300 + 2 * n or tokens == 64, (n, tokens)


def _check(hotkey: str, *, ok: bool = True, failure: FailureReason | None = None, ttft: float = 0.45,
           tokens: int = 256, per_stream_tok_s: float = 100.0, streams: float = 3.0) -> Measurement:
    latency = ttft + (tokens - 1) / per_stream_tok_s
    return Measurement(uid=1, hotkey=hotkey, in_flight=0, prompt_tokens=40, max_tokens=tokens,
                       ttft_s=ttft if ok else None, latency_s=latency if ok else 0.2, completion_tokens=tokens if ok
                       else 0, ok=ok, failure=failure, probe=True, concurrency=streams, capacity_check=True, slots=4)


def test_a_check_stream_is_read_by_the_capacity_reading_not_by_credit_too() -> None:
    """Issue 38: a card carrying other validators' load decodes its check streams slower than an unloaded card. The
    capacity reading prices that; credited as well, the same slow streams cut its quality (a round of probes alone
    credited 0.41 beside 0.9) and, through routing, its traffic a second time. Its user answers set its credit."""
    n = check_tokens(3, CFG, longest=512)
    organic = Measurement(uid=1, hotkey="loaded", in_flight=0, prompt_tokens=40, max_tokens=64, ttft_s=0.45,
                          latency_s=0.45 + 63 / 440.0, completion_tokens=64, ok=True, concurrency=1.0, slots=4)
    scorer = Scorer(CFG)
    for _ in range(3):
        scorer.record(organic)
        scorer.record(_check("loaded", tokens=n, per_stream_tok_s=55.0))  # others' streams share the card
    row = scorer._round.miners["loaded"]
    assert row.measured == 3 and row.score == pytest.approx(1.0)  # the user answers' credit, all of it
    assert len(row.capacity_rates) == 3  # ... and the check streams all read, once
    scorer.close_round(round_s=60.0)
    assert scorer.capacity.multiplier("loaded") < 1.0  # the reading shows the load
    # a refused check stream still shows as nothing delivered, and a round of check streams alone credits nothing
    scorer.record(_check("refuser", ok=False, failure=FailureReason.BUSY))
    assert scorer._round.miners["refuser"].measured == 0 and scorer._round.miners["refuser"].capacity_rates == [0.0]


@pytest.mark.parametrize("failure", [FailureReason.BUSY, FailureReason.CLIENT_REJECTED, FailureReason.HTTP_STATUS])
def test_a_refused_check_stream_delivers_nothing(failure: FailureReason) -> None:
    """Issue 38: four 1-slot hotkeys on one card each served the check stream it won and refused the rest ("busy",
    or a 400 as the client's fault); each was read from the one it won, a whole card. It reads a quarter now."""
    scorer = Scorer(CFG)
    for i in range(4):  # four checks: this hotkey won one of them, its card was busy with siblings at the others
        scorer.record(_check("one-of-four", tokens=256, per_stream_tok_s=440.0, streams=1.0) if i == 0
                      else _check("one-of-four", ok=False, failure=failure))
        scorer.close_round(round_s=60.0)
    assert scorer.capacity.multiplier("one-of-four") == 0.0  # median of 1, 0, 0, 0
    # the validator's own faults say nothing of the card
    for reason in (FailureReason.LOCAL_RESOURCES, FailureReason.SHUTDOWN):
        scorer.record(_check("ours", ok=False, failure=reason))
    scorer.close_round(round_s=60.0)
    assert scorer.capacity.multiplier("ours") == UNMEASURED


def test_a_check_is_read_against_its_best_card() -> None:
    """Issue 38: every card slow at once is the validator reading late; no one but the best card sets that."""
    assert validator_lag([0.46, 0.35, 0.23, 0.1]) == pytest.approx(0.46)  # beside CPU hogs: lift all by 1 / 0.46
    assert validator_lag([1.3, 0.9, 0.25]) == 1.0  # some card read one card: nothing to lift
    assert validator_lag([1.0, 1.0, 0.25, 0.25, 0.25, 0.25]) == 1.0  # sybils outnumbering honest cards set nothing
    assert validator_lag([0.0, 0.0, 0.0]) == LAG_FLOOR  # no one delivered: 0 stays 0, lifted by at most 1 / floor
    assert validator_lag([0.3, 0.3]) == 1.0  # too few to compare: a hotkey is not its own reference
    assert validator_lag([float("nan"), 0.5, 0.4, 0.45]) == 0.5


def _round_of_checks(scorer: Scorer, speed: float, tokens: int) -> None:
    """One capacity check at ``speed`` of the true decode rates (1: read on time; under 1: the validator read every
    stream late): three honest cards, a card split into two hotkeys, and a card carrying others' load."""
    for hk, rate in (("a", 100.0), ("b", 100.0), ("c", 100.0), ("split/0", 50.0), ("split/1", 50.0),
                     ("loaded", 65.0)):
        for _ in range(3):
            scorer.record(_check(hk, tokens=tokens, per_stream_tok_s=rate * speed))
    scorer.close_round(round_s=60.0)


def test_a_check_the_validator_read_late_reads_the_same_cards() -> None:
    """Issue 38: beside two CPU hogs the soak's validator read every honest card at 0.23-0.46 of a card for five
    rounds, the card carrying others' load at 0.26-0.52 for seven; routing then follows the validator's lag. Read
    against the check's best card, each miner reads as it does on time, and sybils stay shares."""
    n = check_tokens(3, CFG, longest=512)
    on_time, late = Scorer(CFG), Scorer(CFG)
    for _ in range(3):
        _round_of_checks(on_time, 1.0, n)
        _round_of_checks(late, 0.4, n)
    for hk in ("a", "b", "c", "split/0", "split/1", "loaded"):
        assert late.capacity.multiplier(hk) == pytest.approx(on_time.capacity.multiplier(hk), abs=0.05), hk
    assert late.capacity.multiplier("a") == 1.0
    assert late.capacity.multiplier("split/0") <= 0.55  # still half a card each
    assert late.capacity.multiplier("loaded") < 1.0


def test_a_check_served_one_hotkey_at_a_time_is_not_more_cards() -> None:
    """Issue 38: two hotkeys on one card, the second starting its check streams once the first's were done. The first
    reads a whole card; the second's streams started after the TTFT band's zero and deliver nothing, so the two
    together read one card, as serving both at once does (0.5 + 0.5)."""
    n = check_tokens(3, CFG, longest=512)
    first = _check("x", tokens=n)  # alone on the card: 100 tok/s a stream over 3 streams
    late = dataclasses.replace(_check("y", tokens=n), ttft_s=first.latency_s + 0.45,
                               latency_s=2 * first.latency_s)  # its turn came when the first's ended
    x = capacity_ratio([delivered_rate(first, CFG)] * 3, 3.0, CFG)
    y = capacity_ratio([delivered_rate(late, CFG)] * 3, 3.0, CFG)
    assert x is not None and y is not None
    assert cards(x) == 1.0 and y == 0.0
    both = capacity_ratio([delivered_rate(_check("z", tokens=n, per_stream_tok_s=50.0), CFG)] * 3, 3.0, CFG)
    assert both is not None and cards(both) == pytest.approx(0.5, abs=0.05)  # each of two served at once


def _streamed(m: Measurement, *, rest_from: float | None = None, per_stream_tok_s: float = 100.0) -> Measurement:
    """``m`` with its tokens' arrivals: the first at its TTFT, the rest at ``per_stream_tok_s`` from then on (or from
    ``rest_from``: a stream held after its first token); its latency the last one's."""
    assert m.ttft_s is not None
    start = m.ttft_s if rest_from is None else rest_from
    arrivals = ((m.ttft_s, 1), *((start + i / per_stream_tok_s, 1 + i) for i in range(1, m.completion_tokens)))
    return dataclasses.replace(m, arrivals=arrivals, latency_s=arrivals[-1][0])


def test_a_card_serving_its_hotkeys_in_turn_after_their_first_tokens_is_one_card() -> None:
    """Issue 38's open hole: one card as two hotkeys sends both hotkeys' first tokens on time, then decodes one
    hotkey's check streams and only then the other's. Timed from the decode clock to each stream's end, the first
    read a whole card and the second half of one: 1.5 cards. By the check's common deadline (an honest card's decode
    of the stream) the second has delivered its first token and nothing else: the two read one card together. A
    card that streams at its own pace reads that pace either way, and a stream without arrivals is read as before."""
    n = check_tokens(3, CFG, longest=512)
    first = _streamed(_check("x", tokens=n))
    held = _streamed(_check("y", tokens=n), rest_from=first.latency_s)
    x = capacity_ratio([delivered_rate(first, CFG)] * 3, 3.0, CFG)
    y = capacity_ratio([delivered_rate(held, CFG)] * 3, 3.0, CFG)
    assert x is not None and y is not None
    assert cards(x) == 1.0 and y <= 0.03, (x, y)  # a few tokens between the first's end and the deadline
    before = capacity_ratio([delivered_rate(dataclasses.replace(held, arrivals=None), CFG)] * 3, 3.0, CFG)
    assert before is not None and 0.45 <= before <= 0.55  # the old reading: 1 + 0.5 cards for one card
    half = _streamed(_check("h", tokens=n, per_stream_tok_s=50.0), per_stream_tok_s=50.0)  # an honest slow card
    slow = capacity_ratio([delivered_rate(half, CFG)] * 3, 3.0, CFG)
    assert slow is not None and slow == pytest.approx(0.5, abs=0.03)


def test_a_quick_first_token_is_not_more_cards() -> None:
    """Issue 38: an honest card whose first token comes at 50 ms read as 3.6 cards at 64 tokens (its decode timed from
    the TTFT band's edge). At the GPU mix's check length it reads one card, like the same card at 450 ms, while two
    cards behind one hotkey still read about two."""
    n = check_tokens(3, CFG, longest=max(MIXES["gpu"].max_tokens))
    for ttft in (0.05, 0.45, 0.9):  # quick, typical, and slow inside the zero band
        ratio = capacity_ratio([delivered_rate(_check("c", ttft=ttft, tokens=n), CFG)] * 3, 3.0, CFG)
        assert ratio is not None and cards(ratio) == 1.0, (ttft, ratio)
    quick64 = capacity_ratio([delivered_rate(_check("c", ttft=0.05, tokens=64), CFG)] * 3, 3.0, CFG)
    assert quick64 is not None and cards(quick64) > 2.0  # why the check asks for long answers
    # two cards behind one hotkey of 8 slots: 7 check streams at twice one card's rate each
    two = capacity_ratio([delivered_rate(_check("c", ttft=0.45, tokens=check_tokens(7, CFG, longest=512),
                                                 per_stream_tok_s=600 / 7,
                                                  streams=7.0), CFG)] * 7, 7.0, CFG)
    assert two is not None and 1.6 <= cards(two) <= 2.1, two


async def test_one_card_as_four_hotkeys_routes_as_one_card(make_sim_miner, make_gateway) -> None:
    """Real miners on loopback: four hotkeys on one simulated card, next to an honest card; one capacity check."""
    profile = "rtx5090:time_scale=2,jitter=0,stop_rate=0"
    honest = await make_sim_miner(profile, slots=4, tag="honest")
    first = await make_sim_miner(profile, slots=4, tag="s0")
    shared = [first] + [await make_sim_miner(slots=4, tag=f"s{i}", runtime=first.server.runtime) for i in (1, 2, 3)]
    h = await make_gateway([honest, *shared], seed=1)
    probes = ProbeRunner(h.router, h.upstream.probe, PromptGenerator(random.Random(2)), "m", random.Random(3))
    assert probes.check_capacity() == 0  # no miner has answered yet: slots unknown, connections cold
    await asyncio.gather(*(probes.probe_once(m.uid) for m in h.router.miners()))
    assert probes.answered == {m.hotkey for m in (honest, *shared)}
    baseline = len(h.measurements())
    sent = probes.check_capacity()
    assert sent == 5 * 3  # every miner's slots but one, all at once
    for _ in range(200):
        if h.router.total_in_flight() == 0:
            break
        await asyncio.sleep(0.05)
    measured = h.measurements()[baseline:]
    assert len(measured) == sent and all(m.capacity_check and m.ok for m in measured)
    least = check_tokens(3, CFG, longest=max(MIXES["gpu"].max_tokens))
    assert all(m.max_tokens >= least == 251 for m in measured)  # ordinary shapes, long enough to time
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


def test_a_check_fills_every_free_slot_but_one() -> None:
    """The slot left free keeps users served; an idle 1-slot miner still takes one stream, a miner with one slot free
    or none takes none (its reading waits for a quieter check)."""
    assert [check_streams(4, busy) for busy in range(5)] == [3, 2, 1, 0, 0]
    assert [check_streams(1, busy) for busy in range(2)] == [1, 0]
    assert check_streams(8, 9) == 0  # more streams than slots (other processes' leases): none, never negative


async def test_capacity_checks_start_in_the_second_round() -> None:
    """In the first round one hotkey of a card may have answered and its sibling not yet: the first was checked alone
    and read a whole card (0.83 of one in the soak). The first round's probes warm every miner; checks follow."""
    from gateway.router import Candidate, Router

    router = Router(rng=random.Random(1))
    router.sync([Candidate(uid=1, hotkey="a", endpoint="127.0.0.1:1")])

    async def probe(lease: Any, payload: dict[str, Any], *, capacity_check: bool = False) -> None:
        return None

    runner = ProbeRunner(router, probe, PromptGenerator(random.Random(2)), "m", random.Random(3))
    checks: list[int] = []

    def check() -> int:
        checks.append(runner.rounds)
        return 0
    runner.check_capacity = check  # type: ignore[method-assign]
    await runner.run_round(1, 0.05)
    assert checks == []
    await runner.run_round(1, 0.05)
    assert checks == [2, 2]


def test_a_card_backs_its_slots_as_far_as_its_reading_and_a_sybil_its_share_of_them() -> None:
    """Issue 38: least-in-flight counts declared slots as far as a measured card backs them: all of them from one
    card on, the multiplier's share below it. One card as two hotkeys read 0.41 each backs 0.41 of each one's slots,
    3.3 of 4 for the pair (at 0.55 of them each, as before, the pair held 4.4 streams where an honest card holds 4,
    and took 1.26-1.57x an honest card's requests from 30 % of the slots busy on: ``scripts/sim_routing_share.py``)."""
    from scoring.capacity import card_share

    assert card_share(1.0) == card_share(2.0) == 1.0
    assert card_share(0.41) == pytest.approx(0.41) and 2 * 4 * card_share(0.41) < 4 * 1.0
    assert card_share(cards(0.6)) == pytest.approx(cards(0.6))  # a card carrying others' load: as its score says
    assert card_share(0.0) == card_share(float("nan")) == 0.0
    scorer = Scorer(CFG)
    scorer.record(_check("shared", tokens=251, per_stream_tok_s=35.0))  # read at about a third of a card
    scorer.record(_check("whole", tokens=251))
    scorer.close_round(round_s=60.0)
    shares = scorer.routing_shares()
    assert shares["whole"] == 1.0 and shares["shared"] < 0.6


def _served(hotkey: str) -> Measurement:
    """One user's answer, served well: 64 tokens at an honest card's one-stream rate."""
    return Measurement(uid=1, hotkey=hotkey, in_flight=0, prompt_tokens=40, max_tokens=64, ttft_s=0.3,
                       latency_s=0.3 + 63 / 440.0, completion_tokens=64, ok=True, concurrency=1.0, slots=4)


@pytest.mark.parametrize("checks", [True, False])
def test_rounds_routed_before_the_first_check_are_paid_at_the_card_share_it_reads(checks: bool,
                                                                                 tmp_path: Path) -> None:
    """Issue 38 (CI): before its first check every hotkey routes at half a card, so one card as four new hotkeys was
    sent two cards' traffic, and four times an honest card's where all were new at once (a new validator, the soak:
    in an 8-round smoke the 4-hotkey group served 35 of its 81 requests in the two rounds before its readings applied,
    and weighed 1.08x an honest card in one CI run). Those rounds are paid at the share of a card a check reads: the
    group one card's worth, the honest card in full. Without capacity checks, pay is as it was."""
    from scoring.store import ScoreStore

    sybils = [f"s{i}" for i in range(4)]
    uids = {hk: i for i, hk in enumerate(["honest", *sybils])}
    t = [1_000_000.0]
    with ScoreStore(tmp_path) as store:
        scorer = Scorer(CFG, capacity_checks=checks, clock=lambda: t[0])
        for rnd in range(3):  # rounds 1-2 routed unmeasured (a reading of round 2 applies from round 3)
            for hk in uids:
                for _ in range(10):
                    scorer.record(_served(hk))
            if rnd == 1:  # round 2's check: the honest card reads one card, each sybil about a quarter
                scorer.record(_check("honest", tokens=251))
                for hk in sybils:
                    scorer.record(_check(hk, tokens=251, per_stream_tok_s=25.0))
            t[0] += 60.0
            saved = scorer.close_round(round_s=60.0).saved
            assert saved is not None
            store.save_round(*saved)
            assert [m.unmeasured for m in saved[0].miners] == [checks and rnd < 2] * 5
            if checks and rnd == 0:
                assert scorer.weights(uids) == {}  # nobody measured yet: every round's pay waits for a check
        w = scorer.weights(uids)
        group = sum(w[uids[hk]] for hk in sybils) / w[uids["honest"]]
        shares = [scorer.capacity.multiplier(hk) for hk in sybils]
        assert scorer.capacity.multiplier("honest") == 1.0 and all(0.15 < s < 0.4 for s in shares), shares
        if checks:  # rounds 1-2 at their shares, round 3 in full (it was routed at them)
            assert group == pytest.approx((2 * sum(shares) + 4) / 3)
        else:
            assert group == pytest.approx(4.0)
        # a restart keeps the readings and the rounds' marks: the same weights, the same routing
        again = Scorer(CFG, capacity_checks=checks, clock=lambda: t[0])
        assert again.restore(store)
        assert again.weights(uids) == pytest.approx(w)
        assert again.routing_shares() == pytest.approx(scorer.routing_shares())
