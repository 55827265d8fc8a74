"""Server-sent events from untrusted bytes, and the frames the gateway writes.

A miner controls every byte of its stream, so parsing is incremental and bounded: a line longer than
``max_line_bytes`` (no newline in sight), invalid UTF-8, invalid JSON, NaN/Infinity (or a number that
overflows to inf) and a chunk of the wrong shape are all :class:`SSEGarbage` — the miner's failure,
never a crash or an unbounded buffer in the gateway.

The hot path is one chunk per token per stream, so both directions have a per-stream fast path:
:class:`ChunkDecoder` learns the miner's content-only chunk as a proven template (everything but the
content string fixed) and then validates each such chunk with a prefix/suffix compare; :class:`ChunkFramer`
writes the client's content chunks from cached bytes around one JSON-escaped string. Both produce exactly
what the slow path (:func:`parse_chunk`, :func:`frame`) would.

Example::

    p = SSEParser()
    events = p.feed(b'data: {"object": "chat.completion.chunk", "choices": []}\\n\\ndata: [DONE]\\n\\n')
    chunk = parse_chunk(events[0])      # ChunkInfo(role=None, content='', finish_reason=None, usage=None)
    events[1] == DONE                   # True
    frame(chunk_json) / DONE_FRAME      # bytes to write to a client

    dec = ChunkDecoder()                # one per upstream stream: dec.decode(data) == parse_chunk(data)
    out = ChunkFramer("chatcmpl-1", 1700000000, "tensorgate/sim-5090")
    out.content("hi")                   # == frame({"id": "chatcmpl-1", ..., "choices": [{... "content": "hi"} ...]})
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
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
    ``\\n`` as the SSE spec says. Lines end with ``\\n`` or ``\\r\\n``. Only an incomplete last line is
    buffered (appended in place, so a miner trickling bytes costs linear time, not quadratic).
    """

    def __init__(self, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES, max_event_bytes: int | None = None) -> None:
        self._max_line = max_line_bytes
        self._max_event = max_event_bytes if max_event_bytes is not None else 4 * max_line_bytes
        self._buf = bytearray()
        self._data: list[str] = []
        self._event_bytes = 0

    def feed(self, data: bytes) -> list[str]:
        if self._buf:
            self._buf += data
            buf: bytes | bytearray = self._buf
        else:
            buf = data  # the usual case: scan the read itself, copy nothing
        events: list[str] = []
        max_line = self._max_line
        pos = 0
        find = buf.find
        while True:
            nl = find(b"\n", pos)
            if nl < 0:
                break
            if nl - pos > max_line:
                raise SSEGarbage(f"line longer than {max_line} bytes")
            end = nl - 1 if nl > pos and buf[nl - 1] == 13 else nl  # strip "\r"
            start, pos = pos, nl + 1
            if end == start:  # blank line: dispatch the event
                if self._data:
                    events.append(self._data[0] if len(self._data) == 1 else "\n".join(self._data))
                    self._data = []
                    self._event_bytes = 0
                continue
            raw = buf[start:end]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise SSEGarbage("invalid UTF-8 in stream") from None
            if line[0] == ":":
                continue
            if line.startswith("data: "):
                value = line[6:]
            else:
                name, sep, value = line.partition(":")
                if name != "data":
                    continue
                if sep and value.startswith(" "):
                    value = value[1:]
            self._event_bytes += end - start
            if self._event_bytes > self._max_event:
                raise SSEGarbage(f"event longer than {self._max_event} bytes")
            self._data.append(value)
        rest = len(buf) - pos
        if rest > max_line:
            raise SSEGarbage(f"line longer than {max_line} bytes")
        if buf is self._buf:
            del self._buf[:pos]
        elif rest:
            self._buf = bytearray(buf[pos:])
        return events

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
    token_ids: tuple[int, ...] | None = None  # the ids the miner says spell ``content`` (vLLM's return_token_ids)
    tool_calls: tuple[dict[str, Any], ...] | None = None  # delta.tool_calls, rebuilt (:func:`_tool_call_deltas`)
    logprobs: dict[str, Any] | None = None  # choice.logprobs, rebuilt (:func:`_logprobs`)

    @property
    def text(self) -> str:
        """What the model wrote in this chunk: the content, and a tool call's name and arguments (the tokens a
        tool-call delta stands for: TTFT ends at it, and it is counted like content)."""
        if self.tool_calls is None:
            return self.content
        return self.content + "".join(c.get("function", {}).get("name", "") + c.get("function", {}).get(
            "arguments", "") for c in self.tool_calls)


