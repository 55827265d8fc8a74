"""What a request's ``temperature`` and ``top_p`` mean: the one definition miners sample from and audits check.

OpenAI and vLLM scale the logits by the temperature first, then keep the nucleus (the most likely
tokens whose probability reaches ``top_p``) and renormalise. The reference miner's llama.cpp runtime
samples from exactly this distribution, and the validator's audit teacher-forces answers against
it, so both sides import it from here. Temperature 0 is greedy decoding (the argmax), which has no
distribution to draw from. Penalties change the distribution per answer history; an answer asked
with them is audited for structure only (see :class:`gateway.protocol.measurement.Answer`).

**The subnet's sampler.** A free draw can only be judged *plausible*: on a small model an answer to
another prompt, or at another temperature, is often plausible too (``scripts/bench_audit.py``
measured 48-65 % per-answer detection for those on Gemma 3 270M). So every miner-bound request
carries a ``seed`` the validator chose, and a sampled token is the Gumbel-max draw
:func:`seeded_token`: the argmax, over the asked nucleus, of each token's scaled logit plus a
Gumbel variate hashed from ``(seed, position, token id)`` (:func:`gumbel`). Over fresh seeds that
is exactly a draw from the asked distribution (the Gumbel-max trick), so clients get what they
asked for; for a given seed it is one token, so an audit checks a sampled answer position by
position like a greedy one, with the same near-tie slack. The hash is splitmix64 on unsigned
64-bit integers, which any runtime (a vLLM logits processor, a CUDA kernel) computes bit for bit.
A finite variate is at most :data:`GUMBEL_MAX` (36.0), so a token whose scaled logit sits further than that under
the best score known cannot win and is never hashed: the same token, for a fraction of the work.

Example::

    params = SamplingParams.of({"temperature": 0.7, "seed": 42})  # top_p 1.0, OpenAI's default
    logp = asked_logprobs(logits_rows, params.temperature, params.top_p)
    token = seeded_token(logits_row, params, position=0)          # what every honest miner picks
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

GREEDY_BELOW = 1e-5  # a temperature this low is greedy decoding
SEED_MAX = (1 << 63) - 1  # seeds are non-negative int64: every JSON stack and runtime reads them
_NUCLEUS_SHORTCUT = 4096  # the nucleus is looked for among this many best tokens before a full sort


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """The sampling a request asked for, with OpenAI's defaults (temperature 1, top_p 1)."""

    temperature: float = 1.0
    top_p: float = 1.0
    penalised: bool = False  # presence or frequency penalty: the distribution depends on the answer so far
    seed: int | None = None  # the subnet sampler's seed (see the module's docstring); None: a free draw

    @property
    def seeded(self) -> bool:
        """Sampled with the subnet's sampler: each token is determined, and audited like a greedy one."""
        return self.seed is not None and not self.greedy

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @classmethod
    def of(cls, payload: dict[str, Any]) -> SamplingParams:
        """Read from a (validated) chat body; lenient on odd types, which the gateway refused earlier."""
        def num(name: str, default: float) -> float:
            v = payload.get(name)
            return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else default

        penalised = num("presence_penalty", 0.0) != 0.0 or num("frequency_penalty", 0.0) != 0.0
        seed = payload.get("seed")
        return cls(temperature=max(0.0, num("temperature", 1.0)), top_p=min(1.0, max(0.0, num("top_p", 1.0))),
                   penalised=penalised, seed=seed if is_seed(seed) else None)


def is_seed(v: Any) -> bool:
    """A seed the subnet's sampler takes: an int (not a bool) in ``0..SEED_MAX``."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= SEED_MAX


_U64 = (1 << 64) - 1
# splitmix64's constants: the spec's, named once for every runtime that computes it (the vLLM plugin's torch code)
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB


def mix64(x: int) -> int:
    """splitmix64's finaliser on one unsigned 64-bit integer: a cheap, well-spread hash."""
    x = (x + GOLDEN) & _U64
    x = ((x ^ (x >> 30)) * MIX1) & _U64
    x = ((x ^ (x >> 27)) * MIX2) & _U64
    return x ^ (x >> 31)


