#!/usr/bin/env python3
"""What the gateway costs: added TTFT, throughput, CPU and memory against direct, nginx and LiteLLM.

A fake upstream (own process, several loopback ports, one miner hotkey each) streams a fixed
schedule, so whatever a path adds over "direct" is the proxy's. The same client harness drives every
path at each concurrency, the paths interleaved per level so background load hits them alike; the
proxies not under test are SIGSTOPped meanwhile (an idle LiteLLM keeps burning CPU on 2 cores):

* ``direct``  — straight to the fake miners (round-robin over the ports): the floor;
* ``signed``  — direct too, but every request btauth-signed (before its clock starts) and verified by the
  miner, exactly the miner-side work a gateway request causes: the gateway's own floor;
* ``pyrelay`` — a bare asyncio relay (``bench_lib/bare_relay.py``: httptools, pooled upstreams, each read
  written back from the read callback, nothing else): the least any CPython asyncio proxy adds here;
* ``pymeter`` — the same relay with the per-token work no gateway can skip, still in the read callback: each read
  through the gateway's own stream meter and re-framed for the client (``bare_relay.py --meter``), nothing
  per request. The floor of a gateway whose relay ran in ``asyncio.Protocol`` callbacks;
* ``nginx``   — Debian's nginx, ``least_conn``, ``proxy_buffering off``, keep-alive upstreams;
* ``litellm`` — the LiteLLM proxy from PyPI (own venv in ``.bench/``), least-busy over the same ports;
* ``gateway`` — this project's gateway in its own process, real routing, btauth signing (verified by
  the fake miners, and checked afterwards from their counters) and measurement;
* ``baseline`` — the gateway as it was at ``--baseline REV`` (a git worktree of that commit), so a change
  is measured side by side with what it replaced, in the same run.

Targets (the gateway over signed direct at 64 streams): added TTFT p50 <= 1 ms and p99 <= 5 ms, each
taken as the median over the repetitions of that repetition's own difference (run ``--repeat 5`` or
more: single runs on this VM prove nothing). nginx and LiteLLM are references: their ratios are printed,
not gated.

Run from the repo root after ``pip install -e '.[test]'``::

    .venv/bin/python scripts/bench_gateway.py --smoke          # seconds: tiny numbers, prints the tables
    .venv/bin/python scripts/bench_gateway.py --install --repeat 3   # full run; installs nginx / LiteLLM if missing
    .venv/bin/python scripts/bench_gateway.py --arrivals lockstep --concurrency 64   # every request in one burst
    .venv/bin/python scripts/bench_gateway.py --paths direct,gateway --concurrency 1,64

Arrivals: ``--arrivals staggered`` (default) starts each client worker at a seeded random offset within
one request's duration, the steady state of that many independent streams; ``--arrivals lockstep``
starts them together, and since every request lasts exactly as long, every request then arrives in a
burst of ``concurrency`` (the worst case: each proxy's per-request work queues up at once). Every path
at a level gets the same offsets.

Layout: ``--layout apart`` (default, on 2 CPUs or more) keeps the client harness, the measuring instrument
and the busiest process of the run, on a CPU of its own, and puts the fake miners and the proxy under test
on the other: the same for every path, ``direct`` included, so the client's own timing is not disturbed by
what it measures. ``--layout shared`` lets every process run on every CPU. Two layouts tried and dropped:
one CPU for the proxy alone flatters every proxy (each takes the kernel's loopback work for the client's
socket off the loaded CPU, and nginx came out faster than ``direct``); and on 2 CPUs ``shared`` makes each
proxy fight the client harness for CPU, which a gateway in production does not.

With ``--repeat`` of 2 or more, each path's added TTFT is also taken within every repetition (where the
paths ran back to back): the p50's median and range and the p99's median over repetitions. Drift between
repetitions, such as other tenants of the VM, and a single stall of the VM in one repetition move pooled
figures but not these. The targets use the pooled figures.

Targets checked at 64 concurrent streams: gateway added TTFT <= 1 ms p50 and <= 5 ms p99; gateway added
latency <= 1.5x nginx's; LiteLLM's added latency >= 5x the gateway's; CPU per relayed token <= 2.5x the bare
relay's and <= 2.0x the metered relay's (issue 40's regression bar; over ``baseline`` it is shown). nginx and LiteLLM
are measured over ``direct``; the gateway over ``signed`` when it was measured (its requests cost the miner a
signature check that nginx's do not), and its figure over unsigned ``direct`` is printed beside it.
Exit status is 0 unless the run broke (or ``--strict`` and a target missed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib import peers  # noqa: E402
from bench_lib.clients import LevelResult, Signer, chat_body, run_level  # noqa: E402
from bench_lib.fake_upstream import validator_keypair  # noqa: E402
from bench_lib.procs import Child, cpu_seconds, exit_on_signals, peak_rss_bytes, pin, tree  # noqa: E402
from bench_lib.stats import percentile, table, verdict  # noqa: E402

from gateway.protocol.signing import RequestSigner  # noqa: E402

HERE = Path(__file__).resolve().parent
ALL_PATHS = ("direct", "signed", "pyrelay", "pymeter", "nginx", "litellm", "gateway", "baseline")
RELAYS = {"pyrelay": [], "pymeter": ["--meter"]}  # bare_relay.py's arguments per path
# measured over signed direct (their miners check btauth)
GATEWAYS = ("gateway", "baseline")
TARGET_C = 64
GATEWAY_KEY = "sk-bench-gateway"
PAIRED_KEYS = ("path", "concurrency", "over", "median", "min", "max", "reps", "p99_median")


@dataclass
class Path_:
    """One way to reach the fake miners."""

    name: str
    urls: list[str]
    headers: dict[str, str]
    pid: int | None  # the proxy process (tree) to account; None for direct
    sign: Signer | None = None


@dataclass
class Row:
    path: str
    concurrency: int
    result: LevelResult
    cpu_s: float | None
    peak_rss: int | None
    rep_p50s: list[float] = field(default_factory=list)  # TTFT p50 of each repetition, in order
    rep_p99s: list[float] = field(default_factory=list)  # and its p99

    def ttft(self, q: float) -> float:
        return percentile(self.result.ttfts_ms(), q)

    def total(self, q: float) -> float:
        return percentile(self.result.totals_ms(), q)

    @property
    def cpu_ms_per_req(self) -> float | None:
        n = len(self.result.ok)
        return None if self.cpu_s is None or n == 0 else self.cpu_s * 1000.0 / n

    def cpu_us_per_token(self, tokens: int) -> float | None:
        """CPU per relayed token, for answers of ``tokens`` tokens."""
        ms = self.cpu_ms_per_req
        return None if ms is None else 1000.0 * ms / tokens


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog=doc.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny numbers (seconds): concurrency 1,4, few requests")
    p.add_argument("--paths", default=",".join(ALL_PATHS), help="comma list among " + ",".join(ALL_PATHS))
    p.add_argument("--concurrency", default="1,16,64,256", help="comma list of concurrent streams")
    p.add_argument("--requests", type=int, default=0, help="timed requests per level (0: max(100, 8*concurrency))")
    p.add_argument("--warmup", type=int, default=16, help="untimed requests per path and level first")
    p.add_argument("--repeat", type=int, default=1,
                   help="repetitions per level, paths interleaved in each; samples pooled (tames noisy p99s)")
    p.add_argument("--ports", type=int, default=4, help="fake miner ports")
    p.add_argument("--ttft-ms", type=float, default=50.0, help="fake miner delay before the first token")
    p.add_argument("--tokens", default="16,128",
                   help="tokens per completion; a comma list runs the whole benchmark once per length (short "
                        "answers decide added TTFT, long ones the CPU per relayed token)")
    p.add_argument("--interval-ms", type=float, default=20.0, help="fake miner time between tokens")
    p.add_argument("--arrivals", choices=("staggered", "lockstep"), default="staggered",
                   help="client workers start at random offsets over one request (steady state) or together (bursts)")
    p.add_argument("--layout", choices=("apart", "shared"), default="apart",
                   help="apart: the measuring clients on CPUs of their own, the fake miners and the proxy under "
                        "test on the others; shared: every process on every CPU")
    p.add_argument("--baseline", default=None, metavar="REV",
                   help="also run the gateway as it was at this git revision (path 'baseline')")
    p.add_argument("--install", action="store_true", help="apt-get install nginx / make the LiteLLM venv if missing")
    p.add_argument("--workdir", default=None, help="where peer configs and logs go (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write every figure to this JSON file")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target misses")
    a = p.parse_args(argv)
    if a.smoke:
        a.concurrency = "1,4" if a.concurrency == p.get_default("concurrency") else a.concurrency
        a.requests = a.requests or 12
        a.warmup = min(a.warmup, 2)
        a.ttft_ms, a.interval_ms = 10.0, 2.0
        a.tokens = "4" if a.tokens == p.get_default("tokens") else a.tokens
        if a.paths == p.get_default("paths"):
            a.paths = "direct,signed,pyrelay,nginx,gateway"  # LiteLLM takes ~10 s to boot: ask for it explicitly
    a.path_list = [x.strip() for x in a.paths.split(",") if x.strip()]
    if a.baseline and "baseline" not in a.path_list:
        a.path_list.append("baseline")
    if "baseline" in a.path_list and not a.baseline:
        p.error("path 'baseline' needs --baseline REV")
    bad = set(a.path_list) - set(ALL_PATHS)
    if bad:
        p.error(f"unknown path(s): {', '.join(sorted(bad))}")
    a.token_list = [int(x) for x in str(a.tokens).split(",") if x.strip()]
    if not a.token_list or min(a.token_list) < 1:
        p.error("--tokens needs positive integers")
    a.levels = [int(x) for x in a.concurrency.split(",") if x.strip()]
    if not a.levels or min(a.levels) < 1:
        p.error("--concurrency needs positive integers")
    return a


def cpu_layout(layout: str) -> tuple[set[int], set[int]] | None:
    """(CPUs for the client harness, CPUs for fake miners and proxies) under ``apart``; None: all share all."""
    cpus = sorted(os.sched_getaffinity(0))
    if layout == "shared" or len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return set(cpus[:half]), set(cpus[half:])


def _cpus(cpus: set[int]) -> str:
    return ",".join(map(str, sorted(cpus)))


def _health(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
        return json.loads(r.read())


def start_paths(a: argparse.Namespace, stack: ExitStack,
                workdir: Path) -> tuple[dict[str, Path_], list[int], list[int]]:
    """The paths by name, the fake miners' ports, and the pids of every server process started."""
    py = sys.executable
    v = validator_keypair().ss58_address
    slots = 1024
    up = stack.enter_context(Child([py, str(HERE / "bench_lib" / "fake_upstream.py"), "--ports", str(a.ports),
                                    "--ttft-ms", str(a.ttft_ms), "--tokens", str(a.tokens), "--interval-ms",
                                    str(a.interval_ms), "--slots", str(slots), "--trusted", v, "--allow-unsigned"],
                                   name="fake-upstream", log_path=workdir / "upstream.log"))
    info = up.wait_ready()
    ports: list[int] = info["ports"]
    chat = "/v1/chat/completions"
    out: dict[str, Path_] = {}
    for name in a.path_list:
        if name == "direct":
            out[name] = Path_(name, [f"http://127.0.0.1:{p}{chat}" for p in ports], {}, None)
        elif name == "signed":
            urls = [f"http://127.0.0.1:{p}{chat}" for p in ports]
            out[name] = Path_(name, urls, {}, None, sign=_btauth_signer(dict(zip(urls, info["hotkeys"], strict=True))))
        elif name in RELAYS:
            argv = [py, str(HERE / "bench_lib" / "bare_relay.py"), "--ports", ",".join(map(str, ports)), *RELAYS[name]]
            relay = stack.enter_context(Child(argv, name=name, log_path=workdir / f"{name}.log"))
            r = relay.wait_ready()
            out[name] = Path_(name, [f"http://127.0.0.1:{r['port']}{chat}"], {}, relay.pid)
        elif name == "nginx":
            if peers.nginx_binary() is None and a.install:
                peers.install_nginx()
            if peers.nginx_binary() is None:
                print(f"[skip] nginx: not installed; run with --install or: {peers.NGINX_INSTALL_CMD}", flush=True)
                continue
            child, port = stack.enter_context(peers.start_nginx(ports, workdir / "nginx"))
            out[name] = Path_(name, [f"http://127.0.0.1:{port}{chat}"], {}, child.pid)
        elif name == "litellm":
            if peers.litellm_binary() is None and a.install:
                peers.install_litellm()
            if peers.litellm_binary() is None:
                print(f"[skip] litellm: not installed; run with --install or: {peers.LITELLM_INSTALL_CMD}",
                      flush=True)
                continue
            try:
                child, port, key = stack.enter_context(peers.start_litellm(ports, workdir / "litellm"))
            except RuntimeError as e:
                print(f"[skip] litellm: did not start: {str(e)[-500:]}", flush=True)
                continue
            out[name] = Path_(name, [f"http://127.0.0.1:{port}{chat}"], {"Authorization": f"Bearer {key}"}, child.pid)
        elif name in GATEWAYS:
            root = HERE.parent if name != "baseline" else worktree(a.baseline, workdir / "baseline", stack)
            argv = [py, str(root / "scripts" / "bench_lib" / "gateway_proc.py"), "--key", GATEWAY_KEY, "--model",
                    "bench"]
            for p, h in zip(ports, info["hotkeys"], strict=True):
                argv += ["--miner", f"127.0.0.1:{p}={h}={slots}"]
            env = {**os.environ, "PYTHONPATH": str(root)}
            gw = stack.enter_context(Child(argv, name=name, log_path=workdir / f"{name}.log", cwd=root, env=env))
            g = gw.wait_ready()
            out[name] = Path_(name, [f"http://127.0.0.1:{g['port']}{chat}"], {"Authorization": f"Bearer {GATEWAY_KEY}"},
                              gw.pid)
    return out, ports, [up.pid, *(p.pid for p in out.values() if p.pid)]


