#!/usr/bin/env python3
"""Does the gateway process's memory stay flat under traffic? RSS after each 2,000 of 10,000 requests.

The gateway (real router, btauth signing, measurement queue drained as the scorer would) runs in
its own process over fake miners on loopback; streamed requests go through it in blocks, and its
VmRSS is read from ``/proc`` after each block. The first block is the warm-up (imports, pools,
allocator arenas); the least-squares slope over the samples is the growth per request. A leak of
one small object per request (a Measurement, a nonce, a response) is >= 100 bytes/request, so the
default limit of 48 bytes/request catches it while allocator noise (a few hundred KB) does not.

Example::

    .venv/bin/python scripts/bench_memory.py --smoke          # 1,000 requests, seconds
    .venv/bin/python scripts/bench_memory.py                  # 10,000 requests, samples every 2,000
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib.clients import chat_body, run_level  # noqa: E402
from bench_lib.fake_upstream import validator_keypair  # noqa: E402
from bench_lib.procs import Child, exit_on_signals, peak_rss_bytes, rss_bytes  # noqa: E402
from bench_lib.stats import slope, table, verdict  # noqa: E402

HERE = Path(__file__).resolve().parent
KEY = "sk-bench-memory"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Gateway RSS after N requests: slope in bytes/request, pass/fail.")
    p.add_argument("--smoke", action="store_true", help="1,000 requests sampled every 200 (seconds)")
    p.add_argument("--requests", type=int, default=10_000, help="total requests through the gateway")
    p.add_argument("--every", type=int, default=2_000, help="sample RSS after this many requests")
    p.add_argument("--concurrency", type=int, default=32, help="concurrent streams")
    p.add_argument("--tokens", type=int, default=8, help="tokens per completion")
    p.add_argument("--max-slope", type=float, default=48.0, help="pass limit, bytes of RSS growth per request")
    p.add_argument("--strict", action="store_true", help="exit 1 when the slope is over the limit")
    a = p.parse_args(argv)
    if a.smoke:
        a.requests, a.every = 1_000, 200
    if a.every <= 0 or a.requests < 2 * a.every:
        p.error("need --requests >= 2 * --every > 0 (at least two samples)")
    exit_on_signals()

    py = sys.executable
    up_argv = [py, str(HERE / "bench_lib" / "fake_upstream.py"), "--ports", "4", "--ttft-ms", "5",
               "--tokens", str(a.tokens), "--interval-ms", "1", "--slots", "1024",
               "--trusted", validator_keypair().ss58_address]
    with Child(up_argv, name="fake-upstream") as up:
        info = up.wait_ready()
        # rounds close every 2 s: what the validator keeps per round (TTFT samples) is bounded by its
        # round length, so a run shorter than a round would read the round in progress as a leak
        gw_argv = [py, str(HERE / "bench_lib" / "gateway_proc.py"), "--key", KEY, "--model", "bench",
                   "--round-every", "2"]
        for port, hk in zip(info["ports"], info["hotkeys"], strict=True):
            gw_argv += ["--miner", f"127.0.0.1:{port}={hk}=1024"]
        with Child(gw_argv, name="gateway") as gw:
            port = gw.wait_ready()["port"]
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            headers = {"Authorization": f"Bearer {KEY}"}
            body = chat_body(a.tokens)
            done, errors, xs, ys, rows = 0, 0, [], [], []
            t0 = time.perf_counter()
            print(f"gateway pid {gw.pid}: {a.requests} requests at concurrency {a.concurrency}, "
                  f"RSS every {a.every}", flush=True)
            while done < a.requests:
                n = min(a.every, a.requests - done)
                res = asyncio.run(run_level(url, concurrency=a.concurrency, requests=n, body=body, headers=headers,
                                            expect_tokens=a.tokens))
                done += n
                errors += res.errors
                time.sleep(0.6)  # let the gateway's queue drain (every 0.5 s) before sampling
                rss = rss_bytes([gw.pid])
                xs.append(float(done))
                ys.append(float(rss))
                rows.append([done, rss / 2**20, (rss - ys[0]) / 2**10, res.rps, res.errors])
            hwm = peak_rss_bytes([gw.pid])
    wall = time.perf_counter() - t0
    print(table(["requests", "RSS MB", "growth KB", "req/s", "errors"], rows))
    s = slope(xs, ys)
    tail = slope(xs[1:], ys[1:]) if len(xs) >= 3 else s
    ok = tail <= a.max_slope and errors == 0
    print(f"slope over all samples: {s:.1f} B/request; after the first (warm-up) sample: {tail:.1f} B/request; "
          f"peak RSS {hwm / 2**20:.1f} MB; {wall:.1f} s")
    print(f"{verdict(ok)}  RSS flat: slope after warm-up {tail:.1f} <= {a.max_slope:g} B/request, "
          f"{errors} client errors")
    if errors:
        return 2
    return 1 if (a.strict and not ok) else 0


if __name__ == "__main__":
    sys.exit(main())
