"""The request features a simulated runtime serves beyond plain chat, as a real runtime's server writes them.

The simulated card (and the tests' scripted miner) stands for a vLLM or SGLang server: given ``tools`` it may
answer with a tool call (streamed as OpenAI's ``delta.tool_calls``: the id, type and name first, then the
arguments in pieces, finish ``tool_calls``), given ``response_format`` JSON it answers a JSON object, given
``logprobs`` it names each token's log-probability. What the text says is the toy model's; the shapes are the
real ones, which is what the gateway relays, assembles and meters.

Example::

    name = tool_to_call(payload)          # the function to call, or None: answer in text
    frames = call_frames(out, [(name, '{"query": "hi"}')], None, "call_", pieces_per_call=4)
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from gateway.protocol.json_schema import SchemaError
from gateway.protocol.openai import LOGPROBS, RESPONSE_FORMAT, TOOLS
from gateway.protocol.sampling import log_softmax
from gateway.protocol.sse import ChunkFramer, frame
from gateway.protocol.structure import check_structure, structure_of
from gateway.protocol.tools import OPEN, could_be_call, parse_tool_calls
from neurons.model.toy import MODEL

SIMULATED_FEATURES = frozenset({TOOLS, RESPONSE_FORMAT, LOGPROBS})


def schema_problem(payload: dict[str, Any]) -> str | None:
    """Why the request's schemas are outside the subnet's subset or bounds (what a real runtime would not compile),
    or None: the simulated card refuses what the gateway refuses, so no schema makes it build an instance without
    bound (a ``minLength`` of 10^12 did)."""
    structure = structure_of(payload)
    try:
        if structure is not None:
            check_structure(structure)
    except SchemaError as e:
        return str(e)
    return None


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


def as_json(text: str, payload: dict[str, Any] | None = None) -> str:
    """The answer ``text`` as the JSON a grammar-constrained model writes: an instance of the request's schema when
    it gives one (:func:`instance_of`), else an object holding the text."""
    rf = (payload or {}).get("response_format")
    spec = rf.get("json_schema") if isinstance(rf, dict) and rf.get("type") == "json_schema" else None
    if isinstance(spec, dict) and isinstance(spec.get("schema"), dict) and spec["schema"]:
        return json.dumps(instance_of(spec["schema"], text.strip()))
    return json.dumps({"answer": text.strip()})


def call_arguments(payload: dict[str, Any], name: str, text: str) -> str:
    """A call's arguments as a grammar-constrained model writes them: an instance of the function's parameters
    schema, with ``text`` in its strings (``{"query": text}`` for a function that declares none)."""
    params = next((t["function"].get("parameters") for t in payload.get("tools") or ()
                   if t["function"]["name"] == name), None)
    if not isinstance(params, dict) or not params.get("properties"):
        return json.dumps({"query": text.strip()})
    return json.dumps(instance_of(params, text.strip()))


_FORMATS = {"date-time": "2026-01-01T00:00:00Z", "date": "2026-01-01", "time": "00:00:00Z",
            "email": "user@example.com", "uri": "https://example.com", "uuid": "00000000-0000-4000-8000-000000000000"}


def instance_of(schema: Any, text: str, defs: dict[str, Any] | None = None, depth: int = 0,
                room: list[int] | None = None) -> Any:
    """A valid instance of the JSON ``schema`` (the subset clients send: types, properties, items, enum, const,
    anyOf/oneOf/allOf, local ``$ref``s, string formats and lengths, number bounds) with ``text`` in its strings: what
    the simulated card answers where a real runtime decodes under the schema's grammar. Optional properties and
    items past ``minItems`` are written while ``room`` (values, shared by the whole instance) lasts: through
    ``$ref``s an instance of every property can outgrow any answer, the shortest one is bounded by the gateway
    (:mod:`gateway.protocol.json_schema`)."""
    room = [256] if room is None else room
    room[0] -= 1
    if not isinstance(schema, dict) or depth > 16:
        return None
    defs = {**(defs or {}), **schema.get("$defs", {}), **schema.get("definitions", {})}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        return instance_of(defs.get(ref.rsplit("/", 1)[-1]), text, defs, depth + 1, room)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            options = [s for s in schema[key] if not (isinstance(s, dict) and s.get("type") == "null")] or schema[key]
            return instance_of(options[0], text, defs, depth + 1, room)
    kind = schema.get("type", "object" if "properties" in schema else "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        required = schema.get("required") or ()
        return {k: instance_of(v, text, defs, depth + 1, room) for k, v in (schema.get("properties") or {}).items()
                if k in required or room[0] > 0}
    if kind == "array":
        least = int(schema.get("minItems", 0))
        return [instance_of(schema.get("items", {}), text, defs, depth + 1, room)
                for _ in range(max(1, least) if room[0] > 0 else least)]
    if kind in ("integer", "number"):
        bounds = (schema.get("minimum"), schema.get("exclusiveMinimum"))
        low = next((v for v in bounds if isinstance(v, int | float)), 0)
        value = max(1, int(low) + 1) if kind == "integer" else float(low) + 0.5
        high = schema.get("maximum")
        return value if not isinstance(high, int | float) or value <= high else high
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    s = _FORMATS.get(str(schema.get("format")), text or "text")
    s = s[:int(schema.get("maxLength", len(s)))]
    return s + "x" * max(0, int(schema.get("minLength", 0)) - len(s))


def pieces(text: str, n: int) -> list[str]:
    """``text`` cut into at most ``n`` pieces, as tokens stream it."""
    n = max(1, min(n, len(text)))
    return [text[len(text) * i // n: len(text) * (i + 1) // n] for i in range(n)]


def logprobs_of(text: str, logprob: float) -> dict[str, Any]:
    """``choice.logprobs`` for one token of text no model wrote (the scripted miner's), itself its one alternative."""
    entry = {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [{**entry, "top_logprobs": [entry]}]}


def toy_logprobs(row: npt.NDArray[np.float32], token: int, top: int) -> dict[str, Any]:
    """``choice.logprobs`` for ``token`` drawn from the toy model's ``row`` of logits: its raw log-probability and the
    ``top`` most likely tokens', best first, as a real runtime reports them."""
    logp = log_softmax(row.astype(np.float64)[None, :])[0]
    best = np.argsort(-logp, kind="stable")[:top]

    def entry(t: int) -> dict[str, Any]:
        piece = MODEL.piece(t)
        return {"token": piece.decode(errors="replace"), "logprob": float(logp[t]), "bytes": list(piece)}

    return {"content": [{**entry(token), "top_logprobs": [entry(int(t)) for t in best]}]}


def call_frames(out: ChunkFramer, calls: list[tuple[str, str]], ids: list[int] | None, id_prefix: str, *,
                pieces_per_call: int = 1) -> list[bytes]:
    """Tool calls as a runtime's parser streams them: each call's id, type and name, then its arguments in
    ``pieces_per_call`` pieces. ``ids``: every token id the model wrote for them, in order, spread so that each
    delta names some (a delta with text and no ids would make the whole answer count by characters): one each,
    the rest on the last.
    """
    deltas: list[dict[str, Any]] = []
    for i, (name, arguments) in enumerate(calls):
        deltas.append({"index": i, "id": f"{id_prefix}{i}", "type": "function",
                       "function": {"name": name, "arguments": ""}})
        deltas += [{"index": i, "function": {"arguments": piece}} for piece in pieces(arguments, pieces_per_call)]
    frames = []
    for k, delta in enumerate(deltas):
        share = (ids[k:k + 1] if k < len(deltas) - 1 else ids[k:]) if ids else None
        frames.append(frame(out.chunk({"tool_calls": [delta]}, None, token_ids=share or None)))
    return frames


class CallGate:
    """Holds back the start of an answer that may be a tool call, as a runtime's tool parser does.

    Text flows through untouched once it cannot be a call; an answer that opens with ``<tool_call>`` is held whole
    and, at the end, sent as the calls it parses to (or as text, when it does not parse).
    """

    def __init__(self) -> None:
        self.held: list[tuple[str, list[int]]] = []
        self.decided: bool | None = None  # None: not known yet; True: a call (held to the end); False: text

    def feed(self, pieces: list[tuple[str, list[int]]]) -> list[tuple[str, list[int]]]:
        """Pieces (text, ids) of the answer so far; returns those that may be sent as text now."""
        if self.decided is False:
            return pieces
        self.held += pieces
        if self.decided is None:
            text = "".join(t for t, _ in self.held)
            if text.lstrip().startswith(OPEN):
                self.decided = True
            elif not could_be_call(text):
                self.decided = False
                ready, self.held = self.held, []
                return ready
        return []

    def finish(self) -> tuple[list[tuple[str, list[int]]], list[tuple[str, str]] | None]:
        """At the end: the pieces held, and the calls they make (None: send them as text)."""
        held, self.held = self.held, []
        return held, parse_tool_calls("".join(t for t, _ in held)) if self.decided else None

    def close(self, out: ChunkFramer, framed: Callable[[list[tuple[str, list[int]]]], list[bytes]],
              want_ids: bool) -> tuple[list[bytes], bool]:
        """At the end: the frames for what was held, the calls as tool-call deltas (every token id kept when
        ``want_ids``) or else the text through ``framed``, and whether the answer was a call (finish
        ``tool_calls``). The one ending of a gated answer, for the llama.cpp runtime and the proxy alike."""
        held, calls = self.finish()
        if not calls:
            return framed(held), False
        ids = [i for _, piece_ids in held for i in piece_ids] if want_ids else None
        return call_frames(out, calls, ids, "call_" + secrets.token_hex(6)), True
