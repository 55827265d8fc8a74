"""What one miner is asked for, typed once where the request is made and carried unchanged to the wire.

The client's request is validated once (:func:`gateway.protocol.openai.parse_chat_request`); a probe's is made by
the validator. Either becomes a :class:`MinerRequest`: the fields the miner's body is built from (as the client asked
them: model, messages, sampling, features) and what the gateway reads from them (the completion cap, the prompt's
estimated tokens, the sampling, the client's seed, the stop strings). The relay and the upstream use those and never
read the fields again; only the body on the wire (:func:`gateway.protocol.openai.miner_body`) and the audit's rule of
what it can check (:func:`gateway.protocol.auditable.audit_skip`) look at the fields themselves.

Example::

    req = MinerRequest.of({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
    req.max_tokens, req.prompt_tokens, req.sampling.greedy      # 8, 2, False
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from .openai import DEFAULT_MAX_TOKENS, ChatRequest, requested_max_tokens
from .sampling import GOLDEN, SEED_MAX, SamplingParams, is_seed
from .tokens import estimate_prompt_tokens


class MinerRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One miner's request: its body's fields and what is known of them."""

    fields: dict[str, Any]  # the body's fields as asked (the wire body is built from them, never changed)
    max_tokens: int  # the completion cap the miner is sent
    prompt_tokens: int  # the prompt's estimated tokens (the one estimate: gateway.protocol.tokens)
    sampling: SamplingParams  # temperature, top_p, penalties and the client's seed when it is one
    client_seed: int | None = None  # the client's seed as sent (any int: the wire seed is keyed from it)
    stop: tuple[str, ...] = ()

    @classmethod
    def of(cls, fields: Mapping[str, Any], default_max_tokens: int = DEFAULT_MAX_TOKENS) -> MinerRequest:
        """Read a (validated, or validator-made) chat body once."""
        body = dict(fields)
        seed = body.get("seed")
        stop = body.get("stop")
        return cls(fields=body, max_tokens=requested_max_tokens(body, default_max_tokens),
                   prompt_tokens=estimate_prompt_tokens(body.get("messages")), sampling=SamplingParams.of(body),
                   client_seed=seed if isinstance(seed, int) and not isinstance(seed, bool) else None,
                   stop=(stop,) if isinstance(stop, str) else tuple(s for s in stop or () if isinstance(s, str)))


def choice_request(req: ChatRequest, index: int) -> MinerRequest:
    """What the miner of answer ``index`` of a client's request is asked, typed once for all of its tries: the
    request, with a client's seed moved along for every answer after the first (each of n answers is its own draw,
    and a seeded request still repeats exactly)."""
    payload = req.upstream_payload()
    seed = payload.get("seed")
    if index and isinstance(seed, int) and is_seed(seed):
        payload["seed"] = (seed + index * GOLDEN) & SEED_MAX
    return MinerRequest.of(payload, req.max_tokens)
