"""The OpenAI chat-completions shapes: a client's request validated, and the one body miners are sent.

The gateway forwards only fields it understands, with values it has range-checked, so a client can
neither make a miner misbehave through odd parameters nor be billed for a silently ignored one.
Every rejection names the offending field (``param``), as OpenAI does.

Example::

    limits = SchemaLimits(models=("tensorgate/sim-5090",))
    req = parse_chat_request({"model": "tensorgate/sim-5090",
                              "messages": [{"role": "user", "content": "hi"}]}, limits)
    req.max_tokens            # limits.default_max_tokens
    req.upstream_payload()    # {"model": ..., "messages": [...], "max_tokens": 256}
    miner_body(req.upstream_payload(), req.max_tokens)   # + "stream": True, "stream_options": {...}
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from .errors import bad_request, model_not_found
from .tokens import estimate_prompt_tokens

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# Accepted but not served: refusing is better than pretending.
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "audio", "modalities", "prediction")
# Every field the gateway reads: passed to the miner (the sampling fields), used by the gateway itself (``stream``,
# ``stream_options``, ``max_tokens``, ``user``: the end user's id, kept from miners), or refused by name unless at
# its default (``n``, ``logprobs``, ``top_logprobs``, ``response_format``, UNSUPPORTED). Anything else given a value
# is refused by name too (``logit_bias``, ``top_k``, ``min_p``, ...): a 200 that silently ignored a field would
# give the client an answer it did not ask for (issue 27).
KNOWN_FIELDS = frozenset({
    "model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "presence_penalty", "frequency_penalty", "stop", "seed", "n", "user", "logprobs", "top_logprobs",
    "response_format", *UNSUPPORTED,
})


DEFAULT_MAX_TOKENS = 256  # completion length when a request names none
_BODY_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)  # built once, not per request
CHAT_PATH = "/v1/chat/completions"  # the one route, on the gateway and on every miner
SLOTS_HEADER = "X-Miner-Slots"  # streams a miner serves each validator at once, on every answer and 429
# The sampler a miner's runtime draws sampled tokens with, on every answer: SUBNET_SAMPLER (the subnet's seeded
# sampler, gateway.protocol.sampling) or anything else / absent (its own RNG: a free draw, audited for plausibility
# only and not paid; scoring.pay). Versioned, so a change of the sampler's spec is a new name.
SAMPLER_HEADER = "X-Miner-Sampler"
SUBNET_SAMPLER = "tensorgate-gumbel/1"


@dataclass(frozen=True, slots=True)
class SchemaLimits:
    models: tuple[str, ...]
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_tokens_cap: int = 4096
    max_messages: int = 256


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A validated request. ``max_tokens`` is already capped; ``sampling`` holds checked extras."""

    model: str
    messages: list[dict[str, Any]]
    stream: bool
    include_usage: bool
    max_tokens: int
    sampling: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: int = 0

    def upstream_payload(self) -> dict[str, Any]:
        """What the client asked a miner for; :func:`miner_body` makes it the body on the wire."""
        return {"model": self.model, "messages": self.messages, "max_tokens": self.max_tokens, **self.sampling}


_LEADING = ("model", "messages")
_SAMPLING = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "stop", "seed")
_FORCED = ("max_tokens", "max_completion_tokens", "stream", "stream_options", "return_token_ids")


def miner_body(payload: dict[str, Any], max_tokens: int, seed: int | None = None) -> dict[str, Any]:
    """The one miner-bound body: fixed key order, ``max_tokens`` explicit, always streamed with usage,
    always asking for the token ids of the answer (``return_token_ids``, as vLLM names it), and
    carrying ``seed`` (the subnet sampler's, :func:`~gateway.protocol.sampling.wire_seed`) in place
    of the client's when one is given.

    Probes and organic requests both pass through here, so nothing in a body's shape tells a miner
    which one it is serving, nor which answer will be audited: every answer names its tokens.
    """
    body: dict[str, Any] = {k: payload[k] for k in _LEADING if k in payload}
    body["max_tokens"] = max_tokens
    body.update((k, payload[k]) for k in _SAMPLING if k in payload)
    if seed is not None:
        body["seed"] = seed
    known = {*_LEADING, *_SAMPLING, *_FORCED}
    body.update((k, payload[k]) for k in sorted(payload) if k not in known)
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    body["return_token_ids"] = True
    return body


def encode_body(body: dict[str, Any]) -> bytes:
    """Compact JSON, NaN refused (a miner must never be sent what it cannot parse)."""
    return _BODY_ENCODER.encode(body).encode()


def requested_max_tokens(body: dict[str, Any], default: int = DEFAULT_MAX_TOKENS) -> int:
    """The completion cap a chat body asks for (``max_completion_tokens`` first), or ``default``.

    Lenient on purpose: for bodies already validated, or read by a miner that must not refuse them.
    """
    for name in ("max_completion_tokens", "max_tokens"):
        v = body.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return default


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict[str, Any], name: str, lo: float, hi: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not lo <= v <= hi:
        raise bad_request(f"'{name}' must be a number between {lo:g} and {hi:g}", param=name)
    return v


