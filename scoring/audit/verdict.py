"""The audit verdict: pass or fail one answer, from what the miner sent and what the reference thought.

Pure rules, in the order they are checked:

1. **Structure** (:func:`check_ids`): the miner must say which tokens it produced (``token_ids``), every
   id must be in the reference's vocabulary, and the ids must spell exactly the text the client
   received. A trailing end-of-turn id is allowed and marks the stop.
2. **The tokens** (:func:`judge`), teacher-forced on the reference:

   * greedy requests (temperature 0), and sampled requests with the subnet's seed (every request
     the gateway sends: :func:`gateway.protocol.sampling.seeded_token`): each token must be the
     reference's best (by logit, or by Gumbel-perturbed score) or within ``greedy_gap`` nats of it
     (batched and token-by-token numerics differ, so near-ties flip); at most ``greedy_miss_share``
     of the positions may miss (and always ``min_misses``: one flip must not fail a short answer),
     none by more than ``greedy_hard_gap``; a seeded token outside the asked nucleus (taken
     ``seeded_nucleus_slack`` wider, for the runtimes' numerics) is a miss too;
   * sampled requests without a seed (``--gateway.free-sampling``): the answer's z-score,
     ``sum(logp - mean) / sqrt(sum var)`` under the asked
     distribution, must lie within ``±z_limit``, over the whole answer and over its first ``head``
     tokens alone (where the prompt weighs most, so an answer to another prompt shows most). Honest
     draws centre on 0; random or cached words, a truncated prompt or another model fall below;
     greedy-when-asked-to-sample (a cheaper setting) lands above. Tokens outside the asked nucleus count as misses too.
3. **The end**: a ``stop`` (or any end but ``length``, a missing finish reason included) the model did
   not choose (the reference gives the end-of-turn less than ``min_stop_prob``, or, greedy or seeded,
   not within ``greedy_gap`` of its best) is an early stop; a ``length`` before ``max_tokens`` tokens is a false
   length. A client's own ``stop`` strings end answers where the model would go on, so such answers
   skip this check (the runtime strips the string, and the reference cannot see it).

The bands were chosen from honest variance measured by ``scripts/bench_audit.py``; see docs/pages/performance.md.

Example::

    ids = check_ids(answer, vocab_size=262144, piece=ref.piece, stop_ids=ref.stop_ids)
    verdict = judge(answer, ids, force(logits, ids.ids, ...), AuditBands())
    verdict.passed, verdict.failure, verdict.tokens
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from gateway.protocol.measurement import Answer
from gateway.protocol.sampling import FloatArray
from gateway.protocol.tools import parse_tool_calls, same_calls

from .forcing import NUCLEUS_SLACK, ForcedScores


class AuditFailure(StrEnum):
    """Why an answer failed its audit: each is a strike against the miner."""

    NO_TOKEN_IDS = "no_token_ids"  # the miner did not say which tokens it produced
    UNKNOWN_TOKEN = "unknown_token"  # an id outside the reference's vocabulary
    TEXT_MISMATCH = "text_mismatch"  # the ids do not spell the text the client received
    WRONG_TOKENS = "wrong_tokens"  # greedy: tokens the reference would not have chosen
    IMPLAUSIBLE = "implausible"  # sampled: not drawn from the distribution the client asked for
    EARLY_STOP = "early_stop"  # claimed a stop where the model would have gone on
    FALSE_LENGTH = "false_length"  # claimed the length limit before reaching it
    WRONG_LOGPROBS = "wrong_logprobs"  # reported log-probabilities the model does not give its tokens


@dataclass(frozen=True, slots=True)
class AuditBands:
    """Where honest ends and cheating begins. Defaults: measured on Gemma 3 270M, llama.cpp, CPU."""

    # Greedy: over 131 honest greedy answers (same runtime) one position of one answer was more than 0.5 nats
    # off the argmax; the slack is for near-ties another runtime's numerics may flip, not measured (no GPU).
    greedy_gap: float = 0.5
    greedy_miss_share: float = 0.05
    # Seeded sampling puts near-ties at many positions (the Gumbel-perturbed top two are often close): over
    # 11,171 honest seeded positions 6 were 0.5-0.80 nats off, and one such flip failed a 16-token answer at 5 %.
    min_misses: int = 1
    greedy_hard_gap: float = 2.0
    # Seeded answers with a nucleus: the probability mass by which the reference widens the nucleus for the miner's
    # token (beyond it the token is a miss) and narrows it for the token's best rival (scoring.audit.forcing).
    seeded_nucleus_slack: float = NUCLEUS_SLACK
    z_limit: float = 5.0  # honest |z| reached 3.46 over 369 sampled answers (scripts/bench_audit.py)
    head: int = 8
    # Logit noise (nats) between the reference's batched pass and a runtime's token-by-token decoding,
    # scaled by 1/temperature into each position's variance: without it honest answers at temperature
    # 0.2 reached |z| 9.5 (sd 2.2) on Gemma 3 270M while at 0.7-1.2 the sd was ~1.
    logit_noise: float = 0.15
    nucleus_miss_share: float = 0.05
    min_stop_prob: float = 1e-4
    # Reported logprobs (raw, as vLLM's default): over 480 honest positions (greedy and seeded, token by token
    # against the batched reference, llama.cpp on CPU) they were off by 0.013 nats at the median, 0.32 at p99 and
    # 0.44 at most. A position misses beyond this band; misses are allowed as greedy ones are (greedy_miss_share).
    logprob_gap: float = 1.0

    def __post_init__(self) -> None:
        for name in ("greedy_gap", "greedy_hard_gap", "z_limit", "min_stop_prob", "logprob_gap"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise ValueError(f"AuditBands.{name} must be a positive number, got {v!r}")
        if not (isinstance(self.logit_noise, int | float) and math.isfinite(self.logit_noise)
                and self.logit_noise >= 0):
            raise ValueError(f"AuditBands.logit_noise must be >= 0, got {self.logit_noise!r}")
        if isinstance(self.min_misses, bool) or not isinstance(self.min_misses, int) or self.min_misses < 0:
            raise ValueError(f"AuditBands.min_misses must be an integer >= 0, got {self.min_misses!r}")
        for name in ("greedy_miss_share", "nucleus_miss_share"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and 0.0 <= v <= 1.0):
                raise ValueError(f"AuditBands.{name} must be within [0, 1], got {v!r}")
        v = self.seeded_nucleus_slack
        if isinstance(v, bool) or not (isinstance(v, int | float) and 0.0 <= v < 1.0):
            raise ValueError(f"AuditBands.seeded_nucleus_slack must be within [0, 1), got {v!r}")


@dataclass(frozen=True, slots=True)
class Verdict:
    """One audit's outcome. ``tokens``: completion tokens verified (what an honest answer is paid for)."""

    passed: bool
    failure: AuditFailure | None = None
    detail: str = ""
    tokens: int = 0
    z: float | None = None  # sampled answers: the z-score
    miss_share: float = 0.0  # share of positions judged wrong
    z_head: float | None = None  # sampled answers: the z-score of the first ``head`` positions alone
    stop_logp: float | None = None  # log-probability of the end-of-turn where the answer stopped
    prompt_tokens: int | None = None  # the prompt as the reference's tokenizer counts it
    worst_gap: float | None = None  # greedy or seeded answers: the farthest token from the reference's choice, nats
    # Greedy or seeded answers: positions judged and those off the reference's choice by more than the near-tie
    # band. The evidence the per-miner sequential test (:mod:`scoring.audit.sequential`) sums over audits.
    positions: int = 0
    misses: int = 0


