"""Which requests an audit can check, by rule: the one audit rule the gateway needs too.

The gateway names the rule as it records an answer (``skipped`` on :class:`gateway.protocol.measurement.Measurement`)
and scoring neither audits, pays nor credits such an answer. So the rule is vocabulary both sides share, kept beside
the measurement record rather than inside the audit (:mod:`scoring.audit.policy` decides which of the checkable
answers are audited).
"""

from __future__ import annotations

from typing import Any

from .tools import uses_tools


def audit_skip(payload: dict[str, Any], greedy: bool, *, tools: bool = False, grammars: bool = False,
               model: str | None = None) -> str | None:
    """The rule by which the audit cannot check an answer to ``payload``, or None when it can.

    The reference forces the answer's tokens on the subnet's chat template with the subnet's sampler, tools and
    tool history written out in the subnet's tool format (:mod:`gateway.protocol.tools`) when ``tools`` (a
    reference that renders them; the toy one does not), and an answer bound to a shape (``response_format`` JSON, a
    forced tool call: :mod:`gateway.protocol.structure`) under the subnet's grammar when ``grammars`` (a reference
    that masks by it: llama.cpp's). It cannot reproduce: such an answer on a reference without grammars, a
    ``logit_bias``, and ``top_k`` / ``min_p`` on a sampled answer (outside the subnet sampler's spec; greedy is their
    argmax either way), nor an answer on another model than ``model``, the one it runs (None: any; ``model``: a
    reference per model is not built). ``logprobs`` and ``n`` change no
    token and are audited as usual.
    """
    if uses_tools(payload):
        if not tools:
            return "tools"
        if payload.get("tool_choice") not in (None, "auto", "none") and not grammars:
            return "tool_choice"
    if payload.get("response_format") and not grammars:
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
