"""The simulated cards' reference: their toy model (:mod:`neurons.model.toy`) through the same checks and verdict,
so the default local subnet and the soak audit their simulated answers too."""

from __future__ import annotations

import asyncio
import dataclasses

from neurons.model.toy import MODEL as TOY
from scoring.audit import AuditBands, Verdict, check_ids, force, judge
from scoring.measurement import Answer


class ToyReference:
    """The simulated cards' model: rows built from the prompt's key, judged like the real model's."""

    name = "toy model of the simulated cards"

    async def start(self) -> None:
        return None

    async def audit(self, answer: Answer, bands: AuditBands) -> Verdict | None:
        return await asyncio.to_thread(_toy_audit, answer, bands)  # rows of up to 4k x 441 floats: off the loop

    async def aclose(self) -> None:
        return None


def _toy_audit(answer: Answer, bands: AuditBands) -> Verdict:
    # The toy model draws freely (the subnet sampler's 441 hashes a token, in pure Python, would slow the
    # soak's tens of thousands of tokens a second): its sampled answers are judged by plausibility.
    answer = dataclasses.replace(answer, sampling=dataclasses.replace(answer.sampling, seed=None))
    model = TOY
    checked = check_ids(answer, vocab_size=model.vocab_size, piece=model.piece, stop_ids=model.stop_ids)
    if isinstance(checked, Verdict):
        return checked
    rows = model.rows(model.key(answer.messages), len(checked.ids), answer.max_tokens)
    scores = force(rows, checked.ids, answer.sampling, model.stop_ids, nucleus_slack=bands.seeded_nucleus_slack)
    return judge(answer, checked, scores, bands)
