"""Teacher forcing, the arithmetic: what the reference model thought of each token a miner sent.

The reference runtime evaluates the prompt followed by the miner's own completion tokens in one
pass (no generation) and hands over one row of logits per completion position, plus one more row
after the last token (where the model would stop or go on). This module turns those rows into the
few numbers a verdict needs, per position:

* ``gap``: how far the miner's token sits below the reference's best token, in nats, at the raw
  distribution (temperature 1). A greedy miner's tokens have gap 0 up to numerics.
* ``logp``, ``mean``, ``var``: the token's log-probability under the distribution the client asked
  for (temperature, then nucleus ``top_p``, as OpenAI and vLLM apply them), and that distribution's
  expected log-probability and variance. Summed over an answer, ``logp - mean`` is a centred
  statistic whose spread ``sqrt(sum var)`` is known, so an honest sampled answer gives a z-score
  near 0 and one drawn from another distribution (another model, prompt or temperature) does not.
* ``outside``: the token lies outside the asked nucleus ``top_p``, even taken a little wider than asked.
  A nucleus's edge is where two runtimes' numerics disagree most: token by token against one batched
  pass, the chosen tokens' logits sit a few tenths of a nat apart (and a whole row of llama.cpp's
  Q4_K_M model up to a few nats somewhere, ``neurons.reference.bands``), which moves the cumulative mass
  at the edge of a flat row by 0.1 and more, so an honest token can sit just beyond it
  (:data:`NUCLEUS_SLACK`). The verdict counts such a token as a miss, never as a failure by itself.
* the stop row: the log-probability that the model ends its turn right after the last token.

A **seeded** sampled answer (the subnet's sampler, :func:`gateway.protocol.sampling.seeded_token`)
is determined by its seed, so ``gap`` and ``stop_gap`` are measured as for greedy ones, on each
token's Gumbel-perturbed score instead of its logit (converted back to nats at temperature 1 by
multiplying by the temperature, so one near-tie band serves both). Its ``logp``/``mean``/``var``
are left at 0: a determined token needs no plausibility test.

Pure numpy, rows processed in blocks so a 4k-token answer over a 262k-token vocabulary never holds
more than a block of full-width temporaries.

Example::

    scores = force(logits, np.array([5, 9]), SamplingParams(temperature=0.0), stop_ids=(1, 106))
    scores.gap            # array([0.0, 0.13]): the miner's tokens were the argmax, then a near-tie
    scores.stop_gap       # nats between the best token and the best stop token after the answer
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from gateway.protocol.sampling import (
    FloatArray,
    SamplingParams,
    asked_logprobs,
    best_seeded_score,
    gumbel_at,
    log_softmax,
    nucleus_edges,
)

_BLOCK = 16  # rows per numpy pass: 16 x 262k float32 = 17 MB of temporaries at most
# Free draws: the distribution whose moments the z-score uses is taken a little wider than asked (the
# reference's numerics differ); tokens beyond it are ``outside``, and the verdict allows a share of them.
_FREE_NUCLEUS_SLACK = 0.02
# Seeded answers: how much probability mass the reference's nucleus is widened by (for the miner's token) and
# narrowed by (for its best rival). Measured with Gemma 3 270M on llama.cpp, an honest miner decoding token by
# token against the batched reference, top_p 0.8-0.95, temperature 0.2-1.2: over 1,026 positions the two nuclei's
# edges disagreed by up to 0.11 of mass (0.21 at temperature 0.2). Over 288 honest answers (9,091 positions), at
# 0.02 seven tokens fell outside the widened nucleus (7 answers, 2.4 %, failed outright) and a rival flipped by
# 1.92 nats; at 0.1 none fell outside and two positions missed, by 0.61 nats at most. A sampler that ignores
# top_p misses at 2.0 % of its positions at 0.1 (79 answers), the rate the sequential test is tuned to catch.
NUCLEUS_SLACK = 0.1


@dataclass(frozen=True, slots=True)
class ForcedScores:
    """Per-position numbers for one answer (length n) and its stop row."""

    gap: FloatArray  # best raw logprob minus the chosen token's, >= 0
    # The chosen token is outside the asked nucleus even widened for numerics (seeded answers: by the bands' slack;
    # free draws: by _FREE_NUCLEUS_SLACK, where its logp is -inf).
    outside: npt.NDArray[np.bool_]
    # Seeded answers with a nucleus: the probability mass the asked nucleus would have to widen by to hold the
    # chosen token (0 inside it). What an honest runtime shows here is what a calibration sets the slack from.
    nucleus_excess: FloatArray
    logp: FloatArray  # chosen token's logprob under the asked distribution (-inf: outside the nucleus)
    mean: FloatArray  # expected logprob under that distribution
    var: FloatArray  # variance of the logprob under it
    stop_gap: float  # best raw logprob minus the best stop token's, after the last token
    stop_logp: float  # log-probability (asked distribution, no nucleus) of stopping after the last token

    @property
    def n(self) -> int:
        return int(self.gap.shape[0])


def force(logits: npt.ArrayLike, chosen: npt.ArrayLike, sampling: SamplingParams,
          stop_ids: tuple[int, ...] | frozenset[int], *, nucleus_slack: float = NUCLEUS_SLACK) -> ForcedScores:
    """Score ``chosen`` (n ids) against ``logits`` (n + 1 rows: one per position, then the stop row).

    Greedy requests need only ``gap`` (a difference of logits: no softmax over the vocabulary), so
    their ``logp``/``mean``/``var`` are left at 0. Sampled requests with ``top_p`` 1 take the moments
    from one ``exp`` per row (``var`` is shift-invariant, so no log-softmax is materialised); a
    nucleus needs the full distribution per row and is the slow path.
    """
    rows = np.asarray(logits, dtype=np.float32)
    ids = np.asarray(chosen, dtype=np.int64)
    n = int(ids.shape[0])
    if rows.ndim != 2 or rows.shape[0] != n + 1:
        raise ValueError(f"need {n + 1} rows of logits for {n} tokens, got shape {rows.shape}")
    vocab = rows.shape[1]
    if n and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError("token id outside the vocabulary")
    stops = sorted(s for s in stop_ids if 0 <= s < vocab)
    if sampling.seeded:
        return _seeded(rows, ids, sampling, stops, nucleus_slack)
    body = rows[:n]
    at = np.arange(n)
    gap = (body.max(axis=1) - body[at, ids]).astype(np.float64)
    logp = np.zeros(n)
    mean = np.zeros(n)
    var = np.zeros(n)
    if not sampling.greedy and n:
        temp = sampling.temperature
        p = min(1.0, sampling.top_p + _FREE_NUCLEUS_SLACK) if sampling.top_p < 1.0 else 1.0
        for lo in range(0, n, _BLOCK):
            hi = min(n, lo + _BLOCK)
            if p >= 1.0:
                logp[lo:hi], mean[lo:hi], var[lo:hi] = _moments(body[lo:hi] / np.float32(temp), ids[lo:hi])
            else:
                lsm = asked_logprobs(body[lo:hi], temp, p)
                prob = np.exp(lsm)
                finite = np.where(np.isfinite(lsm), lsm, 0.0)
                m1 = (prob * finite).sum(axis=1)
                logp[lo:hi] = lsm[np.arange(hi - lo), ids[lo:hi]]
                mean[lo:hi] = m1
                var[lo:hi] = np.maximum(0.0, (prob * finite * finite).sum(axis=1) - m1 * m1)
    last = rows[n].astype(np.float64)
    stop_gap = float(last.max() - last[stops].max()) if stops else float("inf")
    stop_logp = _stop_logp(last, stops, 1.0 if sampling.greedy else sampling.temperature)
    return ForcedScores(gap=gap, outside=~np.isfinite(logp), nucleus_excess=np.zeros(n), logp=logp, mean=mean,
                        var=var, stop_gap=stop_gap, stop_logp=stop_logp)


def _stop_logp(last: FloatArray, stops: list[int], temp: float) -> float:
    """Log-probability, at temperature ``temp``, that the model ends its turn at the row ``last``."""
    if not stops:
        return float("-inf")
    return float(np.logaddexp.reduce(log_softmax(last[None, :] / temp)[0][stops]))


def _seeded(rows: npt.NDArray[np.float32], ids: npt.NDArray[np.int64], sampling: SamplingParams,
            stops: list[int], slack: float) -> ForcedScores:
    """Gaps for a seeded answer: how far (nats at temperature 1) each token's score sits below the best.

    A token's score is its scaled logit plus its Gumbel variate. With a nucleus, the reference's and
    the miner's edges differ (numerics), so the chosen token is flagged ``outside`` only beyond a nucleus
    ``slack`` *wider* than asked, and is compared with the best of one ``slack`` *narrower*. The stop row
    has no such flag: a stop beyond the widened nucleus is a stop the model did not choose (gap inf).
    """
    n = int(ids.shape[0])
    temp, seed, top_p = sampling.temperature, sampling.seed, sampling.top_p
    assert seed is not None
    gap = np.zeros(n)
    excess = np.zeros(n)
    for j in range(n):
        gap[j], excess[j] = _below_best(rows[j].astype(np.float64), [int(ids[j])], temp, seed, j, top_p, slack)
    stop_gap = float("inf")
    if stops:
        below, beyond = _below_best(rows[n].astype(np.float64), stops, temp, seed, n, top_p, slack)
        stop_gap = float("inf") if beyond >= slack else below
    return ForcedScores(gap=gap, outside=excess >= slack, nucleus_excess=excess, logp=np.zeros(n), mean=np.zeros(n),
                        var=np.zeros(n), stop_gap=stop_gap,
                        stop_logp=_stop_logp(rows[n].astype(np.float64), stops, temp))


def _below_best(row: FloatArray, tokens: list[int], temp: float, seed: int, position: int, top_p: float,
                slack: float) -> tuple[float, float]:
    """Nats (temperature 1) the best of ``tokens`` scores below the best of the nucleus ``slack`` narrower than
    asked, and the probability mass the asked nucleus must widen by to hold one of ``tokens`` (0: one is inside).

    A token is inside the nucleus ``p`` when the tokens more likely than it hold less than ``p`` (ties at the edge
    are in, as :func:`~gateway.protocol.sampling.nucleus_edges` keeps them). Beyond the nucleus ``slack`` wider,
    the gap is measured for all ``tokens`` all the same; within it, for those inside. Only the tokens that can
    hold the best score are hashed (:func:`~gateway.protocol.sampling.best_seeded_score`).
    """
    scaled = row / temp

    def score_of(ts: list[int]) -> float:
        ids = np.array(ts, dtype=np.int64)
        return float((scaled[ids] + gumbel_at(seed, position, ids)).max())

    if top_p >= 1.0:
        return max(0.0, temp * (best_seeded_score(scaled, seed, position) - score_of(tokens))), 0.0
    lsm = log_softmax(scaled[None, :])[0]
    probs = np.exp(lsm)
    excess = {t: max(0.0, float(probs[lsm > lsm[t]].sum()) - top_p) for t in tokens}
    allowed = [t for t in tokens if excess[t] < slack]
    (narrow_edge,) = nucleus_edges(lsm, (max(1e-6, top_p - slack),))
    best = best_seeded_score(scaled, seed, position, lsm >= narrow_edge)
    return max(0.0, temp * (best - score_of(allowed or tokens))), min(excess.values())


def _moments(z: npt.NDArray[np.float32], ids: npt.NDArray[np.int64]) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Chosen logprob, mean and variance of the logprob, for rows of scaled logits (float32, one exp per row)."""
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    total = e.sum(axis=1, dtype=np.float64)
    ez = np.einsum("ij,ij->i", e, z, dtype=np.float64) / total
    ez2 = np.einsum("ij,ij->i", e * z, z, dtype=np.float64) / total
    lse = np.log(total)
    chosen = z[np.arange(z.shape[0]), ids].astype(np.float64) - lse
    return chosen, ez - lse, np.maximum(0.0, ez2 - ez * ez)


def chosen_logprobs(logits: npt.ArrayLike, chosen: npt.ArrayLike) -> FloatArray:
    """Each chosen token's log-probability under the raw distribution of its row (temperature 1, no nucleus, no
    grammar: what a runtime reports as a token's logprob by default), for the first ``len(chosen)`` rows."""
    rows = np.asarray(logits, dtype=np.float32)
    ids = np.asarray(chosen, dtype=np.int64)
    out = np.zeros(ids.shape[0])
    for lo in range(0, ids.shape[0], _BLOCK):
        hi = min(ids.shape[0], lo + _BLOCK)
        out[lo:hi] = log_softmax(rows[lo:hi].astype(np.float64))[np.arange(hi - lo), ids[lo:hi]]
    return out
