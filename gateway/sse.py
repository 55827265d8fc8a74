"""Server-sent events from untrusted bytes, and the frames the gateway writes.

A miner controls every byte of its stream, so parsing is incremental and bounded: a line longer than
``max_line_bytes`` (no newline in sight), invalid UTF-8, invalid JSON, NaN/Infinity (or a number that
overflows to inf) and a chunk of the wrong shape are all :class:`SSEGarbage` — the miner's failure,
never a crash or an unbounded buffer in the gateway.

Example::

    p = SSEParser()
    events = p.feed(b'data: {"object": "chat.completion.chunk", "choices": []}\\n\\ndata: [DONE]\\n\\n')
    chunk = parse_chunk(events[0])      # ChunkInfo(role=None, content='', finish_reason=None, usage=None)
    events[1] == DONE                   # True
    frame(chunk_json) / DONE_FRAME      # bytes to write to a client
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

DONE = "[DONE]"
DONE_FRAME = b"data: [DONE]\n\n"
DEFAULT_MAX_LINE_BYTES = 64 * 1024


class SSEGarbage(ValueError):
    """The stream is not a well-formed chat-completions SSE stream."""


class SSEErrorEvent(SSEGarbage):
    """The miner reported an error inside its stream (``data: {"error": ...}``)."""


class SSEParser:
    """Incremental SSE parser: feed bytes, get the ``data`` payload (str) of each complete event.

    Comments (``:``), ``event:``/``id:``/``retry:`` fields are ignored; multi-line data is joined with
    ``\\n`` as the SSE spec says. Lines end with ``\\n`` or ``\\r\\n``.
    """

    def __init__(self, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES, max_event_bytes: int | None = None) -> None:
        self._max_line = max_line_bytes
        self._max_event = max_event_bytes if max_event_bytes is not None else 4 * max_line_bytes
        self._buf = bytearray()
        self._data: list[str] = []
        self._event_bytes = 0

    def feed(self, data: bytes) -> list[str]:
        self._buf += data
        events: list[str] = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                if len(self._buf) > self._max_line:
                    raise SSEGarbage(f"line longer than {self._max_line} bytes")
                return events
            if nl > self._max_line:
                raise SSEGarbage(f"line longer than {self._max_line} bytes")
            raw = bytes(self._buf[:nl])
            del self._buf[: nl + 1]
            if raw.endswith(b"\r"):
                raw = raw[:-1]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise SSEGarbage("invalid UTF-8 in stream") from None
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
                    self._event_bytes = 0
                continue
            if line.startswith(":"):
                continue
            name, sep, value = line.partition(":")
            if sep and value.startswith(" "):
                value = value[1:]
            if name == "data":
                self._event_bytes += len(raw)
                if self._event_bytes > self._max_event:
                    raise SSEGarbage(f"event longer than {self._max_event} bytes")
                self._data.append(value)

    def pending(self) -> bool:
        """True when bytes or data lines are buffered that no complete event has flushed yet."""
        return bool(self._buf.strip()) or bool(self._data)


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    """What the gateway takes from one ``chat.completion.chunk``; everything else is dropped."""

    role: str | None
    content: str
    finish_reason: str | None
    usage: dict[str, int] | None


def _reject_constant(name: str) -> float:
    raise SSEGarbage(f"non-finite number {name} in chunk")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise SSEGarbage("number overflows to infinity")
    return value


def loads_strict(text: str) -> Any:
    """``json.loads`` that rejects NaN, Infinity and overflowing numbers."""
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except SSEGarbage:
        raise
    except (ValueError, RecursionError) as e:
        raise SSEGarbage(f"invalid JSON: {type(e).__name__}") from None


_FINISH = {"stop", "length", "content_filter", "tool_calls", "function_call"}


def _usage(value: Any) -> dict[str, int] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise SSEGarbage("usage is not an object")
    out: dict[str, int] = {}
    for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
        v = value.get(k)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise SSEGarbage(f"usage.{k} is not a non-negative integer")
        out[k] = v
    return out


def parse_chunk(data: str, max_content_chars: int = 4096) -> ChunkInfo:
    """Validate one event's data as a chat-completion chunk (n=1)."""
    obj = loads_strict(data)
    if not isinstance(obj, dict):
        raise SSEGarbage("chunk is not an object")
    if "error" in obj and "choices" not in obj:
        raise SSEErrorEvent("miner sent an error event")
    obj_type = obj.get("object")
    if obj_type is not None and obj_type != "chat.completion.chunk":
        raise SSEGarbage("chunk object is not chat.completion.chunk")
    choices = obj.get("choices")
    if not isinstance(choices, list) or len(choices) > 1:
        raise SSEGarbage("chunk choices is not a list of at most one choice")
    usage = _usage(obj.get("usage"))
    if not choices:
        return ChunkInfo(role=None, content="", finish_reason=None, usage=usage)
    choice = choices[0]
    if not isinstance(choice, dict):
        raise SSEGarbage("choice is not an object")
    delta = choice.get("delta")
    if delta is None:
        delta = {}
    if not isinstance(delta, dict):
        raise SSEGarbage("choice.delta is not an object")
    role = delta.get("role")
    if role is not None and role != "assistant":
        raise SSEGarbage("delta.role is not assistant")
    content = delta.get("content")
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise SSEGarbage("delta.content is not a string")
    if len(content) > max_content_chars:
        raise SSEGarbage(f"chunk content longer than {max_content_chars} characters")
    finish = choice.get("finish_reason")
    if finish is not None and finish not in _FINISH:
        raise SSEGarbage("unknown finish_reason")
    return ChunkInfo(role=role, content=content, finish_reason=finish, usage=usage)


def frame(obj: Any) -> bytes:
    """One SSE ``data:`` frame holding ``obj`` as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), allow_nan=False).encode() + b"\n\n"
