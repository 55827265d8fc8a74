"""Tools in the subnet's format in front of a runtime that renders its own chat template (vLLM, SGLang).

Such a runtime hands its template the tool definitions re-serialized through its request model (vLLM:
``tool.model_dump()``, its own field order and ``null`` for what the client left out), so no template can render
the bytes the reference renders. The proxy therefore writes the tool turns itself: the runtime is sent
:func:`~gateway.protocol.tools.prompt_messages` (tools as a system turn, calls as the assistant's text, results as
a user turn) and no ``tools``, which the subnet's Jinja template renders exactly as the reference does. What the
model writes back is plain text; :func:`relay_calls` holds an answer that opens with ``<tool_call>`` and sends it on
as OpenAI's ``delta.tool_calls`` with finish ``tool_calls`` (the same :class:`~.features.CallGate` the llama.cpp
runtime uses), every token id kept, so the validator's audit forces the very tokens the model wrote.

Example::

    body = tool_body(payload)             # None: no tools or tool history, relay as is
    async for frame in relay_calls(upstream_bytes, payload):
        ...
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterable
from typing import Any

from gateway.protocol.sse import DONE_FRAME, ChunkFramer, SSEGarbage, SSEParser, frame, parse_chunk
from gateway.protocol.tools import prompt_messages, uses_tools

from .base import RuntimeFailure
from .features import CallGate

_TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")


def tool_body(payload: dict[str, Any]) -> dict[str, Any] | None:
    """The body to send a template-rendering runtime for a request with tools or tool history, or None for one
    without (sent as it came)."""
    if not uses_tools(payload):
        return None
    body = {k: v for k, v in payload.items() if k not in _TOOL_FIELDS}
    body["messages"] = prompt_messages(payload)
    return body


def may_call(payload: dict[str, Any]) -> bool:
    """Whether the answer may be a call the proxy must turn into ``tool_calls`` (tools offered, choice not none)."""
    return bool(payload.get("tools")) and payload.get("tool_choice", "auto") != "none"


async def relay_calls(upstream: AsyncIterable[bytes], payload: dict[str, Any]) -> AsyncGenerator[bytes, None]:
    """Re-frame a runtime's chat stream so that a tool call written as text reaches the validator as tool-call
    deltas. Text that cannot be a call flows on as it comes (chunk by chunk); the usage chunk is kept; the runtime's
    finish reason is kept unless the answer was a call. A stream that is not a chat-completions stream is the
    runtime's failure (:class:`RuntimeFailure`, 502), never a half-sent answer."""
    want_ids = payload.get("return_token_ids") is True
    named = payload.get("model")
    out = ChunkFramer("chatcmpl-" + secrets.token_hex(12), int(time.time()), named if isinstance(named, str) else "")
    gate = CallGate()
    parser = SSEParser()
    finish: str | None = None
    usage: dict[str, int] | None = None
    role_sent = False

    def framed(pieces: list[tuple[str, list[int]]]) -> list[bytes]:
        return [out.tokens(t, ids) if want_ids else out.content(t) for t, ids in pieces if t or ids]

    async for data in upstream:
        try:
            events = parser.feed(data)
        except SSEGarbage as e:
            raise RuntimeFailure(f"runtime stream unreadable: {e}", code="runtime_bad_stream") from None
        batch: list[bytes] = []
        for event in events:
            if event.strip() == "[DONE]":
                continue
            try:
                info = parse_chunk(event)
            except SSEGarbage as e:
                raise RuntimeFailure(f"runtime stream unreadable: {e}", code="runtime_bad_stream") from None
            if not role_sent:
                batch.append(frame(out.chunk({"role": "assistant"}, None)))
                role_sent = True
            if info.usage is not None:
                usage = info.usage
            if info.content or info.token_ids:
                batch += framed(gate.feed([(info.content, list(info.token_ids or ()))]))
            if info.finish_reason is not None:
                finish = info.finish_reason
        if batch:
            yield b"".join(batch)
    tail, called = gate.close(out, framed, want_ids)
    finish = "tool_calls" if called else finish
    tail.append(frame(out.chunk({}, finish or "stop")))
    if usage is not None:
        tail.append(out.usage(usage))
    tail.append(DONE_FRAME)
    yield b"".join(tail)
