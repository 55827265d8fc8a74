#!/usr/bin/env python3
"""Scale-out on one machine: 1 against 2 gateway processes at saturation, and what Redis adds to a request.

Issue 28's scale benchmark. Every figure comes from one run, the configurations interleaved per repetition, on
the same fake miners (``bench_lib/fake_upstream.py``, signing checked) and the same Redis (Debian's
``redis-server``, started here on a free port, in memory):

* ``1 proc``           one gateway process, no Redis (the default validator);
* ``1 proc + redis``   one gateway process with its state in Redis (leases, key limits, measurement stream);
* ``2 procs + redis``  two gateway processes on one port (SO_REUSEPORT), as ``--gateway.workers 2`` runs them.

Saturation: ``wrk`` (C, one thread: it leaves the CPUs to what it measures) keeps ``--connections`` streams in
flight for ``--seconds``; req/s and tokens/s are what came back complete (non-2xx counted apart), and the CPU
seconds of the gateway processes, the fake miners and Redis are read from ``/proc`` over the same window, so the
gateway's CPU per token is printed beside each. Added latency: the benchmark's own client, ``--latency-c`` streams
(below saturation), TTFT p50 and p99 with Redis on and off, taken within each repetition and the median reported.
Limits: an API key with ``rpm=--rpm`` gets ``2 x --rpm`` requests spread over the two processes; what they admit
together is printed against the limit (target <= 1.05x).

On a 2-core machine the fake miners, Redis and wrk share the cores with the gateways, so two processes cannot
double the throughput here: what scales is read from the CPU per token (the same with two processes means N
cores serve N times the tokens). Run from the repo root (wrk and redis-server from Debian: ``--install``)::

    .venv/bin/python scripts/bench_scale.py --repeat 3
    .venv/bin/python scripts/bench_scale.py --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib.clients import chat_body, run_level  # noqa: E402
from bench_lib.fake_upstream import validator_keypair  # noqa: E402
from bench_lib.procs import Child, cpu_seconds, exit_on_signals, free_port, start_redis, tree  # noqa: E402
from bench_lib.stats import percentile  # noqa: E402

HERE = Path(__file__).resolve().parent
KEY = "sk-bench-scale"
LIMITED_KEY = "sk-bench-limited"
CONFIGS = ("1 proc", "1 proc + redis", "2 procs + redis")


@dataclass
class Saturation:
    config: str
    rps: float
    tokens_s: float
    non_2xx: int
    gateway_cpu_s: float
    other_cpu_s: float
    seconds: float

    @property
    def cpu_us_per_token(self) -> float:
        return self.gateway_cpu_s / max(1.0, self.tokens_s * self.seconds) * 1e6


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3, help="repetitions, the configurations interleaved in each")
    p.add_argument("--seconds", type=float, default=10.0, help="wrk's run per configuration and repetition")
    p.add_argument("--connections", type=int, default=64, help="streams wrk keeps in flight")
    p.add_argument("--tokens", type=int, default=64, help="tokens per answer")
    p.add_argument("--ttft-ms", type=float, default=5.0, help="fake miner's delay before the first token")
    p.add_argument("--interval-ms", type=float, default=1.0, help="fake miner's time between tokens")
    p.add_argument("--ports", type=int, default=4, help="fake miners")
    p.add_argument("--latency-c", type=int, default=16, help="streams for the added-latency measure")
    p.add_argument("--latency-n", type=int, default=300, help="requests for the added-latency measure")
    p.add_argument("--rpm", type=int, default=200, help="the limited key's requests per minute")
    p.add_argument("--redis-nice", type=int, default=None,
                   help="run redis-server at this nice level (e.g. -10, as root): does Redis's added latency come "
                        "from waiting for a core?")
    p.add_argument("--install", action="store_true", help="apt-get install wrk and redis-server if missing")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    p.add_argument("--smoke", action="store_true", help="seconds, not minutes: tiny numbers")
    a = p.parse_args(argv)
    if a.smoke:
        a.repeat, a.seconds, a.latency_n, a.rpm = 1, 2.0, 40, 20
    return a


def _need(binary: str, install: bool) -> str:
    found = shutil.which(binary)
    if found is None and install:
        subprocess.run(["apt-get", "install", "-y", "-qq", binary], check=False, stdout=subprocess.DEVNULL)
        found = shutil.which(binary)
    if found is None:
        raise SystemExit(f"{binary} is needed: apt-get install -y {binary} (or run with --install)")
    return found


def _wrk_script(workdir: Path, body: bytes, key: str) -> Path:
    script = workdir / "post.lua"
    script.write_text(f"wrk.method = 'POST'\nwrk.body = {json.dumps(body.decode())}\n"
                      f"wrk.headers['Content-Type'] = 'application/json'\n"
                      f"wrk.headers['Authorization'] = 'Bearer {key}'\n")
    return script


def _wrk(wrk: str, url: str, script: Path, connections: int, seconds: float) -> tuple[int, float, int]:
    """(requests, seconds, non-2xx) of one wrk run."""
    out = subprocess.run([wrk, "-t1", f"-c{connections}", f"-d{seconds:g}s", "--timeout", "30s", "-s", str(script),
                          url], capture_output=True, text=True, check=True).stdout
    done = re.search(r"(\d+) requests in ([\d.]+)(m?s)", out)
    if done is None:
        raise RuntimeError(f"wrk said: {out}")
    secs = float(done.group(2)) * (0.001 if done.group(3) == "ms" else 1.0)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    failed = (int(bad.group(1)) if bad else 0) + (sum(int(x) for x in errors.groups()) if errors else 0)
    return int(done.group(1)), secs, failed


class Gateways:
    """One configuration's gateway processes, started on one port, stopped at exit."""

    def __init__(self, stack: ExitStack, config: str, miners: list[str], redis_url: str, keys_file: Path,
                 workdir: Path) -> None:
        self.port = free_port()
        n = 2 if config.startswith("2") else 1
        self.children: list[Child] = []
        for i in range(n):
            argv = [sys.executable, str(HERE / "bench_lib" / "gateway_proc.py"), "--key", KEY, "--model", "bench",
                    "--port", str(self.port), "--keys-file", str(keys_file), "--drain-every", "0.25"]
            for m in miners:
                argv += ["--miner", m]
            if "redis" in config:
                argv += ["--redis-url", redis_url, "--workers", str(n)]
                if i:
                    argv.append("--no-scorer")
            child = stack.enter_context(Child(argv, name=f"{config} #{i}", cwd=HERE.parent,
                                              log_path=workdir / f"gw-{config.replace(' ', '')}-{i}.log"))
            child.wait_ready(60.0)
            self.children.append(child)

    def pids(self) -> list[int]:
        return [p for c in self.children for p in tree(c.pid)]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/chat/completions"


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    exit_on_signals()
    wrk = _need("wrk", a.install)
    redis_server = _need("redis-server", a.install)
    body = chat_body(a.tokens)
    results: dict[str, list[Saturation]] = {c: [] for c in CONFIGS}
    ttft: dict[str, list[tuple[float, float]]] = {c: [] for c in CONFIGS[:2]}
    admitted: list[tuple[int, int]] = []
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-scale-")))
        redis_url, redis = start_redis(stack, redis_server, nice=a.redis_nice, log_path=workdir / "redis.log")
        v = validator_keypair().ss58_address
        up = stack.enter_context(Child([sys.executable, str(HERE / "bench_lib" / "fake_upstream.py"), "--ports",
                                        str(a.ports), "--ttft-ms", str(a.ttft_ms), "--tokens", str(a.tokens),
                                        "--interval-ms", str(a.interval_ms), "--slots", "1024", "--trusted", v],
                                       name="fake-upstream", log_path=workdir / "upstream.log"))
        info = up.wait_ready()
        miners = [f"127.0.0.1:{p}={h}=1024" for p, h in zip(info["ports"], info["hotkeys"], strict=True)]
        keys_file = workdir / "keys.txt"
        limited = [f"{LIMITED_KEY}-{rep}" for rep in range(a.repeat)]  # a fresh minute for each repetition
        keys_file.write_text(f"{KEY} name=bench\n" + "".join(f"{k} name=limited-{i} rpm={a.rpm}\n"
                                                              for i, k in enumerate(limited)))
        script = _wrk_script(workdir, body, KEY)
        others = [up.pid, redis.pid]
        print(f"{a.connections} streams of {a.tokens} tokens ({a.ttft_ms:g} ms to the first, then "
              f"{a.interval_ms:g} ms apart) for {a.seconds:g} s a run; {a.repeat} repetitions", flush=True)
        for rep in range(a.repeat):
            for config in CONFIGS:
                with ExitStack() as gw_stack:
                    gw = Gateways(gw_stack, config, miners, redis_url, keys_file, workdir)
                    _wrk(wrk, gw.url, script, a.connections, 1.0)  # warm up: connections, pools, JIT-free caches
                    pids = gw.pids()
                    g0, o0 = cpu_seconds(pids), cpu_seconds(others)
                    n, secs, failed = _wrk(wrk, gw.url, script, a.connections, a.seconds)
                    g1, o1 = cpu_seconds(pids), cpu_seconds(others)
                    ok = n - failed
                    sat = Saturation(config, ok / secs, ok * a.tokens / secs, failed, g1 - g0, o1 - o0, secs)
                    results[config].append(sat)
                    busy = (sat.gateway_cpu_s + sat.other_cpu_s) / secs
                    line = (f"  rep {rep + 1} {config:16s} {sat.rps:7.1f} req/s {sat.tokens_s:9.0f} tok/s "
                            f"gateway CPU {sat.cpu_us_per_token:5.1f} us/token, failed {failed}; gateways, fake "
                            f"miners and Redis kept {busy:.2f} cores busy")
                    if config in ttft:
                        res = asyncio.run(run_level(gw.url, concurrency=a.latency_c, requests=a.latency_n, body=body,
                                                    headers={"Authorization": f"Bearer {KEY}"},
                                                    expect_tokens=a.tokens, seed=rep))
                        ms = res.ttfts_ms()
                        ttft[config].append((percentile(ms, 50), percentile(ms, 99)))
                        line += f"; c={a.latency_c} TTFT p50 {ttft[config][-1][0]:.2f} p99 {ttft[config][-1][1]:.2f}"
                    if config.startswith("2"):
                        res = asyncio.run(run_level(gw.url, concurrency=32, requests=2 * a.rpm, body=body,
                                                    headers={"Authorization": f"Bearer {limited[rep]}"},
                                                    expect_tokens=a.tokens, seed=rep))
                        admitted.append((sum(1 for s in res.samples if s.status == 200), a.rpm))
                        refused = sum(1 for s in res.samples if s.status == 429)
                        line += f"; limited key: {admitted[-1][0]} of {2 * a.rpm} admitted (rpm {a.rpm}), {refused} 429"
                    print(line, flush=True)
    return _report(a, results, ttft, admitted)


