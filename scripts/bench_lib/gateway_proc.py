"""The tensorgate gateway as a standalone process over given miner ports, for the benchmarks.

Wired by the validator's own :func:`neurons.validator.build.build_parts`: real routing (weighted-random
least-in-flight), real signing (btauth, one receiver hotkey per miner) and real measurement, the
measurement queue drained into the scorer twice a second and a round closed every 20 s, as the
validator does (compressed). It runs in its own process so its CPU and RSS can be read from ``/proc``.

Prints ``READY {"port": ..., "pid": ...}`` once listening; exits when killed, when its parent dies,
or after ``--max-seconds``::

    python scripts/bench_lib/gateway_proc.py --miner 127.0.0.1:8091=5F... --miner 127.0.0.1:8092=5G... \
        --key sk-bench --model bench
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path

from loguru import logger

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/, for bench_lib

from bench_lib.fake_upstream import validator_keypair  # noqa: E402
from gateway.router import Candidate  # noqa: E402
from neurons.validator.build import build_parts  # noqa: E402
from neurons.validator.config import ValidatorConfig  # noqa: E402


def parse_miner(spec: str, uid: int) -> Candidate:
    """``HOST:PORT=SS58`` (``=SLOTS`` optional at the end) as a router candidate."""
    parts = spec.split("=")
    if len(parts) not in (2, 3):
        raise argparse.ArgumentTypeError(f"bad --miner {spec!r}: want HOST:PORT=SS58[=SLOTS]")
    slots = int(parts[2]) if len(parts) == 3 else 1
    return Candidate(uid=uid, hotkey=parts[1], endpoint=parts[0], slots=slots)


async def serve(candidates: list[Candidate], key: str, models: list[str], seed: int, max_seconds: float,
                drain_every: float, round_every: float = 20.0) -> None:
    parent = os.getppid()
    parts = build_parts(ValidatorConfig(gateway_port=0, models=models, seed=seed), validator_keypair(),
                        api_keys=[key], env={})
    parts.router.sync(candidates)
    sink = parts.measurements
    drained = 0
    await parts.gateway.start()
    try:
        print("READY " + json.dumps({"port": parts.gateway.port, "pid": os.getpid()}), flush=True)
        loop = asyncio.get_running_loop()
        end = loop.time() + max_seconds
        next_round = loop.time() + round_every
        while os.getppid() == parent and loop.time() < end:
            await asyncio.sleep(drain_every)
            for m in sink.drain():  # as the validator does: the measurement queue feeds the scorer
                parts.scorer.record(m)
                drained += 1
            if loop.time() >= next_round:  # and rounds close, so the round in progress stays bounded
                parts.scorer.close_round()
                next_round += round_every
    finally:
        await parts.aclose()
        logger.info("gateway bench process done: {} measurements drained, {} overflowed",
                    drained + len(sink), sink.overflowed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run the tensorgate gateway over fixed miners (benchmark helper).")
    p.add_argument("--miner", action="append", required=True, help="HOST:PORT=SS58[=SLOTS] (repeatable)")
    p.add_argument("--key", default="sk-bench", help="the API key clients send as a bearer token")
    p.add_argument("--model", action="append", default=None, help="served model name (repeatable)")
    p.add_argument("--seed", type=int, default=7, help="router RNG seed")
    p.add_argument("--drain-every", type=float, default=0.5, help="seconds between measurement-queue drains")
    p.add_argument("--round-every", type=float, default=20.0, help="seconds between scoring rounds closed")
    p.add_argument("--log-level", default="WARNING", help="loguru level on stderr")
    p.add_argument("--max-seconds", type=float, default=3600.0, help="exit after this long regardless")
    a = p.parse_args(argv)
    logger.remove()
    logger.add(sys.stderr, level=a.log_level)
    cands = [parse_miner(spec, uid) for uid, spec in enumerate(a.miner)]
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(cands, a.key, a.model or ["bench"], a.seed, a.max_seconds, a.drain_every, a.round_every))
    return 0


if __name__ == "__main__":
    sys.exit(main())