@dataclass(frozen=True, slots=True)
class CheckedIds:
    """The completion ids to force, without a trailing end-of-turn id (``ended_with_stop`` says if one was there)."""

    ids: tuple[int, ...]
    ended_with_stop: bool


def _fail(failure: AuditFailure, detail: str, *, z: float | None = None, miss_share: float = 0.0,
          worst_gap: float | None = None, positions: int = 0, misses: int = 0) -> Verdict:
    return Verdict(False, failure, detail, z=z, miss_share=miss_share, worst_gap=worst_gap, positions=positions,
                   misses=misses)


def check_ids(answer: Answer, *, vocab_size: int, piece: Callable[[int], bytes],
              stop_ids: frozenset[int]) -> CheckedIds | Verdict:
    """The structural checks; a :class:`Verdict` (failed) when they fail, else the ids to force."""
    if answer.token_ids is None or not answer.token_ids:
        return _fail(AuditFailure.NO_TOKEN_IDS, "the answer carried no token ids")
    ids = answer.token_ids
    for t in ids:
        if not 0 <= t < vocab_size:
            return _fail(AuditFailure.UNKNOWN_TOKEN, f"token id {t} is outside the vocabulary of {vocab_size}")
    ended = ids[-1] in stop_ids
    body = ids[:-1] if ended else ids
    if any(t in stop_ids for t in body):
        return _fail(AuditFailure.TEXT_MISMATCH, "an end-of-turn token inside the answer")
    spelled = b"".join(piece(t) for t in body).decode("utf-8", errors="replace")  # as the miner streamed it
    if answer.tool_calls is not None:  # the ids spell the calls, in the subnet's tool format, and nothing else
        calls = parse_tool_calls(spelled)
        if calls is None or answer.text.strip() or not same_calls(calls, answer.tool_calls):
            return _fail(AuditFailure.TEXT_MISMATCH, f"{len(body)} ids do not spell the {len(answer.tool_calls)} "
                                                     f"tool calls the client received")
    elif spelled != answer.text and not _stopped_at_string(answer, spelled, body, piece):
        return _fail(AuditFailure.TEXT_MISMATCH, f"{len(body)} ids spell {len(spelled)} characters, "
                                                 f"the client received {len(answer.text)}")
    return CheckedIds(ids=tuple(body), ended_with_stop=ended)


