#!/usr/bin/env python3
"""Soak: routing fairness and incentive soundness, real gateway + router + miners + scoring, compressed time.

Each scenario runs the real :class:`gateway.app.Gateway` and router, reference miners
(``neurons.miner``) serving the simulated RTX 5090 runtime, probes and the :class:`scoring.Scorer`
on loopback, under the project's router and under the deterministic tie-break (the known-bad
baseline), and prints per miner: requests served and share, TTFT p50/p95, round credits, settled
score and final weight; the summary figures; and the targets as PASS/FAIL lines. It writes a PNG
per scenario (share and credit per round, one line per miner, a column per router) and a JSON.

Time compression (``--time-scale S``): every duration is simulated and slept as ``1/S`` real
seconds; the gateway's measurements are multiplied back by S before credit, the credit bands stay
the production ones (details in ``scripts/soak_lib/timescale.py``). The validator's own per-token
and per-request overhead is multiplied by S too: above about 10 the measured decode rate of a
5090 starts to fall under the credit's tolerance on a loaded 2-core machine.

Examples::

    python scripts/soak.py --smoke                              # seconds, for CI
    python scripts/soak.py --scenario seed --router both        # one simulated hour, ~6 min
    python scripts/soak.py --scenario all --out soak-out        # everything (~17 min)
    python scripts/soak.py --scenario validators --seeds 3      # three validators, Yuma on the local chain
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib.procs import start_redis  # noqa: E402
from loguru import logger  # noqa: E402
from soak_lib.harness import RunOptions, RunResult, run_scenario  # noqa: E402
from soak_lib.plot import plot_scenario  # noqa: E402
from soak_lib.report import format_table, summarize, target_lines, to_json  # noqa: E402
from soak_lib.routers import ROUTERS  # noqa: E402
from soak_lib.scenarios import DEFAULT_SCALE, Scenario, build_scenarios, run_scale, time_scale  # noqa: E402
from soak_lib.validators import format_report, run_seed  # noqa: E402
from soak_lib.validators import summarize as summarize_validators  # noqa: E402

SCENARIO_NAMES = ("seed", "burst", "mixed", "capacity", "adversarial", "validators")


def _positive(text: str) -> float:
    """A time scale: simulated seconds per real second, so more than 0 and finite."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def _count(text: str) -> int:
    """A number of seeds or rounds: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python scripts/soak.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--scenario", default="all", choices=(*SCENARIO_NAMES, "all"),
                   help="seed: 2 identical cards, 1 request/20 s, never overlapping; burst: bursts of 2-16; "
                        "mixed: 4 cards of different speeds, one degrades, one dies and returns; "
                        "capacity: one miner with twice the slots; adversarial: honest cards (one with other "
                        "validators' load) next to every cheater of issue 14 (project router only); validators: "
                        "three validators (stakes 50/30/20 %, traffic 0/30/70 %) sharing every miner, the local "
                        "chain's Yuma 3 epoch judging what they set (scripts/soak_lib/validators.py)")
    p.add_argument("--seeds", type=_count, default=3,
                   help="validators scenario: seeds run one after the other, from --seed (the smoke runs one)")
    p.add_argument("--rounds", type=_count, default=16,
                   help="validators scenario: rounds a seed (5 s each, an epoch a round; the smoke runs 8)")
    p.add_argument("--router", default="both", choices=(*ROUTERS, "both", "all"),
                   help="project: gateway.router.Router as the validator wires it (slots learned from X-Miner-Slots); "
                        "deterministic: fewest in flight then highest score; slots: the project router with slot "
                        "counts learned from /health (proposal); smooth: least in flight, then smooth weighted "
                        "round robin, zero scores last (proposal); both: project+deterministic; all: the four")
    p.add_argument("--no-proposal", dest="proposal", action="store_false",
                   help="do not add the proposal routers (smooth; slots for capacity) next to the chosen ones")
    p.add_argument("--time-scale", type=_positive, default=None,
                   help="simulated seconds per real second (cards, rounds, traffic, probes; credit sees simulated s); "
                        f"default {DEFAULT_SCALE:g}, the adversarial scenario 5 (scenarios.py says why)")
    p.add_argument("--window", type=int, default=12, help="settlement window, in rounds")
    p.add_argument("--seed", type=int, default=1, help="seed of cards, traffic, probes and routers")
    p.add_argument("--util-ttft", type=float, default=12.0,
                   help="seed scenario: simulated seconds of extra TTFT per unit of recent busy fraction "
                        "(stands for other validators' load following the same routing; 0 disables)")
    p.add_argument("--util-cap", type=float, default=0.7, help="cap of that extra TTFT, simulated seconds")
    p.add_argument("--sequential-routers", action="store_true",
                   help="run the routers of a scenario one after the other instead of side by side")
    p.add_argument("--gateways", type=int, default=1,
                   help="gateways sharing their state through Redis (issue 28), the requests spread over them; "
                        "above 1 starts Debian's redis-server on a free port unless --redis-url is given")
    p.add_argument("--redis-url", default=None, help="the Redis the gateways share (with --gateways above 1)")
    p.add_argument("--smoke", action="store_true",
                   help="a few short rounds at a high time scale, for CI: checks the plumbing, not the figures "
                        "(the adversarial scenario runs at twice its full run's time scale, its cheaters judged)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target FAILs")
    p.add_argument("--out", type=Path, default=Path("soak-out"), help="directory for the PNGs and soak.json")
    p.add_argument("--cards", choices=("scenario", "apart", "in-process"), default="scenario",
                   help="where the simulated cards run: in a process of their own (apart, the adversarial scenario's "
                        "default) or on the gateway's event loop (in-process, the others' default)")
    p.add_argument("--log-level", default="WARNING", help="loguru level for the gateway, miners and scorer")
    return p


def routers_for(args: argparse.Namespace, sc: Scenario) -> list[str]:
    if sc.name == "adversarial":  # a test of the pay rules, not a comparison of routers
        return ["project"]
    kinds = {"both": ["project", "deterministic"], "all": list(ROUTERS)}.get(args.router, [args.router])
    proposal = "slots" if sc.name == "capacity" else "smooth"
    if args.proposal and proposal not in kinds:
        kinds = [*kinds, proposal]
    return kinds


async def run_all(args: argparse.Namespace) -> int:
    window = 2 if args.smoke else args.window
    scale = run_scale(smoke=args.smoke, requested=args.time_scale)
    with contextlib.ExitStack() as stack:
        redis_url = args.redis_url
        if args.gateways > 1 and redis_url is None:
            redis_url = redis_server(stack)
        opts = RunOptions(scale=scale, seed=args.seed, window=window, util_ttft_s=args.util_ttft,
                          util_cap_s=args.util_cap, gateways=args.gateways, redis_url=redis_url,
                          cards_apart={"apart": True, "in-process": False}.get(args.cards), log_level=args.log_level)
        return await _run_all(args, opts, window)


def redis_server(stack: contextlib.ExitStack) -> str:
    """Debian's redis-server on a free loopback port, in memory, for this run only."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("--gateways above 1 needs Debian's redis-server (apt-get install -y redis-server) "
                         "or --redis-url")
    return start_redis(stack, exe)[0]


