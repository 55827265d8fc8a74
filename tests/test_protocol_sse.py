"""SSE framing from untrusted bytes and the frames the gateway writes: pure, no sockets."""

from __future__ import annotations

import json
import random

import pytest

from gateway.protocol.sse import ChunkFramer, ChunkInfo, SSEGarbage, SSEParser, frame, parse_chunk


def test_sse_parser_is_incremental_across_any_split():
    stream = ('data: {"a": "h\u00e9llo \u2603"}\r\n\r\n: comment\nevent: x\ndata: line1\ndata: line2\n\n'
              "data: [DONE]\n\n").encode()
    whole = SSEParser().feed(stream)
    assert whole == ['{"a": "h\u00e9llo \u2603"}', "line1\nline2", "[DONE]"]
    p = SSEParser()
    one_by_one = [e for i in range(len(stream)) for e in p.feed(stream[i:i + 1])]  # splits multibyte UTF-8 too
    assert one_by_one == whole


@pytest.mark.parametrize("data", [b"data: " + b"x" * 70_000, b"data: \xff\xfe\n\n", b"x" * 65_537])
def test_sse_parser_rejects_overlong_lines_and_bad_utf8(data):
    with pytest.raises(SSEGarbage):
        p = SSEParser(max_line_bytes=64 * 1024)
        for i in range(0, len(data), 4096):
            p.feed(data[i:i + 4096])


@pytest.mark.parametrize(
    "data",
    ['{"choices": [{"delta": {"content": "x"}}], "n": NaN}', '{"choices": [], "v": Infinity}',
     '{"choices": [], "usage": {"prompt_tokens": 1e999}}', '{"choices": [{}, {}]}', '{"choices": "all"}',
     '{"id": "x"}', '{"choices": [{"delta": {"content": "\\ud800"}}]}', '{"choices": [{"delta": {"role": "user"}}]}',
     '{"choices": [{"delta": {"content": 5}}]}', '{"choices": [{"delta": [], "finish_reason": null}]}',
     '{"choices": [{"delta": {}, "finish_reason": "exploded"}]}', '{"object": "chat.completion", "choices": []}',
     '{"choices": [{"delta": {"content": "a"}, "finish_reason": ["stop"]}]}',
     '{"choices": [{"delta": {"role": ["assistant"]}}]}',
     '{"choices": [], "usage": {"completion_tokens": -1}}', '[1, 2]', '{"choices": [{"delta": {"content": "'
     + "y" * 5000 + '"}}]}', "{nope"],
)
def test_parse_chunk_rejects_bad_shapes(data):
    with pytest.raises(SSEGarbage):
        parse_chunk(data)


def test_parse_chunk_accepts_the_usual_shapes():
    assert parse_chunk('{"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": '
                       '"assistant", "content": ""}, "finish_reason": null}]}').role == "assistant"
    c = parse_chunk('{"choices": [{"delta": {"content": "hi"}, "finish_reason": "stop"}], "usage": null}')
    assert (c.content, c.finish_reason, c.usage) == ("hi", "stop", None)
    u = parse_chunk('{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}')
    assert u.usage == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5} and u.content == ""
    # a number too large for a float in a field the gateway skips is still JSON: nothing reads it
    assert parse_chunk('{"choices": [], "timings": {"ms": 1e999}}').usage is None


_ALPHABET = ['a', 'Z', ' ', '0', '\u00e9', '\u2603', '\U0001f600', '"', '\\', '\n', '\x01', '\x7f', '/', ',', '}']


def _random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(_ALPHABET) for _ in range(n))


