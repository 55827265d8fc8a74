"""Prometheus metrics of the gateway, read from its live state when scraped: nothing is added to a request's path.

Why read at scrape time: the gateway already keeps what an operator wants to watch (outcomes by status, each
miner's requests, failures by reason and recent TTFTs, the router's in-flight and slots, every key's usage).
Collecting from those when Prometheus asks costs the serving path nothing; counting again per request would
cost every stream. The validator adds its own families (audits, rounds, weights, metagraph age) with
:meth:`GatewayCollector.add`.

``GET /metrics`` serves them in Prometheus' text format. Key names, hotkeys and usage are the operator's
business, not a client's, so the route has its own access rule: a bearer key of its own (``TENSORGATE_METRICS_KEY``),
or, without one, loopback clients only (a Prometheus on the same host, or one reached through a tunnel).

Example::

    collector = GatewayCollector(gateway)
    registry = CollectorRegistry(); registry.register(collector)
    generate_latest(registry)          # b'# HELP tensorgate_responses_total ...'
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .app import Gateway

METRICS_KEY_ENV = "TENSORGATE_METRICS_KEY"


class GatewayCollector(Collector):
    """The gateway's families, plus any the owner adds (each a callable yielding metric families)."""

    def __init__(self, gateway: Gateway) -> None:
        self._gw = gateway
        self._extra: list[Callable[[], Iterable[Metric]]] = []

    def add(self, families: Callable[[], Iterable[Metric]]) -> None:
        self._extra.append(families)

    def collect(self) -> Iterator[Metric]:
        gw = self._gw
        yield from _gateway_families(gw)
        yield from _dispatch_families(gw)
        yield from _miner_families(gw)
        yield from _key_families(gw)
        yield from gw.clients.families()
        for families in self._extra:
            yield from families()


def _gateway_families(gw: Gateway) -> Iterator[Metric]:
    """Responses by outcome, streams in flight, and the wait for a free slot."""
    responses = CounterMetricFamily("tensorgate_responses", "Completion requests by outcome: HTTP status, or "
                                    "how a stream ended (client_disconnect, stream_error)", labels=["outcome"])
    for outcome, n in sorted(gw.outcomes.items()):
        responses.add_metric([outcome], n)
    yield responses
    yield GaugeMetricFamily("tensorgate_in_flight", "Requests in flight to miners", value=gw.router.total_in_flight())
    yield GaugeMetricFamily("tensorgate_queue_waiting", "Requests waiting for a free slot (every miner's busy)",
                            value=gw.admission.waiting)
    queued = CounterMetricFamily("tensorgate_queue", "Requests that waited for a slot, by how the wait ended",
                                 labels=["outcome"])
    queued.add_metric(["admitted"], gw.admission.waited)
    queued.add_metric(["timed_out"], gw.admission.timed_out)
    yield queued


def _dispatch_families(gw: Gateway) -> Iterator[Metric]:
    """Each miner's dispatches as the upstream measured them: counts, failures, TTFT and decode rate."""
    requests = CounterMetricFamily("tensorgate_miner_requests", "Dispatches to each miner (probes included)",
                                   labels=["uid"])
    ok = CounterMetricFamily("tensorgate_miner_ok", "Dispatches each miner completed", labels=["uid"])
    failures = CounterMetricFamily("tensorgate_miner_failures", "Dispatches each miner failed, by reason",
                                   labels=["uid", "reason"])
    ttft = GaugeMetricFamily("tensorgate_miner_ttft_p50_seconds", "Median TTFT of each miner's last 50 answers",
                             labels=["uid"])
    ttft_hist = HistogramMetricFamily("tensorgate_miner_ttft_seconds", "Time to first token of each miner's "
                                      "dispatches, on the validator's clock", labels=["uid"])
    decode_hist = HistogramMetricFamily("tensorgate_miner_decode_tokens_per_second", "Decode rate of each "
                                        "miner's completed answers (tokens after the first over the time "
                                        "after it), one stream each", labels=["uid"])
    for uid, st in sorted(gw.upstream.stats.items()):
        label = str(uid)
        requests.add_metric([label], st.requests)
        ok.add_metric([label], st.ok)
        for reason, n in sorted(st.failures.items()):
            failures.add_metric([label, str(reason)], n)
        p50 = st.ttft_p50()
        if p50 is not None:
            ttft.add_metric([label], p50)
        ttft_hist.add_metric([label], st.ttft_s.cumulative(), st.ttft_s.total)
        decode_hist.add_metric([label], st.decode_tok_s.cumulative(), st.decode_tok_s.total)
    yield from (requests, ok, failures, ttft, ttft_hist, decode_hist)


def _miner_families(gw: Gateway) -> Iterator[Metric]:
    """Each routable miner as the router holds it: this validator's streams, declared slots, quarantine, and the
    models it serves. The models are an info series (one 1 per model, as vLLM's ``*_info`` gauges), not a label on
    every per-miner series: a dispatch is already one model's, and joining on ``uid``
    (``... * on(uid) group_left(model) tensorgate_miner_model``) adds the label to any of them without splitting each
    miner's histograms by model on the serving path."""
    in_flight = GaugeMetricFamily("tensorgate_miner_in_flight", "This validator's streams on each miner",
                                  labels=["uid", "hotkey"])
    slots = GaugeMetricFamily("tensorgate_miner_slots", "Slots each miner declares", labels=["uid", "hotkey"])
    quarantined = GaugeMetricFamily("tensorgate_miner_quarantined", "1 while a miner is quarantined by its audits",
                                    labels=["uid", "hotkey"])
    models = GaugeMetricFamily("tensorgate_miner_model", "1 for each model a miner serves (what it declared, or the "
                               "subnet's default model when it declared none)", labels=["uid", "hotkey", "model"])
    default = gw.router.default_model
    for m in gw.router.miners():
        labels = [str(m.uid), m.hotkey]
        in_flight.add_metric(labels, m.in_flight)
        slots.add_metric(labels, m.slots)
        quarantined.add_metric(labels, 1 if m.quarantined else 0)
        for model in sorted(m.models or ({default} if default else set())):
            models.add_metric([*labels, model], 1)
    yield from (in_flight, slots, quarantined, models)


def _key_families(gw: Gateway) -> Iterator[Metric]:
    """Each API key's use today (UTC)."""
    tokens = GaugeMetricFamily("tensorgate_key_tokens_today", "Tokens each API key used today (UTC), reservations "
                               "included", labels=["key"])
    key_requests = GaugeMetricFamily("tensorgate_key_requests_today", "Requests each API key made today (UTC)",
                                     labels=["key"])
    for name, usage in sorted(gw.quota.usage.items()):
        tokens.add_metric([name], usage.tokens)
        key_requests.add_metric([name], usage.requests)
    yield from (tokens, key_requests)