def _reject_constant(name: str) -> float:
    raise SSEGarbage(f"non-finite number {name} in chunk")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise SSEGarbage("number overflows to infinity")
    return value


# One decoder for every call: json.loads(**kw) would build a decoder and its scanner per chunk.
_STRICT = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)


def loads_strict(text: str) -> Any:
    """``json.loads`` that rejects NaN, Infinity and overflowing numbers."""
    try:
        return _STRICT.decode(text)
    except SSEGarbage:
        raise
    except (ValueError, RecursionError) as e:
        raise SSEGarbage(f"invalid JSON: {type(e).__name__}") from None


_FINISH = {"stop", "length", "content_filter", "tool_calls", "function_call"}
MAX_TOKEN_ID = 2**31 - 1


def _token_ids(value: Any, limit: int) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > limit:
        raise SSEGarbage(f"choice.token_ids is not a list of at most {limit} ids")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
            raise SSEGarbage("choice.token_ids holds something other than token ids")
    return tuple(value)


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


MAX_TOOL_CALLS = 128  # tool calls one answer may make (as the gateway's MAX_TOOLS)
MAX_TOKEN_CHARS = 256  # one logprobs entry's token text


def _short(value: Any, limit: int, what: str) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise SSEGarbage(f"{what} is not a string of at most {limit} characters")
    return value


def _tool_call_deltas(value: Any, max_chars: int) -> tuple[dict[str, Any], ...]:
    """``delta.tool_calls`` as OpenAI streams them (index, then id/type/name once, arguments in pieces), rebuilt
    from the fields it defines: a miner's extra keys never reach a client."""
    if not isinstance(value, list) or not value or len(value) > MAX_TOOL_CALLS:
        raise SSEGarbage(f"delta.tool_calls is not a list of 1 to {MAX_TOOL_CALLS} calls")
    out = []
    for call in value:
        if not isinstance(call, dict):
            raise SSEGarbage("a tool call delta is not an object")
        index = call.get("index")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < MAX_TOOL_CALLS:
            raise SSEGarbage("tool call delta has no valid index")
        d: dict[str, Any] = {"index": index}
        if call.get("id") is not None:
            d["id"] = _short(call["id"], 128, "tool call id")
        if call.get("type") is not None:
            if call["type"] != "function":
                raise SSEGarbage("tool call type is not function")
            d["type"] = "function"
        fn = call.get("function")
        if fn is not None:
            if not isinstance(fn, dict):
                raise SSEGarbage("tool call function is not an object")
            f: dict[str, str] = {}
            if fn.get("name") is not None:
                f["name"] = _short(fn["name"], 64, "tool call name")
            if fn.get("arguments") is not None:
                f["arguments"] = _short(fn["arguments"], max_chars, "tool call arguments")
            d["function"] = f
        out.append(d)
    return tuple(out)


def _logprob_entry(e: Any, top: bool) -> dict[str, Any]:
    if not isinstance(e, dict):
        raise SSEGarbage("a logprobs entry is not an object")
    lp = e.get("logprob")
    if isinstance(lp, bool) or not isinstance(lp, int | float) or not math.isfinite(lp):
        raise SSEGarbage("logprob is not a finite number")
    b = e.get("bytes")
    if b is not None and (not isinstance(b, list) or len(b) > 4 * MAX_TOKEN_CHARS or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= 255 for x in b)):
        raise SSEGarbage("logprobs bytes is not a list of bytes")
    out: dict[str, Any] = {"token": _short(e.get("token"), MAX_TOKEN_CHARS, "logprobs token"),
                           "logprob": float(lp), "bytes": b}
    if top:
        alts = e.get("top_logprobs") or []
        if not isinstance(alts, list) or len(alts) > 20:
            raise SSEGarbage("top_logprobs is not a list of at most 20 entries")
        out["top_logprobs"] = [_logprob_entry(a, False) for a in alts]
    return out


