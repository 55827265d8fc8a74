"""What a request's ``temperature`` and ``top_p`` mean: the one definition miners sample from and audits check.

OpenAI and vLLM scale the logits by the temperature first, then keep the nucleus (the most likely
tokens whose probability reaches ``top_p``) and renormalise. The reference miner's llama.cpp runtime
samples from exactly this distribution, and the validator's audit teacher-forces answers against
it, so both sides import it from here. Temperature 0 is greedy decoding (the argmax), which has no
distribution to draw from. Penalties change the distribution per answer history; an answer asked
with them is audited for structure only (see :class:`scoring.measurement.Answer`).

Example::

    params = SamplingParams.of({"temperature": 0.7})       # top_p 1.0, OpenAI's default
    logp = asked_logprobs(logits_rows, params.temperature, params.top_p)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

GREEDY_BELOW = 1e-5  # a temperature this low is greedy decoding
_NUCLEUS_SHORTCUT = 4096  # the nucleus is looked for among this many best tokens before a full sort


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """The sampling a request asked for, with OpenAI's defaults (temperature 1, top_p 1)."""

    temperature: float = 1.0
    top_p: float = 1.0
    penalised: bool = False  # presence or frequency penalty: the distribution depends on the answer so far

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
        return cls(temperature=max(0.0, num("temperature", 1.0)), top_p=min(1.0, max(0.0, num("top_p", 1.0))),
                   penalised=penalised)


def log_softmax(rows: FloatArray) -> FloatArray:
    """Row-wise log-softmax, stable for any finite logits."""
    m = rows.max(axis=1, keepdims=True)
    z = rows - m
    out: FloatArray = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return out


def _nucleus_edge(row: FloatArray, top_p: float) -> float:
    """The smallest log-probability inside the nucleus of one row of log-probabilities."""
    k = min(row.shape[0], _NUCLEUS_SHORTCUT)
    top = np.argpartition(-row, k - 1)[:k] if k < row.shape[0] else np.arange(row.shape[0])
    order = top[np.argsort(-row[top], kind="stable")]
    cum = np.cumsum(np.exp(row[order]))
    if cum[-1] < top_p and k < row.shape[0]:  # a flat row: the nucleus is wider than the shortcut
        order = np.argsort(-row, kind="stable")
        cum = np.cumsum(np.exp(row[order]))
    cut = min(int(np.searchsorted(cum, top_p, side="left")), order.shape[0] - 1)
    return float(row[order[cut]])


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
    edges = np.array([_nucleus_edge(r, top_p) for r in lsm])[:, None]
    kept = np.where(lsm >= edges, lsm, -np.inf)
    out: FloatArray = kept - np.logaddexp.reduce(kept, axis=1, keepdims=True)
    return out