def _server_chunk(style: int, cid: str, content: str | None, finish: str | None = None, role: str | None = None) -> str:
    """A chunk as one of several servers would write it (key order, spacing, extras, escaping)."""
    delta: dict = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if style == 0:  # vLLM-like, compact
        obj = {"id": cid, "object": "chat.completion.chunk", "created": 1, "model": "m",
               "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    if style == 1:  # spaced, ASCII-escaped, delta last
        obj = {"choices": [{"finish_reason": finish, "index": 0, "delta": delta}], "id": cid, "model": "m"}
        return json.dumps(obj)
    # llama-server-like: extra fields after the choices, usage null
    obj = {"choices": [{"index": 0, "finish_reason": finish, "delta": delta}], "created": 2, "id": cid,
           "model": "m", "system_fingerprint": "b1", "object": "chat.completion.chunk", "usage": None,
           "timings": {"predicted_ms": 1.5}}
    return json.dumps(obj, separators=(", ", ": "), ensure_ascii=False)


def _read_plainly(data: str, max_content: int) -> ChunkInfo:
    """What a chunk says, read the plain way (``json.loads`` and dictionary lookups): the decoder must agree."""
    obj = json.loads(data)
    choice = obj["choices"][0]
    delta = choice.get("delta") or {}
    content = delta.get("content") or ""
    if len(content) > max_content:
        raise SSEGarbage("too long")
    ids = choice.get("token_ids")
    return ChunkInfo(role=delta.get("role"), content=content, finish_reason=choice.get("finish_reason"),
                     usage=obj.get("usage"), token_ids=None if ids is None else tuple(ids))


def _agrees(data: str, max_content: int) -> None:
    try:
        want = _read_plainly(data, max_content)
    except SSEGarbage:
        with pytest.raises(SSEGarbage):
            parse_chunk(data, max_content)
        return
    assert parse_chunk(data, max_content) == want
    assert parse_chunk(data.encode(), max_content) == want  # bytes read the same


@pytest.mark.parametrize("style", [0, 1, 2])
def test_the_decoder_reads_what_json_loads_reads_on_seeded_streams(style):
    """Three servers' styles (key order, spacing, extra fields, ASCII escapes), text with quotes, escapes, control
    characters and astral characters, around the content limit, with and without token ids."""
    rng = random.Random(1000 + style)
    for _ in range(60):
        cid = f"chatcmpl-{rng.randrange(10**6)}"
        stream = [_server_chunk(style, cid, "", role="assistant")]
        for _ in range(rng.randrange(1, 30)):
            r = rng.random()
            if r < 0.6:
                text = "".join(rng.choice("abc xyz.") for _ in range(rng.randrange(1, 8)))  # plain tokens
            elif r < 0.9:
                text = _random_text(rng, rng.randrange(0, 8))  # quotes, escapes, control chars, unicode
            else:
                text = "w" * rng.randrange(38, 44)  # around max_content_chars
            ids = [rng.randrange(262144) for _ in range(rng.randrange(1, 4))]
            stream.append(_with_ids(style, cid, text, ids) if rng.random() < 0.5 else _server_chunk(style, cid, text))
        stream.append(_server_chunk(style, cid, None, finish="stop"))
        for data in stream:
            _agrees(data, 40)


@pytest.mark.parametrize("data", [
    '{"id":"x","choices":[{"delta":{"content":"x"}}]}',
    '{"choices":[{"delta":{"content":"a","content":"b"}}]}',  # a duplicate key: the last one wins, as in json.loads
    '{"choices":[{"delta":{"content":"\\u0041"},"finish_reason":null}]}',
    '{"choices":[{"delta":{"content":"tab\\there"},"finish_reason":null}]}',
    '{"t":{"t":1},"choices":[{"delta":{"content":"t"}}]}',
    '{"choices":[{"delta":{"content":"b"},"finish_reason":null,"token_ids":[]}]}',
    '{"choices":[{"delta":{"content":"' + "y" * 41 + '"},"finish_reason":null}]}',
])
def test_the_decoder_agrees_on_the_odd_cases(data):
    _agrees(data, 40)


def test_chunk_framer_writes_what_json_dumps_would():
    rng = random.Random(7)
    for model in ("tensorgate/sim-5090", 'q"uote\\d \u2603 tg\u2603probe'):
        out = ChunkFramer("chatcmpl-abc", 1_700_000_000, model)
        for _ in range(300):
            text = _random_text(rng, rng.randrange(0, 12))
            expected = frame({"id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 1_700_000_000,
                              "model": model, "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None,
                                                           "finish_reason": None}]})
            assert out.content(text) == expected
            assert json.loads(expected[6:])["choices"][0]["delta"]["content"] == text
        usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
        assert json.loads(out.usage(usage)[6:]) == {"id": "chatcmpl-abc", "object": "chat.completion.chunk",
                                                    "created": 1_700_000_000, "model": model, "choices": [],
                                                    "usage": usage}


def test_sse_parser_line_limit_is_exact_in_one_read_or_many():
    limit = 1000
    ok = b"data: " + b"x" * (limit - 6) + b"\n\n"  # a line of exactly `limit` bytes
    bad = b"data: " + b"x" * (limit - 5) + b"\n\n"
    assert SSEParser(max_line_bytes=limit).feed(ok) == ["x" * (limit - 6)]
    p = SSEParser(max_line_bytes=limit)
    assert [e for i in range(0, len(ok), 7) for e in p.feed(ok[i:i + 7])] == ["x" * (limit - 6)]
    assert not p.pending()
    for step in (len(bad), 7, 1):
        p = SSEParser(max_line_bytes=limit)
        with pytest.raises(SSEGarbage):
            for i in range(0, len(bad), step):
                p.feed(bad[i:i + step])