def _stopped_at_string(answer: Answer, spelled: str, body: tuple[int, ...] | list[int],
                       piece: Callable[[int], bytes]) -> bool:
    """Whether the ids spell the text, then one of the client's stop strings, completed by the last token.

    A runtime that honours ``stop`` sends the text before the string and names every id it generated, the
    string's own included (vLLM does; so does the reference miner). Only that exact tail is allowed: the
    string must finish inside the last token, so no extra tokens can hide behind it.
    """
    if answer.finish_reason != "stop" or not answer.stop or not body:
        return False
    before_last = len(b"".join(piece(t) for t in body[:-1]).decode("utf-8", errors="replace"))
    for s in answer.stop:
        end = len(answer.text) + len(s)
        if s and spelled.startswith(answer.text + s) and end > before_last:
            return True
    return False


def check_logprobs(answer: Answer, raw: FloatArray, bands: AuditBands) -> Verdict | None:
    """A failed verdict when the logprobs the miner reported are not the model's: fewer than its tokens, or more
    than a greedy answer's share of misses off the reference's raw log-probability (``raw``, one per forced token)
    by over ``bands.logprob_gap``. None: nothing reported (not asked, or a tool call) or they hold. An answer cut at a
    client's stop string may leave out the entries of the string's own tokens (their ids still named)."""
    if answer.logprobs is None or answer.tool_calls is not None:
        return None
    n = int(raw.shape[0])
    reported = np.asarray(answer.logprobs[:n], dtype=np.float64)
    if reported.shape[0] < n and not (answer.stop and reported.shape[0]):
        return _fail(AuditFailure.WRONG_LOGPROBS, f"logprobs reported for {reported.shape[0]} of {n} tokens")
    n = int(reported.shape[0])
    if n == 0:
        return None
    off = np.abs(reported - raw[:n])
    misses = int((off > bands.logprob_gap).sum())
    if misses > max(bands.min_misses, bands.greedy_miss_share * n):
        return _fail(AuditFailure.WRONG_LOGPROBS, f"{misses}/{n} reported logprobs off the model's by more than "
                                                  f"{bands.logprob_gap} nats (worst {float(off.max()):.2f})",
                     miss_share=misses / n)
    return None


