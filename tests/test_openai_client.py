"""The official ``openai`` client, unmodified, against the gateway (sync in a thread, and async)."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from tests.conftest import API_KEY
from tests.fakes import MODEL, Script

MESSAGES: Any = [{"role": "user", "content": "hello"}]  # the client's TypedDicts, written as a user would


def base_url(h) -> str:
    return f"{h.base_url}/v1"


async def test_async_client_non_streaming_and_streaming(make_miner, make_gateway):
    m = await make_miner(Script("ok", tokens=5))
    h = await make_gateway([m])
    async with openai.AsyncOpenAI(base_url=base_url(h), api_key=API_KEY, max_retries=0, timeout=20) as client:
        models = await client.models.list()
        assert [x.id for x in models.data] == [MODEL]

        done = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
        assert done.object == "chat.completion"
        assert done.choices[0].message.role == "assistant"
        assert done.choices[0].message.content == "".join(m.token(i) for i in range(5))
        assert done.choices[0].finish_reason == "length"
        assert done.usage is not None and done.usage.completion_tokens == 5

        stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, stream=True,
                                                      stream_options={"include_usage": True})
        pieces, usage, finish = [], None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                if c.delta.content:
                    pieces.append(c.delta.content)
                if c.finish_reason:
                    finish = c.finish_reason
        assert pieces == [m.token(i) for i in range(5)]
        assert finish == "length" and usage is not None and usage.completion_tokens == 5

        raw = await client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert raw.headers["X-Tensorgate-Miner-Uid"] == "1"
    assert h.router.total_in_flight() == 0


async def test_sync_client_in_a_thread(make_miner, make_gateway):
    m = await make_miner(Script("ok", tokens=4))
    h = await make_gateway([m])

    def use_sync_client() -> tuple[str | None, list[str]]:
        with openai.OpenAI(base_url=base_url(h), api_key=API_KEY, max_retries=0, timeout=20) as client:
            done = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
            pieces = []
            for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, stream=True):
                pieces += [c.delta.content for c in chunk.choices if c.delta.content]
            return done.choices[0].message.content, pieces

    text, pieces = await asyncio.wait_for(asyncio.to_thread(use_sync_client), timeout=60)
    assert text == "".join(m.token(i) for i in range(4))
    assert pieces == [m.token(i) for i in range(4)]
    assert m.requests == 2


async def test_errors_map_to_the_clients_exception_types(make_miner, make_gateway):
    busy = await make_miner(Script("busy"), tag="busy-")
    h = await make_gateway([busy])
    async with openai.AsyncOpenAI(base_url=base_url(h), api_key=API_KEY, max_retries=0, timeout=20) as client:
        with pytest.raises(openai.NotFoundError) as nf:
            await client.chat.completions.create(model="nope", messages=MESSAGES)
        assert nf.value.code == "model_not_found" and nf.value.param == "model"
        with pytest.raises(openai.BadRequestError) as br:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=9)
        assert br.value.param == "temperature"
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(model=MODEL, messages=MESSAGES)
    async with openai.AsyncOpenAI(base_url=base_url(h), api_key="wrong", max_retries=0, timeout=20) as bad:
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(model=MODEL, messages=MESSAGES)


async def test_mid_stream_failure_raises_in_the_client(make_miner, make_gateway):
    drop = await make_miner(Script("drop_after", tokens=8, after=2))
    h = await make_gateway([drop])
    async with openai.AsyncOpenAI(base_url=base_url(h), api_key=API_KEY, max_retries=0, timeout=20) as client:
        stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, stream=True)
        pieces = []
        with pytest.raises(openai.APIError) as e:
            async for chunk in stream:
                pieces += [c.delta.content for c in chunk.choices if c.delta.content]
        assert "mid-answer" in e.value.message
    assert pieces == [drop.token(0), drop.token(1)]


async def test_async_client_against_real_simulated_miners(make_sim_miner, make_gateway):
    sims = [await make_sim_miner("rtx5090:time_scale=20,stop_rate=0", slots=2) for _ in range(2)]
    h = await make_gateway(sims)
    async with openai.AsyncOpenAI(base_url=base_url(h), api_key=API_KEY, max_retries=0, timeout=30) as client:

        async def one(i: int) -> int:
            if i % 2:
                r = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12)
                assert r.choices[0].message.content
                return r.usage.completion_tokens if r.usage else -1
            n = 0
            stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, stream=True)
            async for chunk in stream:
                n += sum(1 for c in chunk.choices if c.delta.content)
            return n

        counts = await asyncio.gather(*(one(i) for i in range(4)))  # 4 requests, 4 slots
    assert counts == [12, 12, 12, 12]
    # a request may race a slot that its predecessor's handler has not freed yet: a retried 429 is fine
    assert sum(x.ok for x in h.measurements()) == 4
    assert all(x.ok or x.failure == "busy" for x in h.measurements())


async def test_every_field_is_passed_or_refused_by_name_and_models_can_be_retrieved(make_miner, make_gateway):
    """Issue 27: nothing a client sends is dropped silently (``logit_bias`` and ``top_k`` were, with a 200); a
    field at its default or null is fine; ``user`` is the gateway's and never reaches a miner; models.retrieve."""
    m = await make_miner(Script("ok", tokens=2))
    m.keep_bodies = True
    h = await make_gateway([m])
    async with openai.AsyncOpenAI(base_url=base_url(h), api_key=API_KEY, max_retries=0, timeout=20) as client:
        for kwargs, param in (({"logit_bias": {"5": 10}}, "logit_bias"), ({"extra_body": {"top_k": 5}}, "top_k"),
                              ({"extra_body": {"min_p": 0.1}}, "min_p"),
                              ({"extra_body": {"repetition_penalty": 1.1}}, "repetition_penalty")):
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **kwargs)
            assert e.value.body["param"] == param and e.value.body["code"] == "unsupported_parameter", e.value.body
        done = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, n=1,
                                                    logprobs=False, user="end-user-7",
                                                    extra_body={"top_k": None})
        assert done.choices[0].message.content
        assert m.bodies and "user" not in m.bodies[-1] and "top_k" not in m.bodies[-1]
        assert (await client.models.retrieve(MODEL)).id == MODEL
        with pytest.raises(openai.NotFoundError) as nf:
            await client.models.retrieve("org/no-such-model")
        assert nf.value.body["code"] == "model_not_found"
