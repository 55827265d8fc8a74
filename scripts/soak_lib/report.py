"""Turns soak runs into the per-miner table, summary figures and PASS/FAIL target lines.

Pure: :class:`~soak_lib.harness.RunResult` in, text and plain dicts out (JSON-ready).

Example::

    summary = summarize(scenario, result)
    print(format_table(scenario, result, summary))
    for line in target_lines(scenario, {"project": s1, "deterministic": s2}): print(line)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from scoring.rounds import percentile

from .harness import MinerSeries, RunResult
from .scenarios import CHEATERS, Scenario

SHARE_TOLERANCE = 0.10  # identical cards: within 10 % (relative) of the equal share
CREDIT_TOLERANCE = 0.03  # identical cards: final settled scores within 0.03
CAPACITY_CREDIT_SLACK = 0.01  # "without a lower credit": measurement noise allowance, stated in the line
CHEAT_BOUND = 1.0  # a cheater's final weight over an honest card's (mean of the unloaded honest cards)
SPLIT_BOUND = 1.05  # one card as several hotkeys, all of them together, over the same card as one hotkey
# A hotkey its card serves only after its other hotkey, which serves honestly: its own weight over an honest card's.
# The group's total is that honest hotkey's weight, whose noise over a 12-round run (identical cards up to 1.14x)
# is larger than SPLIT_BOUND's margin, plus this sibling's: the cheat's gain is the sibling's alone.
AFTER_SIBLING_BOUND = 0.1
NO_WORK_BOUND = 0.1  # a cheater with no real work to show (probes only, two-token answers): ~0
BACKGROUND_CREDIT_TOLERANCE = 0.05  # settled credit of a card carrying other validators' load vs unloaded
BACKGROUND_WEIGHT_FLOOR = 0.85  # ... and its weight over an unloaded honest card's
HONEST_WEIGHT_SPREAD = 1.15  # identical honest cards: the highest weight over the lowest
FAST_FIRST_SPREAD = 1.15  # an honest card with a quicker first token, same work: within this of the honest cards
SAME_CARD_BOUND = 1.05  # a cheat on a card over the same card serving honestly
CAPACITY_WEIGHT_BAND = (1.6, 2.4)  # twice the cards and slots: about twice the weight
DOMINANT_MARGIN = 0.15  # a round's top-share miner counts as dominant above 1/n + this


@dataclass
class Target:
    name: str
    ok: bool
    detail: str


@dataclass
class Summary:
    router: str
    total_served: int
    shares: dict[str, float]
    expected_shares: dict[str, float]  # proportional to the final settled credits (routing also weighs capacity)
    max_round_credit_diff: float | None  # identical cards, over rounds where both were measured
    final_settled_diff: float | None
    oscillations: int  # rounds whose dominant miner differs from the previous round's dominant miner
    starved: dict[str, int]  # rounds with 0 organic dispatches while alive (and traffic was there)
    targets: list[Target] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def _share_halfwidth(n: int, k: int) -> float:
    """95 % binomial half-width of one miner's share among ``k`` equally likely miners over ``n`` requests."""
    if n <= 0:
        return math.inf
    p = 1.0 / k
    return 1.96 * math.sqrt(p * (1 - p) / n)


def _dominant(series: list[MinerSeries], r: int) -> str | None:
    live = [s for s in series if s.alive[r]]
    if not live or sum(s.served[r] for s in live) == 0:
        return None
    top = max(live, key=lambda s: s.share[r])
    return top.label if top.share[r] > 1.0 / len(live) + DOMINANT_MARGIN else None


def summarize(sc: Scenario, res: RunResult) -> Summary:
    series = [res.series[label] for label in sc.labels]
    total = sum(sum(s.served) for s in series)
    shares = {s.label: (sum(s.served) / total if total else 0.0) for s in series}
    final = {s.label: s.settled[-1] for s in series}
    fsum = sum(final.values())
    expected = {k: (v / fsum if fsum else 0.0) for k, v in final.items()}
    max_diff = final_diff = None
    if len(sc.identical) >= 2:
        ids = [res.series[label] for label in sc.identical]
        diffs = []
        for r in range(res.rounds):
            cs = [s.credit[r] for s in ids]
            if all(c is not None for c in cs):
                diffs.append(max(cs) - min(cs))  # type: ignore[type-var, operator]
        max_diff = max(diffs) if diffs else None
        fs = [s.settled[-1] for s in ids]
        final_diff = max(fs) - min(fs)
    osc, prev = 0, None
    for r in range(res.rounds):
        d = _dominant(series, r)
        if d is not None and prev is not None and d != prev:
            osc += 1
        if d is not None:
            prev = d
    starved: dict[str, int] = {}
    for s in series:
        n = sum(1 for r in range(res.rounds)
                if s.alive[r] and s.dispatched[r] == 0 and sum(x.served[r] for x in series) >= 2 * len(series))
        if n:
            starved[s.label] = n
    summ = Summary(res.router, total, shares, expected, max_diff, final_diff, osc, starved)
    summ.targets = _targets(sc, res, summ)
    return summ


