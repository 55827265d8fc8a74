"""Which answers are audited, and what a verdict does to the measurement that is paid on.

Sampling is hidden: every answer names its token ids, so nothing on the wire tells a miner which
ones the validator replays. Audited are every probe (the validator's own prompts: they reach every
miner every round, which is the per-miner floor), every answer of a quarantined miner (so it can
earn its way back), every organic answer that stopped before ``max_tokens`` (it is paid only when its
audit confirms the model chose to stop: :mod:`scoring.pay`), and a random ``rate`` of the organic
rest, drawn by the caller from a private RNG.

Some answers no audit can check: :func:`gateway.protocol.auditable.audit_skip` names the rule (a forced tool call,
JSON mode, ``logit_bias``, ...; the gateway marks them as it records them, so the rule lives in the vocabulary both
share); they are never audited, and (:mod:`scoring.pay`) neither paid nor credited where the validator audits.

A passed audit pays the tokens the reference verified (not the chunks the gateway counted), and the
prompt is counted by the reference's tokenizer instead of the gateway's estimate (which runs ~45 %
high for Gemma); a failed one turns the measurement into an ``audit_failed`` failure: credit 0 for
that request.

Example::

    if should_audit(m, rate=0.1, quarantined=False, draw=rng.random()):
        ...                                       # teacher-force m.answer on the reference
    scorer.record(apply_verdict(m, verdict))
"""

from __future__ import annotations

import dataclasses

from gateway.protocol.measurement import FailureReason, Measurement

from .verdict import Verdict


def should_audit(m: Measurement, *, rate: float, quarantined: bool, draw: float) -> bool:
    """Whether to audit ``m``; ``draw`` is a uniform [0, 1) number from the caller's private RNG."""
    if not m.ok or m.answer is None or m.skipped is not None:
        return False
    return m.probe or quarantined or m.stopped_early or draw < rate


def apply_verdict(m: Measurement, verdict: Verdict) -> Measurement:
    """The measurement as it is paid after its audit."""
    prompt = verdict.prompt_tokens if verdict.prompt_tokens is not None else m.prompt_tokens
    if verdict.passed:
        return dataclasses.replace(m, completion_tokens=verdict.tokens, prompt_tokens=prompt, audited=True,
                                   answer=None)
    return dataclasses.replace(m, ok=False, failure=FailureReason.AUDIT_FAILED, prompt_tokens=prompt, audited=True,
                               answer=None)
