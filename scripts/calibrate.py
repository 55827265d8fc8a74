#!/usr/bin/env python3
"""Measure a reference runtime and write the credit profile an honest card of its kind earns full credit at.

The speed bar is the hardware's, so it is measured, not typed: this runs the honest runtime
(Gemma 3 270M on llama.cpp, this CPU, one thread per stream, as the local subnet's real miners run)
on the ``cpu`` prompt mix at 1 and at ``--streams`` concurrent streams, and derives:

* ``prefill_tok_s``: the slope of TTFT against prompt tokens (least squares);
* ``full_band_s``: the 95th percentile of TTFT less that prefill allowance, with ``--margin`` headroom
  (the load of a real deployment: gateway, other processes); ``zero_band_s`` three times it;
* ``decode_curve``: the median aggregate decode rate at each concurrency (per-request rate x n).

The file it writes is what ``--credit.profile PATH`` loads; the built-in ``cpu-gemma270m`` profile
holds this script's figures from the project's machine.

Example::

    .venv/bin/python scripts/calibrate.py --out ~/.tensorgate/cpu.json
    .venv/bin/python -m neurons.validator --local --local.runtime real --credit.profile ~/.tensorgate/cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib.stats import percentile, slope, table  # noqa: E402

from gateway.metering import StreamMeter  # noqa: E402
from neurons.miner.runtimes.llama import LlamaRuntime  # noqa: E402
from neurons.model.packaged import model_path  # noqa: E402
from neurons.validator.prompts import MIXES, PromptGenerator  # noqa: E402
from scoring.credit import CreditConfig  # noqa: E402
from scoring.profiles import save_profile  # noqa: E402


async def _one(rt: LlamaRuntime, payload: dict[str, object], out: list[tuple[int, float, int, float]]) -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    meter = StreamMeter(max_tokens=int(payload["max_tokens"]), started_at=t0)  # type: ignore[call-overload]
    async for frames in rt.stream(payload):
        meter.feed(frames, now=loop.time())
    if meter.ttft_s is not None and meter.usage is not None:
        decode_s = meter.last_content_at - (t0 + meter.ttft_s)
        out.append((meter.usage.get("prompt_tokens", 0), meter.ttft_s, meter.tokens, decode_s))


async def measure(streams: int, requests: int, seed: int) -> dict[int, list[tuple[int, float, int, float]]]:
    rt = LlamaRuntime(model_path(), slots=streams, threads=1, seed=seed)
    await rt.start()
    gen = PromptGenerator(random.Random(seed), MIXES["cpu"])
    results: dict[int, list[tuple[int, float, int, float]]] = {}
    try:
        for n in sorted({1, streams}):
            out: list[tuple[int, float, int, float]] = []
            for _ in range(max(1, requests // n)):
                batch = []
                for _ in range(n):
                    p = gen.payload("calibrate")
                    p["max_tokens"] = 48  # long enough for a decode rate, short enough to stay quick
                    p["stream_options"] = {"include_usage": True}
                    batch.append(p)
                await asyncio.gather(*(_one(rt, p, out) for p in batch))
            results[n] = out
    finally:
        await rt.aclose()
    return results


def derive(results: dict[int, list[tuple[int, float, int, float]]], margin: float) -> tuple[CreditConfig, dict]:
    single = results[1]
    prompts = [float(p) for p, _, _, _ in single]
    ttfts = [t for _, t, _, _ in single]
    per_tok = max(1e-6, slope(prompts, ttfts))
    prefill = 1.0 / per_tok
    residual = [t - p / prefill for p, t in zip(prompts, ttfts, strict=True)]
    full = round(max(0.05, percentile(residual, 95)) * margin, 3)
    curve = []
    measured: dict[str, object] = {"prefill_tok_s": round(prefill, 1), "ttft_residual_p95_s": percentile(residual, 95)}
    for n, rows in sorted(results.items()):
        rates = [(k - 1) / d for _, _, k, d in rows if k >= 16 and d > 0]
        agg = statistics.median(rates) * n if rates else float("nan")
        curve.append((n, round(agg, 1)))
        measured[f"aggregate_tok_s_at_{n}"] = round(agg, 2)
        measured[f"requests_at_{n}"] = len(rows)
    cfg = CreditConfig(full_band_s=full, zero_band_s=round(3 * full, 3), prefill_tok_s=round(prefill, 1),
                       decode_curve=tuple(curve))
    return cfg, measured


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("~/.tensorgate/cpu-gemma270m.json").expanduser())
    p.add_argument("--streams", type=int, default=2, help="concurrent streams of the second point of the curve")
    p.add_argument("--requests", type=int, default=24, help="requests per concurrency level")
    p.add_argument("--margin", type=float, default=1.5, help="headroom on the TTFT band for a loaded deployment")
    p.add_argument("--seed", type=int, default=11)
    args = p.parse_args()
    t0 = time.perf_counter()
    results = asyncio.run(measure(args.streams, args.requests, args.seed))
    cfg, measured = derive(results, args.margin)
    print(table(["figure", "value"], [[k, v] for k, v in measured.items()]))
    print(f"\nprofile: full credit TTFT <= {cfg.full_band_s} s (+ prompt / {cfg.prefill_tok_s} tok/s), zero at "
          f"{cfg.zero_band_s} s; decode curve {cfg.decode_curve} (aggregate tok/s by streams); "
          f"measured in {time.perf_counter() - t0:.0f} s")
    save_profile(cfg, args.out, measured={k: v for k, v in measured.items() if isinstance(v, int | float)})
    print(f"written to {args.out}: use it with --credit.profile {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