def _targets(sc: Scenario, res: RunResult, summ: Summary) -> list[Target]:
    out: list[Target] = []
    S = res.series
    if len(sc.identical) >= 2:
        diff = summ.final_settled_diff or 0.0
        out.append(Target("identical cards within 0.03 settled credit", diff <= CREDIT_TOLERANCE,
                          f"settled {', '.join(f'{x}={S[x].settled[-1]:.3f}' for x in sc.identical)}, "
                          f"diff {diff:.3f}"))
        k = len(sc.identical)
        n = sum(sum(S[x].served) for x in sc.identical)
        worst = max(abs(summ.shares[x] - 1 / k) * k for x in sc.identical)
        hw = _share_halfwidth(n, k) * k
        out.append(Target("identical cards within 10 % of equal share", worst <= SHARE_TOLERANCE,
                          f"shares {', '.join(f'{x}={summ.shares[x]:.3f}' for x in sc.identical)} of n={n}, "
                          f"worst {worst:.1%} off (a fair router's 95 % noise band is +-{hw:.1%})"))
    for slow, fast in sc.slower_than:
        ws, wf = S[slow].weight[-1], S[fast].weight[-1]
        out.append(Target(f"slower card {slow!r} weighs strictly less than {fast!r}", ws < wf,
                          f"weight {slow}={ws:.3f} < {fast}={wf:.3f}"))
    if sc.degrades is not None:
        deg = next(e.round for e in sc.events if e.action == "degrade")
        before = [c for c in S[sc.degrades].credit[:deg] if c is not None]
        after = [c for c in S[sc.degrades].credit[deg + 1:] if c is not None]
        b = sum(before) / len(before) if before else 0.0
        a = sum(after) / len(after) if after else 0.0
        out.append(Target(f"degraded card {sc.degrades!r} earns less after round {deg}", a < b,
                          f"mean round credit before {b:.3f}, after {a:.3f}"))
    if sc.dies is not None:
        die = next(e.round for e in sc.events if e.action == "die")
        back = next(e.round for e in sc.events if e.action == "revive")
        d = S[sc.dies]
        late = sum(d.dispatched[die + 1:back])
        out.append(Target(f"dead card {sc.dies!r} out of routing within one round", late == 0,
                          f"organic dispatches in rounds {die + 1}..{back - 1} (after the death round {die}): {late}"))
        settled_end = d.settled[back - 1]
        out.append(Target(f"dead card {sc.dies!r} settles to 0 within the window", settled_end <= 1e-9,
                          f"settled {d.settled[die - 1]:.3f} before death -> {settled_end:.3f} at round {back - 1}; "
                          f"after return: {sum(d.served[back:])} organic served, settled {d.settled[-1]:.3f}"))
    if sc.honest:
        out += _adversarial_targets(sc, S)
    if sc.big is not None:
        big, small = sc.big
        wb, ws = S[big].weight[-1], S[small].weight[-1]
        ratio = wb / ws if ws > 0 else math.inf
        lo, hi = CAPACITY_WEIGHT_BAND
        out.append(Target(f"{big!r} earns about twice the weight of {small!r}", lo <= ratio <= hi,
                          f"weight {wb:.3f} vs {ws:.3f}: {ratio:.2f}x (band {lo}-{hi})"))
        sb, ss = summ.shares[big], summ.shares[small]
        cb, cs = S[big].settled[-1], S[small].settled[-1]
        out.append(Target(f"{big!r} gets more traffic than {small!r} without a lower credit",
                          sb > ss and cb >= cs - CAPACITY_CREDIT_SLACK,
                          f"share {sb:.3f} vs {ss:.3f}; settled {cb:.3f} vs {cs:.3f} (slack {CAPACITY_CREDIT_SLACK})"))
    return out