def _logprobs(value: Any, max_entries: int) -> dict[str, Any] | None:
    """``choice.logprobs`` (``{"content": [{token, logprob, bytes, top_logprobs}]}``), rebuilt; shown to the client
    as the miner's own figures (the audit never reads them)."""
    if value is None:
        return None
    content = value.get("content") if isinstance(value, dict) else None
    if content is None:
        return None
    if not isinstance(content, list) or len(content) > max_entries:
        raise SSEGarbage(f"logprobs.content is not a list of at most {max_entries} entries")
    return {"content": [_logprob_entry(e, True) for e in content]}


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
    if finish is not None and (not isinstance(finish, str) or finish not in _FINISH):  # a list is unhashable
        raise SSEGarbage("unknown finish_reason")
    ids = _token_ids(choice.get("token_ids"), max_content_chars)
    calls = delta.get("tool_calls")  # vLLM writes [] on content chunks
    return ChunkInfo(role=role, content=content, finish_reason=finish, usage=usage, token_ids=ids,
                     tool_calls=None if calls is None or calls == [] else _tool_call_deltas(calls, max_content_chars),
                     logprobs=_logprobs(choice.get("logprobs"), max_content_chars))


# Characters that end or escape a JSON string (or are not allowed in one): a string body free of
# them is one complete JSON string token whose value is the body itself.
_NOT_PLAIN = re.compile(r'["\\\x00-\x1f]')
_SENTINEL = "tg\u2603probe"


class ChunkDecoder:
    """:func:`parse_chunk` for one stream, with a fast path for the miner's content-only chunks.

    Servers write every content chunk of a stream alike (``{"id": same, ..., "delta": {"content": "<tok>"},
    ...}``), so after one such chunk was fully parsed the decoder keeps the text before and after its
    content string as a template. A later chunk that is exactly ``prefix + body + suffix`` with a body
    free of quotes, backslashes and control characters *is* that chunk with another content string:

    * the template has no backslash outside the content, so its lexer state is fixed by counting quotes:
      an even count before the content means the content's opening quote starts a string token;
    * a plain body closes that token at the suffix's first quote, so the rest lexes byte for byte alike;
    * a probe parse (the template around a sentinel) proved this token is the ``delta.content`` that
      wins (not a key, not a duplicate, not another field), and the template passed every other check.

    Chunks that also carry ``token_ids`` get a template with a second hole, ``prefix + body + mid +
    ids + tail``, where ``ids`` is digits and commas only (numbers lex alike whatever their value) and
    a probe with sentinel ids proved the hole is ``choice.token_ids``.

    Anything else (role, finish, usage, escapes, new fields, another id) takes the full parse.
    """

    __slots__ = ("_max", "_prefix", "_suffix", "_mid", "_plen", "_slen", "_learns")

    def __init__(self, max_content_chars: int = 4096, max_learns: int = 4) -> None:
        self._max = max_content_chars
        self._prefix = ""
        self._suffix = ""  # after the content (one hole) or after the ids (two holes)
        self._mid: str | None = None  # between the content and the ids: a two-hole template
        self._plen = -1  # no template yet
        self._slen = 0
        self._learns = max_learns

    @property
    def has_template(self) -> bool:
        return self._plen >= 0

    def decode(self, data: str) -> ChunkInfo:
        plen = self._plen
        if plen >= 0 and data.startswith(self._prefix) and data.endswith(self._suffix):
            end = len(data) - self._slen
            mid = self._mid
            if mid is None:
                if end - plen <= self._max and end >= plen:
                    body = data[plen:end]
                    if _NOT_PLAIN.search(body) is None:
                        return ChunkInfo(None, body, None, None)
            else:
                q = data.find('"', plen, end)
                if 0 <= q - plen <= self._max and data.startswith(mid, q):
                    body = data[plen:q]
                    digits = data[q + len(mid):end]
                    if _NOT_PLAIN.search(body) is None and _ID_LIST.fullmatch(digits) is not None:
                        ids = tuple(map(int, digits.split(",")))
                        if len(ids) <= self._max and max(ids) <= MAX_TOKEN_ID:
                            return ChunkInfo(None, body, None, None, ids)
        chunk = parse_chunk(data, self._max)
        if (self._learns > 0 and chunk.content and chunk.role is None and chunk.finish_reason is None
                and chunk.usage is None):
            self._learn(data, chunk.content, chunk.token_ids)
        return chunk

    def _learn(self, data: str, content: str, ids: tuple[int, ...] | None) -> None:
        self._learns -= 1
        if _NOT_PLAIN.search(content) is not None or _SENTINEL in data:
            return  # escaped content: its raw text is not the value; try a later chunk
        lit = f'"{content}"'
        i = data.find(lit)
        while i >= 0:
            prefix, suffix = data[: i + 1], data[i + 1 + len(content):]
            if "\\" not in prefix and "\\" not in suffix and prefix.count('"') % 2 == 1:
                if ids is None:
                    if _probe(prefix + _SENTINEL + suffix) == ChunkInfo(None, _SENTINEL, None, None):
                        self._prefix, self._suffix, self._mid = prefix, suffix, None
                        self._plen, self._slen = len(prefix), len(suffix)
                        return
                elif ids and self._learn_ids(prefix, suffix, ids):
                    return
            i = data.find(lit, i + 1)

    def _learn_ids(self, prefix: str, suffix: str, ids: tuple[int, ...]) -> bool:
        digits = ",".join(map(str, ids))
        j = suffix.find("[" + digits + "]")
        while j >= 0:
            mid, tail = suffix[: j + 1], suffix[j + 1 + len(digits):]
            if mid.startswith('"') and _probe(prefix + _SENTINEL + mid + "7,7" + tail) == ChunkInfo(
                    None, _SENTINEL, None, None, (7, 7)):
                self._prefix, self._mid, self._suffix = prefix, mid, tail
                self._plen, self._slen = len(prefix), len(tail)
                return True
            j = suffix.find("[" + digits + "]", j + 1)
        return False


