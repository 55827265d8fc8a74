"""What clients saw, in the field's vocabulary: time to first token and end-to-end latency per model, tokens in and
out per API key and model.

The per-miner series (:mod:`gateway.metrics`) are the validator's view of its miners: every dispatch, probes
included, TTFT from the dispatch. A dashboard for the service's users needs the requests as clients made them: from
the request's arrival to its first byte and to its end, organic only (probes never pass the gateway's routes), by the
model asked for. Named after OpenTelemetry's GenAI conventions (``gen_ai.server.time_to_first_token``,
``gen_ai.server.request.duration``, ``gen_ai.client.token.usage``; labels ``gen_ai_request_model``,
``gen_ai_token_type``), as Prometheus spells them, the way vLLM exports ``vllm:time_to_first_token_seconds`` and
``vllm:e2e_request_latency_seconds``.

Example::

    series = ClientSeries()
    series.observe("tensorgate/sim-5090", "alice", ttft_s=0.5, latency_s=1.2, input_tokens=40, output_tokens=64)
    list(series.families())       # two histograms and one counter
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from .asgi import Message, Send
from .buckets import TTFT_BOUNDS_S, Buckets

LATENCY_BOUNDS_S = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
MODEL = "gen_ai_request_model"


class ClientSeries:
    """Counts kept where the requests end (:mod:`gateway.routes.completions`), exported at scrape time."""

    def __init__(self) -> None:
        self.ttft: dict[str, Buckets] = {}
        self.latency: dict[str, Buckets] = {}
        self.tokens: Counter[tuple[str, str, str]] = Counter()  # (key, model, "input" | "output")

    def observe(self, model: str, key: str, *, ttft_s: float | None, latency_s: float, input_tokens: int,
                output_tokens: int) -> None:
        """One answered request: ``ttft_s`` from its arrival to its first byte (None: nothing was sent)."""
        if ttft_s is not None:
            self.ttft.setdefault(model, Buckets(TTFT_BOUNDS_S)).observe(ttft_s)
        self.latency.setdefault(model, Buckets(LATENCY_BOUNDS_S)).observe(latency_s)
        self.tokens[(key, model, "input")] += max(0, input_tokens)
        self.tokens[(key, model, "output")] += max(0, output_tokens)

    def families(self) -> Iterator[Metric]:
        ttft = HistogramMetricFamily("gen_ai_server_time_to_first_token_seconds", "Time from a client's request to "
                                     "its first byte, by the model asked for (organic requests only)", labels=[MODEL])
        for model, b in sorted(self.ttft.items()):
            ttft.add_metric([model], b.cumulative(), b.total)
        latency = HistogramMetricFamily("gen_ai_server_request_duration_seconds", "Time from a client's request to "
                                        "its last byte, by the model asked for (organic requests only)",
                                        labels=[MODEL])
        for model, b in sorted(self.latency.items()):
            latency.add_metric([model], b.cumulative(), b.total)
        tokens = CounterMetricFamily("gen_ai_client_token_usage", "Tokens of answered requests, by API key, model "
                                     "and direction (input: the prompt as the key is charged; output: the answer)",
                                     labels=["key", MODEL, "gen_ai_token_type"])
        for (key, model, kind), n in sorted(self.tokens.items()):
            tokens.add_metric([key, model, kind], n)
        yield from (ttft, latency, tokens)


class FirstByte:
    """``send`` that notes when the first body bytes left (a client's time to first token)."""

    __slots__ = ("_send", "at")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.at: float | None = None

    async def __call__(self, message: Message) -> None:
        if self.at is None and message["type"] == "http.response.body":
            self.at = time.monotonic()
        await self._send(message)
