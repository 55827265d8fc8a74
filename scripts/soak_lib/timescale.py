"""Time compression: one factor ``S`` applied everywhere, undone exactly once, before credit.

With ``--time-scale S`` one simulated second lasts ``1/S`` real seconds:

* the simulated card runs with ``CardProfile.time_scale = S`` (all its durations divided by S, its
  token rates multiplied by S);
* the round length, the traffic inter-arrival times, the probe schedule and the load model's time
  constant are given in simulated seconds and divided by S before they are slept;
* the gateway measures real seconds on its own clock, so :class:`TimeScaledSink` multiplies
  ``ttft_s`` and ``latency_s`` of every measurement by S before the scorer sees it (the decode rate,
  tokens / decode seconds, is thereby divided by S). The :class:`~scoring.credit.CreditConfig` stays
  the production one, bands in real seconds. This is the same as dividing the TTFT bands by S and
  multiplying ``prefill_tok_s`` and the decode curve by S (:func:`scaled_credit_config`; the tests
  check the two agree);
* the gateway's upstream deadlines are divided by S too (:func:`scaled_timeouts`), connect excepted.

The price: the validator's own overhead (signing, loopback HTTP, event-loop lag on a busy machine)
is multiplied by S as well. The soak reports it (``overhead_ms``: measured TTFT minus the TTFT the
card itself slept, in simulated ms) so a reader can tell card behaviour from harness noise.

Example::

    sink = TimeScaledSink(scorer, scale=20.0)
    upstream = Upstream(pool, signer, sink)     # the scorer sees simulated seconds
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from gateway.protocol.measurement import Measurement, MeasurementSink
from gateway.upstream import UpstreamTimeouts
from scoring.credit import CreditConfig


def to_simulated(m: Measurement, scale: float) -> Measurement:
    """The measurement as the scorer must see it: real seconds times ``scale``."""
    ttft = None if m.ttft_s is None else m.ttft_s * scale
    arrivals = None if m.arrivals is None else tuple((t * scale, n) for t, n in m.arrivals)
    return dataclasses.replace(m, ttft_s=ttft, latency_s=m.latency_s * scale, arrivals=arrivals)


class TimeScaledSink:
    """A measurement sink that rescales to simulated time, then hands on to ``inner`` and ``taps``."""

    def __init__(self, inner: MeasurementSink, scale: float,
                 taps: tuple[Callable[[Measurement], None], ...] = ()) -> None:
        if scale <= 0:
            raise ValueError(f"time scale must be > 0, got {scale}")
        self.inner = inner
        self.scale = scale
        self.taps = taps

    def record(self, m: Measurement) -> None:
        sim = to_simulated(m, self.scale)
        self.inner.record(sim)
        for tap in self.taps:
            tap(sim)


def scaled_credit_config(cfg: CreditConfig, scale: float) -> CreditConfig:
    """The equivalent config for *unscaled* (real-second) measurements: bands / S, rates x S."""
    return dataclasses.replace(
        cfg,
        full_band_s=cfg.full_band_s / scale,
        zero_band_s=cfg.zero_band_s / scale,
        prefill_tok_s=cfg.prefill_tok_s * scale,
        decode_curve=tuple((n, a * scale) for n, a in cfg.decode_curve),
    )


def scaled_timeouts(t: UpstreamTimeouts, scale: float) -> UpstreamTimeouts:
    """Deadlines in simulated seconds -> real seconds (connect is a loopback socket: left alone)."""
    return UpstreamTimeouts(connect=t.connect, first_token=t.first_token / scale, stall=t.stall / scale,
                            total=t.total / scale)
