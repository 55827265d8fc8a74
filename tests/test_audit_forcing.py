"""Teacher-forcing arithmetic and the sampling distribution, on synthetic logits (no model)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gateway.protocol.sampling import SamplingParams, asked_logprobs, log_softmax
from scoring.audit.forcing import force


def _rows(n: int, vocab: int = 50, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 3.0, size=(n + 1, vocab)).astype(np.float32)


def test_sampling_params_defaults_and_penalties() -> None:
    assert SamplingParams.of({}) == SamplingParams(temperature=1.0, top_p=1.0, penalised=False)
    assert SamplingParams.of({"temperature": 0}).greedy
    assert SamplingParams.of({"presence_penalty": 0.5}).penalised
    assert SamplingParams.of({"temperature": True}).temperature == 1.0  # a bool is not a number here


def test_asked_logprobs_is_temperature_then_nucleus() -> None:
    logits = np.array([[2.0, 1.0, 0.0, -1.0]])
    full = asked_logprobs(logits, 0.5, 1.0)[0]
    assert np.allclose(full, log_softmax(logits / 0.5)[0])
    assert math.isclose(float(np.exp(full).sum()), 1.0, rel_tol=1e-9)
    # nucleus 0.9 at T=0.5: probs ~ [0.865, 0.117, 0.016, 0.002] -> the first two reach 0.9
    nuc = asked_logprobs(logits, 0.5, 0.9)[0]
    assert np.isfinite(nuc[:2]).all() and np.isneginf(nuc[2:]).all()
    assert math.isclose(float(np.exp(nuc[:2]).sum()), 1.0, rel_tol=1e-9)
    with pytest.raises(ValueError):
        asked_logprobs(logits, 0.0, 1.0)


def test_greedy_gap_is_zero_on_argmax_and_positive_elsewhere() -> None:
    rows = _rows(6)
    best = rows[:6].argmax(axis=1)
    s = force(rows, best, SamplingParams(temperature=0.0), stop_ids=(0,))
    assert s.n == 6 and np.allclose(s.gap, 0.0)
    worst = rows[:6].argmin(axis=1)
    s2 = force(rows, worst, SamplingParams(temperature=0.0), stop_ids=(0,))
    assert (s2.gap > 1.0).all()
    assert math.isclose(s2.stop_gap, float(rows[6].max() - rows[6][0]), rel_tol=1e-6)


def test_sampled_moments_match_the_direct_definition() -> None:
    rows = _rows(5, seed=3)
    ids = np.array([1, 2, 3, 4, 5])
    for temp, top_p in ((0.7, 1.0), (1.3, 0.8)):
        s = force(rows, ids, SamplingParams(temperature=temp, top_p=top_p), stop_ids=(0, 7))
        lsm = asked_logprobs(rows[:5], temp, min(1.0, top_p + 0.02) if top_p < 1 else 1.0)
        p = np.exp(lsm)
        fin = np.where(np.isfinite(lsm), lsm, 0.0)
        mean = (p * fin).sum(axis=1)
        var = (p * fin * fin).sum(axis=1) - mean**2
        assert np.allclose(s.mean, mean, atol=1e-4)
        assert np.allclose(s.var, var, atol=1e-3)
        assert np.allclose(np.where(np.isfinite(s.logp), s.logp, -99), np.where(np.isfinite(lsm[range(5), ids]),
                           lsm[range(5), ids], -99), atol=1e-4)
        stop = np.logaddexp.reduce(log_softmax(rows[5:6] / temp)[0][[0, 7]])
        assert math.isclose(s.stop_logp, float(stop), rel_tol=1e-5)


def test_honest_draws_centre_the_z_score_and_other_distributions_do_not() -> None:
    """Draw from the asked distribution -> z ~ N(0, 1); from a hotter one -> far below 0."""
    rng = np.random.default_rng(5)
    rows = rng.normal(0.0, 4.0, size=(401, 200)).astype(np.float32)
    sampling = SamplingParams(temperature=0.8)
    lsm = asked_logprobs(rows[:400], 0.8, 1.0)

    def z_of(ids: np.ndarray) -> float:
        s = force(rows, ids, sampling, stop_ids=(0,))
        return float((s.logp - s.mean).sum() / np.sqrt(s.var.sum()))

    honest = [z_of(np.array([rng.choice(200, p=np.exp(r)) for r in lsm])) for _ in range(20)]
    assert abs(float(np.mean(honest))) < 1.0 and max(abs(z) for z in honest) < 4.0
    hot = asked_logprobs(rows[:400], 2.0, 1.0)
    assert z_of(np.array([rng.choice(200, p=np.exp(r)) for r in hot])) < -8.0
    greedy = rows[:400].argmax(axis=1)
    assert z_of(greedy) > 8.0


def test_force_rejects_mismatched_shapes_and_ids() -> None:
    rows = _rows(3)
    with pytest.raises(ValueError):
        force(rows, [1, 2], SamplingParams(), stop_ids=(0,))
    with pytest.raises(ValueError):
        force(rows, [1, 2, 999], SamplingParams(), stop_ids=(0,))