def worktree(rev: str, where: Path, stack: ExitStack) -> Path:
    """A detached git worktree of ``rev`` (removed at exit): the baseline gateway's code."""
    repo = HERE.parent
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(where), rev], check=True,
                   capture_output=True)
    stack.callback(subprocess.run, ["git", "-C", str(repo), "worktree", "remove", "--force", str(where)],
                   capture_output=True)
    return where


def _btauth_signer(hotkeys: dict[str, str]) -> Signer:
    """Signs as the benchmark's gateway does (same key, same nonces rule) for the miner behind each URL."""
    signer = RequestSigner(validator_keypair())

    def sign(url: str, body: bytes) -> dict[str, str]:
        return signer.sign(path="/v1/chat/completions", body=body, receiver_ss58=hotkeys[url])

    return sign


def measure(a: argparse.Namespace, paths: dict[str, Path_]) -> list[Row]:
    rows: list[Row] = []
    body = chat_body(a.tokens)
    proxies = [p for p in paths.values() if p.pid]
    try:
        for c in a.levels:
            merged: dict[str, Row] = {}
            for rep in range(a.repeat):  # paths interleaved within each repetition: drift hits them alike
                for name in ALL_PATHS:
                    path = paths.get(name)
                    if path is not None:
                        # Only the path under test may run: an idle LiteLLM still burns CPU on 2 cores.
                        for other in proxies:
                            _signal_tree(other.pid, signal.SIGCONT if other is path else signal.SIGSTOP)
                        row = _measure_one(a, path, c, body, seed=c * 1000 + rep)
                        merged[name] = _pooled(merged[name], row) if name in merged else row
            rows.extend(merged.values())
    finally:
        for other in proxies:
            _signal_tree(other.pid, signal.SIGCONT)
    return rows


