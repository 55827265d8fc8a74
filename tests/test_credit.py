"""Per-request credit: TTFT bands and prefill allowance, the decode curve, exclusions, bad inputs."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from gateway.protocol.measurement import FailureReason, Measurement
from scoring.credit import (
    CreditConfig,
    aggregate_rate,
    decode_credit,
    expected_rate,
    on_time_rate,
    request_credit,
    ttft_credit,
)

CFG = CreditConfig()


def measure(
    *,
    rate: float | None = None,
    ttft: float | None = 0.3,
    concurrency: int = 1,
    tokens: int = 256,
    prompt: int = 100,
    ok: bool = True,
    failure: FailureReason | None = None,
    latency: float | None = None,
) -> Measurement:
    """A measurement whose decode rate is ``rate`` tok/s (when given), its first token at the band's edge
    (so its completion time is an honest card's at the expected rate, scaled by rate / expected)."""
    if latency is None:
        start = prompt / CFG.prefill_tok_s + CFG.full_band_s  # decode_start_s
        latency = (start + (tokens - 1) / expected_rate(concurrency, CFG)) * expected_rate(concurrency, CFG) / rate \
            if rate else (ttft or 0.0) + 0.1
    return Measurement(uid=1, hotkey="hk", in_flight=concurrency - 1, prompt_tokens=prompt, max_tokens=tokens,
                       ttft_s=ttft, latency_s=latency, completion_tokens=tokens, ok=ok, failure=failure)


# -- TTFT --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ttft", "expected"),
    [(0.0, 1.0), (0.2, 1.0), (0.5, 1.0), (0.75, 0.75), (1.0, 0.5), (1.25, 0.25), (1.5, 0.0), (3.0, 0.0)],
)
def test_ttft_bands_without_prompt(ttft: float, expected: float) -> None:
    assert ttft_credit(ttft, 0, CFG) == pytest.approx(expected)


def test_ttft_band_edges_are_continuous_and_monotone() -> None:
    xs = [i / 1000 for i in range(0, 2001)]
    ys = [ttft_credit(x, 0, CFG) for x in xs]
    assert all(a >= b for a, b in zip(ys, ys[1:], strict=False))
    assert ttft_credit(0.5 + 1e-9, 0, CFG) == pytest.approx(1.0, abs=1e-6)
    assert ttft_credit(0.5 + 1e-3, 0, CFG) < 1.0
    assert ttft_credit(1.5 - 1e-3, 0, CFG) > 0.0


def test_prefill_allowance_subtracts_prompt_time() -> None:
    # 24 000 prompt tokens at 24 000 tok/s is a 1 s allowance.
    assert ttft_credit(1.5, 24_000, CFG) == pytest.approx(1.0)
    assert ttft_credit(1.5, 0, CFG) == pytest.approx(0.0)
    assert ttft_credit(2.0, 24_000, CFG) == pytest.approx(0.5)
    # 2 400 tokens = 0.1 s allowance: 0.6 s is just inside the full band.
    assert ttft_credit(0.6, 2_400, CFG) == pytest.approx(1.0)
    assert ttft_credit(0.7, 2_400, CFG) == pytest.approx(0.9)
    # A faster prefill allowance in the config moves the band.
    fast = CreditConfig(prefill_tok_s=48_000.0)
    assert ttft_credit(1.5, 24_000, fast) == pytest.approx(0.5)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -0.1, None])
def test_ttft_bad_values_are_zero(bad: float | None) -> None:
    assert ttft_credit(bad, 0, CFG) == 0.0


def test_ttft_negative_prompt_tokens_is_zero() -> None:
    assert ttft_credit(0.1, -5, CFG) == 0.0


# -- decode curve ------------------------------------------------------------------------------------


def test_expected_rate_follows_aggregate_curve() -> None:
    assert expected_rate(1, CFG) == pytest.approx(440.0)
    assert expected_rate(2, CFG) == pytest.approx(150.0)
    assert expected_rate(5, CFG) == pytest.approx(60.0)
    assert expected_rate(16, CFG) == pytest.approx(18.75)
    # Flat aggregate beyond the last point, and below the first.
    assert aggregate_rate(32, CFG) == pytest.approx(300.0)
    assert expected_rate(32, CFG) == pytest.approx(300.0 / 32)
    assert expected_rate(0, CFG) == pytest.approx(440.0)


def test_aggregate_is_interpolated_linearly_between_points() -> None:
    cfg = CreditConfig(decode_curve=((1, 400.0), (2, 300.0), (4, 500.0)))
    assert aggregate_rate(3, cfg) == pytest.approx(400.0)
    assert expected_rate(3, cfg) == pytest.approx(400.0 / 3)
    cfg2 = CreditConfig(decode_curve=((2, 200.0), (10, 600.0)))
    assert aggregate_rate(6, cfg2) == pytest.approx(400.0)
    assert aggregate_rate(1, cfg2) == pytest.approx(200.0)  # flat below the first point


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16])
def test_decode_credit_ramp(n: int) -> None:
    exp = expected_rate(n, CFG)
    assert decode_credit(exp, n, CFG) == 1.0
    assert decode_credit(exp * 3, n, CFG) == 1.0
    assert decode_credit(exp * 0.8, n, CFG) == pytest.approx(1.0)
    assert decode_credit(exp * 0.65, n, CFG) == pytest.approx(0.5)
    assert decode_credit(exp * 0.5, n, CFG) == pytest.approx(0.0)
    assert decode_credit(exp * 0.3, n, CFG) == 0.0


