"""The gateway benchmark's report: its tables, its targets and the CPU bar, from the rows ``bench_gateway.py`` measured.

Apart from the measuring (processes, paths, clients) so the arithmetic the targets rest on is read and tested alone:
:func:`cpu_checks` is issue 40's regression bar, :func:`cpu_split` splits a path's CPU into a part a request and a
part a token, :func:`rewrite_floor` is the least a relay in ``asyncio.Protocol`` callbacks could cost.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field

from bench_lib.clients import LevelResult
from bench_lib.stats import percentile, table, verdict

ALL_PATHS = ("direct", "signed", "pyrelay", "pymeter", "nginx", "litellm", "gateway", "baseline")
GATEWAYS = ("gateway", "baseline")  # measured over signed direct (their miners check btauth)
TARGET_C = 64
PAIRED_KEYS = ("path", "concurrency", "over", "median", "min", "max", "reps", "p99_median")


@dataclass
class Row:
    path: str
    concurrency: int
    result: LevelResult
    cpu_s: float | None
    peak_rss: int | None
    rep_p50s: list[float] = field(default_factory=list)  # TTFT p50 of each repetition, in order
    rep_p99s: list[float] = field(default_factory=list)  # and its p99
    rep_cpu_ms: list[float] = field(default_factory=list)  # CPU ms a request of each repetition, in order

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
                      "rps": r.result.rps, "cpu_ms_per_req": r.cpu_ms_per_req, "cpu_ms_per_req_by_rep": r.rep_cpu_ms,
                      "peak_rss_bytes": r.peak_rss}
                     for r in rows],
            "checks": [{"name": n_, "ok": ok, "detail": d} for n_, ok, d in checks],
            "paired_p50_ms": [dict(zip(PAIRED_KEYS, p_, strict=True)) for p_ in paired]}
    return checks, data


def _ratio(num: tuple[float, float] | None, den: tuple[float, float] | None, floor: float = 0.05) -> float:
    if num is None or den is None or math.isnan(num[0]) or math.isnan(den[0]):
        return math.nan
    return max(num[0], floor) / max(den[0], floor)


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
                    f"{ratio:.2f}x ({tokens}-token answers){_spread(gw, other)}"))
    return out


def _spread(gw: Row, other: Row) -> str:
    """The ratio of each repetition, which ran the two paths one after the other: how far one run's ratio moves
    on the same code and machine (2.34-2.71x for the bare relay's across runs of one day), so that a bar on the
    pooled ratio is read with its noise."""
    pairs = [(g, o) for g, o in zip(gw.rep_cpu_ms, other.rep_cpu_ms, strict=False) if o > 0]
    if len(pairs) < 2 or len(gw.rep_cpu_ms) != len(other.rep_cpu_ms):
        return ""
    ratios = sorted(g / o for g, o in pairs)
    return f"; by repetition {ratios[0]:.2f}-{ratios[-1]:.2f}x"


def rewrite_floor(gateway: tuple[float, float], metered: tuple[float, float], bare: tuple[float, float],
                  tokens: int) -> float:
    """The least CPU a relayed token could cost, over the bare relay's, if the gateway kept its per-request work
    and relayed each token as cheaply as the metered relay does: each ``(ms a request, us a token)``."""
    def per_token(fixed_ms: float, us: float) -> float:
        return 1000.0 * fixed_ms / tokens + us

    unit = per_token(*bare)
    return per_token(gateway[0], metered[1]) / unit if unit > 0 else math.nan  # nan: no CPU seen (smoke sizes)
