#!/usr/bin/env python3
"""Where sampled requests go, and what a miner without the subnet's sampler earns, with and without the preference.

A stock runtime (SGLang, llama-server, vLLM without the plugin) answers a sampled request with its own RNG: a free
draw, unverified and unpaid (``scoring/pay.py``). Since issue 37 the router sends a sampled request to a free miner
that declares the sampler first (``Router.acquire(sampled=True)``). This event simulation runs the real router:
three identical cards of ``--slots`` slots, two declaring the sampler and one stock, requests arriving at random
(Poisson) with random service times (exponential) at a given utilisation, ``--sampled`` of them sampled (0.93: the
realistic organic mix of ``neurons.validator.prompts``). It prints, with the preference off ("before") and on:

* the share of sampled requests a stock card answered (unverified for the user);
* each card's paid requests (greedy ones, and sampled ones for sampler cards) relative to a sampler card's.

Example::

    .venv/bin/python scripts/bench_stock_sampler.py            # ~10 s
    .venv/bin/python scripts/bench_stock_sampler.py --smoke
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_lib.router_sim import arrivals  # noqa: E402

from gateway.router import Candidate, Lease, Router  # noqa: E402


def simulate(utilisation: float, prefer: bool, *, requests: int, slots: int, sampled_share: float,
             seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    r = Router(rng=random.Random(seed + 1))
    r.sync([Candidate(uid=u, hotkey=f"hk{u}", endpoint=f"e{u}", slots=slots) for u in range(3)])
    r.set_scores({f"hk{u}": 1.0 for u in range(3)})
    for m in r.miners():
        m.declares_sampler = m.uid != 2  # uid 2: the stock runtime
    rate = utilisation * 3 * slots  # arrivals per unit service time
    served = {u: [0, 0] for u in range(3)}  # uid -> [greedy, sampled]
    dropped = 0
    sampled = False

    def acquire() -> Lease | None:
        nonlocal sampled
        sampled = rng.random() < sampled_share
        if r.free_slots() == 0:
            return None  # the gateway would queue it; the figure counts where served requests go
        lease = r.acquire(sampled=sampled and prefer)
        assert lease is not None
        return lease

    for lease in arrivals(r, rate=rate, requests=requests, rng=rng, acquire=acquire,
                          hold=lambda: rng.expovariate(1.0)):
        if lease is None:
            dropped += 1
            continue
        served[lease.miner.uid][int(sampled)] += 1
    sampled_total = sum(s for _, s in served.values()) or 1
    paid = {u: g + (s if u != 2 else 0) for u, (g, s) in served.items()}
    honest = (paid[0] + paid[1]) / 2 or 1
    return {"stock_sampled_share": served[2][1] / sampled_total, "stock_paid_vs_honest": paid[2] / honest,
            "stock_requests_vs_honest": sum(served[2]) / ((sum(served[0]) + sum(served[1])) / 2 or 1),
            "dropped": dropped / requests}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=60_000)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--sampled", type=float, default=0.93)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args(argv)
    n = 3000 if a.smoke else a.requests
    print(f"3 identical cards x {a.slots} slots, 2 with the subnet's sampler, 1 stock; {a.sampled:.0%} sampled; "
          f"{n} requests per row")
    print("| utilisation | sampled answered by the stock card (before -> now) | stock card's requests vs a sampler "
          "card's | stock card's paid requests vs a sampler card's |")
    print("| --- | --- | --- | --- |")
    ok = True
    for u in (0.2, 0.5, 0.8, 0.95):
        before = simulate(u, False, requests=n, slots=a.slots, sampled_share=a.sampled, seed=a.seed)
        now = simulate(u, True, requests=n, slots=a.slots, sampled_share=a.sampled, seed=a.seed)
        ok &= now["stock_sampled_share"] <= before["stock_sampled_share"]
        print(f"| {u:.0%} | {before['stock_sampled_share']:.1%} -> {now['stock_sampled_share']:.1%} | "
              f"{before['stock_requests_vs_honest']:.2f}x -> {now['stock_requests_vs_honest']:.2f}x | "
              f"{before['stock_paid_vs_honest']:.2f}x -> {now['stock_paid_vs_honest']:.2f}x |")
    print("PASS" if ok else "FAIL", " the preference never sends more sampled requests to the stock card")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