def gumbel(seed: int, position: int, vocab: int) -> FloatArray:
    """The Gumbel variates of one position: ``-log(-log(u))``, ``u`` hashed from (seed, position, token id).

    With ``h = mix64((mix64(seed ^ mix64(position)) + id * golden) mod 2**64)``,
    ``u = ((h >> 11) + 0.5) / 2**53``: 53 random bits, never 0 (and 1, an infinite variate, only for the top value
    of ``h >> 11``, where float rounding lands; once in ``2**53``). The spec a miner's runtime
    implements, bit for bit (``tests/test_audit_forcing.py`` spells one variate out).
    """
    return gumbel_at(seed, position, np.arange(vocab, dtype=np.uint64))


def gumbel_at(seed: int, position: int, ids: npt.NDArray[Any]) -> FloatArray:
    """:func:`gumbel`'s variates for the token ``ids`` only (the same numbers, bit for bit).

    Every step in place, on two buffers: over the 262k vocabulary that is 2.6x faster than the same
    arithmetic written as expressions (1.2 ms against 3.2 ms a row on this CPU), which allocate a new
    array for each of its ~18 steps.
    """
    base = np.uint64(mix64(seed ^ mix64(position)))
    x = ids.astype(np.uint64)  # a copy: the caller's ids are left alone
    t = np.empty_like(x)
    with np.errstate(over="ignore"):
        x *= np.uint64(GOLDEN)
        x += base
        x += np.uint64(GOLDEN)  # from here, mix64 in place
        np.right_shift(x, np.uint64(30), out=t)
        x ^= t
        x *= np.uint64(MIX1)
        np.right_shift(x, np.uint64(27), out=t)
        x ^= t
        x *= np.uint64(MIX2)
        np.right_shift(x, np.uint64(31), out=t)
        x ^= t
        x >>= np.uint64(11)
    u: FloatArray = x.astype(np.float64)
    u += 0.5
    u *= 1.0 / (1 << 53)
    np.log(u, out=u)
    np.negative(u, out=u)
    np.log(u, out=u)
    np.negative(u, out=u)
    return u


def _largest_finite_variate() -> float:
    """The largest finite variate :func:`gumbel` gives: ``h >> 11`` one below its top value (at the top value
    ``+ 0.5`` rounds up to ``2**53`` and ``u`` is 1: an infinite variate, for one token in ``2**53``)."""
    top = np.array([(1 << 53) - 2], dtype=np.uint64)
    u = (top.astype(np.float64) + 0.5) * (1.0 / (1 << 53))
    return float(-np.log(-np.log(u))[0])


# No token whose scaled logit is more than this below some token's score can win, so only the tokens within it of
# the best known score need hashing. Exact but for the one-in-2**53 infinite variate, where a pruned and a full
# argmax could differ (about once in 3e10 tokens on a 262k vocabulary). A hair of slack, relative to the scores
# (whose rounding grows with them: at temperature 1e-5 a scaled logit is ~1e6), covers rounding.
GUMBEL_MAX = _largest_finite_variate()
PRUNE_SLACK = 1e-9


def contenders(scaled: FloatArray, seed: int, position: int, allowed: npt.NDArray[np.bool_] | None = None
                ) -> tuple[npt.NDArray[np.intp], FloatArray]:
    """The tokens that can still hold the best score (ascending ids, as a full argmax would see them) and their
    scores. The best scaled logit's own score bounds the winner's from below, so a token whose scaled logit is
    more than :data:`GUMBEL_MAX` under it cannot win and is not hashed. How much that saves depends on the
    temperature: on Gemma 3 270M it left 0.1 % of the 262k vocabulary at 0.3 and 86-100 % at 0.7-1.0
    (``scripts/bench_sampler.py``). When most of the vocabulary stays, all of it is hashed (gathering a subset
    would cost more than it saves), and the tokens below the bound keep their true scores, which cannot win.
    """
    masked = scaled if allowed is None else np.where(allowed, scaled, -np.inf)
    top = int(np.argmax(masked))
    first = float(masked[top]) + float(gumbel_at(seed, position, np.array([top]))[0])
    keep = masked >= first - GUMBEL_MAX - PRUNE_SLACK * max(1.0, abs(first))  # NaN/inf first: keeps none
    if not math.isfinite(first) or 4 * int(np.count_nonzero(keep)) > keep.shape[0]:
        every = _every_id(keep.shape[0])
        score = gumbel_at(seed, position, every)
        score += masked
        return every, score
    ids = np.flatnonzero(keep)
    return ids, masked[ids] + gumbel_at(seed, position, ids)


_EVERY: dict[int, npt.NDArray[np.intp]] = {}