def _pooled(a: Row, b: Row) -> Row:
    """Two repetitions of one path and level as one row: samples pooled, CPU and wall time summed."""
    res = LevelResult(a.concurrency, a.result.samples + b.result.samples, a.result.wall_s + b.result.wall_s)
    cpu = None if a.cpu_s is None or b.cpu_s is None else a.cpu_s + b.cpu_s
    rss = None if a.peak_rss is None or b.peak_rss is None else max(a.peak_rss, b.peak_rss)
    return Row(a.path, a.concurrency, res, cpu, rss, a.rep_p50s + b.rep_p50s, a.rep_p99s + b.rep_p99s)


def _signal_tree(pid: int | None, sig: int) -> None:
    for p in tree(pid) if pid else []:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def _measure_one(a: argparse.Namespace, path: Path_, c: int, body: bytes, *, seed: int) -> Row:
    n = a.requests or max(100, 8 * c)
    name = path.name
    pids = tree(path.pid) if path.pid else []
    if a.warmup:
        asyncio.run(run_level(path.urls, concurrency=c, requests=a.warmup, body=body,
                              headers=path.headers, expect_tokens=a.tokens, sign=path.sign))
    stagger_s = (a.ttft_ms + (a.tokens - 1) * a.interval_ms) / 1000.0 if a.arrivals == "staggered" else 0.0
    cpu0 = cpu_seconds(pids) if pids else None
    res = asyncio.run(run_level(path.urls, concurrency=c, requests=n, body=body, headers=path.headers,
                                expect_tokens=a.tokens, sign=path.sign, stagger_s=stagger_s, seed=seed))
    cpu = cpu_seconds(pids) - cpu0 if cpu0 is not None else None
    rss = peak_rss_bytes(tree(path.pid)) if path.pid else None
    err = f"  first error: {res.first_error()}" if res.errors else ""
    p50 = percentile(res.ttfts_ms(), 50)
    print(f"  {name:8s} c={c:<4d} n={len(res.samples):<5d} ok={len(res.ok):<5d} "
          f"ttft p50={p50:7.2f} ms  rps={res.rps:7.1f}{err}", flush=True)
    return Row(name, c, res, cpu, rss, [p50], [percentile(res.ttfts_ms(), 99)])


