"""Which answers are audited, and what a verdict does to the measurement that is paid on.

Sampling is hidden: every answer names its token ids, so nothing on the wire tells a miner which
ones the validator replays. Audited are every probe (the validator's own prompts: they reach every
miner every round, which is the per-miner floor), every answer of a quarantined miner (so it can
earn its way back), every organic answer that stopped before ``max_tokens`` (it is paid only when its
audit confirms the model chose to stop: :mod:`scoring.pay`), and a random ``rate`` of the organic
rest, drawn by the caller from a private RNG.

Some answers no audit can check: :func:`audit_skip` names the rule (a forced tool call, JSON mode, ``logit_bias``,
...); they are never audited, and (:mod:`scoring.pay`) neither paid nor credited where the validator audits.

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
from typing import Any

from gateway.protocol.tools import uses_tools
from scoring.measurement import FailureReason, Measurement

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


def audit_skip(payload: dict[str, Any], greedy: bool, *, tools: bool = False, model: str | None = None) -> str | None:
    """The rule by which the audit cannot check an answer to ``payload``, or None when it can.

    The reference forces the answer's tokens on the subnet's chat template with the subnet's sampler, tools and
    tool history written out in the subnet's tool format (:mod:`gateway.protocol.tools`) when ``tools`` (a
    reference that renders them; the toy one does not). It cannot reproduce: a forced tool call
    (``tool_choice`` ``required`` or a named function: a runtime constrains decoding to it), grammar-constrained
    decoding (``response_format`` JSON), a ``logit_bias``, and ``top_k`` / ``min_p`` on a sampled answer (outside
    the subnet sampler's spec; greedy is their argmax either way), nor an answer on another model than ``model``,
    the one it runs (None: any; ``model``: a reference per model is not built). ``logprobs`` and ``n`` change no
    token and are audited as usual.
    """
    if uses_tools(payload):
        if not tools:
            return "tools"
        if payload.get("tool_choice") not in (None, "auto", "none"):
            return "tool_choice"
    if payload.get("response_format"):
        return "response_format"
    if payload.get("logit_bias"):
        return "logit_bias"
    if not greedy:
        for name in ("top_k", "min_p"):
            if payload.get(name):
                return name
    if model is not None and payload.get("model") != model:
        return "model"
    return None
