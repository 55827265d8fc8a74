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
from dataclasses import dataclass, field, replace
from typing import Any

from .errors import bad_request, model_not_found
from .request_features import (  # noqa: F401 - the feature names are also this module's: miners and offers read them
    FEATURES,
    GRAMMAR,
    LOGIT_BIAS,
    LOGPROBS,
    MAX_TOOLS,
    MIN_P,
    NAME,
    RESPONSE_FORMAT,
    TOOLS,
    TOP_K,
    features,
    is_int,
    number,
)
from .sampling import SamplingParams
from .tokens import estimate_prompt_tokens

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# Refused by name: not served by any runtime the subnet runs (``functions``/``function_call`` are the deprecated
# spelling of ``tools``, refused with a pointer to it rather than translated).
UNSUPPORTED = ("functions", "function_call", "audio", "modalities", "prediction", "web_search_options")
# Every field the gateway reads: passed to the miner (sampling and feature fields), used by the gateway itself
# (``stream``, ``stream_options``, ``max_tokens``, ``n``: answered by n miners, ``user``: the end user's id, kept
# from miners), or refused by name (UNSUPPORTED). Anything else given a value is refused by name too: a 200 that
# silently ignored a field would give the client an answer it did not ask for (issue 27).
KNOWN_FIELDS = frozenset({
    "model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "presence_penalty", "frequency_penalty", "stop", "seed", "n", "user", "logprobs", "top_logprobs",
    "response_format", "tools", "tool_choice", "parallel_tool_calls", "logit_bias", "top_k", "min_p", *UNSUPPORTED,
})
MAX_N = 8  # answers one request may ask for (each is one miner's stream)


DEFAULT_MAX_TOKENS = 256  # completion length when a request names none
MODEL_CONTEXT = 4096  # tokens of prompt + answer every miner serves: the subnet model's context, as the reference's
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
    n: int = 1  # answers asked for: each from its own miner (gateway.relay), each measured and audited alone
    needs: frozenset[str] = frozenset()  # FEATURES the request uses: only miners declaring them all may serve it
    completion: bool = False  # a /v1/completions request: answered as ``text_completion`` objects
    max_tokens_asked: int | None = None  # what the client asked when it was over the cap (``max_tokens`` is the cap)

    @property
    def sampled(self) -> bool:
        """Whether the answer is drawn, not greedy: verified token by token (and paid) only from a miner that
        draws with the subnet's sampler, so the router sends it to one first (gateway.router)."""
        return not SamplingParams.of(self.sampling).greedy

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


