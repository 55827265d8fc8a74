"""SSE framing from untrusted bytes and the frames the gateway writes: pure, no sockets."""

from __future__ import annotations

import json
import random

import pytest

from gateway.protocol.sse import ChunkDecoder, ChunkFramer, SSEGarbage, SSEParser, frame, parse_chunk


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
     '{"choices": [], "v": 1e999}', '{"choices": [{}, {}]}', '{"choices": [{"delta": {"role": "user"}}]}',
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


def _same_as_parse_chunk(dec: ChunkDecoder, data: str, max_content: int) -> None:
    try:
        want = parse_chunk(data, max_content)
    except SSEGarbage as e:
        with pytest.raises(type(e)):
            dec.decode(data)
        return
    assert dec.decode(data) == want


@pytest.mark.parametrize("style", [0, 1, 2])
def test_chunk_decoder_agrees_with_parse_chunk_on_seeded_streams(style):
    rng = random.Random(1000 + style)
    fast_hits = 0
    for _ in range(60):
        dec = ChunkDecoder(max_content_chars=40)
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
            stream.append(_server_chunk(style, cid, text))
        stream.append(_server_chunk(style, cid, None, finish="stop"))
        for data in stream:
            had = dec.has_template
            _same_as_parse_chunk(dec, data, 40)
            fast_hits += had
    assert fast_hits > 500  # the template was learnt and used, not only the slow path


@pytest.mark.parametrize("first,later", [
    # the content also occurs as another value: the template must sit on delta.content
    ('{"id":"x","choices":[{"delta":{"content":"x"}}]}', ['{"id":"y","choices":[{"delta":{"content":"x"}}]}',
                                                          '{"id":"x","choices":[{"delta":{"content":"q"}}]}']),
    # a duplicate key: the last one wins, in the template as in json.loads
    ('{"choices":[{"delta":{"content":"a","content":"b"}}]}', ['{"choices":[{"delta":{"content":"a","content":"z"}}]}',
                                                               '{"choices":[{"delta":{"content":"z","content":"b"}}]}']),
    # a body smuggling structure, NaN or an escape through the template's slot
    ('{"choices":[{"delta":{"content":"t"},"finish_reason":null}]}',
     ['{"choices":[{"delta":{"content":"t"},"finish_reason":"stop"},{"delta":{"content":""},"finish_reason":null}]}',
      '{"choices":[{"delta":{"content":"","x":NaN,"y":""},"finish_reason":null}]}',
      '{"choices":[{"delta":{"content":"\\"},"finish_reason":null}]}',
      '{"choices":[{"delta":{"content":"\\u0041"},"finish_reason":null}]}',
      '{"choices":[{"delta":{"content":"tab\there"},"finish_reason":null}]}',
      '{"choices":[{"delta":{"content":"' + "y" * 41 + '"},"finish_reason":null}]}']),
    # content as a key's text, and backslashes elsewhere: never a template
    ('{"t":{"t":1},"choices":[{"delta":{"content":"t"}}]}', ['{"t":{"u":1},"choices":[{"delta":{"content":"u"}}]}']),
    ('{"id":"a\\\\b","choices":[{"delta":{"content":"c"}}]}',
     ['{"id":"a\\\\b","choices":[{"delta":{"content":"d"}}]}']),
])
def test_chunk_decoder_cannot_be_fooled(first, later):
    dec = ChunkDecoder(max_content_chars=40)
    _same_as_parse_chunk(dec, first, 40)
    for data in later:
        _same_as_parse_chunk(dec, data, 40)
        _same_as_parse_chunk(dec, data, 40)  # and again, once any template was (re)learnt from it


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


@pytest.mark.parametrize("style", [0, 1, 2])
def test_chunk_decoder_reads_token_ids_on_the_fast_path_too(style):
    rng = random.Random(77 + style)
    dec = ChunkDecoder(max_content_chars=40)
    fast = 0
    for i in range(200):
        text = "".join(rng.choice("abc xyz.") for _ in range(rng.randrange(1, 8)))
        ids = [rng.randrange(262144) for _ in range(rng.randrange(1, 4))]
        data = _with_ids(style, "chatcmpl-1", text, ids)
        had = dec.has_template
        got = dec.decode(data)
        assert got == parse_chunk(data, 40) and got.token_ids == tuple(ids) and got.content == text
        fast += had and i > 0
    assert fast > 150


@pytest.mark.parametrize("bad", [
    '{"choices":[{"delta":{"content":"a"},"token_ids":"12"}]}',
    '{"choices":[{"delta":{"content":"a"},"token_ids":[1,true]}]}',
    '{"choices":[{"delta":{"content":"a"},"token_ids":[-3]}]}',
    '{"choices":[{"delta":{"content":"a"},"token_ids":[1.5]}]}',
    '{"choices":[{"delta":{"content":"a"},"token_ids":[4294967296]}]}',
])
def test_bad_token_ids_are_garbage(bad):
    with pytest.raises(SSEGarbage):
        parse_chunk(bad)


def test_token_id_template_cannot_be_fooled():
    dec = ChunkDecoder(max_content_chars=40)
    first = '{"choices":[{"delta":{"content":"a"},"finish_reason":null,"token_ids":[5]}]}'
    assert dec.decode(first).token_ids == (5,)
    for later in ['{"choices":[{"delta":{"content":"b"},"finish_reason":null,"token_ids":[5,NaN]}]}',
                  '{"choices":[{"delta":{"content":"b"},"finish_reason":null,"token_ids":[99999999999]}]}',
                  '{"choices":[{"delta":{"content":"b"},"finish_reason":null,"token_ids":[5],"x":[1]}]}',
                  '{"choices":[{"delta":{"content":"b\\"},"finish_reason":null,"token_ids":[5]}]}',
                  '{"choices":[{"delta":{"content":"b"},"finish_reason":null,"token_ids":[]}]}']:
        _same_as_parse_chunk(dec, later, 40)


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


def test_the_fast_path_never_drops_logprobs_or_tool_calls():
    """A stream whose every chunk carries the same logprobs or tool-call delta around the content must not learn a
    template that returns the content alone: the probe parse proves the hole is the only field."""
    for extra in ({"logprobs": {"content": [{"token": "x", "logprob": -1.0, "bytes": None, "top_logprobs": []}]}},):
        dec = ChunkDecoder()
        chunks = [dec.decode(_choice({"content": f"w{i}"}, **extra)) for i in range(6)]
        assert all(c.logprobs is not None for c in chunks) and not dec.has_template
    dec = ChunkDecoder()
    calls = [dec.decode(_choice({"content": f"w{i}", "tool_calls": [{"index": 0, "function": {"arguments": "1"}}]}))
             for i in range(6)]
    assert all(c.tool_calls for c in calls) and not dec.has_template
