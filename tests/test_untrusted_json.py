"""Issue 39 (1): every parse of miner bytes is bounded in depth and size, and fails as the miner's, never as a
RecursionError that escapes into the validator's loops or a client's request."""

from __future__ import annotations

import pytest

from gateway.protocol.sse import SSEGarbage, parse_chunk
from gateway.protocol.tools import CLOSE, OPEN, parse_tool_calls, same_calls
from gateway.protocol.untrusted import MAX_DEPTH, UntrustedJSONError, depth, loads
from gateway.upstream.refusals import client_fault

DEEP = b"[" * 7000 + b"]" * 7000


def test_depth_counts_brackets_outside_strings_only() -> None:
    assert depth(b'[1, {"a": [2]}]') == 3
    assert depth(b'["[[[[", "\\"[[", {"k": "}}"}]') == 2  # brackets and escaped quotes inside strings
    assert depth(b'"' + b"\\" * 3 + b'"[[[') == 0  # an unterminated string swallows the rest, in one pass


def test_loads_refuses_deep_long_and_malformed_bodies_as_value_errors() -> None:
    for raw, says in ((DEEP, "nested deeper"), (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), "nested deeper"),
                      (b"{not json", "not JSON"), (b"\xff\xfe", "not JSON")):
        with pytest.raises(UntrustedJSONError, match=says):
            loads(raw)
    with pytest.raises(UntrustedJSONError, match="longer than"):
        loads(b'{"a": 1}', max_bytes=4)
    assert issubclass(UntrustedJSONError, ValueError)
    nest = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    assert loads(nest) is not None and loads('{"a": "[[[["}') == {"a": "[[[["}


def test_a_miners_deep_error_body_is_not_a_client_fault_and_raises_nothing() -> None:
    body = b'{"error": {"code": "context_length_exceeded", "x": ' + DEEP + b"}}"
    assert client_fault(400, body) is None
    assert client_fault(400, b'{"error": {"code": "context_length_exceeded", "message": "too long"}}') == "too long"


def test_a_deeply_nested_tool_call_in_an_answer_is_not_a_call() -> None:
    text = f'{OPEN}\n{{"name": "f", "arguments": {DEEP.decode()}}}\n{CLOSE}'
    assert parse_tool_calls(text) is None
    assert not same_calls([("f", DEEP.decode())], [("f", "[]")])


def test_a_stream_chunk_nested_past_the_decoders_limit_is_the_miners_garbage() -> None:
    with pytest.raises(SSEGarbage, match="nested too deeply"):
        parse_chunk(b'{"choices": [], "x": ' + DEEP + b"}")
