#!/usr/bin/env python3
"""The Grafana dashboard's panels, drawn from a real local run: what an operator sees, without Grafana.

Runs the embedded local subnet (``python -m neurons.validator --local``, simulated 5090s, audits, weights) for
``--rounds`` rounds, scrapes its ``/metrics`` every ``--every`` seconds as Prometheus would, and draws the panels of
``scripts/deploy/grafana/dashboards/tensorgate.json`` from the scrapes with the same arithmetic (rates of counters
over a trailing window, quantiles of histogram buckets interpolated as ``histogram_quantile`` does) into a PNG.
Needs ``.[plot]`` (matplotlib).

Example::

    .venv/bin/python scripts/dashboard_plot.py --rounds 6 --out scripts/deploy/dashboard.png
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
Key = tuple[str, tuple[tuple[str, str], ...]]
Scrape = tuple[float, dict[Key, float]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(url: str) -> dict[Key, float]:
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out: dict[Key, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def series(scrapes: list[Scrape], name: str, by: str) -> dict[str, list[tuple[float, float]]]:
    """A gauge's value over time, one line per value of label ``by`` (summed over other labels)."""
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for t, sample in scrapes:
        acc: dict[str, float] = defaultdict(float)
        for (n, labels), v in sample.items():
            if n == name:
                acc[dict(labels).get(by, name)] += v
        for k, v in acc.items():
            out[k].append((t, v))
    return out


def rates(scrapes: list[Scrape], name: str, by: str, window: float, scale: float = 1.0
          ) -> dict[str, list[tuple[float, float]]]:
    """``sum by (by) (rate(name[window]))`` at each scrape: the counter's increase over the trailing window."""
    counts = series(scrapes, name, by)
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for k, points in counts.items():
        for i, (t, v) in enumerate(points):
            older = [(t0, v0) for t0, v0 in points[:i] if t - t0 <= window]
            if older:
                t0, v0 = older[0]
                out[k].append((t, scale * max(0.0, v - v0) / (t - t0)))
    return out


def quantiles(scrapes: list[Scrape], name: str, q: float, window: float, by: str = "uid"
              ) -> dict[str, list[tuple[float, float]]]:
    """``histogram_quantile(q, sum by (le, by) (rate(name_bucket[window])))`` per value of ``by``, at each scrape."""
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for i, (t, sample) in enumerate(scrapes):
        older = [s for s in scrapes[:i] if t - s[0] <= window]
        if not older:
            continue
        base = older[0][1]
        per_uid: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for (metric, labels), v in sample.items():
            if metric == name + "_bucket":
                d = dict(labels)
                bound = math.inf if d["le"] == "+Inf" else float(d["le"])
                per_uid[d[by]].append((bound, v - base.get((metric, labels), 0.0)))
        for uid, buckets in per_uid.items():
            buckets.sort()
            total = buckets[-1][1]
            if total <= 0:
                continue
            rank, prev_le, prev_n = q * total, 0.0, 0.0
            for le, n in buckets:
                if n >= rank:
                    value = prev_le if math.isinf(le) else prev_le + (le - prev_le) * (rank - prev_n) / max(
                        n - prev_n, 1e-12)
                    out[uid].append((t, value))
                    break
                prev_le, prev_n = le, n
    return out


def _client(scrapes: list[Scrape], what: str) -> dict[str, list[tuple[float, float]]]:
    """The clients' p50 and p95 of ``gen_ai_server_<what>_seconds``, one line each per model."""
    name = f"gen_ai_server_{what}_seconds"
    return {f"p{round(100 * q)} {model}": points for q in (0.5, 0.95)
            for model, points in quantiles(scrapes, name, q, 60, by="gen_ai_request_model").items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--round-seconds", type=float, default=20.0)
    p.add_argument("--every", type=float, default=2.0, help="seconds between scrapes")
    p.add_argument("--out", type=Path, default=ROOT / "scripts" / "deploy" / "dashboard.png")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    scrapes: list[Scrape] = []
    with tempfile.TemporaryDirectory(prefix="dashboard-") as state:
        cmd = [sys.executable, "-m", "neurons.validator", "--local", "--local.rounds", str(args.rounds),
               "--local.round-seconds", str(args.round_seconds), "--gateway.port", str(port), "--state-dir", state,
               "--seed", "7"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORGATE_")}
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t0 = time.monotonic()
        deadline = t0 + args.rounds * args.round_seconds * 3 + 120
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    scrapes.append((time.monotonic() - t0, scrape(url)))
                except OSError:
                    pass  # not listening yet, or closing
                time.sleep(args.every)
        finally:
            if proc.poll() is None:
                proc.terminate()
            proc.wait(timeout=60)
    if len(scrapes) < 3:
        print("too few scrapes: did the local subnet start?", file=sys.stderr)
        return 1
    panels = [
        ("Requests per second, by outcome", rates(scrapes, "tensorgate_responses_total", "outcome", 60)),
        ("TTFT p95 per miner (s)", quantiles(scrapes, "tensorgate_miner_ttft_seconds", 0.95, 60)),
        ("TTFT p50 per miner (s)", quantiles(scrapes, "tensorgate_miner_ttft_seconds", 0.5, 60)),
        ("Decode rate p50 per miner (tok/s, one stream)",
         quantiles(scrapes, "tensorgate_miner_decode_tokens_per_second", 0.5, 60)),
        ("In flight per miner", series(scrapes, "tensorgate_miner_in_flight", "uid")),
        ("Failures per second, by reason", rates(scrapes, "tensorgate_miner_failures_total", "reason", 60)),
        ("Audits per minute, by outcome", rates(scrapes, "tensorgate_audits_total", "outcome", 60, scale=60.0)),
        ("Settled value per hotkey (what weights follow)", series(scrapes, "tensorgate_settled_value", "hotkey")),
        ("Clients' time to first token, p50 and p95, by model (s)", _client(scrapes, "time_to_first_token")),
        ("Clients' request duration, p50 and p95, by model (s)", _client(scrapes, "request_duration")),
        ("Tokens per second, by direction", rates(scrapes, "gen_ai_client_token_usage_total", "gen_ai_token_type", 60)),
        ("Gateway process: CPU (cores)", rates(scrapes, "process_cpu_seconds_total", "", 60)),
    ]
    fig, axes = plt.subplots(6, 2, figsize=(13, 19))
    for ax, (title, lines) in zip(axes.flat, panels, strict=True):
        for label, points in sorted(lines.items()):
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, label=label[:24])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("seconds", fontsize=8)
        ax.tick_params(labelsize=8)
        if lines:
            ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"tensorgate: the embedded local subnet, {args.rounds} rounds of {args.round_seconds:g} s, "
                 f"{len(scrapes)} scrapes of /metrics", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.985))  # room for the title above the first row
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=80)
    print(f"{args.out}: {len(scrapes)} scrapes, {sum(len(s[1]) for s in scrapes[-1:])} samples in the last")
    return 0


if __name__ == "__main__":
    sys.exit(main())