def report(rows: list[Row], levels: list[int], tokens: int) -> tuple[list[tuple[str, bool | None, str]], dict]:
    direct = {r.concurrency: r for r in rows if r.path == "direct"}
    signed = {r.concurrency: r for r in rows if r.path == "signed"}
    headers = ["path", "conc", "ok", "err", "ttft p50", "ttft p99", "+ttft p50", "+ttft p99", "+total p50",
               "req/s", "cpu ms/req", "cpu us/token", "peak RSS MB"]
    body = []
    added: dict[tuple[str, int], tuple[float, float]] = {}
    for r in rows:
        d = direct.get(r.concurrency)
        a50 = r.ttft(50) - d.ttft(50) if d else math.nan
        a99 = r.ttft(99) - d.ttft(99) if d else math.nan
        t50 = r.total(50) - d.total(50) if d else math.nan
        added[(r.path, r.concurrency)] = (a50, a99)
        body.append([r.path, r.concurrency, len(r.result.ok), r.result.errors, r.ttft(50), r.ttft(99),
                     a50 if r.path != "direct" else None, a99 if r.path != "direct" else None,
                     t50 if r.path != "direct" else None, r.result.rps, r.cpu_ms_per_req,
                     r.cpu_us_per_token(tokens),
                     None if r.peak_rss is None else r.peak_rss / 2**20])
    print("\n== per path and concurrency (ms; '+' = added over direct at the same concurrency) ==")
    print(table(headers, body))

    # What each proxy adds over the same miner-side work: nginx and LiteLLM over direct; the gateway over
    # signed direct when measured (its miner checks a signature on every request, theirs never do).
    own = dict(added)
    own_rows = []
    for r in rows:
        if r.path in GATEWAYS and r.concurrency in signed:
            sg = signed[r.concurrency]
            own[(r.path, r.concurrency)] = (r.ttft(50) - sg.ttft(50), r.ttft(99) - sg.ttft(99))
            own_rows.append([r.path, r.concurrency, *own[(r.path, r.concurrency)], *added[(r.path, r.concurrency)],
                             sg.ttft(50) - direct[r.concurrency].ttft(50) if r.concurrency in direct else None])
    if own_rows:
        print("\n== the gateway over signed direct (the same btauth check on the miner), pooled samples ==")
        print(table(["path", "conc", "+ttft p50", "+ttft p99", "over direct p50", "over direct p99",
                     "btauth cost p50"], own_rows))

    # Drift (other tenants of the VM, thermal, ...) moves whole repetitions: the same difference taken within
    # each repetition, where the paths ran back to back, and its median, shows how much of a pooled figure is drift.
    paired: list[tuple[str, int, str, float, float, float, int, float]] = []
    for r in rows:
        base = (signed if r.path in GATEWAYS and r.concurrency in signed else direct).get(r.concurrency)
        if base is None or r.path == "direct" or len(r.rep_p50s) < 2 or len(base.rep_p50s) != len(r.rep_p50s):
            continue
        diffs = sorted(x - y for x, y in zip(r.rep_p50s, base.rep_p50s, strict=True))
        d99 = statistics.median(x - y for x, y in zip(r.rep_p99s, base.rep_p99s, strict=True))
        paired.append((r.path, r.concurrency, base.path, statistics.median(diffs), diffs[0], diffs[-1], len(diffs),
                       d99))
    if paired:
        # A pooled p99 also takes in a single stall of the VM (tens of ms, seen here) in any one repetition; the
        # median over repetitions of each repetition's own p99 difference does not.
        print("\n== added TTFT within each repetition (ms): p50's median and range, p99's median, over repetitions ==")
        print(table(["path", "conc", "over", "median", "min", "max", "reps", "p99 median"], paired))

    ratio_rows = []
    for c in levels:
        g = own.get(("gateway", c))
        n = own.get(("nginx", c))
        ll = own.get(("litellm", c))
        py = own.get(("pyrelay", c))
        ratio_rows.append([c, _ratio(g, n), _ratio(ll, g), _ratio(py, n), _ratio(g, py)])
    print("\n== ratios of added TTFT p50 (floored at 0.05 ms so noise around zero cannot explode them) ==")
    print(table(["conc", "gateway/nginx", "litellm/gateway", "pyrelay/nginx", "gateway/pyrelay"], ratio_rows))

    checks: list[tuple[str, bool | None, str]] = []
    within = {(p_[0], p_[1]): p_ for p_ in paired}
    for gw in GATEWAYS:
        w = within.get((gw, TARGET_C))
        if w is None:
            if gw == "gateway":
                checks.append((f"targets at {TARGET_C} streams", None, "not measured (need signed and gateway at "
                               f"--concurrency including {TARGET_C}, and --repeat >= 2)"))
            continue
        reps = w[6]
        note = "" if reps >= 5 else f" (only {reps} repetitions: run --repeat 5 or more)"
        # issue 28's targets: p99 <= 5 ms at short answers, <= 10 ms at long ones (the p50 <= 1 ms target it replaced
        # is shown, not gated)
        bound = 5.0 if tokens <= 16 else 10.0
        checks.append((f"{gw} added TTFT p50 at {TARGET_C} (shown)", None,
                       f"median over {reps} repetitions {w[3]:.2f} ms over {w[2]} (range {w[4]:.2f} to {w[5]:.2f})"
                       + note))
        checks.append((f"{gw} added TTFT p99 <= {bound:g} ms at {TARGET_C}, {tokens}-token answers", w[7] <= bound,
                       f"median over {reps} repetitions {w[7]:.2f} ms over {w[2]}" + note))
    by_path = {(r.path, r.concurrency): r for r in rows}
    checks += cpu_checks(by_path, tokens)
    g = own.get(("gateway", TARGET_C))
    n = own.get(("nginx", TARGET_C))
    ll = own.get(("litellm", TARGET_C))
    if g is not None and n is not None:
        print(f"reference: the gateway adds {_ratio(g, n):.1f}x what nginx adds at {TARGET_C} streams (not gated)")
    if g is not None and ll is not None:
        print(f"reference: LiteLLM adds {_ratio(ll, g):.1f}x what the gateway adds at {TARGET_C} streams (not gated)")
    print("\n== targets ==")
    for name, ok, detail in checks:
        print(f"{'NOTE' if ok is None else verdict(ok)}  {name}: {detail}")
    data = {"rows": [{"path": r.path, "concurrency": r.concurrency, "ok": len(r.result.ok), "errors": r.result.errors,
                      "ttft_p50_ms": r.ttft(50), "ttft_p99_ms": r.ttft(99), "total_p50_ms": r.total(50),
                      "rps": r.result.rps, "cpu_ms_per_req": r.cpu_ms_per_req, "peak_rss_bytes": r.peak_rss}
                     for r in rows],
            "checks": [{"name": n_, "ok": ok, "detail": d} for n_, ok, d in checks],
            "paired_p50_ms": [dict(zip(PAIRED_KEYS, p_, strict=True)) for p_ in paired]}
    return checks, data


