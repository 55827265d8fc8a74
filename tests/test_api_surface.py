"""Issue 27: the API clients use, through the official ``openai`` SDK and LangChain, against the local subnet.

One embedded local subnet (the validator, the SDK over the local chain, two simulated cards on loopback) serving
two models, one on each card, each declared in the miner's signed /health: model routing, an unknown model,
tool calls streamed and not, JSON mode, logprobs, ``n=2``, ``/v1/completions``, and a LangChain agent with one
tool plus ``with_structured_output``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from neurons.local_subnet import LocalSubnet
from neurons.validator.config import ValidatorConfig
from tests.subnets import running_subnet, sdk_client

FIRST, SECOND = "tensorgate/sim-5090", "org/second-model"
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}


@pytest.fixture
async def subnet(tmp_path: Path) -> AsyncIterator[LocalSubnet]:
    cfg = ValidatorConfig(local=True, state_dir=tmp_path, gateway_port=0, local_round_s=30.0, local_block_time=0.25,
                          local_miners=2, probes_per_round=0, capacity_check=False, models=[FIRST, SECOND], seed=5)
    async with running_subnet(cfg, seed=5) as net:
        yield net


async def test_models_route_to_the_miners_that_declare_them(subnet: LocalSubnet) -> None:
    async with sdk_client(subnet) as client:
        assert [m.id for m in (await client.models.list()).data] == [FIRST, SECOND]
        for model, uid in ((FIRST, "1"), (SECOND, "2"), (FIRST, "1"), (SECOND, "2")):
            raw = await client.chat.completions.with_raw_response.create(model=model, messages=ASK, max_tokens=4)
            assert raw.headers["X-Tensorgate-Miner-Uid"] == uid, model
            assert raw.parse().model == model
        with pytest.raises(openai.NotFoundError) as e:
            await client.chat.completions.create(model="org/unknown", messages=ASK, max_tokens=4)
        assert e.value.body["code"] == "model_not_found"  # type: ignore[index]
        # the second card's card has the features too, but a feature no miner declared is refused by name
        with pytest.raises(openai.BadRequestError) as bad:
            await client.chat.completions.create(model=FIRST, messages=ASK, max_tokens=4, logit_bias={"5": 1})
        assert bad.value.body["param"] == "logit_bias"  # type: ignore[index]


async def test_tool_calls_json_mode_logprobs_n_and_completions(subnet: LocalSubnet) -> None:
    async with sdk_client(subnet) as client:
        # tool call, whole: the message carries the call, finish_reason says so
        done = await client.chat.completions.create(model=FIRST, messages=ASK, tools=[WEATHER], max_tokens=16)
        call: Any = done.choices[0].message.tool_calls[0]  # type: ignore[index]
        assert done.choices[0].finish_reason == "tool_calls" and call.type == "function"
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["query"], str)
        assert call.id and done.choices[0].message.content is None
        # tool call, streamed: the id and name first, the arguments in pieces that join to JSON
        stream = await client.chat.completions.create(model=FIRST, messages=ASK, tools=[WEATHER], max_tokens=16,
                                                      stream=True, stream_options={"include_usage": True})
        names, args, finish, usage, pieces = [], "", None, None, 0
        async for chunk in stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                for d in c.delta.tool_calls or []:
                    pieces += 1
                    names += [d.function.name] if d.function and d.function.name else []
                    args += d.function.arguments or "" if d.function else ""
                finish = c.finish_reason or finish
        assert names == ["get_weather"] and pieces > 2 and finish == "tool_calls"
        assert json.loads(args)["query"] and usage is not None and usage.completion_tokens > 0
        # the agent's next turn: the tool's result, answered in text
        history: Any = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
        after = await client.chat.completions.create(model=FIRST, messages=history, tools=[WEATHER], max_tokens=8)
        assert after.choices[0].message.content and not after.choices[0].message.tool_calls

        # JSON mode and a JSON schema: the content parses
        formats: list[Any] = [{"type": "json_object"},
                   {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": {
                       "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}]
        for rf in formats:
            js = await client.chat.completions.create(model=FIRST, messages=ASK, max_tokens=12, response_format=rf)
            assert isinstance(json.loads(js.choices[0].message.content or ""), dict)

        # the SDK's .parse() with a pydantic model: the simulated card answers a valid instance of its schema
        class Weather(BaseModel):
            city: str
            celsius: float
            hours: list[int]

        parsed = await client.chat.completions.parse(model=FIRST, messages=ASK, max_tokens=12, response_format=Weather)
        assert isinstance(parsed.choices[0].message.parsed, Weather)

        # logprobs, whole and streamed: one entry a token, the alternatives asked for
        lp = await client.chat.completions.create(model=FIRST, messages=ASK, max_tokens=6, logprobs=True,
                                                  top_logprobs=1)
        entries = lp.choices[0].logprobs.content  # type: ignore[union-attr]
        assert entries and len(entries) == lp.usage.completion_tokens  # type: ignore[union-attr]
        assert "".join(e.token for e in entries) == lp.choices[0].message.content
        assert all(e.logprob <= 0 and e.top_logprobs for e in entries)
        seen = 0
        async for chunk in await client.chat.completions.create(model=FIRST, messages=ASK, max_tokens=6, stream=True,
                                                                 logprobs=True):
            seen += sum(len(c.logprobs.content or []) for c in chunk.choices if c.logprobs)
        assert seen == 6

        # n=2: two answers (two draws of one seeded request), whole and streamed, usage summed over both
        two = await client.chat.completions.create(model=FIRST, messages=ASK, max_tokens=5, n=2, temperature=1.0,
                                                   seed=11)
        assert [c.index for c in two.choices] == [0, 1] and all(c.message.content for c in two.choices)
        assert two.usage is not None and two.usage.completion_tokens == 10
        text: dict[int, str] = {0: "", 1: ""}
        usage = None
        async for chunk in await client.chat.completions.create(model=FIRST, messages=ASK, max_tokens=5, n=2,
                                                                 stream=True, stream_options={"include_usage": True}):
            usage = chunk.usage or usage
            for c in chunk.choices:
                text[c.index] += c.delta.content or ""
        assert text[0] and text[1] and usage is not None and usage.completion_tokens == 10

        # /v1/completions, whole and streamed
        comp = await client.completions.create(model=FIRST, prompt="Say hello", max_tokens=5)
        assert comp.object == "text_completion" and comp.choices[0].text and comp.usage.completion_tokens == 5  # type: ignore[union-attr]
        parts = [c.choices[0].text async for c in await client.completions.create(
            model=SECOND, prompt="Say hello", max_tokens=5, stream=True) if c.choices]
        assert "".join(parts) and all(isinstance(p, str) for p in parts)
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model=FIRST, prompt="x", max_tokens=5, echo=True)
        assert e.value.body["param"] == "echo"  # type: ignore[index]

    # the status page counts, per miner and rule, the answers no audit can check (not paid)
    miners = {m["uid"]: m for m in (await _status(subnet))["miners"]}
    assert miners[1]["unaudited"]["tools"] >= 3 and miners[1]["unaudited"]["response_format"] == 3
    assert miners[2]["unaudited"].get("model", 0) >= 1  # the second model has no reference
    assert miners[1]["models"] == [FIRST] and "tools" in miners[1]["features"]


async def _status(net: LocalSubnet) -> dict[str, Any]:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{net.validator.gateway.port}/v1/status",
                                                   headers={"Authorization": f"Bearer {net.api_key}"}) as r:
        assert r.status == 200
        body: dict[str, Any] = await r.json()
        return body


async def test_a_langchain_agent_with_one_tool_and_structured_output(subnet: LocalSubnet) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    @tool
    def get_weather(query: str) -> str:
        """The weather in a city."""
        return f"sunny in {query}"

    llm = ChatOpenAI(model=FIRST, base_url=f"http://127.0.0.1:{subnet.validator.gateway.port}/v1",
                     api_key=subnet.api_key, max_retries=0, timeout=30, max_completion_tokens=16)  # type: ignore[arg-type]
    agent = llm.bind_tools([get_weather])
    messages: list[Any] = [HumanMessage("What is the weather in Paris?")]
    reply = await agent.ainvoke(messages)
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"
    messages.append(reply)
    for call in reply.tool_calls:
        messages.append(ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]))
    final = await agent.ainvoke(messages)
    assert isinstance(final.content, str) and final.content and not final.tool_calls

    class Answer(BaseModel):
        answer: str

    structured = await llm.with_structured_output(Answer).ainvoke("Say hello")
    assert isinstance(structured, Answer) and structured.answer