def _every_id(vocab: int) -> npt.NDArray[np.intp]:
    ids = _EVERY.get(vocab)
    if ids is None:
        ids = _EVERY[vocab] = np.arange(vocab, dtype=np.intp)
    return ids


def wire_seed(client_seed: object, key: int, fresh: int) -> int:
    """The seed a miner is sent: ``fresh`` (random) unless the client's ``seed`` is an int, which is keyed
    (any int: OpenAI takes int64, so a negative seed must repeat for its client too).

    Keyed with the validator's secret ``key`` (so the same client seed gives the same answer, as
    OpenAI's ``seed`` promises, yet the miner sees a number it cannot tell from a fresh one: a seed on
    the wire no longer marks organic traffic, since every request carries one).
    """
    if not isinstance(client_seed, int) or isinstance(client_seed, bool):
        return fresh & SEED_MAX
    return mix64((client_seed ^ key) & _U64) & SEED_MAX


def seeded_token(logits: npt.ArrayLike, sampling: SamplingParams, position: int) -> int:
    """The subnet sampler's token at ``position`` (0: the answer's first).

    The argmax, over the asked nucleus, of ``logit / temperature + gumbel(seed, position, id)`` (the
    log-softmax's shift is the same for every token of a row, so it is left out: one less pass over
    the vocabulary, and the reference scores the same sum).
    """
    if sampling.seed is None:
        raise ValueError("the subnet's sampler needs a seed")
    row = np.asarray(logits).reshape(-1)
    if sampling.greedy:
        return int(np.argmax(row))
    allowed = None
    if sampling.top_p < 1.0:
        allowed = np.isfinite(asked_logprobs(row, sampling.temperature, sampling.top_p)[0])
    scaled: FloatArray = row.astype(np.float64)  # a copy, scaled in place: the same numbers as row / temperature
    scaled /= sampling.temperature
    ids, score = contenders(scaled, sampling.seed, position, allowed)
    return int(ids[int(np.argmax(score))])


def best_seeded_score(scaled: FloatArray, seed: int, position: int,
                      allowed: npt.NDArray[np.bool_] | None = None) -> float:
    """The best ``scaled + gumbel`` over the vocabulary (or the ``allowed`` tokens): what the audit measures a
    token's gap from, hashing only the tokens that can hold it."""
    return float(contenders(scaled, seed, position, allowed)[1].max())


def log_softmax(rows: FloatArray) -> FloatArray:
    """Row-wise log-softmax, stable for any finite logits."""
    m = rows.max(axis=1, keepdims=True)
    z = rows - m
    out: FloatArray = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return out


def nucleus_edges(row: FloatArray, ps: tuple[float, ...]) -> list[float]:
    """The smallest log-probability inside the nucleus of each ``top_p`` in ``ps``, for one row of
    log-probabilities (one sort serves them all)."""
    k = min(row.shape[0], _NUCLEUS_SHORTCUT)
    top = np.argpartition(-row, k - 1)[:k] if k < row.shape[0] else np.arange(row.shape[0])
    order = top[np.argsort(-row[top], kind="stable")]
    cum = np.cumsum(np.exp(row[order]))
    if cum[-1] < max(ps) and k < row.shape[0]:  # a flat row: the nucleus is wider than the shortcut
        order = np.argsort(-row, kind="stable")
        cum = np.cumsum(np.exp(row[order]))
    cuts = [min(int(np.searchsorted(cum, p, side="left")), order.shape[0] - 1) for p in ps]
    return [float(row[order[c]]) for c in cuts]


def asked_logprobs(logits: npt.ArrayLike, temperature: float, top_p: float) -> FloatArray:
    """Log-probabilities of the distribution each row's next token is drawn from (-inf outside the nucleus).

    ``temperature`` must be above :data:`GREEDY_BELOW`; ``logits`` is one row per position.
    """
    if temperature < GREEDY_BELOW:
        raise ValueError("greedy decoding (temperature 0) has no distribution to draw from")
    rows = np.atleast_2d(np.asarray(logits, dtype=np.float64))
    lsm = log_softmax(rows / temperature)
    if top_p >= 1.0:
        return lsm
    edges = np.array([nucleus_edges(r, (top_p,))[0] for r in lsm])[:, None]
    kept = np.where(lsm >= edges, lsm, -np.inf)
    out: FloatArray = kept - np.logaddexp.reduce(kept, axis=1, keepdims=True)
    return out
