#!/usr/bin/env python3
"""What verification costs and how well it separates honest miners from cheaters, on the real model.

Measured side by side in one run, on this machine, with Gemma 3 270M (the packaged model) on
llama.cpp: a miner's engine generates answers on one thread while the validator's reference audits
them on another (the exact ``neurons.reference.llama`` code path, minus HTTP), so each side has
a core, as on a 2-core box running both.

Printed:

* generation time of each answer and verification time of the same tokens (target: verification
  <= 50 % of generation on this CPU);
* the false-failure rate over ``--honest`` audited honest answers (target 0; >= 500 for the issue's
  figure), with the distributions the bands were chosen from (greedy: worst gap per answer;
  sampled: |z| per answer);
* the detection rate of each cheating miner of :mod:`neurons.miner.runtimes.cheats` over
  ``--per-cheat`` answers (target 100 %), by greedy and sampled requests, and the chance such a miner
  is quarantined within 10 audits (2 strikes), computed from its measured per-answer rate. A cheat's
  answer that is, token for token, the honest miner's answer to the same request and seed (a prompt
  cut the model ignores, say) is counted apart as an "honest twin": it is the work the subnet pays
  for, and no audit can or should fail it. A cheat's answer that passed with no token further from
  the reference's choice than the honest answers' own worst is a "near twin": failing it would fail
  honest answers too. The gate is 100 % over the rest ("detected beyond").

* the per-miner sequential test (:mod:`scoring.audit.sequential`) over each miner's audited answers in
  ``--runs`` random orders: the audited tokens until it alarms (p50, p95), the share of runs caught within
  1,000 tokens (target >= 99 % for the Q2_K and Q3_K_M requantizations and the truncated prompt), and the honest
  runs that alarmed (target 0). Besides the cheats every audit must catch, the subtle ones are measured
  here: ``warm`` (the temperature 0.1 too high, reported), ``no-nucleus`` (the asked ``top_p`` ignored,
  reported; run it with ``--top-p``, the mix rarely asks for one) and the packaged model requantized to Q3_K_M
  and Q2_K with llama.cpp's quantizer, served with the subnet's sampler.

Requests carry the subnet sampler's seed, as the gateway sends them; ``--free-sampling`` drops it
(sampled answers then judged by plausibility, as under ``--gateway.free-sampling``).

Requests come from the ``cpu`` prompt mix (probes' shapes; a quarter greedy, the rest temperature
0.2-1.2), seeded. ``--top-p P`` asks every sampled request for nucleus ``P``: the nucleus's edge is where
two runtimes' numerics disagree most, and the mix asks for one only now and then.

Example::

    .venv/bin/python scripts/bench_audit.py --smoke            # ~1 min: 20 honest, 6 per cheat
    .venv/bin/python scripts/bench_audit.py --honest 500 --per-cheat 40
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib.stats import percentile, table, verdict  # noqa: E402


def check(name: str, ok: bool, figure: str) -> bool:
    print(f"  {verdict(ok)}  {name}: {figure}")
    return ok

from gateway.protocol.measurement import Answer  # noqa: E402
from gateway.protocol.sampling import SamplingParams, wire_seed  # noqa: E402
from neurons.miner.runtimes.cheats import CHEATS, no_nucleus, requantized, warm  # noqa: E402
from neurons.miner.runtimes.llama import Generate, answer_once  # noqa: E402
from neurons.model.engine import EngineThread, LlamaEngine  # noqa: E402
from neurons.model.packaged import model_path  # noqa: E402
from neurons.reference.llama import LlamaReference  # noqa: E402
from neurons.validator.prompts import MIXES, PromptGenerator, asking_nucleus  # noqa: E402
from scoring.audit import AuditBands, StrikePolicy, Verdict  # noqa: E402
from scoring.audit.sequential import SequentialTest  # noqa: E402

RATIO_TARGET = 0.5


@dataclass
class Case:
    kind: str  # "honest" or a cheat's name
    answer: Answer
    gen_s: float
    verdict: Verdict | None = None
    verify_s: float = 0.0
    honest_twin: bool = False  # a cheat's answer token for token what an honest miner sends (seeded or greedy)


def _generate(engine: LlamaEngine, payload: dict[str, Any], rng: random.Random, kind: str,
              gen: Generate | None) -> tuple[Answer, float]:
    sampling = SamplingParams.of(payload)
    t0 = time.perf_counter()
    text, ids, finish = answer_once(engine, payload["messages"], payload["max_tokens"], sampling, rng, gen)
    dt = time.perf_counter() - t0
    return Answer(messages=payload["messages"], sampling=sampling, max_tokens=payload["max_tokens"], stop=(),
                  text=text, token_ids=tuple(ids), finish_reason=finish), dt


SUBTLE: dict[str, Generate | None] = {"warm": warm, "no-nucleus": no_nucleus, "Q3_K_M": None,
                                      "Q2_K": None}  # None: a requantized model


async def run(args: argparse.Namespace) -> int:
    path = model_path()
    miner = EngineThread("miner")
    await miner.load(path, n_ctx=2048, threads=1)
    ref = LlamaReference(path, n_ctx=4096, threads=1)  # the same file the miner loaded
    await ref.start()
    engines: dict[str, EngineThread] = {}
    with tempfile.TemporaryDirectory(prefix="bench-audit-") as tmp:
        for kind, fn in SUBTLE.items():
            if fn is None:  # the packaged model at fewer bits, served honestly with the subnet's sampler
                engines[kind] = EngineThread(kind)
                await engines[kind].load(await asyncio.to_thread(requantized, path, kind, Path(tmp)), n_ctx=2048,
                                         threads=1)
    bands = AuditBands()
    prompts = PromptGenerator(random.Random(args.seed), MIXES["cpu"])
    rng = random.Random(args.seed + 1)
    plan: list[tuple[str, Generate | None]] = [("honest", None)] * args.honest
    for name, fn in {**CHEATS, **SUBTLE}.items():
        plan += [(name, fn)] * args.per_cheat
    queue: asyncio.Queue[Case | None] = asyncio.Queue(maxsize=4)
    cases: list[Case] = []

    async def produce() -> None:
        for kind, fn in plan:
            payload = prompts.payload("gemma")
            if args.top_p is not None:
                payload = asking_nucleus(payload, args.top_p)
            if not args.free_sampling:  # as the gateway sends every request: the subnet sampler's seed
                payload["seed"] = wire_seed(None, 0, rng.getrandbits(64))
            draw = rng.random()
            engine = engines.get(kind, miner)
            answer, gen_s = await engine.run(_generate, payload, random.Random(draw), kind, fn)
            twin = False
            if kind != "honest":  # free draws too: the same RNG draws the honest answer (own-rng under --free-sampling)
                honest, _ = await miner.run(_generate, payload, random.Random(draw), "honest", None)
                twin = (honest.token_ids, honest.finish_reason) == (answer.token_ids, answer.finish_reason)
            await queue.put(Case(kind, answer, gen_s, honest_twin=twin))
        await queue.put(None)

    async def verify() -> None:
        while (case := await queue.get()) is not None:
            t0 = time.perf_counter()
            case.verdict = await ref.audit(case.answer, bands)
            case.verify_s = time.perf_counter() - t0
            cases.append(case)
            if len(cases) % 50 == 0:
                print(f"  ... {len(cases)}/{len(plan)} audited", file=sys.stderr)

    t0 = time.perf_counter()
    await asyncio.gather(produce(), verify())
    wall = time.perf_counter() - t0
    await miner.aclose()
    for engine in engines.values():
        await engine.aclose()
    await ref.aclose()
    return report(cases, wall, args)


def report(cases: list[Case], wall: float, args: argparse.Namespace) -> int:
    honest = [c for c in cases if c.kind == "honest"]
    audited = [c for c in honest if c.verdict is not None]
    ok = True
    print(f"\nbench_audit: Gemma 3 270M Q4_K_M, llama.cpp, 1 thread each side; {len(cases)} answers in {wall:.0f} s\n")

    tokens = [len(c.answer.token_ids or ()) for c in audited]
    gen = [c.gen_s for c in audited]
    ver = [c.verify_s for c in audited]
    ratios = [v / g for v, g in zip(ver, gen, strict=True) if g > 0]
    total_ratio = sum(ver) / sum(gen) if sum(gen) else float("nan")
    print(table(["honest answers", "n", "tokens p50", "gen s p50", "verify s p50", "verify/gen p50",
                 "verify/gen total"],
                [["all", len(audited), percentile(tokens, 50), f"{percentile(gen, 50):.2f}",
                  f"{percentile(ver, 50):.2f}", f"{percentile(ratios, 50):.2f}", f"{total_ratio:.2f}"]]))
    ok &= check("verification <= 50 % of generation (total over honest answers)", total_ratio <= RATIO_TARGET,
                  f"{total_ratio:.2f}")

    failed = [c for c in audited if c.verdict is not None and not c.verdict.passed]
    reasons = Counter(str(c.verdict.failure) for c in failed if c.verdict is not None)
    print(f"\nhonest false failures: {len(failed)}/{len(audited)} ({dict(reasons) or 'none'}); "
          f"not auditable: {len(honest) - len(audited)}")
    for c in failed[:5]:
        assert c.verdict is not None
        print(f"  T={c.answer.temperature} n={len(c.answer.token_ids or ())}: {c.verdict.detail}")
    ok &= check(f"no honest answer fails (over {len(audited)})", not failed, f"{len(failed)} failed")
    zs = [abs(c.verdict.z) for c in audited if c.verdict and c.verdict.z is not None]
    if zs:
        print(f"  sampled |z| (band {AuditBands().z_limit}): p50 {percentile(zs, 50):.2f}  p99 {percentile(zs, 99):.2f}"
              f"  max {max(zs):.2f}  (n={len(zs)})")
    # the honest spread of determined answers (greedy, or seeded sampling): what no audit may fail
    envelope = 0.0
    for label, mode in (("greedy", True), ("seeded", False)):
        mine = [c for c in audited if c.verdict and c.verdict.worst_gap is not None
                and c.answer.sampling.greedy == mode]
        if not mine:
            continue
        worst = [c.verdict.worst_gap or 0.0 for c in mine if c.verdict]
        positions = sum(len(c.answer.token_ids or ()) for c in mine)
        misses = sum(round(c.verdict.miss_share * len(c.answer.token_ids or ())) for c in mine if c.verdict)
        envelope = max(envelope, max(worst))
        print(f"  {label}: {misses} of {positions} positions off the reference's choice by more than "
              f"{AuditBands().greedy_gap} nats; worst gap per answer p99 {percentile(worst, 99):.2f}, "
              f"max {max(worst):.2f} (n={len(mine)})")

    rows = []
    for name in CHEATS:
        twins = sum(c.honest_twin for c in cases if c.kind == name)
        mine = [c for c in cases if c.kind == name and c.verdict is not None and not c.honest_twin]
        caught = [c for c in mine if c.verdict is not None and not c.verdict.passed]
        why = Counter(str(c.verdict.failure) for c in caught if c.verdict is not None)
        rate = len(caught) / len(mine) if mine else float("nan")
        # passed, yet no token further from the reference's choice than honest answers' own worst: near twins
        near = [c for c in mine if c.verdict is not None and c.verdict.passed and c.verdict.worst_gap is not None
                and c.verdict.worst_gap <= envelope]
        apart = len(mine) - len(near)
        beyond = len(caught) / apart if apart else float("nan")
        by_mode = []
        for greedy in (True, False):
            part = [c for c in mine if c.answer.sampling.greedy == greedy]
            hit = [c for c in part if c.verdict is not None and not c.verdict.passed]
            by_mode.append(f"{len(hit)}/{len(part)}")
        why_text = ", ".join(f"{k} {v}" for k, v in why.most_common()) or "-"
        rows.append([name, len(mine), twins, f"{rate:.0%}", *by_mode, len(near), f"{beyond:.0%}",
                     f"{_quarantined_within(rate, 10):.1%}", why_text])
        if name in STRICT:
            ok &= check(f"cheater '{name}' detected on every answer beyond the honest spread", beyond == 1.0,
                        f"{beyond:.0%} ({rate:.0%} of all, {len(near)} near twins passed)")
    for name in SUBTLE:
        mine = [c for c in cases if c.kind == name and c.verdict is not None]
        caught = [c for c in mine if c.verdict is not None and not c.verdict.passed]
        rate = len(caught) / len(mine) if mine else float("nan")
        rows.append([name, len(mine), sum(c.honest_twin for c in cases if c.kind == name), f"{rate:.0%}",
                     "-", "-", "-", "-", f"{_quarantined_within(rate, 10):.1%}",
                     ", ".join(f"{k} {v}" for k, v in Counter(str(c.verdict.failure) for c in caught
                                                              if c.verdict).most_common()) or "-"])
    print()
    print(table(["cheater", "answers", "honest twins", "detected", "greedy", "sampled", "near twins",
                 "detected beyond", "quarantined in 10 audits", "why"], rows))
    ok &= sequential_report(cases, args)
    print(f"\n(honest twins: answers identical, token for token and in their end, to the honest miner's for the same "
          "request and seed; they are the work paid for and are left out of every rate. near twins: answers that "
          f"passed with no token further from the reference's choice than the honest answers' worst ({envelope:.2f} "
          "nats): no audit can fail them without failing honest ones. 'detected beyond' is the rate over the rest. "
          "greedy: reported, not gated; with free sampling it is detectable only where the asked temperature makes "
          "greedy decoding a different distribution)")
    return 0 if ok else 1


STRICT = ("random", "stop-early", "cached", "hot", "truncated")
SEQUENTIAL_WITHIN = 1000  # audited tokens within which the sequential test must catch the gated cheats
SEQUENTIAL_GATED = ("Q2_K", "Q3_K_M", "truncated")


def sequential_report(cases: list[Case], args: argparse.Namespace) -> bool:
    """The per-miner sequential test over each miner's audited answers, in ``args.runs`` random orders.

    The order of audits is the one thing the validator does not choose, so each run shuffles a miner's audited
    answers and feeds them to the test one at a time, as audits would come. The figure is the greedy or
    seeded positions audited until the alarm. Honest answers must never alarm, in any order.
    """
    test = SequentialTest()
    order = random.Random(args.seed + 2)
    ok = True

    def tokens_to_alarm(answers: list[Case]) -> int | None:
        s, seen = 0.0, 0
        for c in answers:
            assert c.verdict is not None
            s = test.update(s, positions=c.verdict.positions, misses=c.verdict.misses)
            seen += c.verdict.positions
            if test.alarmed(s):
                return seen
        return None

    rows = []
    honest = [c for c in cases if c.kind == "honest" and c.verdict is not None]
    false_alarms = 0
    for _ in range(args.runs):
        order.shuffle(honest)
        false_alarms += tokens_to_alarm(honest) is not None
    positions = sum(c.verdict.positions for c in honest if c.verdict)
    misses = sum(c.verdict.misses for c in honest if c.verdict)
    rows.append(["honest", len(honest), positions, misses, f"{misses / max(1, positions):.4f}", "-", "-",
                 f"{false_alarms}/{args.runs} runs alarmed"])
    for name in (*CHEATS, *SUBTLE):
        mine = [c for c in cases if c.kind == name and c.verdict is not None and not c.honest_twin]
        if not mine:
            continue
        runs = []
        for _ in range(args.runs):
            order.shuffle(mine)
            runs.append(tokens_to_alarm(mine))
        alarmed = sorted(r for r in runs if r is not None)
        within = sum(1 for r in runs if r is not None and r <= SEQUENTIAL_WITHIN) / len(runs)
        positions = sum(c.verdict.positions for c in mine if c.verdict)
        misses = sum(c.verdict.misses for c in mine if c.verdict)
        rows.append([name, len(mine), positions, misses, f"{misses / max(1, positions):.4f}",
                     f"{percentile(alarmed, 50):.0f}" if alarmed else "never",
                     f"{percentile(alarmed, 95):.0f}" if len(alarmed) == len(runs) else "not in every run",
                     f"{within:.1%} within {SEQUENTIAL_WITHIN}"])
        if name in SEQUENTIAL_GATED:
            ok &= check(f"sequential test catches '{name}' within {SEQUENTIAL_WITHIN} audited tokens in >= 99 % "
                        f"of runs", within >= 0.99, f"{within:.1%}")
    print(f"\nsequential test (p0 {test.p0}, p1 {test.p1}, threshold {test.threshold}) over each miner's audited "
          f"answers in {args.runs} random orders (honest twins left out):")
    print(table(["miner", "answers", "positions", "misses", "miss rate", "tokens to alarm p50", "p95", "caught"],
                rows))
    ok &= check(f"no honest false alarm (over {len(honest)} answers, {args.runs} orders)", false_alarms == 0,
                f"{false_alarms} runs alarmed")
    return ok


def _quarantined_within(p: float, audits: int, strikes: int = StrikePolicy().threshold) -> float:
    """P(at least ``strikes`` failures in ``audits`` audits) when each fails with probability ``p``."""
    if not 0.0 <= p <= 1.0:
        return float("nan")
    below = sum(math.comb(audits, k) * p**k * (1 - p) ** (audits - k) for k in range(strikes))
    return 1.0 - below


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--honest", type=int, default=500, help="honest answers to audit")
    p.add_argument("--per-cheat", type=int, default=40, help="answers per cheating miner")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--runs", type=int, default=200, help="random audit orders the sequential test is run in")
    p.add_argument("--smoke", action="store_true", help="20 honest answers, 6 per cheat")
    p.add_argument("--free-sampling", action="store_true",
                   help="no sampler seed (as --gateway.free-sampling): sampled answers judged by plausibility")
    p.add_argument("--top-p", dest="top_p", type=float, default=None,
                   help="ask every sampled request for this nucleus (0 < P <= 1) instead of the mix's")
    args = p.parse_args()
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        p.error(f"--top-p must be within (0, 1], got {args.top_p}")
    if args.smoke:
        args.honest, args.per_cheat = 20, 6
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
