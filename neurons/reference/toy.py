"""The simulated cards' reference: their toy model (:mod:`neurons.model.toy`) through the same checks and verdict,
so the default local subnet and the soak audit their simulated answers too."""

from __future__ import annotations

import asyncio
import random

from gateway.protocol.measurement import Answer
from neurons.model.toy import MODEL as TOY
from scoring.audit import (
    AuditBands,
    AuditFailure,
    Verdict,
    check_ids,
    check_logprobs,
    chosen_logprobs,
    force,
    judge,
)
from scoring.audit.verdict import CheckedIds


class ToyReference:
    """The simulated cards' model: rows built from the prompt's key, judged like the real model's."""

    name = "toy model of the simulated cards"
    grammars = False  # the toy model writes no JSON: the simulated cards' shaped answers are not audited

    async def start(self) -> None:
        return None

    async def audit(self, answer: Answer, bands: AuditBands) -> Verdict | None:
        return await asyncio.to_thread(_toy_audit, answer, bands)  # rows of up to 4k x 441 floats: off the loop

    async def aclose(self) -> None:
        return None


def _toy_audit(answer: Answer, bands: AuditBands) -> Verdict:
    model = TOY
    checked = check_ids(answer, vocab_size=model.vocab_size, piece=model.piece, stop_ids=model.stop_ids)
    if isinstance(checked, Verdict):
        return checked
    if answer.logprobs is not None:  # the simulated card reports the toy model's (features.toy_logprobs)
        rows = model.rows(model.key(answer.messages), len(checked.ids), answer.max_tokens)
        wrong = check_logprobs(answer, chosen_logprobs(rows, checked.ids), bands)
        if wrong is not None:
            return wrong
    if answer.sampling.seeded and not answer.penalised:
        return _replayed(answer, checked, bands)
    # greedy answers, and free draws (a card without the subnet's sampler): the real model's verdict on the rows
    rows = model.rows(model.key(answer.messages), len(checked.ids), answer.max_tokens)
    scores = force(rows, checked.ids, answer.sampling, model.stop_ids, nucleus_slack=bands.seeded_nucleus_slack)
    return judge(answer, checked, scores, bands)


def _replayed(answer: Answer, checked: CheckedIds, bands: AuditBands) -> Verdict:
    """A seeded answer against the toy's own draw from the same seed (:class:`neurons.model.toy.SeededDraws`):
    one right token a position, as the subnet sampler gives the real model, and the same rules for misses and ends
    as :func:`scoring.audit.judge`."""
    expected, ended = TOY.generate(TOY.key(answer.messages), answer.max_tokens, answer.sampling, _NO_RNG)
    got, n = checked.ids, len(checked.ids)
    if answer.finish_reason == "length" and n < answer.max_tokens:
        return Verdict(False, AuditFailure.FALSE_LENGTH, f"finish 'length' after {n} of {answer.max_tokens} tokens")
    misses = sum(1 for i, t in enumerate(got) if i >= len(expected) or t != expected[i])
    if misses > max(bands.min_misses, bands.greedy_miss_share * n):
        return Verdict(False, AuditFailure.WRONG_TOKENS, f"{misses}/{n} tokens off the seeded draw",
                       miss_share=misses / n, positions=n, misses=misses)
    if answer.finish_reason != "length" and n < answer.max_tokens and not answer.stop and not (
            ended and len(expected) == n):
        return Verdict(False, AuditFailure.EARLY_STOP, f"stopped after {n} tokens where the model goes on",
                       positions=n, misses=misses)
    return Verdict(True, tokens=n, miss_share=misses / n if n else 0.0, positions=n, misses=misses)


class _NoRandom(random.Random):
    """The rng a seeded replay never reads."""

    def random(self) -> float:
        raise AssertionError("a seeded replay drew from an RNG")


_NO_RNG = _NoRandom()