def judge(answer: Answer, checked: CheckedIds, scores: ForcedScores, bands: AuditBands) -> Verdict:
    """The verdict on an answer whose structure passed, from its teacher-forced scores."""
    n = scores.n
    if n != len(checked.ids):
        raise ValueError(f"scores cover {n} positions, the answer has {len(checked.ids)}")
    if answer.finish_reason == "length" and n < answer.max_tokens:
        return _fail(AuditFailure.FALSE_LENGTH, f"finish 'length' after {n} of {answer.max_tokens} tokens")
    determined = answer.sampling.greedy or answer.sampling.seeded  # one right token per position
    z: float | None = None
    z_head: float | None = None
    worst_gap: float | None = None
    miss_share = 0.0
    positions = misses = 0
    if n and not answer.penalised:
        if determined:
            positions = n
            beyond = int(scores.outside.sum())  # beyond even the widened nucleus: a miss, whatever its gap
            misses = int(((scores.gap > bands.greedy_gap) | scores.outside).sum())
            miss_share = misses / n
            worst_gap = float(scores.gap.max())
            if worst_gap > bands.greedy_hard_gap or misses > max(bands.min_misses, bands.greedy_miss_share * n):
                return _fail(AuditFailure.WRONG_TOKENS, f"{misses}/{n} tokens off the reference's choice "
                                                        f"({beyond} outside top_p), worst by {worst_gap:.2f} nats",
                             miss_share=miss_share, worst_gap=worst_gap, positions=positions, misses=misses)
        else:
            outside = scores.outside
            miss_share = float(outside.sum()) / n
            if miss_share > bands.nucleus_miss_share:
                return _fail(AuditFailure.IMPLAUSIBLE, f"{int(outside.sum())}/{n} tokens outside top_p",
                             miss_share=miss_share)
            noise = (bands.logit_noise / answer.sampling.temperature) ** 2
            z = _z(scores, ~outside, noise)
            head = ~outside
            head[bands.head:] = False
            z_head = _z(scores, head, noise)
            if abs(z) > bands.z_limit or abs(z_head) > bands.z_limit:
                return _fail(AuditFailure.IMPLAUSIBLE, f"z-score {z:+.1f} (first {bands.head} tokens {z_head:+.1f}) "
                                                       "under the asked distribution", z=z, miss_share=miss_share)
    # any end but "length" (no finish reason at all, "content_filter", ...) before max_tokens is a stop
    if answer.finish_reason != "length" and n < answer.max_tokens and not answer.stop:
        if determined:
            early = scores.stop_gap > bands.greedy_gap
        else:
            early = scores.stop_logp < math.log(bands.min_stop_prob)
        if early:
            return _fail(AuditFailure.EARLY_STOP, f"stopped after {n} tokens where the model goes on "
                                                  f"(end-of-turn p={math.exp(scores.stop_logp):.2g})",
                         z=z, miss_share=miss_share, worst_gap=worst_gap, positions=positions, misses=misses)
    return Verdict(True, tokens=n, z=z, miss_share=miss_share, z_head=z_head, stop_logp=scores.stop_logp,
                   worst_gap=worst_gap, positions=positions, misses=misses)


def _z(scores: ForcedScores, mask: npt.NDArray[np.bool_], noise: float) -> float:
    """``sum(logp - mean) / sqrt(sum (var + noise))`` over the masked positions (0 for none)."""
    if not mask.any():
        return 0.0
    spread = math.sqrt(float(scores.var[mask].sum()) + (noise + 1e-6) * int(mask.sum()))
    return float((scores.logp[mask] - scores.mean[mask]).sum()) / spread