def test_decode_credit_not_applicable_and_bad() -> None:
    assert decode_credit(None, 1, CFG) is None
    for bad in (math.nan, math.inf, -1.0):
        assert decode_credit(bad, 1, CFG) == 0.0


def test_single_stream_card_at_one_gets_full_credit_and_a_slow_one_none() -> None:
    assert request_credit(measure(rate=420.0), CFG) == pytest.approx(1.0)
    assert request_credit(measure(rate=200.0), CFG) == pytest.approx(0.0)


def test_honest_card_at_two_to_five_concurrent_gets_full_credit() -> None:
    """An honest 5090 keeps >= 300 tok/s aggregate from 2 to 5 streams; per-request noise of +-15 % is fine."""
    rng = random.Random(1234)
    honest_aggregate = {2: 305.0, 3: 320.0, 4: 335.0, 5: 350.0}
    for n, agg in honest_aggregate.items():
        for _ in range(200):
            per_request = agg / n * rng.uniform(0.85, 1.15)
            credit = request_credit(measure(rate=per_request, concurrency=n, ttft=rng.uniform(0.1, 0.45)), CFG)
            assert credit == pytest.approx(1.0), (n, per_request)


def test_honest_card_judged_at_its_concurrency_not_at_one() -> None:
    # 150 tok/s is honest for a request that shared the card with another, not for a lone request.
    assert request_credit(measure(rate=150.0, concurrency=2), CFG) == pytest.approx(1.0)
    assert request_credit(measure(rate=150.0, concurrency=1), CFG) == pytest.approx(0.0)


def test_sixteen_concurrent() -> None:
    exp = 300.0 / 16
    assert request_credit(measure(rate=exp * 0.9, concurrency=16), CFG) == pytest.approx(1.0)
    assert request_credit(measure(rate=exp * 0.65, concurrency=16), CFG) == pytest.approx(0.5)
    assert request_credit(measure(rate=exp * 0.4, concurrency=16), CFG) == 0.0


# -- whole requests ----------------------------------------------------------------------------------


def test_credit_is_product_of_ttft_and_decode() -> None:
    c = request_credit(measure(rate=440.0 * 0.65, ttft=1.0, prompt=0), CFG)  # 0.5 x 0.5
    assert c == pytest.approx(0.25)


def test_too_few_tokens_means_ttft_only() -> None:
    m = measure(ttft=1.0, tokens=CFG.min_decode_tokens - 1, latency=1.01, prompt=0)
    assert on_time_rate(m, CFG) is None
    assert request_credit(m, CFG) == pytest.approx(0.5)


@pytest.mark.parametrize("reason", [FailureReason.BUSY, FailureReason.CLIENT_DISCONNECT])
def test_not_the_miners_fault_is_excluded(reason: FailureReason) -> None:
    assert request_credit(measure(ok=False, failure=reason, ttft=None, latency=0.01), CFG) is None


@pytest.mark.parametrize("reason", [FailureReason.CONNECT, FailureReason.TIMEOUT, FailureReason.DROPPED,
                                    FailureReason.GARBAGE, FailureReason.HTTP_STATUS, None])
def test_miner_failures_are_zero(reason: FailureReason | None) -> None:
    # Even with a good TTFT before the failure, a failed request earns nothing.
    assert request_credit(measure(rate=440.0, ok=False, failure=reason), CFG) == 0.0


@pytest.mark.parametrize(
    "fields",
    [
        {"ttft_s": math.nan},
        {"ttft_s": math.inf},
        {"ttft_s": -0.2},
        {"ttft_s": None},
        {"latency_s": math.nan},
        {"latency_s": math.inf},
        {"latency_s": 0.1},  # ends before its first token
        {"completion_tokens": -3},
        {"prompt_tokens": -1},
        {"in_flight": -1},
    ],
)
def test_impossible_measurements_count_as_failure(fields: dict[str, float | None]) -> None:
    good = measure(rate=440.0)
    assert request_credit(good, CFG) == pytest.approx(1.0)
    values: dict[str, Any] = {
        "uid": 1, "hotkey": "hk", "in_flight": 0, "prompt_tokens": 100, "max_tokens": 256, "ttft_s": 0.3,
        "latency_s": good.latency_s, "completion_tokens": 256, "ok": True,
    }
    values.update(fields)
    assert request_credit(Measurement(**values), CFG) == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"full_band_s": 1.0, "zero_band_s": 1.0},
        {"full_band_s": 2.0, "zero_band_s": 1.0},
        {"full_band_s": -0.1},
        {"prefill_tok_s": 0.0},
        {"prefill_tok_s": math.nan},
        {"floor_ratio": 0.8, "tolerance_ratio": 0.8},
        {"floor_ratio": -0.1},
        {"decode_curve": ()},
        {"decode_curve": ((2, 300.0), (1, 440.0))},
        {"decode_curve": ((1, 440.0), (1, 300.0))},
        {"decode_curve": ((0, 440.0),)},
        {"decode_curve": ((1, -5.0),)},
        {"decode_curve": ((1, math.inf),)},
        {"min_decode_tokens": 1},
    ],
)
def test_config_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        CreditConfig(**kwargs)  # type: ignore[arg-type]
