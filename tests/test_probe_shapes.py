"""Probes that look like users (issue 14): real clients' shapes, a large content source, no tells left."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from gateway.protocol.openai import SchemaLimits, parse_chat_request
from gateway.protocol.tokens import estimate_prompt_tokens
from neurons.validator.corpus import stdlib_passages
from neurons.validator.prompts import _ASKS, PromptGenerator, asking_nucleus
from neurons.validator.shapes import ShapeSample

LIMITS = SchemaLimits(models=("m",))


def _client_request(rng: random.Random) -> dict:
    """A client population unlike the generator's defaults: no temperature 40 % of the time, odd max_tokens."""
    body: dict = {"model": "m", "stream": True, "max_tokens": rng.randint(100, 900),
                  "messages": [{"role": "system", "content": "You are terse."},
                               {"role": "user", "content": "word " * rng.randint(10, 400)}],
                  "user": f"customer-{rng.randint(1, 99)}"}
    r = rng.random()
    if r < 0.3:
        body["temperature"] = 0.7
    elif r < 0.6:
        body["temperature"] = 0.25
        body["top_p"] = 0.9
    if rng.random() < 0.2:
        body["seed"] = 1234
    return body


def test_shapes_keep_parameters_and_sizes_never_text_or_identity() -> None:
    sample = ShapeSample(capacity=50, rng=random.Random(1))
    assert sample.draw() is None
    rng = random.Random(2)
    for _ in range(500):
        sample.observe(parse_chat_request(_client_request(rng), LIMITS))
    assert len(sample) == 50 and sample.seen == 500  # bounded: a reservoir of recent traffic
    shapes = [sample.draw() for _ in range(200)]
    assert all(s is not None for s in shapes)
    for s in shapes:
        assert s is not None and s.roles == ("system", "user")
        assert "seed" not in s.sampling and "user" not in s.sampling  # what could single a client out is dropped
        assert set(s.sampling) <= {"temperature", "top_p"}
        assert 100 <= s.max_tokens <= 900
    assert "word" not in repr(shapes)  # no text is kept


def test_probes_copy_the_clients_parameter_distribution() -> None:
    rng = random.Random(3)
    sample = ShapeSample(capacity=1000, rng=random.Random(4))
    organic = [_client_request(rng) for _ in range(1000)]
    for body in organic:
        sample.observe(parse_chat_request(body, LIMITS))
    gen = PromptGenerator(random.Random(5), shapes=sample, shape_share=1.0)
    probes = [gen.payload("m") for _ in range(1000)]

    def tells(bodies: list[dict]) -> Counter[str]:
        c: Counter[str] = Counter()
        for b in bodies:
            c["no temperature"] += "temperature" not in b
            c["top_p"] += "top_p" in b
            c["menu max_tokens"] += b["max_tokens"] in (16, 32, 64, 128, 256, 384, 512)
            c["system"] += b["messages"][0]["role"] == "system"
        return c

    o, p = tells(organic), tells(probes)
    for k in ("no temperature", "top_p", "menu max_tokens", "system"):
        # binomial sd of a share over 1000 is <= 0.016: 4 sd between two independent samples is 0.09
        assert abs(o[k] - p[k]) / 1000 < 0.09, (k, o[k], p[k])
    sizes_o = sorted(estimate_prompt_tokens(b["messages"]) for b in organic)
    sizes_p = sorted(estimate_prompt_tokens(b["messages"]) for b in probes)
    median_o, median_p = sizes_o[500], sizes_p[500]
    assert 0.6 < median_p / median_o < 1.6, (median_o, median_p)


def test_without_traffic_parameters_are_drawn_as_clients_set_them() -> None:
    gen = PromptGenerator(random.Random(6))
    bodies = [gen.payload("m") for _ in range(2000)]
    absent = sum("temperature" not in b for b in bodies) / 2000
    assert 0.05 < absent < 0.25  # the old generator set a 2-decimal temperature on every probe
    temps = Counter(b["temperature"] for b in bodies if "temperature" in b)
    assert temps[0.7] > 100  # the common round values dominate, as with real clients
    off_menu = sum(b["max_tokens"] not in gen.mix.max_tokens for b in bodies) / 2000
    assert 0.1 < off_menu < 0.4