def _ratio(num: tuple[float, float] | None, den: tuple[float, float] | None, floor: float = 0.05) -> float:
    if num is None or den is None or math.isnan(num[0]) or math.isnan(den[0]):
        return math.nan
    return max(num[0], floor) / max(den[0], floor)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    exit_on_signals()
    rc = 0
    cpu: dict[int, dict[tuple[str, int], float]] = {}  # answer length -> (path, concurrency) -> CPU ms a request
    # Once, before the first run pins this process to the clients' CPUs (a layout taken after that found one CPU,
    # and the next answer length ran every process on it).
    layout = cpu_layout(a.layout)
    for tokens in a.token_list:  # the whole run once per answer length, each with its own fake miners' schedule
        one = argparse.Namespace(**{**vars(a), "tokens": tokens, "cpus": layout})
        if a.json and len(a.token_list) > 1:
            one.json = str(Path(a.json).with_suffix("")) + f"-{tokens}.json"
        code, rows = _run(one)
        rc = max(rc, code)
        cpu[tokens] = {(r.path, r.concurrency): r.cpu_ms_per_req for r in rows if r.cpu_ms_per_req is not None}
    if len(cpu) > 1:
        print_cpu_split(cpu)
    return rc


def cpu_split(by_length: Mapping[int, float]) -> tuple[float, float]:
    """(ms a request, us a token): the least-squares line through CPU per request against answer length.

    The per-request part is what a proxy does once (keys, routing, signing, measurement); the per-token part
    is what each relayed token costs. Only the second is what a different way of relaying could change."""
    xs, ys = list(by_length), list(by_length.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, 1000.0 * slope


def print_cpu_split(cpu: Mapping[int, Mapping[tuple[str, int], float]]) -> None:
    lengths = sorted(cpu)
    keys = sorted(set.intersection(*(set(cpu[t]) for t in lengths)), key=lambda k: (k[1], ALL_PATHS.index(k[0])))
    if not keys:
        return
    split = {k: cpu_split({t: cpu[t][k] for t in lengths}) for k in keys}
    rows = []
    for (path, c), (per_req, per_tok) in split.items():
        bare = split.get(("pyrelay", c))
        rows.append([path, str(c), f"{per_req:.2f}", f"{per_tok:.1f}",
                     f"{per_tok / bare[1]:.2f}" if bare and bare[1] > 1e-6 else "-"])
    print(f"\n== CPU a request = a fixed part + a part per token (fitted over {', '.join(map(str, lengths))}-token "
          "answers) ==")
    print(table(["path", "conc", "ms a request", "us a token", "per token / pyrelay's"], rows))
    n = lengths[-1]
    print()
    for c in sorted({k[1] for k in keys}):
        gw, meter, bare = split.get(("gateway", c)), split.get(("pymeter", c)), split.get(("pyrelay", c))
        if gw and meter and bare:  # the gateway's per-request work, each token at the metered relay's cost
            floor = rewrite_floor(gw, meter, bare, n)
            print(f"NOTE  a gateway relaying in Protocol callbacks, at {c} streams and {n}-token answers, costs at "
                  f"least {floor:.2f}x the bare relay's CPU a token (its fixed part, pymeter's part a token)")


def cpu_checks(by_path: dict[tuple[str, int], Row], tokens: int) -> list[tuple[str, bool | None, str]]:
    """Issue 40's regression bar on CPU per relayed token at :data:`TARGET_C` streams: the gateway at most 2.5x the
    bare relay and 2.0x the metered relay, side by side in one run (issue 28's 1.5x was withdrawn: a rewrite of the
    relay into ``asyncio.Protocol`` callbacks would reach ~1.5x at best); against ``baseline``, shown."""
    gw = by_path.get(("gateway", TARGET_C))
    if gw is None or not gw.cpu_ms_per_req:
        return []
    out: list[tuple[str, bool | None, str]] = []
    for path, name, bound in (("pyrelay", "bare relay", 2.5), ("pymeter", "metered relay", 2.0),
                              ("baseline", "baseline gateway", None)):
        other = by_path.get((path, TARGET_C))
        if other is None or not other.cpu_ms_per_req:
            continue
        ratio = gw.cpu_ms_per_req / other.cpu_ms_per_req
        limit = "" if bound is None else f" <= {bound:g}x"
        out.append((f"gateway CPU per relayed token{limit} the {name}'s at {TARGET_C}" + (" (shown)" if bound is None
                    else ""), None if bound is None else ratio <= bound,
                    f"{gw.cpu_us_per_token(tokens):.1f} vs {other.cpu_us_per_token(tokens):.1f} us a token: "
                    f"{ratio:.2f}x ({tokens}-token answers)"))
    return out


def rewrite_floor(gateway: tuple[float, float], metered: tuple[float, float], bare: tuple[float, float],
                  tokens: int) -> float:
    """The least CPU a relayed token could cost, over the bare relay's, if the gateway kept its per-request work
    and relayed each token as cheaply as the metered relay does: each ``(ms a request, us a token)``."""
    def per_token(fixed_ms: float, us: float) -> float:
        return 1000.0 * fixed_ms / tokens + us

    unit = per_token(*bare)
    return per_token(gateway[0], metered[1]) / unit if unit > 0 else math.nan  # nan: no CPU seen (smoke sizes)


def _run(a: argparse.Namespace) -> tuple[int, list[Row]]:
    with ExitStack() as stack:
        if a.workdir:
            workdir = Path(a.workdir)
            workdir.mkdir(parents=True, exist_ok=True)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tg-bench-")))
        layout = a.cpus
        if layout is None:
            where = "every process on every CPU" + (" (one CPU: not apart)" if a.layout == "apart" else "")
        else:
            where = f"clients on CPU {_cpus(layout[0])}, fake miners and proxies on CPU {_cpus(layout[1])}"
            pin([os.getpid()], layout[0])
        print(f"schedule: first token after {a.ttft_ms:g} ms, {a.tokens} tokens every {a.interval_ms:g} ms; "
              f"{a.ports} fake miners; levels {a.levels}; {a.arrivals} arrivals; {where}", flush=True)
        paths, ports, servers = start_paths(a, stack, workdir)
        if layout is not None:
            for pid in servers:
                pin(tree(pid), layout[1])
        if "direct" not in paths:
            print("[warn] no direct path: added figures cannot be computed", flush=True)
        verified0 = sum(_health(p)["verified"] for p in ports)
        rows = measure(a, paths)
        verified = sum(_health(p)["verified"] for p in ports) - verified0
        rejected = sum(_health(p)["rejected"] for p in ports)
    checks, data = report(rows, a.levels, a.tokens)
    gw_requests = sum(len(r.result.samples) for r in rows if r.path in GATEWAYS)
    if any(gw in paths for gw in GATEWAYS):
        signed_ok = rejected == 0 and verified >= sum(len(r.result.ok) for r in rows if r.path in GATEWAYS)
        print(f"{verdict(signed_ok)}  btauth: fake miners verified {verified} signed requests "
              f"({gw_requests} timed gateway requests + warm-up), rejected {rejected}")
        checks.append(("btauth verified", signed_ok, f"{verified} verified, {rejected} rejected"))
    errors = sum(r.result.errors for r in rows)
    print(f"{verdict(errors == 0)}  client errors: {errors}")
    if a.json:
        data["arrivals"] = a.arrivals
        data["layout"] = where
        Path(a.json).write_text(json.dumps(data, indent=2))
    broken = errors > 0 or any(ok is False for n_, ok, _ in checks if n_ == "btauth verified")
    if broken:
        return 2, rows
    if a.strict and any(ok is False for _, ok, _ in checks):
        return 1, rows
    return 0, rows


if __name__ == "__main__":
    sys.exit(main())
