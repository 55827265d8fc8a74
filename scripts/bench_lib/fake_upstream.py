"""A miner stand-in that streams on a fixed clock, so any extra time seen through a proxy is the proxy's.

The project's one scripted miner (:class:`neurons.miner.scripted.FakeMiner`, the tests' too) with the
"ok" script on an absolute schedule. Serves the validator->miner contract (OpenAI SSE, role
prelude, one chunk per token, finish chunk, usage chunk, ``[DONE]``, slots with 429 when full,
``GET /health``) on several loopback ports, one miner hotkey per port. A request carrying btauth
headers is verified with ``bt.http_auth.verify`` exactly as the reference miner does (401/403 on
failure); an unsigned request is served only with
``--allow-unsigned`` (the nginx / LiteLLM / direct paths cannot sign). ``/health`` counts both, so the
benchmark can prove the gateway's requests were really signed and verified.

Run it in its own process (it prints ``READY {json}`` with ports and hotkeys, then serves until killed,
until its parent dies, or until ``--max-seconds``)::

    python scripts/bench_lib/fake_upstream.py --ports 4 --ttft-ms 50 --tokens 32 --interval-ms 20 \
        --trusted 5F... --allow-unsigned
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from bittensor.sp_core import Keypair

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, when run as a script

from neurons.miner.scripted import FakeMiner, Script  # noqa: E402


def miner_keypair(i: int) -> Keypair:
    """The deterministic hotkey of fake miner ``i`` (dev URI, never a real key)."""
    return Keypair.create_from_uri(f"//tensorgate-bench-miner-{i}")


def validator_keypair() -> Keypair:
    """The deterministic hotkey the benchmark's gateway signs with."""
    return Keypair.create_from_uri("//tensorgate-bench-validator")


@dataclass(frozen=True, slots=True)
class Schedule:
    """First token ``ttft_s`` after the request arrives, then one token every ``interval_s``."""

    ttft_s: float = 0.05
    tokens: int = 32
    interval_s: float = 0.02

    def script(self) -> Script:
        return Script("ok", tokens=self.tokens, first_token_delay=self.ttft_s, token_delay=self.interval_s)


async def _watch_parent(parent: int, max_seconds: float) -> None:
    """Exit when the parent dies or the lifetime runs out: the upstream never outlives the benchmark."""
    loop = asyncio.get_running_loop()
    end = loop.time() + max_seconds
    while os.getppid() == parent and loop.time() < end:  # noqa: ASYNC110 - polling a process, not an event
        await asyncio.sleep(0.5)


async def serve(n_ports: int, schedule: Schedule, trusted: frozenset[str], allow_unsigned: bool,
                slots: int, max_seconds: float) -> None:
    parent = os.getppid()
    miners: list[FakeMiner] = []
    ports, hotkeys = [], []
    try:
        for i in range(n_ports):
            miner = FakeMiner(miner_keypair(i), trusted=trusted, script=schedule.script(), slots=slots, tag="t",
                              allow_unsigned=allow_unsigned, keep_bodies=False)
            await miner.start()
            miners.append(miner)
            ports.append(miner.port)
            hotkeys.append(miner.hotkey)
        print("READY " + json.dumps({"ports": ports, "hotkeys": hotkeys, "pid": os.getpid()}), flush=True)
        await _watch_parent(parent, max_seconds)
    finally:
        for miner in miners:
            await miner.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Fixed-schedule OpenAI-SSE fake miners on loopback ports.")
    p.add_argument("--ports", type=int, default=4, help="number of miner ports (one hotkey each)")
    p.add_argument("--ttft-ms", type=float, default=50.0, help="delay before the first token")
    p.add_argument("--tokens", type=int, default=32, help="tokens per completion (capped by max_tokens)")
    p.add_argument("--interval-ms", type=float, default=20.0, help="time between tokens")
    p.add_argument("--slots", type=int, default=256, help="concurrent slots per miner; 429 beyond")
    p.add_argument("--trusted", action="append", default=[], help="ss58 of a caller hotkey to accept (repeatable)")
    p.add_argument("--allow-unsigned", action="store_true", help="serve requests without btauth headers")
    p.add_argument("--max-seconds", type=float, default=3600.0, help="exit after this long regardless")
    a = p.parse_args(argv)
    schedule = Schedule(a.ttft_ms / 1000.0, a.tokens, a.interval_ms / 1000.0)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(a.ports, schedule, frozenset(a.trusted), a.allow_unsigned, a.slots, a.max_seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
