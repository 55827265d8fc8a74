"""The timeouts and limits a dispatch to a miner runs under."""

from __future__ import annotations

from dataclasses import dataclass

from ..protocol.openai import DEFAULT_MAX_TOKENS, MODEL_CONTEXT
from .refusals import DRAIN_GRACE_S


@dataclass(frozen=True, slots=True)
class UpstreamTimeouts:
    """Seconds. ``first_token`` counts from dispatch; ``stall`` between chunks; ``total`` caps everything."""

    connect: float = 3.0
    first_token: float = 30.0
    stall: float = 15.0
    total: float = 300.0


@dataclass(frozen=True, slots=True)
class UpstreamLimits:
    max_line_bytes: int = 64 * 1024
    max_content_chars: int = 4096  # one chunk's delta.content; a token is a few characters
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # for payloads that name no max_tokens
    keep_answers: bool = False  # keep each complete answer (text, token ids) on its measurement, for audits
    max_held_chars: int = 64_000_000  # answer text held at once across streams (metering.AnswerBudget)
    # Send each request the subnet sampler's seed (gateway.protocol.sampling): sampled answers are then
    # audited token by token. False: free draws, audited by plausibility only (for miners on stock runtimes).
    seeded_sampling: bool = True
    # The model the reference audits (None: any). Answers on another model are not audited (``skipped="model"``):
    # a reference per model is not built yet.
    audited_model: str | None = None
    # The reference renders tools in the subnet's tool format (gateway.protocol.tools): tool answers are audited.
    # False (the toy reference of the simulated cards): they are skipped (rule "tools").
    audit_tools: bool = False
    # The reference masks by the subnet's grammar (neurons.model.grammar): answers bound to a shape (JSON output, a
    # forced tool call) are audited. False: they are skipped (rules "response_format", "tool_choice").
    audit_grammars: bool = False
    # Tokens of prompt + answer every miner must serve (the subnet model's context): a miner's "too long" for a
    # request that fits is its refusal, not the client's fault (refusals.may_not_fit).
    model_context: int = MODEL_CONTEXT
    # After this validator cancels a stream on a miner, a 429 within this many seconds is its runtime draining the
    # cancelled work (one per cancel: refusals.CancelExcuses).
    drain_grace_s: float = DRAIN_GRACE_S
