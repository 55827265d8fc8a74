"""The tensorgate gateway as a standalone process over given miner ports, for the benchmarks.

Wired by the validator's own :func:`neurons.validator.build.build_parts`: real routing (weighted-random
least-in-flight), real signing (btauth, one receiver hotkey per miner) and real measurement, the
measurement queue drained into the scorer twice a second and a round closed every 20 s, as the
validator does (compressed). It runs in its own process so its CPU and RSS can be read from ``/proc``.

With ``--redis-url`` it is one of several gateway processes sharing Redis (gateway.shared), as
``--gateway.workers`` runs them: leases, key limits and measurements go through Redis; ``--port`` with
``--workers N`` lets N of them serve one port (SO_REUSEPORT), and the one started with ``--scorer`` reads the
measurement stream into the scorer and acknowledges each round, as the validator does.

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
from gateway.shared.measurements import MeasurementReader  # noqa: E402
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
                drain_every: float, round_every: float = 20.0, *, redis_url: str | None = None, port: int = 0,
                workers: int = 1, scorer: bool = True, keys_file: str | None = None) -> None:
    parent = os.getppid()
    cfg = ValidatorConfig(gateway_port=port, models=models, seed=seed, redis_url=redis_url, gateway_workers=workers,
                          api_keys_file=keys_file)
    parts = build_parts(cfg, validator_keypair(), api_keys=[key], env={})
    parts.router.sync(candidates)
    shared = parts.shared
    reader = MeasurementReader(shared.link) if shared is not None and scorer else None
    loops = [asyncio.create_task(fn(), name=name) for name, fn in (shared.loops().items() if shared else ())]
    sink = parts.measurements
    drained = 0
    unacked: list[str] = []
    await parts.gateway.start()
    try:
        print("READY " + json.dumps({"port": parts.gateway.port, "pid": os.getpid()}), flush=True)
        loop = asyncio.get_running_loop()
        end = loop.time() + max_seconds
        next_round = loop.time() + round_every
        while os.getppid() == parent and loop.time() < end:
            await asyncio.sleep(drain_every)
            batch = sink.drain() if reader is None else await reader.pull()
            for m in batch:  # as the validator does: the measurements feed the scorer
                parts.scorer.record(m)
                if m.ref is not None:
                    unacked.append(m.ref)
                drained += 1
            if loop.time() >= next_round:  # and rounds close, so the round in progress stays bounded
                parts.scorer.close_round()
                if reader is not None:
                    await reader.ack(unacked)
                    unacked.clear()
                next_round += round_every
    finally:
        await parts.aclose()
        for t in loops:
            t.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
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
    p.add_argument("--redis-url", default=None, help="share state with the other gateway processes here")
    p.add_argument("--port", type=int, default=0, help="port to serve (0: any free one)")
    p.add_argument("--workers", type=int, default=1, help="gateway processes serving --port together")
    p.add_argument("--no-scorer", action="store_true", help="with --redis-url: another process reads the stream")
    p.add_argument("--keys-file", default=None, help="API keys file (names and limits) besides --key")
    a = p.parse_args(argv)
    logger.remove()
    logger.add(sys.stderr, level=a.log_level)
    cands = [parse_miner(spec, uid) for uid, spec in enumerate(a.miner)]
    profile = os.environ.get("TENSORGATE_BENCH_PROFILE")  # a path: cProfile the gateway, stats written at SIGTERM
    if profile:
        import cProfile
        import signal

        profiler = cProfile.Profile()
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        profiler.enable()
        try:
            asyncio.run(serve(cands, a.key, a.model or ["bench"], a.seed, a.max_seconds, a.drain_every,
                              a.round_every))
        finally:
            profiler.disable()
            profiler.dump_stats(profile)
        return 0
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(cands, a.key, a.model or ["bench"], a.seed, a.max_seconds, a.drain_every, a.round_every,
                          redis_url=a.redis_url, port=a.port, workers=a.workers, scorer=not a.no_scorer,
                          keys_file=a.keys_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
