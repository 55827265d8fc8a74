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
import os
import signal
import subprocess
import sys
import tempfile
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib import peers  # noqa: E402
from bench_lib.clients import LevelResult, Signer, chat_body, run_level  # noqa: E402
from bench_lib.fake_upstream import validator_keypair  # noqa: E402
from bench_lib.gateway_report import ALL_PATHS, GATEWAYS, Row, print_cpu_split, report  # noqa: E402
from bench_lib.procs import Child, cpu_seconds, exit_on_signals, peak_rss_bytes, pin, tree  # noqa: E402
from bench_lib.stats import percentile, verdict  # noqa: E402

from gateway.protocol.signing import RequestSigner  # noqa: E402

HERE = Path(__file__).resolve().parent
RELAYS = {"pyrelay": [], "pymeter": ["--meter"]}  # bare_relay.py's arguments per path
GATEWAY_KEY = "sk-bench-gateway"


@dataclass
class Path_:
    """One way to reach the fake miners."""

    name: str
    urls: list[str]
    headers: dict[str, str]
    pid: int | None  # the proxy process (tree) to account; None for direct
    sign: Signer | None = None


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
    return Row(a.path, a.concurrency, res, cpu, rss, a.rep_p50s + b.rep_p50s, a.rep_p99s + b.rep_p99s,
               a.rep_cpu_ms + b.rep_cpu_ms)


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
    row = Row(name, c, res, cpu, rss, [p50], [percentile(res.ttfts_ms(), 99)])
    row.rep_cpu_ms = [] if row.cpu_ms_per_req is None else [row.cpu_ms_per_req]
    return row


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
