"""What shape a request binds its answer to (gateway.protocol.structure), carried to the audit; and the simulated
card's answers as valid instances of the asked schema (no model here: the grammar itself is tested on the real model
in tests/test_structured_output.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel

from gateway.protocol.measurement import Answer
from gateway.protocol.sampling import SamplingParams
from gateway.protocol.structure import Structure, structure_of
from neurons.miner.runtimes.features import as_json, call_arguments, instance_of
from neurons.reference.protocol import BadAuditRequest, decode_request, encode_request
from scoring.audit import AuditBands

TOOLS: Any = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}}}}, {"type": "function", "function": {"name": "g"}}]
MSGS = [{"role": "user", "content": "hi"}]


def test_the_shape_a_request_asks_for() -> None:
    assert structure_of({"messages": MSGS}) is None
    assert structure_of({"messages": MSGS, "tools": TOOLS}) is None  # a call is the model's choice: free text
    assert structure_of({"messages": MSGS, "tools": TOOLS, "tool_choice": "none"}) is None
    assert structure_of({"response_format": {"type": "text"}}) is None
    assert structure_of({"response_format": {"type": "json_object"}}) == Structure("json_object")
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    got = structure_of({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
    assert got is not None and got.kind == "json_schema" and json.loads(got.schema) == schema
    assert list(json.loads(got.schema)["properties"]) == ["b", "a"]  # the order the grammar writes them in
    required = structure_of({"tools": TOOLS, "tool_choice": "required"})
    assert required is not None and required.kind == "tool_call" and not required.parallel
    assert required.functions == [("f", TOOLS[0]["function"]["parameters"]), ("g", {"type": "object"})]
    assert structure_of({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": True}).parallel  # type: ignore[union-attr]
    named = structure_of({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}},
                          "parallel_tool_calls": True, "response_format": {"type": "json_object"}})
    assert named is not None and named.functions == [("g", {"type": "object"})] and not named.parallel  # one call
    with pytest.raises(ValueError):
        Structure("yaml")


def test_the_shape_travels_to_a_remote_reference_and_a_bad_one_is_a_named_400() -> None:
    shaped = Answer(messages=MSGS, sampling=SamplingParams(temperature=0.0), max_tokens=8, stop=(), text="{}",
                    token_ids=(1, 2), finish_reason="stop", structure=structure_of({"tools": TOOLS,
                                                                                    "tool_choice": "required"}))
    assert decode_request(json.loads(encode_request(shaped, AuditBands())))[0] == shaped
    raw: dict[str, Any] = json.loads(encode_request(shaped, AuditBands()))
    for bad in ({"kind": "yaml"}, {"kind": "json_object", "schema": 3}, "json"):
        raw["answer"]["structure"] = bad
        with pytest.raises(BadAuditRequest, match="answer.structure"):
            decode_request(raw)


class Address(BaseModel):
    street: str
    number: int


class Person(BaseModel):
    name: str
    age: int
    tags: list[str]
    address: Address
    nickname: str | None = None
    score: float


def test_the_simulated_card_answers_an_instance_of_the_asked_schema() -> None:
    """What pydantic (the SDK's ``.parse()``, instructor, LangChain) validates: nested models through ``$defs``,
    optionals, lists, numbers; and bounds and formats a schema can add."""
    payload = {"response_format": {"type": "json_schema", "json_schema": {"name": "p",
                                                                           "schema": Person.model_json_schema()}}}
    person = Person.model_validate_json(as_json("Ada", payload))
    assert person.name == "Ada" and person.address.street == "Ada" and person.tags == ["Ada"]
    bounded = {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 10, "maximum": 12}, "s": {"type": "string", "minLength": 5, "maxLength": 6},
        "e": {"enum": ["a", "b"]}, "c": {"const": 3}, "when": {"type": "string", "format": "date-time"},
        "maybe": {"type": ["null", "boolean"]}}}
    got = instance_of(bounded, "hi")
    assert got == {"n": 11, "s": "hixxx", "e": "a", "c": 3, "when": "2026-01-01T00:00:00Z", "maybe": True}
    assert json.loads(as_json("plain", {"response_format": {"type": "json_object"}})) == {"answer": "plain"}
    assert json.loads(call_arguments({"tools": TOOLS}, "f", "q")) == {"x": 1}
    assert json.loads(call_arguments({"tools": TOOLS}, "g", "q")) == {"query": "q"}  # no parameters declared
