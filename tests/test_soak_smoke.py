"""``scripts/soak.py --smoke`` runs every scenario under both routers in seconds and keeps its invariants.

The smoke run is a subprocess bounded by a timeout, as a user runs it. Its figures are not judged (a
few rounds at time scale 40 say nothing about fairness), except the adversarial scenario's cheaters,
which run 8 rounds at the full run's time scale. What must hold whatever the timing is: the table and
the PASS/FAIL lines are printed, sequential traffic never overlaps, the deterministic tie-break sends
a whole round to one card when nothing is in flight, every organic request that got a 200 is counted
once as served, weights sum to 1, a dead card settles to 0, no cheater out-earns an honest card.
The pure pieces (time-scale equivalence, the deterministic router) are checked in-process.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from bittensor.sp_core import Keypair

from gateway.protocol.measurement import Measurement
from gateway.router import Candidate
from neurons.miner.runtimes.sim import PROFILES
from scoring.credit import CreditConfig, request_credit

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import soak  # noqa: E402
from soak_lib.cards import CardsApart, miner_key  # noqa: E402
from soak_lib.harness import RunOptions  # noqa: E402
from soak_lib.load import CardRuntime  # noqa: E402
from soak_lib.routers import DeterministicRouter, SmoothRouter  # noqa: E402
from soak_lib.scenarios import Event, build_scenarios, time_scale  # noqa: E402
from soak_lib.timescale import scaled_credit_config, to_simulated  # noqa: E402


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    out = tmp_path_factory.mktemp("soak")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "soak.py"), "--smoke", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"soak.py exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout, json.loads((out / "soak.json").read_text())


def _runs(report: dict, scenario: str) -> dict[str, dict]:
    return {r["router"]: r for r in report["scenarios"][scenario]}


def test_prints_tables_and_target_lines(smoke: tuple[str, dict]) -> None:
    out, report = smoke
    for scenario in ("seed", "burst", "mixed", "capacity"):
        for router in ("project", "deterministic"):
            assert f"== {scenario} / router={router}:" in out
            assert re.search(rf"^(PASS|FAIL) \[{scenario}/{router}\] ", out, re.M), (scenario, router)
    assert "== capacity / router=slots:" in out  # the capacity-aware proposal runs next to them
    assert "== adversarial / router=project:" in out  # issue 14's cheaters, under the project router only
    assert re.search(r"^(PASS|FAIL) \[adversarial/project\] cheater 'split' ", out, re.M)
    header = next(line for line in out.splitlines() if line.startswith("miner "))
    for col in ("served", "share", "p50ms", "p95ms", "credit", "settled", "weight"):
        assert col in header.split()
    assert re.search(r"^soak done in \d+ s wall; \d+ target\(s\) failed", out, re.M)
    n_targets = sum(len(r["targets"]) for runs in report["scenarios"].values() for r in runs)
    assert len(re.findall(r"^(?:PASS|FAIL) \[", out, re.M)) == n_targets > 0


def test_seed_never_overlaps_and_deterministic_takes_whole_rounds(smoke: tuple[str, dict]) -> None:
    runs = _runs(smoke[1], "seed")
    for router, run in runs.items():
        assert run["overlap_violations"] == 0, router
        assert all(m["max_in_flight_at_dispatch"] == 0 for m in run["miners"]), router
        ok = run["client"].get("200", 0)
        assert ok > 0 and ok == sum(run["client"].values()), run["client"]
        assert sum(m["served"] for m in run["miners"]) == ok
    det = runs["deterministic"]["per_round"]
    rounds = len(next(iter(det.values()))["share"])
    for r in range(rounds):
        shares = sorted(series["share"][r] for series in det.values())
        assert shares == [0.0, 1.0], (r, shares)  # in-flight 0 at every dispatch: top score takes all


def test_weights_sum_to_one_and_shares_are_consistent(smoke: tuple[str, dict]) -> None:
    for runs in smoke[1]["scenarios"].values():
        for run in runs:
            per = run["per_round"]
            rounds = len(next(iter(per.values()))["weight"])
            for r in range(rounds):
                total = sum(s["weight"][r] for s in per.values())
                assert total == 0.0 or math.isclose(total, 1.0, rel_tol=1e-9), (run["scenario"], r, total)
                served = sum(s["served"][r] for s in per.values())
                share = sum(s["share"][r] for s in per.values())
                assert served == 0 or math.isclose(share, 1.0, rel_tol=1e-9)
                for s in per.values():
                    assert s["served"][r] <= s["dispatched"][r]


def test_dead_card_serves_nothing_and_settles_to_zero(smoke: tuple[str, dict]) -> None:
    for run in smoke[1]["scenarios"]["mixed"]:
        dies = run["per_round"]["dies"]
        dead = [r for r, a in enumerate(dies["alive"]) if not a]
        assert dead, "the mixed scenario must kill a card"
        assert all(dies["served"][r] == 0 for r in dead)
        assert dies["settled"][dead[-1]] == 0.0
        target = next(t for t in run["targets"] if "settles to 0" in t["name"])
        assert target["ok"], target


def test_time_scaling_before_credit_equals_scaled_bands() -> None:
    """Multiplying measured times by S before credit is the same as dividing the bands by S."""
    rng = random.Random(4)
    cfg = CreditConfig()
    for _ in range(400):
        scale = rng.choice([2.0, 10.0, 20.0, 40.0])
        ttft = rng.uniform(0.2, 2.0) / scale
        tokens = rng.randint(1, 300)
        m = Measurement(uid=1, hotkey="hk", in_flight=rng.randint(0, 7), prompt_tokens=rng.randint(1, 4000),
                        max_tokens=300, ttft_s=ttft, latency_s=ttft + tokens / rng.uniform(50, 600) / scale,
                        completion_tokens=tokens, ok=True)
        a = request_credit(to_simulated(m, scale), cfg)
        b = request_credit(m, scaled_credit_config(cfg, scale))
        assert a is not None and b is not None
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9), (m, scale, a, b)


def test_time_scaling_scales_a_check_streams_arrivals_too() -> None:
    """The check's common deadline reads the token arrivals against the decode clock: both in simulated seconds
    (scaled as measured, a held stream's tokens all read as on time, and the stalling sibling read 0.4 of a card)."""
    m = Measurement(uid=1, hotkey="hk", in_flight=0, prompt_tokens=10, max_tokens=3, ttft_s=0.1, latency_s=0.5,
                    completion_tokens=3, ok=True, capacity_check=True, arrivals=((0.1, 1), (0.5, 3)))
    sim = to_simulated(m, 5.0)
    assert sim.arrivals == ((0.5, 1), (2.5, 3)) and sim.latency_s == 2.5
    assert to_simulated(dataclasses.replace(m, arrivals=None), 5.0).arrivals is None


def test_the_adversarial_full_run_is_at_half_the_default_time_scale_unless_asked_otherwise() -> None:
    """The adversarial scenario runs its cards apart from the gateway, at 5, every other scenario in-process at 10;
    an explicit --time-scale wins in a full run, and the smoke keeps its own fixed scales."""
    full, smoke = build_scenarios(window=12, smoke=False), build_scenarios(window=12, smoke=True)
    assert full["adversarial"].cards_apart and smoke["adversarial"].cards_apart
    assert not any(sc.cards_apart for name, sc in full.items() if name != "adversarial")
    assert time_scale(full["adversarial"], smoke=False, requested=None) == 5.0
    assert {time_scale(sc, smoke=False, requested=None) for name, sc in full.items() if name != "adversarial"} == {10.0}
    assert {time_scale(sc, smoke=False, requested=20.0) for sc in full.values()} == {20.0}
    assert time_scale(smoke["adversarial"], smoke=True, requested=20.0) == 5.0  # judged in CI: as the full run
    assert time_scale(smoke["seed"], smoke=True, requested=20.0) == 40.0


async def test_cards_apart_serve_die_return_and_report() -> None:
    """Issue 38's faithful soak: the cards in a process of their own answer on loopback, the scenario's events reach
    them (a card dies and returns on the same port), and what only they know comes back at the end."""
    sc = build_scenarios(smoke=True)["seed"]
    opts = RunOptions(scale=40.0, seed=3)
    validator = Keypair.create_from_uri("//tensorgate-soak-validator").ss58_address
    timeout = aiohttp.ClientTimeout(total=10)
    async with CardsApart(sc, opts, validator) as cards, aiohttp.ClientSession(timeout=timeout) as http:
        assert [m.label for m in cards.miners] == ["card-a", "card-b"] and len({m.port for m in cards.miners}) == 2
        assert all(m.hotkey == miner_key(m.uid).ss58_address for m in cards.miners)

        async def up(label: str) -> bool:
            m = next(x for x in cards.miners if x.label == label)
            try:
                async with http.get(f"http://{m.endpoint}/health") as resp:
                    return resp.status == 200
            except aiohttp.ClientConnectionError:
                return False

        assert await up("card-a") and await up("card-b")
        await cards.apply(Event(0, "card-a", "die"))
        assert not await up("card-a") and await up("card-b")
        await cards.apply(Event(1, "card-a", "revive"))
        assert await up("card-a")
        reports = await cards.finish()
    assert set(reports) == {"card-a", "card-b"}
    assert all(r.runtime_ttfts == [] and r.refused_busy == 0 and r.background_streams == 0 for r in reports.values())


@pytest.mark.parametrize("bad", ["0", "-5", "nan", "inf", "fast"])
def test_a_time_scale_that_is_not_a_positive_number_is_refused_by_name(bad: str,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        soak.build_parser().parse_args(["--time-scale", bad])
    assert e.value.code == 2
    assert "--time-scale" in capsys.readouterr().err


def test_deterministic_router_is_fewest_in_flight_then_highest_score() -> None:
    r = DeterministicRouter(rng=random.Random(0))
    r.sync([Candidate(1, "a", "127.0.0.1:1"), Candidate(2, "b", "127.0.0.1:2"), Candidate(3, "c", "127.0.0.1:3")])
    r.set_scores({"a": 0.9, "b": 0.95, "c": 0.5})
    picks = set()
    for _ in range(50):
        lease = r.acquire()
        assert lease is not None
        picks.add(lease.miner.uid)
        r.release(lease)
    assert picks == {2}  # nothing in flight: the top score, every time
    first = r.acquire()
    second = r.acquire()
    third = r.acquire()
    assert first is not None and second is not None and third is not None
    assert [first.miner.uid, second.miner.uid, third.miner.uid] == [2, 1, 3]
    assert r.acquire(exclude={1, 2}).miner.uid == 3  # type: ignore[union-attr]


async def test_utilisation_term_rises_with_busy_time_and_is_capped() -> None:
    card = CardRuntime(PROFILES["rtx5090"], scale=20.0, rng=random.Random(2), util_ttft_s=12.0, util_cap_s=0.7,
                       util_tau_s=30.0)
    idle = CardRuntime(PROFILES["rtx5090"], scale=20.0, rng=random.Random(2), util_ttft_s=0.0)
    assert card.extra_ttft_s() == 0.0
    payload = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}
    for rt in (card, idle):
        for _ in range(3):
            frames = b"".join([f async for f in rt.stream(payload)])
            assert frames.endswith(b"data: [DONE]\n\n")
    assert 0.0 < card.utilisation() < 1.0
    assert 0.0 < card.extra_ttft_s() <= 0.7
    assert idle.extra_ttft_s() == 0.0
    # the term is added to the first token: later requests on the busy card wait longer than on the idle one
    assert card.extra_ttfts[0] == 0.0 < card.extra_ttfts[-1]
    assert sum(card.runtime_ttfts[1:]) > sum(idle.runtime_ttfts[1:])


def test_smooth_router_follows_scores_exactly_and_routes_zero_scores_last() -> None:
    r = SmoothRouter(rng=random.Random(3))
    r.sync([Candidate(1, "a", "127.0.0.1:1"), Candidate(2, "b", "127.0.0.1:2"), Candidate(3, "z", "127.0.0.1:3")])
    r.set_scores({"a": 0.6, "b": 0.3, "z": 0.0})
    counts = {1: 0, 2: 0, 3: 0}
    for _ in range(90):  # nothing in flight: a pure score-proportional sequence, no binomial noise
        lease = r.acquire()
        assert lease is not None
        counts[lease.miner.uid] += 1
        r.release(lease)
    assert counts == {1: 60, 2: 30, 3: 0}
    a = r.acquire_uid(1)
    b = r.acquire_uid(2)
    assert a is not None and b is not None
    lease = r.acquire()  # z is the only idle miner, but it is routed at 0: a busy positive one goes first
    assert lease is not None and lease.miner.uid in (1, 2)
    assert r.acquire(exclude={1, 2}).miner.uid == 3  # type: ignore[union-attr]  # last resort only


def test_adversarial_miners_without_user_work_are_paid_nothing(smoke: tuple[str, dict]) -> None:
    """Whatever the timing: a miner that serves only probes serves (almost) no user and earns (almost) nothing.

    Almost: its oracle knows every probe prompt, and the prompt generator now and then makes a user
    prompt identical to a probe's, which it then serves (1 of ~40 in a smoke run).
    """
    run = _runs(smoke[1], "adversarial")["project"]
    per = run["per_round"]
    honest_w = min(per[f"honest-{i}"]["weight"][-1] for i in (1, 2, 3))
    honest_served = min(sum(per[f"honest-{i}"]["served"]) for i in (1, 2, 3))
    assert honest_w > 0.0 and honest_served > 0
    for cheat in ("probes-only", "probes-stall"):
        assert sum(per[cheat]["probes"]) > 0, (cheat, per[cheat])
        assert sum(per[cheat]["served"]) <= 0.2 * honest_served, (cheat, per[cheat])
        assert per[cheat]["weight"][-1] <= 0.2 * honest_w, (cheat, per[cheat]["weight"], honest_w)


def test_a_card_that_serves_one_hotkeys_checks_after_the_others_earns_that_hotkey_almost_nothing(
        smoke: tuple[str, dict]) -> None:
    """Issue 38: one card as two hotkeys, the second serving its capacity-check streams only after the first's (its
    first tokens late, or on time with the decode held). Read to each stream's own end that was 1 + 0.11 and 1 + 0.5
    cards; the second hotkey now reads almost none, so the card earns about one card's weight. Judged on the second
    hotkey alone: the group's total is the first hotkey's, an honest card's, whose noise is larger than the margin."""
    run = _runs(smoke[1], "adversarial")["project"]
    per = run["per_round"]
    honest_w = min(per[f"honest-{i}"]["weight"][-1] for i in (1, 2, 3))
    assert honest_w > 0.0
    for held in ("split-serial/1", "split-stall/1"):
        assert per[held]["weight"][-1] <= 0.2 * honest_w, (held, per[held]["weight"], honest_w)
        assert min(per[held]["cards"][2:]) <= 0.2, (held, per[held]["cards"])  # read as a sliver of a card


# Targets of the adversarial smoke whose margin is inside the noise of 8 rounds: judged over the full run's 3 seeds
# (docs/pages/performance.md), printed here. Over the full runs (2026-12-07, quiet and beside two CPU hogs, figures
# there): the self-dealer, the honest card with invisible load, identical honest cards, the honest card with a 50 ms
# first token, and the two groups made of an honest card and a sibling served after it (judged there on the sibling
# alone, at most 0.1 of an honest card: the group's total carries the honest card's own noise; here on the sibling
# alone too, above, at 0.2 over the smoke's 8 rounds), one card as 2 hotkeys, the same split unevenly and the uneven
# split tuned to the one-card band (each paid about as one card or a little under it since 2026-12-07, their margins
# inside the noise of 8 rounds).
STATISTICAL = ("cheater 'self-dealer'", "honest card with invisible load", "identical honest cards",
               "honest card with a 50 ms first token", "cheater 'split-serial'", "cheater 'split-stall'",
               "cheater 'split-2'", "cheater 'split-uneven'", "cheater 'split-part'")


def test_adversarial_cheaters_out_earn_no_honest_card(smoke: tuple[str, dict]) -> None:
    """Issues 14 and 23: every cheater of both exploit tables ends under its bound even in the smoke run."""
    run = _runs(smoke[1], "adversarial")["project"]
    judged = [t for t in run["targets"] if not t["name"].startswith(STATISTICAL)]
    assert len(judged) >= 15
    failed = [f"{t['name']}: {t['detail']}" for t in judged if not t["ok"]]
    assert not failed, failed
    # one card as 2 hotkeys, judged over the full runs at 1.05x: here, it must at least not earn a second card
    (pair,) = [t["detail"] for t in run["targets"] if t["name"].startswith("cheater 'split-2'")]
    ratio = re.search(r": ([\d.]+)x;", pair)
    assert ratio is not None and float(ratio.group(1)) <= 1.3, pair


def test_the_invisible_load_line_splits_its_weight_into_requests_served_and_pay_for_each(
        smoke: tuple[str, dict]) -> None:
    """The invisible-load card's weight is the router's share times the pay per request: the line says both, and
    they multiply back to the weight it prints."""
    run = _runs(smoke[1], "adversarial")["project"]
    (line,) = [t["detail"] for t in run["targets"] if t["name"].startswith("honest card with invisible load")]
    m = re.search(r"weight ([\d.]+)x: served ([\d.]+)x an unloaded card's requests, weight per request served "
                  r"([\d.]+)x", line)
    assert m, line
    weight, served, per_request = map(float, m.groups())
    assert served > 0 and abs(served * per_request - weight) <= 0.01 + 0.005 * (served + per_request), line


def test_two_gateways_sharing_redis_never_send_a_miner_more_than_its_slots(redis_url: str,
                                                                            tmp_path: Path) -> None:
    """The burst scenario (bursts of 2-16 against two 4-slot cards) through two gateways, each its own router,
    leases in Redis: no miner ever refuses a stream for its slots being full (with the leases off, measured: 30
    such refusals and 15 client 429s in the same run), and every answer is served once."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "soak.py"), "--smoke", "--scenario", "burst",
                           "--router", "project", "--no-proposal", "--gateways", "2", "--redis-url", redis_url,
                           "--out", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads((tmp_path / "soak.json").read_text())["scenarios"]["burst"][0]
    ok = run["client"].get("200", 0)
    assert ok > 20 and ok == sum(run["client"].values()), run["client"]
    assert sum(m["served"] for m in run["miners"]) == ok
    assert [m["refused_busy"] for m in run["miners"]] == [0, 0]
    assert all(m["max_in_flight_at_dispatch"] <= 3 for m in run["miners"])  # subnet-wide, at dispatch


def test_the_validators_scenario_records_the_chains_epochs_for_three_validators(smoke: tuple[str, dict]) -> None:
    """The soak with three validators (issue 57) ran the local subnet's Yuma 3 epochs and reports, per validator,
    vtrust and dividends over stake, per miner incentive over the identical honest cards' mean (figures not judged
    in a smoke: eight 5-second rounds)."""
    out, report = smoke
    assert "### validators:" in out and "identical honest cards" in out
    (run,) = report["validators"]
    assert run["epochs"] >= 4 and len(run["epoch_log"]) == run["epochs"]
    for epoch in run["epoch_log"]:
        stakes = [v["stake"] for v in epoch["validators"].values()]
        assert sorted(stakes) == pytest.approx([0.2, 0.3, 0.5])
        assert all(0 <= v["vtrust"] <= 1 for v in epoch["validators"].values())
        incentive = sum(m["incentive"] for m in epoch["miners"].values())
        assert incentive == pytest.approx(1.0, abs=1e-3) or incentive == 0
    if run["used"]:
        assert set(run["validators"]) == {"0", "1", "2"} and len(run["miners"]) == 4
