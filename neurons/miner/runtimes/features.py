"""The request features a simulated runtime serves beyond plain chat, as a real runtime's server writes them.

The simulated card (and the tests' scripted miner) stands for a vLLM or SGLang server: given ``tools`` it may
answer with a tool call (streamed as OpenAI's ``delta.tool_calls``: the id, type and name first, then the
arguments in pieces, finish ``tool_calls``), given ``response_format`` JSON it answers a JSON object, given
``logprobs`` it names each token's log-probability. What the text says is the toy model's; the shapes are the
real ones, which is what the gateway relays, assembles and meters.

Example::

    name = tool_to_call(payload)          # the function to call, or None: answer in text
    frames = tool_call_frames(out, "call_1", name, '{"query": "hi"}')
"""

from __future__ import annotations

import json
from typing import Any

from gateway.protocol.openai import LOGPROBS, RESPONSE_FORMAT, TOOLS
from gateway.protocol.sse import ChunkFramer, frame

SIMULATED_FEATURES = frozenset({TOOLS, RESPONSE_FORMAT, LOGPROBS})


def tool_to_call(payload: dict[str, Any]) -> str | None:
    """The function a model would call here: the one ``tool_choice`` names, else the first tool when the choice is
    ``required`` or ``auto`` and the last message is the user's (after a tool's result it answers in text)."""
    tools = payload.get("tools")
    if not isinstance(tools, list) or not tools:
        return None
    choice = payload.get("tool_choice", "auto")
    if isinstance(choice, dict):
        return str(choice["function"]["name"])
    messages = payload.get("messages") or [{}]
    if choice == "none" or (choice == "auto" and messages[-1].get("role") != "user"):
        return None
    return str(tools[0]["function"]["name"])


def wants_json(payload: dict[str, Any]) -> bool:
    rf = payload.get("response_format")
    return isinstance(rf, dict) and rf.get("type") in ("json_object", "json_schema")


def as_json(text: str) -> str:
    """The answer ``text`` as the JSON object a grammar-constrained model writes."""
    return json.dumps({"answer": text.strip()})


def pieces(text: str, n: int) -> list[str]:
    """``text`` cut into at most ``n`` pieces, as tokens stream it."""
    n = max(1, min(n, len(text)))
    return [text[len(text) * i // n: len(text) * (i + 1) // n] for i in range(n)]


def tool_call_frames(out: ChunkFramer, call_id: str, name: str, arguments: str, tokens: int) -> list[bytes]:
    """A tool call as a runtime streams it: one delta naming it, then its arguments in ``tokens`` pieces."""
    frames = [frame(out.chunk({"tool_calls": [{"index": 0, "id": call_id, "type": "function",
                                               "function": {"name": name, "arguments": ""}}]}, None))]
    frames += [frame(out.chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}, None))
               for piece in pieces(arguments, max(1, tokens - 1))]
    return frames


def logprobs_of(text: str, logprob: float) -> dict[str, Any]:
    """``choice.logprobs`` for one token (with itself as its one alternative)."""
    entry = {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [{**entry, "top_logprobs": [entry]}]}
