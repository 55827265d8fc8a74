"""The subnet's tool format (``tensorgate-tools/1``): how tools enter the prompt and how a tool call is written.

An audit forces the miner's tokens on the prompt the miner conditioned on, so tool definitions and tool history
must render into the prompt the same way on the miner's runtime and on the validator's reference, and a tool call
must be text the model wrote, from which the runtime's parser took the call. Like the sampler, the format is the
subnet's, so any runtime can follow it: Hermes' (vLLM's ``--tool-call-parser hermes`` reads it), with the
definitions in a system message:

* the tools become a system message before the conversation (after the client's own system messages);
* an assistant message's earlier tool calls are its text, one ``<tool_call>`` block each;
* a ``tool`` message is a user turn holding ``<tool_response>`` and the result.

A tool call is an answer made of ``<tool_call>`` blocks only (whitespace between them), each holding
``{"name": ..., "arguments": {...}}``; anything else is a text answer. The audit checks that the answer's token ids
spell blocks that parse to exactly the calls the client received (:func:`same_calls`), then forces those ids.

Example::

    msgs = tool_messages(messages, tools)        # what the chat template renders, on miner and reference alike
    parse_tool_calls('<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>')
    # [("f", '{"x": 1}')]
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from .tokens import message_text
from .untrusted import loads as untrusted_json

TOOL_FORMAT = "tensorgate-tools/1"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PREAMBLE = ("You may call the functions below. To call one, answer with nothing but one block per call:\n"
             f"{OPEN}\n{{\"name\": <function name>, \"arguments\": <arguments object>}}\n{CLOSE}\n"
             "Functions:")

Call = tuple[str, str]  # (name, arguments as JSON text)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it; arguments that are not a JSON object stay as the string they were."""
    try:
        args: Any = untrusted_json(arguments)
    except ValueError:
        args = arguments
    return f"{OPEN}\n{_dumps({'name': name, 'arguments': args})}\n{CLOSE}"


def tool_messages(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``messages`` with the tools and the tool history written out as plain turns (the chat template's input)."""
    out: list[dict[str, Any]] = []
    lead = 0
    while lead < len(messages) and messages[lead].get("role") in ("system", "developer"):
        out.append(dict(messages[lead]))
        lead += 1
    if tools:
        lines = [_PREAMBLE, *(_dumps(t.get("function", t)) for t in tools)]
        out.append({"role": "system", "content": "\n".join(lines)})
    for m in messages[lead:]:
        role = m.get("role")
        if role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{message_text(m)}\n</tool_response>"})
        elif role == "assistant" and m.get("tool_calls"):
            blocks = [call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            text = message_text(m)
            out.append({"role": "assistant", "content": "\n".join([text, *blocks] if text else blocks)})
        else:
            out.append(dict(m))
    return out


def prompt_messages(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The turns a chat body's prompt is rendered from: its messages, with tools and tool history written out when
    it has any. The one rule, for the runtime that answers and the reference that audits."""
    messages = payload.get("messages") or []
    return tool_messages(messages, payload.get("tools")) if uses_tools(payload) else list(messages)


def uses_tools(payload: dict[str, Any]) -> bool:
    """Whether a chat body has tools or tool history: its prompt is :func:`tool_messages`'."""
    return bool(payload.get("tools")) or any(
        isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool") for m in payload.get("messages", ()))


def could_be_call(text: str) -> bool:
    """Whether an answer that begins with ``text`` may still turn out to be a tool call (hold it back)."""
    head = text.lstrip()
    return head.startswith(OPEN) or OPEN.startswith(head)


def parse_tool_calls(text: str) -> list[Call] | None:
    """The calls an answer's text makes, or None when it is a text answer (or not a well-formed call)."""
    if not text.lstrip().startswith(OPEN):
        return None
    calls: list[Call] = []
    end = 0
    for m in _BLOCK.finditer(text):
        if text[end:m.start()].strip():
            return None
        end = m.end()
        try:
            obj = untrusted_json(m.group(1))
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(
                obj.get("arguments"), dict | str):
            return None
        args = obj["arguments"]
        calls.append((obj["name"], args if isinstance(args, str) else _dumps(args)))
    if not calls or text[end:].strip():
        return None
    return calls


def same_calls(a: Sequence[Call], b: Sequence[Call]) -> bool:
    """The same calls: names equal, arguments equal as JSON (a runtime may re-serialise them)."""
    def norm(args: str) -> Any:
        try:
            return untrusted_json(args)
        except ValueError:
            return args
    return len(a) == len(b) and all(x[0] == y[0] and norm(x[1]) == norm(y[1]) for x, y in zip(a, b, strict=True))