def _adversarial_targets(sc: Scenario, S: dict[str, MinerSeries]) -> list[Target]:
    """Issue 14's proof: no cheater out-earns an honest card; invisible load costs an honest card nothing."""
    out: list[Target] = []
    honest_w = sum(S[x].weight[-1] for x in sc.honest) / len(sc.honest)
    honest_c = sum(S[x].settled[-1] for x in sc.honest) / len(sc.honest)
    groups: dict[str, list[str]] = {}
    for spec in sc.cards:
        key = spec.card or spec.label
        if key in CHEATERS:
            groups.setdefault(key, []).append(spec.label)
    for name, labels in groups.items():
        w = sum(S[x].weight[-1] for x in labels)
        ratio = w / honest_w if honest_w > 0 else math.inf
        after = [x for x in labels if x in sc.after_siblings]
        if after:  # judged on the sibling served after the card's honest hotkey (AFTER_SIBLING_BOUND)
            ws = sum(S[x].weight[-1] for x in after)
            rs = ws / honest_w if honest_w > 0 else math.inf
            out.append(Target(f"cheater {name!r} ({len(labels)} hotkeys on one card, {', '.join(after)} served "
                              f"after the other) earns <= {AFTER_SIBLING_BOUND}x an honest card's weight on "
                              f"{', '.join(after)}", rs <= AFTER_SIBLING_BOUND,
                              f"weight {ws:.4f} vs honest {honest_w:.4f}: {rs:.3f}x; the group {w:.4f}: "
                              f"{ratio:.2f}x (its honest hotkey's noise included)"))
            continue
        bound = NO_WORK_BOUND if CHEATERS[name] else SPLIT_BOUND if len(labels) > 1 else CHEAT_BOUND
        what = f"{len(labels)} hotkeys on one card" if len(labels) > 1 else "one hotkey"
        out.append(Target(f"cheater {name!r} ({what}) ends at <= {bound}x an honest card's weight", ratio <= bound,
                          f"weight {w:.4f} vs honest {honest_w:.4f}: {ratio:.2f}x; settled credit "
                          f"{sum(S[x].settled[-1] for x in labels) / len(labels):.3f}"))
    for cheat, same in sc.same_card:
        w, ws = S[cheat].weight[-1], S[same].weight[-1]
        ratio = w / ws if ws > 0 else (0.0 if w <= 0 else math.inf)
        vs_honest = w / honest_w if honest_w > 0 else math.inf
        out.append(Target(f"cheater {cheat!r} earns <= {SAME_CARD_BOUND}x its own card served honestly ({same!r})",
                          ratio <= SAME_CARD_BOUND,
                          f"weight {w:.4f} vs {ws:.4f}: {ratio:.2f}x; {vs_honest:.2f}x an honest 5090"))
    hw = [S[x].weight[-1] for x in sc.honest]
    spread = max(hw) / min(hw) if min(hw) > 0 else math.inf
    out.append(Target(f"identical honest cards within {HONEST_WEIGHT_SPREAD}x of each other's weight",
                      spread <= HONEST_WEIGHT_SPREAD, f"weights {', '.join(f'{x:.4f}' for x in hw)}: {spread:.2f}x"))
    if sc.fast_first is not None:
        w = S[sc.fast_first].weight[-1]
        ratio = w / honest_w if honest_w > 0 else math.inf
        ok = 1 / FAST_FIRST_SPREAD <= ratio <= FAST_FIRST_SPREAD
        out.append(Target(f"honest card with a 50 ms first token {sc.fast_first!r} within {FAST_FIRST_SPREAD}x of "
                          f"the honest cards' weight (same work: a quicker first token is not more cards)", ok,
                          f"weight {w:.4f} vs honest {honest_w:.4f}: {ratio:.2f}x; settled credit "
                          f"{S[sc.fast_first].settled[-1]:.3f}"))
    if sc.background is not None:
        b = S[sc.background]
        diff = abs(b.settled[-1] - honest_c)
        wr = b.weight[-1] / honest_w if honest_w > 0 else math.inf
        # What the weight is made of: the requests the router sent it (least-in-flight finds a card whose streams
        # last longer busy more often) and the pay for each, so a reader can tell the router's share from the pay.
        honest_served = sum(sum(S[x].served) for x in sc.honest) / len(sc.honest)
        sr = sum(b.served) / honest_served if honest_served > 0 else math.inf
        out.append(Target(f"honest card with invisible load {sc.background!r} within "
                          f"{BACKGROUND_CREDIT_TOLERANCE} settled credit of an unloaded one, weight >= "
                          f"{BACKGROUND_WEIGHT_FLOOR}x", diff <= BACKGROUND_CREDIT_TOLERANCE
                          and wr >= BACKGROUND_WEIGHT_FLOOR,
                          f"settled {b.settled[-1]:.3f} vs {honest_c:.3f} (diff {diff:.3f}); weight {wr:.2f}x: "
                          f"served {sr:.2f}x an unloaded card's requests, weight per request served "
                          f"{wr / sr if sr > 0 else math.inf:.2f}x; it carried {b.background_streams} streams of "
                          f"other validators next to {sum(b.served)} of this one's"))
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def miner_rows(sc: Scenario, res: RunResult) -> list[dict[str, Any]]:
    rows = []
    total = sum(sum(res.series[x].served) for x in sc.labels)
    for label in sc.labels:
        s = res.series[label]
        credits = [c for c in s.credit if c is not None]
        over = None
        if s.ttfts and s.runtime_ttfts:
            over = sum(s.ttfts) / len(s.ttfts) - sum(s.runtime_ttfts) / len(s.runtime_ttfts)
        rows.append({
            "miner": label, "uid": s.uid, "served": sum(s.served), "share": sum(s.served) / total if total else 0.0,
            "probes": sum(s.probes), "ttft_p50_s": percentile(s.ttfts, 50), "ttft_p95_s": percentile(s.ttfts, 95),
            "mean_round_credit": sum(credits) / len(credits) if credits else None,
            "round_credits": s.credit, "settled": s.settled[-1], "weight": s.weight[-1],
            "cards": s.cards[-1] if s.cards else None,
            "overhead_s": over, "max_in_flight_at_dispatch": s.max_in_flight_at_dispatch,
            "refused_busy": s.refused_busy,
        })
    return rows