async def _run_all(args: argparse.Namespace, opts: RunOptions, window: int) -> int:
    scenarios = build_scenarios(window=window, smoke=args.smoke)
    names = SCENARIO_NAMES if args.scenario == "all" else (args.scenario,)
    t0 = time.monotonic()
    report: dict[str, list[dict]] = {}
    validators: list[dict] = []
    failed = 0
    gateways = f", {opts.gateways} gateways sharing {opts.redis_url}" if opts.gateways > 1 else ""
    print(f"soak: time scale {opts.scale:g} (or a scenario's own), settlement window {window} rounds, "
          f"seed {args.seed}{gateways}" + (" (smoke)" if args.smoke else ""), flush=True)
    for name in names:
        if name == "validators":  # not a router comparison: its own section of the JSON
            validators = await _run_validators(args)
            continue
        sc = scenarios[name]
        sc_opts = dataclasses.replace(opts, scale=time_scale(sc, smoke=args.smoke, requested=args.time_scale),
                                      window=sc.window or opts.window)
        kinds = routers_for(args, sc)
        print(f"\n### {sc.name}: {sc.description}; routers {', '.join(kinds)}", flush=True)
        results: dict[str, RunResult] = {}
        if args.sequential_routers:
            for k in kinds:
                results[k] = await run_scenario(sc, k, sc_opts)
        else:
            done = await asyncio.gather(*(run_scenario(sc, k, sc_opts) for k in kinds))
            results = dict(zip(kinds, done, strict=True))
        summaries = {k: summarize(sc, r) for k, r in results.items()}
        for k, r in results.items():
            print(format_table(sc, r, summaries[k]), flush=True)
        lines = target_lines(sc, summaries)
        failed += sum(1 for line in lines if line.startswith("FAIL"))
        print("\n".join(lines), flush=True)
        path, why = plot_scenario(sc, results, args.out)
        print(f"plot: {path}" if path else f"plot: {why}", flush=True)
        report[name] = [to_json(sc, r, summaries[k]) for k, r in results.items()]
    args.out.mkdir(parents=True, exist_ok=True)
    wall = time.monotonic() - t0
    meta = {"time_scale": opts.scale, "window": window, "seed": args.seed, "smoke": args.smoke, "wall_s": wall,
            "util_ttft_s": args.util_ttft, "util_cap_s": args.util_cap,
            "options": dataclasses.asdict(opts)}
    (args.out / "soak.json").write_text(json.dumps({"meta": meta, "scenarios": report, "validators": validators},
                                                          indent=1, default=str))
    print(f"\nsoak done in {wall:.0f} s wall; {failed} target(s) failed; json: {args.out / 'soak.json'}")
    return 1 if (failed and args.strict) else 0


async def _run_validators(args: argparse.Namespace) -> list[dict]:
    """The validators scenario: the local subnet with three validators, a seed at a time (soak_lib/validators.py)."""
    seeds = [args.seed + i for i in range(1 if args.smoke else args.seeds)]
    rounds = 8 if args.smoke else args.rounds
    print(f"\n### validators: three validators sharing every miner, {rounds} rounds of 5 s, seeds {seeds}",
          flush=True)
    summaries = []
    for seed in seeds:
        run = await run_seed(seed, rounds=rounds, round_s=5.0, block_time=0.25, rps=4.0)
        summaries.append({**summarize_validators(run), "epoch_log": run.epochs})
    print(format_report(summaries), flush=True)
    return summaries


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logger.remove()
    logger.add(sys.stderr, level=args.log_level.upper(), format="{time:HH:mm:ss} {level: <7} {message}")
    try:
        return asyncio.run(run_all(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