def _report(a: argparse.Namespace, results: dict[str, list[Saturation]], ttft: dict[str, list[tuple[float, float]]],
            admitted: list[tuple[int, int]]) -> int:
    def med(xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")

    print("\nmedian of repetitions:")
    print(f"  {'configuration':16s} {'req/s':>8s} {'tokens/s':>9s} {'gateway us/token':>17s} {'failed':>7s}")
    figures: dict[str, object] = {}
    for config, rows in results.items():
        rps, tok = med([r.rps for r in rows]), med([r.tokens_s for r in rows])
        cpu = med([r.cpu_us_per_token for r in rows])
        print(f"  {config:16s} {rps:8.1f} {tok:9.0f} {cpu:17.1f} {sum(r.non_2xx for r in rows):7d}")
        figures[config] = {"rps": rps, "tokens_s": tok, "gateway_cpu_us_per_token": cpu}
    base, two = figures["1 proc"], figures["2 procs + redis"]
    assert isinstance(base, dict) and isinstance(two, dict)
    print(f"  2 procs + redis / 1 proc: {two['tokens_s'] / base['tokens_s']:.2f}x tokens/s")
    off, on = ttft["1 proc"], ttft["1 proc + redis"]
    added50 = med([b[0] - o[0] for o, b in zip(off, on, strict=True)])
    added99 = med([b[1] - o[1] for o, b in zip(off, on, strict=True)])
    print(f"Redis's added TTFT at {a.latency_c} streams (median of per-repetition differences): p50 {added50:+.2f} ms, "
          f"p99 {added99:+.2f} ms")
    worst = max((n / limit for n, limit in admitted), default=float("nan"))
    print(f"limited key across 2 processes: admitted at most {worst:.3f}x its limit (target <= 1.05x)")
    figures.update(redis_ttft_p50_ms=added50, redis_ttft_p99_ms=added99, limit_ratio=worst)
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=2))
    return 0 if worst <= 1.05 else 1


if __name__ == "__main__":
    sys.exit(main())
