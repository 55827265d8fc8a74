"""What shape a request binds its answer to: a JSON object, an instance of a JSON schema, or a call of given tools.

A client asks for it with ``response_format`` (``json_object``, ``json_schema``) or a forced tool call
(``tool_choice`` ``required`` or a named function): OpenAI and vLLM then guarantee the shape by decoding under a
grammar that allows only such text. The subnet writes that grammar one way for every runtime and for the audit, as it
does its sampler: the miner decodes under it, the reference forces the miner's tokens under the same mask, so a
constrained answer is checked like any other. This module only names the shape (no model code: the gateway has none);
:mod:`neurons.model.grammar` turns it into llama.cpp's grammar.

A forced tool call takes precedence over ``response_format`` (the answer is a call); with tools offered but not
forced, ``response_format`` constrains the answer and no tool can be called. A forced call is one call unless the
client asks for ``parallel_tool_calls: true`` (OpenAI's default is true, but a model allowed to go on after its call
repeats it until ``max_tokens``: Gemma 3 270M did, greedy and sampled, and a cut call reaches the client as text).

Example::

    structure_of({"response_format": {"type": "json_object"}})          # Structure(kind="json_object")
    structure_of({"tools": [...], "tool_choice": "required"}).functions  # (("f", {...parameters}), ...)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .json_schema import Budget, check_schema

JSON_OBJECT, JSON_SCHEMA, TOOL_CALL = "json_object", "json_schema", "tool_call"
KINDS = (JSON_OBJECT, JSON_SCHEMA, TOOL_CALL)


@dataclass(frozen=True, slots=True)
class Structure:
    """The shape an answer is decoded under. ``schema``: the JSON schema (``json_schema``), or the functions that may
    be called as a JSON list of ``{"name", "parameters"}`` (``tool_call``), key order kept (it orders the grammar's
    properties); empty for ``json_object``. ``parallel``: a tool call may be several calls."""

    kind: str
    schema: str = ""
    parallel: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structure kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def functions(self) -> list[tuple[str, dict[str, Any]]]:
        """``tool_call``: the (name, parameters schema) of each function the answer may call."""
        return [(f["name"], f.get("parameters") or {"type": "object"}) for f in json.loads(self.schema or "[]")]

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "schema": self.schema, "parallel": self.parallel}

    @classmethod
    def from_json(cls, obj: Any) -> Structure:
        """Read from :meth:`to_json`'s form; a ``ValueError`` names what is wrong."""
        if not isinstance(obj, dict) or not isinstance(obj.get("schema", ""), str) \
                or not isinstance(obj.get("parallel", True), bool):
            raise ValueError("structure must be {'kind': str, 'schema': str, 'parallel': bool}")
        return cls(kind=str(obj.get("kind")), schema=obj.get("schema", ""), parallel=obj.get("parallel", True))


def structure_of(payload: dict[str, Any]) -> Structure | None:
    """The shape a (validated) chat body binds its answer to, or None for free text."""
    tools, choice = payload.get("tools"), payload.get("tool_choice")
    if tools and (choice == "required" or isinstance(choice, dict)):
        named = choice["function"]["name"] if isinstance(choice, dict) else None
        functions = [{"name": t["function"]["name"], "parameters": t["function"].get("parameters") or
                      {"type": "object"}} for t in tools if named is None or t["function"]["name"] == named]
        parallel = named is None and payload.get("parallel_tool_calls") is True
        return Structure(TOOL_CALL, _dumps(functions), parallel=parallel)
    rf = payload.get("response_format")
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == JSON_OBJECT:
        return Structure(JSON_OBJECT)
    if kind == JSON_SCHEMA and isinstance(rf, dict):
        spec = rf.get("json_schema")
        return Structure(JSON_SCHEMA, _dumps((spec.get("schema") if isinstance(spec, dict) else None) or {}))
    return None


def check_structure(structure: Structure, tool_param: Callable[[str], str] | None = None) -> None:
    """Refuse (:class:`~gateway.protocol.json_schema.SchemaError`, naming the field) a structure whose schemas are
    outside the subnet's subset or its bounds, together: they make one grammar. Only what becomes a grammar is
    checked, so a tool offered but not forced is only prompt text and keeps any schema. ``tool_param``: the path of
    a function's ``parameters`` in the request, by the function's name."""
    budget = Budget()
    if structure.kind == JSON_SCHEMA:
        try:
            schema = json.loads(structure.schema or "{}")
        except ValueError:
            schema = None
        check_schema(schema, "response_format.json_schema.schema", budget)
    elif structure.kind == TOOL_CALL:
        for name, params in structure.functions:
            check_schema(params, tool_param(name) if tool_param else f"tools[{name}].function.parameters", budget)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