def test_the_stdlib_corpus_makes_prompts_that_are_rarely_the_same() -> None:
    passages = stdlib_passages(random.Random(7), files=120)
    assert len(passages) > 300 and len(set(passages)) > 0.9 * len(passages)
    gen = PromptGenerator(random.Random(8), corpus=passages)
    asks = [gen.payload("m")["messages"][-1]["content"] for _ in range(1000)]
    assert len(set(asks)) > 950  # the templates alone give 22 topics x 8 asks = 176 questions
    templated = sum(any(a.endswith(t.format(t="")[-12:]) for t in _ASKS) for a in asks)
    assert templated < 250  # most prompts come from the corpus


def test_replays_resend_recent_user_requests_with_a_fresh_seed() -> None:
    """Issue 23: most probes are recent organic requests themselves, so their text cannot be indexed."""
    from neurons.validator.replays import MAX_PROMPT_TOKENS, ReplaySample

    replays = ReplaySample(capacity=20, rng=random.Random(3))
    assert replays.draw("m") is None
    rng = random.Random(4)
    sent = [parse_chat_request(_client_request(rng), LIMITS) for _ in range(200)]
    for req in sent:
        replays.observe(req)
    assert len(replays) == 20 and replays.seen == 200  # bounded
    texts = {str(r.messages) for r in sent}
    drawn = []
    for _ in range(20):
        p = replays.draw("served-model")
        assert p is not None and str(p["messages"]) in texts  # a user's request, as sent
        assert p["model"] == "served-model" and p["stream"] is True and "seed" not in p and "user" not in p
        drawn.append(str(p["messages"]))
        p["messages"][0]["content"] = "changed"  # a copy: the sample is untouched
    assert len(set(drawn)) == 20 and replays.draw("m") is None  # each request is replayed once at most
    assert all(str(r.messages) in texts for r in sent)
    for req in sent[:20]:
        replays.observe(req)
    huge = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x " * (MAX_PROMPT_TOKENS * 5)}]},
                              LIMITS)
    replays.observe(huge)
    assert replays.seen == 220  # too long to hold: not kept
    gen = PromptGenerator(random.Random(5), replays=replays, replay_share=0.8)
    replayed = 0
    for _ in range(500):  # traffic goes on: a user's request, then a probe
        req = parse_chat_request(_client_request(rng), LIMITS)
        replays.observe(req)
        texts.add(str(req.messages))
        replayed += str(gen.payload("m")["messages"]) in texts
    assert 350 <= replayed <= 450  # ~80 % replays, the rest generated


def test_the_validator_replays_only_when_its_operator_lets_it() -> None:
    from neurons.keys import dev_keypair
    from neurons.validator.build import build_parts
    from neurons.validator.config import ValidatorConfig

    on = build_parts(ValidatorConfig(gateway_port=0), dev_keypair("Alice"))
    off = build_parts(ValidatorConfig(gateway_port=0, probes_replay=False), dev_keypair("Alice"))
    req = parse_chat_request(_client_request(random.Random(6)), LIMITS)
    for parts in (on, off):
        assert parts.gateway.hooks.on_request is not None
        parts.gateway.hooks.on_request(req)
    assert on.prompts.replays is not None and len(on.prompts.replays) == 1
    assert off.prompts.replays is None


def test_asking_a_nucleus_changes_sampled_requests_only() -> None:
    """What ``--top-p`` of the calibration and the audit benchmark sends: every sampled request with that nucleus."""
    greedy = {"model": "m", "messages": [], "temperature": 0.0}
    assert asking_nucleus(greedy, 0.8) is greedy  # greedy stays greedy: no nucleus to ask for
    default = {"model": "m", "messages": []}  # no temperature: sampled at 1.0
    assert asking_nucleus(default, 0.8)["top_p"] == 0.8 and "top_p" not in default  # a copy, the draw kept
    assert asking_nucleus({"temperature": 0.7, "top_p": 0.95}, 0.8)["top_p"] == 0.8
    for bad in (0.0, -0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match="top_p"):
            asking_nucleus(default, bad)

