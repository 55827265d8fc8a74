"""The shipped chat template (the packaged GGUF has none): what miner and reference both render."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from neurons.model.chat_template import render


def test_user_turn_opens_the_model_turn() -> None:
    assert render([{"role": "user", "content": "Hi"}]) == "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_system_folds_into_the_first_user_turn_and_roles_map() -> None:
    text = render([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "TCP?"}]},
        {"role": "assistant", "content": "  A protocol.  "},
        {"role": "developer", "content": "Late instructions."},
        {"role": "user", "content": "More?"},
    ])
    assert text == ("<start_of_turn>user\nBe brief.\n\nWhat is TCP?<end_of_turn>\n"
                    "<start_of_turn>model\nA protocol.<end_of_turn>\n"
                    "<start_of_turn>user\nLate instructions.<end_of_turn>\n"
                    "<start_of_turn>user\nMore?<end_of_turn>\n"
                    "<start_of_turn>model\n")


def test_a_lone_system_message_becomes_the_user_turn() -> None:
    assert render([{"role": "system", "content": "Rules."}]).startswith("<start_of_turn>user\nRules.<end_of_turn>")


# -- the subnet's tool format (issue 27) --------------------------------------------------------


def test_tools_and_tool_history_render_as_plain_turns() -> None:
    from gateway.protocol.tools import prompt_messages

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    payload: dict[str, Any] = {"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "42"}], "tools": tools}
    turns = prompt_messages(payload)
    assert [t["role"] for t in turns] == ["system", "system", "user", "assistant", "user"]
    assert turns[1]["content"].endswith('{"name": "f", "parameters": {"type": "object"}}')
    assert turns[3]["content"] == '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    assert turns[4]["content"] == "<tool_response>\n42\n</tool_response>"
    assert prompt_messages({"messages": payload["messages"][:2]}) == payload["messages"][:2]  # no tools: as sent
    text = render(turns)
    assert text.count("<start_of_turn>user") == 2 and "Be brief." in text and "<tool_call>" in text


def test_a_tool_call_is_an_answer_made_of_call_blocks_only() -> None:
    from gateway.protocol.tools import call_text, parse_tool_calls, same_calls

    one = call_text("f", '{"x": 1}')
    assert parse_tool_calls(one) == [("f", '{"x": 1}')]
    assert parse_tool_calls(f"  {one}\n{call_text('g', '{}')}\n") == [("f", '{"x": 1}'), ("g", "{}")]
    for text in ("hello", f"Sure! {one}", f"{one} and more", "<tool_call>\n{not json}\n</tool_call>",
                 '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>', "<tool_call>\n", ""):
        assert parse_tool_calls(text) is None, text
    assert same_calls([("f", '{"x": 1}')], [("f", '{"x":1}')])  # re-serialised arguments are the same call
    assert not same_calls([("f", '{"x": 1}')], [("f", '{"x": 2}')]) and not same_calls([("f", "{}")], [])


def test_the_call_gate_holds_back_only_what_may_be_a_call() -> None:
    from neurons.miner.runtimes.features import CallGate

    gate = CallGate()
    assert gate.feed([("<tool", [1])]) == [] and gate.feed([("_call>\n", [2])]) == []  # a prefix, then a call
    gate.feed([('{"name": "f", "arguments": {}}\n</tool_call>', [3, 4])])
    held, calls = gate.finish()
    assert calls == [("f", "{}")] and [i for _, ids in held for i in ids] == [1, 2, 3, 4]
    text = CallGate()
    assert text.feed([(" <to", [1])]) == [] and text.feed([("day", [2])]) == [(" <to", [1]), ("day", [2])]
    assert text.feed([(" it", [3])]) == [(" it", [3])] and text.finish() == ([], None)
    broken = CallGate()
    broken.feed([("<tool_call> oops", [1])])
    assert broken.finish() == ([("<tool_call> oops", [1])], None)  # not a call after all: sent as text


# -- the Jinja twin a Jinja runtime (vLLM's --chat-template) renders (issue 37) ------------------------------------


@functools.cache
def _jinja() -> Any:
    """The shipped Jinja template compiled as transformers (and so vLLM) compiles chat templates: an immutable
    sandbox with trim_blocks and lstrip_blocks."""
    pytest.importorskip("jinja2")
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from neurons.model.chat_template import jinja_template

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    return env.from_string(jinja_template())


def _jinja_render(messages: list[dict[str, Any]]) -> str:
    """The Jinja render less its leading ``<bos>`` (which llama.cpp adds to render()'s text as a token)."""
    text = str(_jinja().render(messages=messages, add_generation_prompt=True, bos_token="<bos>"))
    assert text.startswith("<bos>")
    return text.removeprefix("<bos>")


def test_the_jinja_twin_renders_the_same_prompt_as_render_byte_for_byte() -> None:
    """Every role, system messages early and late, text parts, whitespace to trim, unicode, and 2,000 random
    conversations: the Jinja template and render() give the same bytes (one differing byte fails every audit)."""
    import random

    fixed: list[list[dict[str, Any]]] = [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Rules."}],
        [{"role": "system", "content": "A"}, {"role": "developer", "content": " B "}],
        [{"role": "system", "content": "A"}, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}],
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "TCP?"}]},
         {"role": "assistant", "content": "  A protocol.  "}, {"role": "developer", "content": "Late."},
         {"role": "tool", "content": "42"}, {"role": "user", "content": "More? \u00e9\u4e2d\U0001f600"}],
        [{"role": "user", "content": None}, {"role": "assistant", "content": [{"type": "image_url"}, "x", 5]}],
        [{"content": "no role"}, {"role": "user", "content": "{{ not a template }} {% raw %}"}],
    ]
    rng = random.Random(37)
    words = ["", " ", "\n", "hi", "  pad  ", "\t\u00e9", "<start_of_turn>", "{{x}}", "two\n\nlines", "\U0001f600"]
    roles = ["system", "developer", "user", "assistant", "tool", None, "other"]
    for _ in range(2000):
        conv: list[dict[str, Any]] = []
        for _ in range(rng.randint(0, 6)):
            role = rng.choice(roles)
            if rng.random() < 0.25:
                content: Any = [{"type": "text", "text": rng.choice(words)} for _ in range(rng.randint(0, 3))]
            else:
                content = "".join(rng.choice(words) for _ in range(rng.randint(0, 4)))
            conv.append({"content": content} if role is None else {"role": role, "content": content})
        fixed.append(conv)
    for conv in fixed:
        assert _jinja_render(conv) == render(conv), conv