def _cards(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_table(sc: Scenario, res: RunResult, summ: Summary) -> str:
    head = (f"{'miner':<12} {'uid':>3} {'served':>6} {'share':>6} {'expect':>6} {'probes':>6} {'p50ms':>6} "
            f"{'p95ms':>6} {'credit':>6} {'settled':>7} {'weight':>6} {'cards':>5} {'ovh_ms':>6}  round credits")
    lines = [f"== {sc.name} / router={res.router}: {res.rounds} rounds of {sc.round_s:.0f} s (simulated), "
             f"time scale {res.scale:g}, cards {'apart' if res.cards_apart else 'in-process'}, "
             f"wall {res.wall_s:.0f} s; client {dict(res.client)}", head]
    for row in miner_rows(sc, res):
        rc = " ".join("  -  " if c is None else f"{c:.2f}" for c in row["round_credits"])
        mc = row["mean_round_credit"]
        lines.append(
            f"{row['miner']:<12} {row['uid']:>3} {row['served']:>6} {row['share']:6.3f} "
            f"{summ.expected_shares[row['miner']]:6.3f} {row['probes']:>6} {_ms(row['ttft_p50_s']):>6} "
            f"{_ms(row['ttft_p95_s']):>6} {'-' if mc is None else f'{mc:.3f}':>6} {row['settled']:7.3f} "
            f"{row['weight']:6.3f} {_cards(row['cards']):>5} "
            f"{_ms(row['overhead_s']):>6}  {rc}")
    md = "-" if summ.max_round_credit_diff is None else f"{summ.max_round_credit_diff:.3f}"
    fd = "-" if summ.final_settled_diff is None else f"{summ.final_settled_diff:.3f}"
    starved = ", ".join(f"{k}: {v} rounds" for k, v in summ.starved.items()) or "none"
    lines.append(f"summary: identical cards max round-credit diff {md}, final settled diff {fd}; "
                 f"dominant-miner switches {summ.oscillations}; starved {starved}"
                 + (f"; overlapping dispatches {res.overlap_violations}" if res.sequential else "")
                 + (f"; slots seen {res.slots_seen}" if res.router == "slots" else ""))
    return "\n".join(lines)


def target_lines(sc: Scenario, summaries: dict[str, Summary]) -> list[str]:
    out = []
    for router, summ in summaries.items():
        for t in summ.targets:
            out.append(f"{'PASS' if t.ok else 'FAIL'} [{sc.name}/{router}] {t.name}: {t.detail}")
    return out


def to_json(sc: Scenario, res: RunResult, summ: Summary) -> dict[str, Any]:
    return {
        "scenario": sc.name, "router": res.router, "rounds": res.rounds, "round_s": sc.round_s,
        "time_scale": res.scale, "cards_apart": res.cards_apart, "wall_s": res.wall_s, "client": dict(res.client),
        "overlap_violations": res.overlap_violations, "slots_seen": res.slots_seen,
        "miners": miner_rows(sc, res),
        "per_round": {k: {"share": s.share, "credit": s.credit, "settled": s.settled, "weight": s.weight,
                          "served": s.served, "dispatched": s.dispatched, "alive": s.alive, "probes": s.probes,
                          "cards": s.cards,
                          "background_streams": s.background_streams}
                      for k, s in res.series.items()},
        "summary": {"shares": summ.shares, "expected_shares": summ.expected_shares,
                    "max_round_credit_diff": summ.max_round_credit_diff,
                    "final_settled_diff": summ.final_settled_diff, "oscillations": summ.oscillations,
                    "starved": summ.starved},
        "targets": [{"name": t.name, "ok": t.ok, "detail": t.detail} for t in summ.targets],
    }
