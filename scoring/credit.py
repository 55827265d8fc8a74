"""Per-request credit: how well one streamed completion met the bar an honest RTX 5090 sets.

Two factors, multiplied. **TTFT**: the time to first token, less an allowance for prefilling the
prompt (``prompt_tokens / prefill_tok_s``), must sit inside a full-credit band; credit falls
linearly to 0 at the zero band. **Decode**: the per-request decode rate is compared with what an
honest card delivers at that concurrency. The curve is *aggregate* tok/s (per-request rate x n),
because batching raises the card's total throughput while each stream gets slower; a miner is
never penalised for being asked to run requests side by side.

Decode is judged on the validator's clock only (:func:`on_time_ratio`): when the whole answer arrived,
from dispatch, against when an honest card at that concurrency would have finished it (prefill
allowance + the full TTFT band + the tokens after the first at the expected rate). It used to be the
rate from the miner's first token, and a miner chooses when that is: a card that held its first token
and sent the rest in one burst showed any rate it liked (issue 23: a half-speed card earned 4.9x its
honest pay that way). Now holding tokens back changes nothing decode sees, and costs TTFT credit. The
price, on purpose: a short answer's deadline is mostly the TTFT band, so a card slower at decode but
quicker to its first token is judged by what its user sees, the whole answer as soon as from an
honest card at the band's edge; and a first token past the band makes the answer late too.
:func:`on_time_rate` is the same clock read as a rate, for the capacity check.

Everything here is pure and total: NaN, inf or negative measurements are the miner's failure
(credit 0), never an exception in the scoring path.

Example::

    cfg = CreditConfig()
    ttft_credit(0.4, prompt_tokens=2400, cfg=cfg)   # 1.0: 0.4 s - 0.1 s prefill allowance <= 0.5 s
    expected_rate(2, cfg)                            # 150.0 tok/s per request (300 aggregate / 2)
    decode_credit(130.0, concurrency=2, cfg=cfg)     # 1.0: 130/150 = 0.87 >= tolerance 0.8
    request_credit(measurement, cfg)                 # float in [0, 1], or None when excluded
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.protocol.measurement import FailureReason, Measurement

# Failures that are not the miner's fault: a 429 is the miner telling the truth about its capacity,
# a client disconnect is the caller walking away (unless the miner had made it wait past the TTFT band:
# see stalled_client). They are excluded from credit (neither 0 nor 1).
EXCLUDED_FAILURES: frozenset[str] = frozenset(r for r in FailureReason if not r.blames_miner)

DecodeCurve = tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class CreditConfig:
    """The bar. Defaults describe one RTX 5090 serving the subnet's model.

    ``decode_curve`` holds ``(concurrency, aggregate tok/s)`` points, strictly increasing in
    concurrency; between points the aggregate is interpolated linearly, beyond the ends it is flat.
    """

    full_band_s: float = 0.5
    zero_band_s: float = 1.5
    prefill_tok_s: float = 24000.0
    decode_curve: DecodeCurve = ((1, 440.0), (2, 300.0), (16, 300.0))
    floor_ratio: float = 0.5
    tolerance_ratio: float = 0.8
    min_decode_tokens: int = 16

    def __post_init__(self) -> None:
        def finite(name: str, v: float) -> None:
            if not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"CreditConfig.{name} must be a finite number, got {v!r}")

        for name in ("full_band_s", "zero_band_s", "prefill_tok_s", "floor_ratio", "tolerance_ratio"):
            finite(name, getattr(self, name))
        if self.full_band_s < 0:
            raise ValueError(f"full_band_s must be >= 0, got {self.full_band_s}")
        if self.zero_band_s <= self.full_band_s:
            raise ValueError(f"zero_band_s ({self.zero_band_s}) must be > full_band_s ({self.full_band_s})")
        if self.prefill_tok_s <= 0:
            raise ValueError(f"prefill_tok_s must be > 0, got {self.prefill_tok_s}")
        if not 0 <= self.floor_ratio < self.tolerance_ratio:
            raise ValueError(f"need 0 <= floor_ratio ({self.floor_ratio}) < tolerance_ratio ({self.tolerance_ratio})")
        if self.tolerance_ratio <= 0:
            raise ValueError(f"tolerance_ratio must be > 0, got {self.tolerance_ratio}")
        if not isinstance(self.min_decode_tokens, int) or self.min_decode_tokens < 2:
            raise ValueError(f"min_decode_tokens must be an int >= 2, got {self.min_decode_tokens!r}")
        if not self.decode_curve:
            raise ValueError("decode_curve needs at least one (concurrency, aggregate tok/s) point")
        prev = 0
        for point in self.decode_curve:
            if len(point) != 2:
                raise ValueError(f"decode_curve point {point!r} is not (concurrency, tok/s)")
            n, agg = point
            if not isinstance(n, int) or n <= prev:
                raise ValueError(f"decode_curve concurrencies must be ints, >= 1 and increasing; got {n!r}")
            finite("decode_curve", agg)
            if agg <= 0:
                raise ValueError(f"decode_curve aggregate at concurrency {n} must be > 0, got {agg}")
            prev = n


def _ramp(x: float, zero_at: float, one_at: float) -> float:
    """Linear 0..1 between ``zero_at`` and ``one_at`` (either order), clamped outside."""
    if zero_at < one_at:
        if x <= zero_at:
            return 0.0
        if x >= one_at:
            return 1.0
    else:
        if x >= zero_at:
            return 0.0
        if x <= one_at:
            return 1.0
    return (x - zero_at) / (one_at - zero_at)


def _bad(x: float) -> bool:
    """True for values that cannot be a real measurement: NaN, inf, negative, or not a number."""
    return not isinstance(x, int | float) or isinstance(x, bool) or not math.isfinite(x) or x < 0


def ttft_credit(ttft_s: float | None, prompt_tokens: int, cfg: CreditConfig) -> float:
    """1.0 when TTFT minus the prefill allowance is within the full band, 0.0 from the zero band on."""
    if ttft_s is None or _bad(ttft_s) or _bad(prompt_tokens):
        return 0.0
    residual = ttft_s - prompt_tokens / cfg.prefill_tok_s
    return _ramp(residual, zero_at=cfg.zero_band_s, one_at=cfg.full_band_s)


def aggregate_rate(concurrency: float, cfg: CreditConfig) -> float:
    """Aggregate tok/s an honest card sustains across ``concurrency`` simultaneous streams."""
    curve = cfg.decode_curve
    n = max(1, concurrency)
    if n <= curve[0][0]:
        return curve[0][1]
    for (n0, a0), (n1, a1) in zip(curve, curve[1:], strict=False):
        if n <= n1:
            return a0 + (a1 - a0) * (n - n0) / (n1 - n0)
    return curve[-1][1]


def expected_rate(concurrency: float, cfg: CreditConfig) -> float:
    """Per-request decode tok/s an honest card gives each of ``concurrency`` streams."""
    n = max(1, concurrency)
    return aggregate_rate(n, cfg) / n


def _ratio_credit(ratio: float, cfg: CreditConfig) -> float:
    return _ramp(ratio, zero_at=cfg.floor_ratio, one_at=cfg.tolerance_ratio)


def decode_credit(rate: float | None, concurrency: float, cfg: CreditConfig) -> float | None:
    """0 under ``floor_ratio`` of the expected rate, 1 from ``tolerance_ratio``, linear between.

    ``None`` means "not applicable" (too few tokens to measure a rate): the caller uses factor 1.0.
    """
    if rate is None:
        return None
    if _bad(rate) or _bad(concurrency):
        return 0.0
    return _ratio_credit(rate / expected_rate(concurrency, cfg), cfg)


def decode_start_s(m: Measurement, cfg: CreditConfig) -> float:
    """Seconds after dispatch from which ``m``'s decode is timed: the prefill allowance plus the full TTFT band.

    Fixed by the request and the profile, never by anything the miner sends.
    """
    prompt = m.prompt_tokens if not _bad(m.prompt_tokens) else 0
    return prompt / cfg.prefill_tok_s + cfg.full_band_s


def on_time_ratio(m: Measurement, concurrency: float, cfg: CreditConfig) -> float | None:
    """An honest card's completion time for ``m`` at ``concurrency`` over the one measured, both from dispatch.

    1.0: on time; 0.5: the answer took twice as long as an honest card's. ``None`` when there is nothing
    to judge (fewer than ``min_decode_tokens`` tokens, no token at all); 0.0 for a latency that is not a
    possible measurement.
    """
    if m.ttft_s is None or _bad(m.completion_tokens) or m.completion_tokens < cfg.min_decode_tokens:
        return None
    if _bad(m.latency_s) or m.latency_s <= 0 or _bad(concurrency):
        return 0.0
    expected = decode_start_s(m, cfg) + (m.completion_tokens - 1) / expected_rate(concurrency, cfg)
    return expected / m.latency_s


def on_time_credit(m: Measurement, concurrency: float, cfg: CreditConfig) -> float | None:
    """Decode credit of ``m``: :func:`on_time_ratio` on the tolerance ramp (``None``: not judged, factor 1)."""
    ratio = on_time_ratio(m, concurrency, cfg)
    return None if ratio is None else _ratio_credit(ratio, cfg)


def on_time_rate(m: Measurement, cfg: CreditConfig) -> float | None:
    """Tokens after the first per second, from :func:`decode_start_s` to the end of the answer.

    ``None`` when there is nothing to time: fewer than ``min_decode_tokens`` tokens, no token at all, a
    latency that is not a number, or an answer complete before the decode clock starts.
    """
    if m.ttft_s is None or _bad(m.latency_s) or _bad(m.completion_tokens):
        return None
    if m.completion_tokens < cfg.min_decode_tokens:
        return None
    window = m.latency_s - decode_start_s(m, cfg)
    if window <= 0:
        return None
    return (m.completion_tokens - 1) / window


def _measurement_is_sane(m: Measurement) -> bool:
    if m.ttft_s is None or _bad(m.ttft_s) or _bad(m.latency_s) or m.latency_s < m.ttft_s:
        return False
    return not (_bad(m.prompt_tokens) or _bad(m.completion_tokens) or _bad(m.in_flight)
                or _bad(m.decode_concurrency))


def stalled_client(m: Measurement, cfg: CreditConfig) -> bool:
    """A client that gave up on a miner that had not sent a token by the time its TTFT earned nothing.

    Leaving a request hanging until the client walks away must not be free: that wait is the miner's,
    so it is booked like a timeout (credit 0). A client that leaves sooner is its own business (excluded).
    """
    if m.failure != FailureReason.CLIENT_DISCONNECT or m.ttft_s is not None or _bad(m.latency_s):
        return False
    return ttft_credit(m.latency_s, m.prompt_tokens, cfg) == 0.0


def request_credit(m: Measurement, cfg: CreditConfig, *, loaded: bool = False) -> float | None:
    """Credit in [0, 1] for one dispatched request, or ``None`` when it is excluded from credit.

    Excluded: a truthful 429 (``busy``), a client leaving before the miner was late, a client-fault
    refusal and the validator's own resource failures. Every other failure, and any success whose
    numbers are not a possible measurement, is 0.0.

    ``loaded``: judge the decode rate as if the card were running all the slots it declares, i.e.
    allow for streams of other validators this one cannot see (the scorer grants it to a miner that
    has shown its full speed in the same round; see :mod:`scoring.rounds`).
    """
    if not m.ok:
        if stalled_client(m, cfg):
            return 0.0
        return None if m.failure in EXCLUDED_FAILURES else 0.0
    if not _measurement_is_sane(m):
        return 0.0
    t = ttft_credit(m.ttft_s, m.prompt_tokens, cfg)
    if t == 0.0:
        return 0.0
    concurrency = max(m.decode_concurrency, float(m.slots)) if loaded else m.decode_concurrency
    d = on_time_credit(m, concurrency, cfg)
    return t if d is None else t * d
