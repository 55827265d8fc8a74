"""The one prompt-size estimate shared by the gateway (expected prefill) and the simulated card (its prefill)."""

from __future__ import annotations

import random

from gateway.protocol.openai import SchemaLimits, parse_chat_request
from gateway.protocol.tokens import estimate_prompt_tokens
from neurons.miner.runtimes import sim
from neurons.miner.runtimes.sim import SimulatedRuntime


def test_four_characters_a_token_plus_the_template_per_message() -> None:
    assert estimate_prompt_tokens([{"role": "user", "content": "a" * 400}]) == 104
    assert estimate_prompt_tokens([{"role": "user", "content": "a" * 401}]) == 105  # a started token counts
    two = [{"role": "system", "content": "s" * 8}, {"role": "user", "content": ""}]
    assert estimate_prompt_tokens(two) == 2 + 4 + 0 + 4


def test_text_parts_count_and_other_parts_do_not() -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "b" * 40}, {"type": "image_url"}]}]
    assert estimate_prompt_tokens(parts) == 10 + 4


def test_lenient_on_what_a_miner_may_be_sent() -> None:
    assert estimate_prompt_tokens(None) == 0
    assert estimate_prompt_tokens("hello") == 0
    assert estimate_prompt_tokens([42, {"role": "user", "content": 7}]) == 8  # odd entries: empty text, template kept


async def test_gateway_and_simulated_card_use_the_same_count(monkeypatch) -> None:
    """The card prefills exactly the tokens the validator's credit expects it to."""
    body = {"model": "m", "messages": [{"role": "system", "content": "x" * 123}, {"role": "user", "content": "hi"}]}
    req = parse_chat_request(body, SchemaLimits(models=("m",)))
    seen: list[int] = []
    def spy(messages: object) -> int:
        seen.append(estimate_prompt_tokens(messages))
        return 0

    monkeypatch.setattr(sim, "estimate_prompt_tokens", spy)
    rt = SimulatedRuntime(sim.CardProfile(time_scale=1000.0, jitter=0.0), rng=random.Random(0))

    gen = rt.stream({**req.upstream_payload(), "stream": True})
    await anext(gen)
    await gen.aclose()
    assert seen == [req.prompt_tokens] == [31 + 4 + 1 + 4]
