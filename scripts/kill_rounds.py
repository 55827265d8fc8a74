"""kill -9 at every step of a round's close, with and without Redis: is every measurement counted exactly once?

Issue 39 (2): a validator killed after a round was saved but before its Redis entries were acknowledged counted the
same answers again after its restart (60 requests stored for 30 answers). This script runs, for each step and each
mode, a validator process that takes in ``--measurements`` measurements and closes a round, and kills itself with
SIGKILL at that step; then a successor opens the same state (and Redis), drains, closes a round, and the stored
rounds are summed. Steps:

* ``before-save``: measurements taken in (journaled, or read from the stream), the round's save not begun;
* ``between-save-and-ack``: the round is saved, its stream entries not acknowledged (without Redis the journal rows
  left with the save, so this is the step after it);
* ``after-ack``: saved and acknowledged.

A row passes when the stored requests equal the measurements sent: none lost, none counted twice.
``--smoke`` runs each step once; the issue's proof is ``--times 20`` (docs/pages/operators.md, *Where state lives*,
gives the figures).

    python scripts/kill_rounds.py --times 20            # starts its own redis-server on a free loopback port
    python scripts/kill_rounds.py --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

STEPS = ("before-save", "between-save-and-ack", "after-ack")


def _measurement(i: int) -> Any:
    from gateway.protocol.measurement import Measurement

    return Measurement(uid=1 + i % 3, hotkey=f"hk{i % 3}", in_flight=0, prompt_tokens=10, max_tokens=16,
                       ttft_s=0.2, latency_s=0.5, completion_tokens=16, ok=True, finish_reason="length",
                       at=time.time() + i * 1e-3)


class _Chain:
    netuid = 1

    async def metagraph(self) -> list[Any]:
        return []


def _validator(state: Path, redis_url: str | None) -> Any:
    from neurons.keys import dev_keypair
    from neurons.validator.build import build_validator
    from neurons.validator.config import ValidatorConfig

    cfg = ValidatorConfig(state_dir=state, gateway_port=0, redis_url=redis_url, audit_off=True)
    return build_validator(cfg, _Chain(), dev_keypair("Alice"))  # type: ignore[arg-type]


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


async def _life(state: Path, redis_url: str | None, step: str, n: int) -> None:
    """One validator's life: take ``n`` measurements in, close a round, die at ``step``."""
    v = _validator(state, redis_url)
    await v.open_state()
    if redis_url is None:
        for i in range(n):
            v.parts.measurements.record(_measurement(i))
    assert v.state.store is not None
    save = v.state.store.save_round

    def save_then_maybe_die(*a: Any, **kw: Any) -> None:
        if step == "before-save":
            _die()
        save(*a, **kw)
        if step == "between-save-and-ack" or (step == "after-ack" and v.state.reader is None):
            _die()

    v.state.store.save_round = save_then_maybe_die
    if v.state.reader is not None:
        ack = v.state.reader.ack

        async def ack_then_die(refs: Any) -> bool:
            ok = await ack(refs)
            _die()
            return ok

        v.state.reader.ack = ack_then_die
    await v._drain()
    await v.close_round()
    raise SystemExit("the step to die at was never reached")


async def _count(state: Path, redis_url: str | None) -> int:
    """The successor: drain what is owed, close a round, and sum the requests every stored round holds."""
    from scoring.store import ScoreStore

    v = _validator(state, redis_url)
    await v.open_state()
    for _ in range(3):  # the stream's pending entries come back over a read or two
        await v._drain()
    await v.close_round()
    await v.stop()
    with ScoreStore(state / "validator.sqlite") as st:
        return sum(m.requests for r in st.load_rounds(100) for m in r.miners)


async def _publish(redis_url: str, n: int) -> None:
    from gateway.shared.link import RedisLink
    from gateway.shared.measurements import MeasurementPublisher
    from neurons.keys import dev_keypair
    from neurons.validator.build import shared_namespace
    from neurons.validator.config import ValidatorConfig

    link = RedisLink(redis_url, shared_namespace(ValidatorConfig().netuid, dev_keypair("Alice").ss58_address))
    try:
        pub = MeasurementPublisher(link)
        for i in range(n):
            pub.record(_measurement(i))
        assert await pub.send() == n
    finally:
        await link.aclose()


async def _flush(redis_url: str) -> None:
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(redis_url)
    try:
        await r.flushall()
    finally:
        await r.aclose()


def one_try(step: str, redis_url: str | None, n: int) -> int:
    """One kill at ``step`` and its successor; returns the requests stored (``n`` when counted exactly once)."""
    state = Path(tempfile.mkdtemp(prefix="killrounds-"))
    try:
        if redis_url is not None:
            asyncio.run(_flush(redis_url))
            asyncio.run(_publish(redis_url, n))
        child = subprocess.run([sys.executable, __file__, "--life", step, "--state", str(state), "--n", str(n),
                                *(["--redis-url", redis_url] if redis_url else [])], cwd=REPO,
                               capture_output=True, text=True, timeout=120)
        if child.returncode != -signal.SIGKILL:
            raise RuntimeError(f"the validator did not die at {step}: rc {child.returncode}\n{child.stderr[-2000:]}")
        return asyncio.run(_count(state, redis_url))
    finally:
        shutil.rmtree(state, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--times", type=int, default=20, help="kills per step and mode (default 20)")
    ap.add_argument("--measurements", type=int, default=30, help="measurements each life takes in (default 30)")
    ap.add_argument("--smoke", action="store_true", help="each step once (seconds)")
    ap.add_argument("--no-redis", action="store_true", help="only the mode without Redis")
    ap.add_argument("--life", choices=STEPS, help=argparse.SUPPRESS)
    ap.add_argument("--state", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--redis-url", help=argparse.SUPPRESS)
    args = ap.parse_args()
    from loguru import logger

    logger.remove()  # the table is the output; a validator's warnings still show
    logger.add(sys.stderr, level="WARNING")
    if args.life:
        asyncio.run(_life(args.state, args.redis_url, args.life, args.n))
        return 1
    times = 1 if args.smoke else args.times
    if times < 1 or args.measurements < 1:
        ap.error("--times and --measurements must be at least 1")
    modes: list[tuple[str, str | None]] = [("no Redis", None)]
    failed = 0
    with ExitStack() as stack:
        if not args.no_redis:
            from bench_lib.procs import start_redis

            exe = shutil.which("redis-server")
            if exe is None:
                ap.error("redis-server is not installed (apt-get install redis-server), or pass --no-redis")
            modes.append(("Redis", start_redis(stack, exe)[0]))
        print(f"{'mode':<9} {'step':<22} {'kills':>5} {'sent':>5} {'stored min':>10} {'stored max':>10}  result")
        for mode, url in modes:
            for step in STEPS:
                stored = [one_try(step, url, args.measurements) for _ in range(times)]
                ok = all(s == args.measurements for s in stored)
                failed += not ok
                print(f"{mode:<9} {step:<22} {times:>5} {args.measurements:>5} {min(stored):>10} {max(stored):>10}  "
                      f"{'PASS' if ok else 'FAIL'}", flush=True)
    print(f"{'every measurement counted exactly once' if not failed else f'{failed} rows FAIL'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
