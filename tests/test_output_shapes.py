"""What shape a request binds its answer to (gateway.protocol.structure), carried to the audit; and the simulated
card's answers as valid instances of the asked schema (no model here: the grammar itself is tested on the real model
in tests/test_structured_output.py)."""

from __future__ import annotations

import dataclasses
import json
import random
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
    scored = dataclasses.replace(shaped, logprobs=(-0.5, -1.25))
    assert decode_request(json.loads(encode_request(scored, AuditBands())))[0] == scored
    lied: dict[str, Any] = json.loads(encode_request(scored, AuditBands()))
    lied["answer"]["logprobs"] = [-0.5, "x"]
    with pytest.raises(BadAuditRequest, match="answer.logprobs"):
        decode_request(lied)
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


async def test_a_shaped_answer_is_audited_only_from_a_miner_that_decodes_under_the_subnets_grammar(make_miner) -> None:
    """vLLM's grammar (xgrammar) allows whitespace llama.cpp's does not: forced under the subnet's grammar, an honest
    vLLM miner's JSON would fail. So a shaped answer is kept for an audit only from a miner that declared
    ``subnet_grammar``; any other's is skipped by its rule (unpaid, never blamed)."""
    from bittensor.sp_core import Keypair

    from gateway.http.client import MinerClient
    from gateway.protocol.measurement import MeasurementQueue
    from gateway.protocol.openai import GRAMMAR, RESPONSE_FORMAT
    from gateway.protocol.signing import RequestSigner
    from gateway.router import Candidate, Router
    from gateway.upstream import Upstream, UpstreamLimits

    miner = await make_miner()
    router = Router(rng=random.Random(0))
    router.sync([Candidate(uid=1, hotkey=miner.hotkey, endpoint=miner.endpoint)])
    shaped = {"model": "m", "messages": MSGS, "max_tokens": 4, "temperature": 0,
              "response_format": {"type": "json_object"}}
    skipped = []
    async with MinerClient() as client:
        up = Upstream(client, RequestSigner(Keypair.create_from_uri("//Alice")), MeasurementQueue(),
                      limits=UpstreamLimits(keep_answers=True, audit_tools=True, audit_grammars=True))
        for features in (frozenset({RESPONSE_FORMAT}), frozenset({RESPONSE_FORMAT, GRAMMAR})):
            state = router.get(1)
            assert state is not None
            router.learn_offer(state, frozenset(), features)
            lease = router.acquire()
            assert lease is not None
            try:
                m = await up.probe(lease, shaped)
            finally:
                router.release(lease)
            assert m.ok
            skipped.append(m.skipped)
    assert skipped == ["response_format", None]