def _text(value: str, param: str) -> str:
    """``value`` if it is text a miner can encode: JSON lets a client send a lone surrogate (``"\\ud800"``),
    which no UTF-8 encoder takes; forwarded, it made every runtime answer 500 and the gateway blamed the
    miners (issue 24: five such requests zeroed two honest miners). It is the client's error."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"text is not valid Unicode: a lone surrogate {value[e.start]!r} at index {e.start}",
                          param=param) from None
    return value


def _content(value: Any, param: str) -> str | list[dict[str, str]]:
    if isinstance(value, str):
        return _text(value, param)
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request("only text content parts ({'type': 'text', 'text': str}) are supported",
                                  param=f"{param}[{j}]")
            parts.append({"type": "text", "text": _text(part["text"], f"{param}[{j}].text")})
        return parts
    raise bad_request("content must be a string or a list of text parts", param=param)


def _messages(value: Any, limits: SchemaLimits) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    if len(value) > limits.max_messages:
        raise bad_request(f"at most {limits.max_messages} messages are allowed", param="messages")
    out = []
    for i, m in enumerate(value):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request("each message must be an object", param=p)
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:  # a list or object role is unhashable: a 400, not a 500
            raise bad_request(f"role must be one of {sorted(ROLES)}", param=f"{p}.role")
        if "content" not in m or (m["content"] is None and role != "assistant"):
            raise bad_request("content is required", param=f"{p}.content")
        msg: dict[str, Any] = {"role": role, "content": "" if m["content"] is None else _content(m["content"],
                                                                                            f"{p}.content")}
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise bad_request("name must be a string", param=f"{p}.name")
            msg["name"] = _text(name, f"{p}.name")
        out.append(msg)
    return out


def _max_tokens(body: dict[str, Any], limits: SchemaLimits) -> int:
    chosen: int | None = None
    for name in ("max_completion_tokens", "max_tokens"):
        v = body.get(name)
        if v is None:
            continue
        if not _is_int(v) or v < 1:
            raise bad_request(f"'{name}' must be a positive integer", param=name)
        if chosen is not None and v != chosen:
            raise bad_request("'max_tokens' and 'max_completion_tokens' disagree", param="max_tokens")
        chosen = v
    return min(chosen if chosen is not None else limits.default_max_tokens, limits.max_tokens_cap)


def _stop(value: Any) -> str | list[str] | None:
    if value is None:
        return value
    if isinstance(value, str):
        return _text(value, "stop")
    if isinstance(value, list) and len(value) <= 4 and all(isinstance(s, str) for s in value):
        return [_text(s, f"stop[{i}]") for i, s in enumerate(value)]
    raise bad_request("'stop' must be a string or a list of at most 4 strings", param="stop")


def parse_chat_request(body: Any, limits: SchemaLimits) -> ChatRequest:
    """Validate a decoded JSON body; raises :class:`gateway.protocol.errors.GatewayError` (400/404)."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", param="model")
    messages = _messages(body.get("messages"), limits)
    if model not in limits.models:
        raise model_not_found(model)
    for name in sorted(body):
        if name not in KNOWN_FIELDS and body[name] is not None:
            raise bad_request(f"'{name}' is not supported by this gateway (refused rather than ignored)", param=name,
                              code="unsupported_parameter")
    for name in UNSUPPORTED:
        if body.get(name) is not None:
            raise bad_request(f"'{name}' is not supported by this gateway", param=name, code="unsupported_parameter")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise bad_request("'logprobs' is not supported by this gateway", param="logprobs",
                          code="unsupported_parameter")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise bad_request("only response_format {'type': 'text'} is supported", param="response_format",
                          code="unsupported_parameter")

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", param="stream")
    include_usage = False
    so = body.get("stream_options")
    if so is not None:
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        if not isinstance(so, dict):
            raise bad_request("'stream_options' must be an object", param="stream_options")
        iu = so.get("include_usage", False)
        if not isinstance(iu, bool):
            raise bad_request("'include_usage' must be a boolean", param="stream_options.include_usage")
        include_usage = iu

    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise bad_request("only n=1 is supported", param="n")

    sampling: dict[str, Any] = {}
    for name, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0),
                         ("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
        v = _number(body, name, lo, hi)
        if v is not None:
            sampling[name] = v
    stop = _stop(body.get("stop"))
    if stop is not None:
        sampling["stop"] = stop
    seed = body.get("seed")
    if seed is not None:
        if not _is_int(seed):
            raise bad_request("'seed' must be an integer", param="seed")
        sampling["seed"] = seed
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("'user' must be a string", param="user")

    return ChatRequest(
        model=model,
        messages=messages,
        stream=stream,
        include_usage=include_usage,
        max_tokens=_max_tokens(body, limits),
        sampling=sampling,
        prompt_tokens=estimate_prompt_tokens(messages),
    )