def _tool_calls(value: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's earlier tool calls (agent history), rebuilt from the fields OpenAI defines."""
    if not isinstance(value, list) or not value or len(value) > MAX_TOOLS:
        raise bad_request(f"'tool_calls' must be a list of 1 to {MAX_TOOLS} calls", param=param)
    out = []
    for j, call in enumerate(value):
        p = f"{param}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function":
            raise bad_request("a tool call is {'id', 'type': 'function', 'function': {'name', 'arguments'}}", param=p)
        cid, name, args = call.get("id"), fn.get("name"), fn.get("arguments")
        if not isinstance(cid, str) or not cid or not isinstance(name, str) or not NAME.fullmatch(name):
            raise bad_request("a tool call needs a string 'id' and a function 'name'", param=p)
        if not isinstance(args, str):
            raise bad_request("function 'arguments' must be a string (JSON text)", param=f"{p}.function.arguments")
        out.append({"id": _text(cid, f"{p}.id"), "type": "function",
                    "function": {"name": name, "arguments": _text(args, f"{p}.function.arguments")}})
    return out


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
        calls = m.get("tool_calls")
        if calls is not None and role != "assistant":
            raise bad_request("only assistant messages carry 'tool_calls'", param=f"{p}.tool_calls")
        if ("content" not in m and calls is None) or (m.get("content") is None and role != "assistant"):
            raise bad_request("content is required", param=f"{p}.content")
        content = m.get("content")
        msg: dict[str, Any] = {"role": role, "content": "" if content is None else _content(content, f"{p}.content")}
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise bad_request("name must be a string", param=f"{p}.name")
            msg["name"] = _text(name, f"{p}.name")
        if calls is not None:
            msg["tool_calls"] = _tool_calls(calls, f"{p}.tool_calls")
        if role == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or not cid:
                raise bad_request("a tool message needs the 'tool_call_id' it answers", param=f"{p}.tool_call_id")
            msg["tool_call_id"] = _text(cid, f"{p}.tool_call_id")
        out.append(msg)
    return out


def _asked_over_cap(body: dict[str, Any], limits: SchemaLimits) -> int | None:
    """The client's ``max_tokens`` when it is over the cap (served at the cap, which the answer's
    ``X-Max-Tokens-Capped`` header says), else None. Called after :func:`_max_tokens` checked the values."""
    asked = body.get("max_completion_tokens") or body.get("max_tokens")
    return asked if isinstance(asked, int) and asked > limits.max_tokens_cap else None


def _max_tokens(body: dict[str, Any], limits: SchemaLimits) -> int:
    chosen: int | None = None
    for name in ("max_completion_tokens", "max_tokens"):
        v = body.get(name)
        if v is None:
            continue
        if not is_int(v) or v < 1:
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


def _streaming(body: dict[str, Any]) -> tuple[bool, bool]:
    """Whether the answer is streamed, and whether a streamed one ends with a usage chunk."""
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", param="stream")
    so = body.get("stream_options")
    if so is None:
        return stream, False
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if not isinstance(so, dict):
        raise bad_request("'stream_options' must be an object", param="stream_options")
    iu = so.get("include_usage", False)
    if not isinstance(iu, bool):
        raise bad_request("'include_usage' must be a boolean", param="stream_options.include_usage")
    return stream, iu


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields a request sets, range-checked: temperature, top_p, the penalties, stop and seed."""
    sampling: dict[str, Any] = {}
    for name, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0),
                         ("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
        v = number(body, name, lo, hi)
        if v is not None:
            sampling[name] = v
    stop = _stop(body.get("stop"))
    if stop is not None:
        sampling["stop"] = stop
    seed = body.get("seed")
    if seed is not None:
        if not is_int(seed):
            raise bad_request("'seed' must be an integer", param="seed")
        sampling["seed"] = seed
    return sampling


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
            hint = " (use 'tools' and 'tool_choice')" if name.startswith("function") else ""
            raise bad_request(f"'{name}' is not supported by this gateway{hint}", param=name,
                              code="unsupported_parameter")
    options, needs = features(body)
    stream, include_usage = _streaming(body)
    n = body.get("n")
    if n is not None and (not is_int(n) or not 1 <= n <= MAX_N):
        raise bad_request(f"'n' must be an integer from 1 to {MAX_N}", param="n")
    sampling = {**_sampling(body), **options}
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("'user' must be a string", param="user")

    return ChatRequest(
        model=model,
        messages=messages,
        stream=stream,
        include_usage=include_usage,
        max_tokens=_max_tokens(body, limits),
        max_tokens_asked=_asked_over_cap(body, limits),
        sampling=sampling,
        prompt_tokens=estimate_prompt_tokens(messages),
        n=n or 1,
        needs=frozenset(needs),
    )


COMPLETIONS_PATH = "/v1/completions"
# The legacy completions API: the fields it shares with chat mean the same; these are its own.
_COMPLETION_ONLY = frozenset({"prompt", "suffix", "echo", "best_of", "logprobs"})


def parse_completion_request(body: Any, limits: SchemaLimits) -> ChatRequest:
    """A ``/v1/completions`` body as the chat request it is served as: the prompt is one user message.

    Miners serve chat (their runtime renders the subnet's chat template, and the audit forces that render), so a
    completion is the model's answer to the prompt as a user turn, as OpenRouter serves completions on chat
    models: not a raw continuation of the text. ``suffix``, ``echo``, ``best_of`` > 1 and ``logprobs`` (the legacy
    shape) are refused by name.
    """
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise bad_request("'prompt' must be a non-empty string (token-id prompts and batches are not served)",
                          param="prompt")
    for name, off in (("suffix", None), ("echo", False), ("best_of", 1), ("logprobs", None)):
        v = body.get(name)
        if v is not None and v != off and not (name == "logprobs" and v == 0):
            raise bad_request(f"'{name}' is not supported on /v1/completions", param=name,
                              code="unsupported_parameter")
    chat = {k: v for k, v in body.items() if k not in _COMPLETION_ONLY}
    for name in ("messages", "tools", "tool_choice", "parallel_tool_calls", "response_format", "top_logprobs"):
        if name in chat:
            raise bad_request(f"'{name}' is a chat field: use /v1/chat/completions", param=name,
                              code="unsupported_parameter")
    chat["messages"] = [{"role": "user", "content": prompt}]
    return replace(parse_chat_request(chat, limits), completion=True)