def _with_ids(style: int, cid: str, content: str, ids: list[int]) -> str:
    """A content chunk that names its token ids (vLLM's ``return_token_ids``), in each server style."""
    obj = json.loads(_server_chunk(style, cid, content))
    obj["choices"][0]["token_ids"] = ids
    if style == 1:
        return json.dumps(obj)
    return json.dumps(obj, separators=(",", ":") if style == 0 else (", ", ": "), ensure_ascii=False)


@pytest.mark.parametrize("bad", [
    '{"choices":[{"delta":{"content":"a"},"token_ids":"12"}]}',
    '{"choices":[{"delta":{"content":"a"},"token_ids":[1,true]}]}',
    '{"choices":[{"delta":{"content":"a"},"token_ids":[-3]}]}',
    '{"choices":[{"delta":{"content":"a"},"token_ids":[1.5]}]}',
    '{"choices":[{"delta":{"content":"a"},"token_ids":[4294967296]}]}',
    '{"choices":[{"delta":{"content":"b"},"finish_reason":null,"token_ids":[5,NaN]}]}',
    '{"choices":[{"delta":{"content":"b\\"},"finish_reason":null,"token_ids":[5]}]}',
])
def test_bad_token_ids_are_garbage(bad):
    with pytest.raises(SSEGarbage):
        parse_chunk(bad)


def test_chunk_framer_token_frames():
    f = ChunkFramer("c", 1, "m")
    obj = f.chunk({"content": 'a"é'}, None)
    obj["choices"][0]["token_ids"] = [3, 4]
    assert f.tokens('a"é', [3, 4]) == frame(obj)
    assert parse_chunk(f.tokens("x", [9])[6:-2].decode()).token_ids == (9,)


# -- tool-call deltas and logprobs (issue 27) ---------------------------------------------------


def _choice(delta: dict, **choice: object) -> str:
    return json.dumps({"object": "chat.completion.chunk",
                       "choices": [{"index": 0, "delta": delta, "finish_reason": None, **choice}]})


def test_tool_call_deltas_and_logprobs_are_rebuilt_from_the_fields_openai_defines():
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""},
            "evil": "x"}
    ch = parse_chunk(_choice({"tool_calls": [call]}))
    assert ch.tool_calls == ({"index": 0, "id": "call_1", "type": "function",
                              "function": {"name": "f", "arguments": ""}},)
    assert ch.text == "f"  # what TTFT and an id-less count see: the call's name and arguments
    assert parse_chunk(_choice({"content": "a", "tool_calls": []})).tool_calls is None  # vLLM's empty list
    lp = {"content": [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": [
        {"token": "a", "logprob": -0.5, "bytes": [97], "extra": 1}]}]}
    ch = parse_chunk(_choice({"content": "a"}, logprobs=lp))
    assert ch.logprobs == {"content": [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": [
        {"token": "a", "logprob": -0.5, "bytes": [97]}]}]}


@pytest.mark.parametrize("delta,choice", [
    ({"tool_calls": {"index": 0}}, {}),  # not a list
    ({"tool_calls": [{"index": -1}]}, {}),
    ({"tool_calls": [{"index": True}]}, {}),
    ({"tool_calls": [{"index": 0, "type": "code"}]}, {}),
    ({"tool_calls": [{"index": 0, "function": {"arguments": {"x": 1}}}]}, {}),  # arguments are JSON *text*
    ({"tool_calls": [{"index": 0, "function": {"name": "n" * 65}}]}, {}),
    ({"content": "a"}, {"logprobs": {"content": [{"token": "a", "logprob": "high"}]}}),
    ({"content": "a"}, {"logprobs": {"content": [{"token": "a", "logprob": -1, "bytes": [256]}]}}),
    ({"content": "a"}, {"logprobs": {"content": [{"token": "a", "logprob": -1, "top_logprobs": [1]}]}}),
    ({"content": "a"}, {"logprobs": {"content": "a"}}),
])
def test_bad_tool_calls_and_logprobs_are_garbage(delta, choice):
    with pytest.raises(SSEGarbage):
        parse_chunk(_choice(delta, **choice))