_ID_LIST = re.compile(r"\d{1,10}(?:,\d{1,10})*")


def _probe(data: str) -> ChunkInfo | None:
    try:
        return parse_chunk(data, len(_SENTINEL))
    except SSEGarbage:
        return None


def frame(obj: Any) -> bytes:
    """One SSE ``data:`` frame holding ``obj`` as compact JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), allow_nan=False).encode() + b"\n\n"


class ChunkFramer:
    """The client-bound chunk frames of one answer (``index``: its choice), constant parts encoded once.

    ``content(text)`` is byte-for-byte ``frame(chunk(delta={"content": text}))``; everything else
    (the first chunk, role, finish) goes through :meth:`chunk` and :func:`frame`. ``completion``: the
    legacy ``text_completion`` shape (``choices[i].text``) of ``/v1/completions``.
    """

    __slots__ = ("id", "created", "model", "index", "completion", "_head", "_tail", "_with_ids")

    def __init__(self, cid: str, created: int, model: str, *, index: int = 0, completion: bool = False) -> None:
        self.id = cid
        self.created = created
        self.model = model
        self.index = index
        self.completion = completion
        self._with_ids: tuple[bytes, bytes, bytes] | None = None
        probe = frame(self.chunk({"content": _SENTINEL}, None))
        lit = encode_basestring_ascii(_SENTINEL).encode()
        i = probe.rindex(lit)  # the delta (or text) is the last string-valued field
        self._head, self._tail = probe[:i], probe[i + len(lit):]

    @property
    def object(self) -> str:
        return "text_completion" if self.completion else "chat.completion.chunk"

    def chunk(self, delta: dict[str, Any], finish: str | None, logprobs: dict[str, Any] | None = None,
              **extra: Any) -> dict[str, Any]:
        if self.completion:
            choice: dict[str, Any] = {"index": self.index, "text": delta.get("content", ""), "logprobs": None,
                                      "finish_reason": finish}
        else:
            choice = {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        obj: dict[str, Any] = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                               "choices": [choice]}
        obj.update(extra)
        return obj

    def content(self, text: str) -> bytes:
        return self._head + encode_basestring_ascii(text).encode() + self._tail

    def tokens(self, text: str, ids: Sequence[int]) -> bytes:
        """A content chunk that names the token ids spelling ``text`` (``choice.token_ids``, as vLLM's
        ``return_token_ids``): what a miner sends a validator so its answers can be audited.
        Byte-for-byte ``frame(chunk(delta={"content": text}))`` with ``"token_ids": ids`` on the choice."""
        parts = self._with_ids
        if parts is None:
            obj = self.chunk({"content": _SENTINEL}, None)
            obj["choices"][0]["token_ids"] = [7, 7]
            probe = frame(obj)
            lit = encode_basestring_ascii(_SENTINEL).encode()
            i = probe.rindex(lit)
            j = probe.rindex(b"[7,7]")
            parts = self._with_ids = (probe[:i], probe[i + len(lit):j + 1], probe[j + 4:])
        head, mid, tail = parts
        return head + encode_basestring_ascii(text).encode() + mid + ",".join(map(str, ids)).encode() + tail

    def usage(self, usage: dict[str, int]) -> bytes:
        """The closing usage chunk (``choices`` empty), as OpenAI sends it with ``include_usage``."""
        return frame({"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                      "choices": [], "usage": usage})
