"""The simulated cards' toy model: honest answers pass the audit's own verdict, cheats fail it."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any

import numpy as np
import pytest

from gateway.protocol.measurement import Answer
from gateway.protocol.sampling import SamplingParams, asked_logprobs
from neurons.model.toy import ToyModel
from neurons.reference.toy import ToyReference
from scoring.audit import AuditBands, AuditFailure, Verdict

M = ToyModel()


def _answer(messages: list[dict], *, temperature: float, top_p: float = 1.0, max_tokens: int = 48,
            rng: random.Random, cheat: str = "") -> Answer:
    key = M.key(messages)
    sampling = SamplingParams(temperature=temperature, top_p=top_p)
    ids, ended = M.generate(key, max_tokens, sampling, rng)
    finish = "stop" if ended else "length"
    if cheat == "random":
        ids = [rng.randrange(M.n) + (M.n if i == 0 else 0) for i in range(len(ids))]
    elif cheat == "stop-early":
        ids, finish = ids[:2], "stop"
    elif cheat == "other-prompt":
        other = M.key([{"role": "user", "content": "something else entirely"}])
        ids = [M.next_token(other, pos, None, sampling, rng) for pos in range(len(ids))]
    text = b"".join(M.piece(t) for t in ids).decode()
    return Answer(messages=messages, sampling=sampling, max_tokens=max_tokens, stop=(), text=text,
                  token_ids=None if cheat == "no-ids" else tuple(ids), finish_reason=finish)


def _verdict(a: Answer) -> Verdict | None:
    return asyncio.run(ToyReference().audit(a, AuditBands()))


def _prompt(i: int) -> list[dict]:
    return [{"role": "user", "content": f"question number {i}: tell me about {i * 7919 % 1000}"}]


def test_sampling_on_the_miner_is_the_distribution_the_reference_computes() -> None:
    """The miner's analytic draw and the reference's numpy rows agree (temperature, then the nucleus)."""
    key = M.key(_prompt(1))
    for temperature, top_p in ((1.0, 1.0), (0.7, 1.0), (1.0, 0.5), (1.3, 0.9)):
        rng = random.Random(2)
        draws = [M.next_token(key, 5, None, SamplingParams(temperature, top_p), rng) for _ in range(20000)]
        probs = np.exp(asked_logprobs(M.rows(key, 5, 64)[5], temperature, top_p)[0])
        fav = M.favourite(key, 5)
        observed = draws.count(fav) / len(draws)
        sd = (probs[fav] * (1 - probs[fav]) / len(draws)) ** 0.5
        assert abs(observed - probs[fav]) < 5 * sd + 1e-3, (temperature, top_p, observed, probs[fav])
        outside = [t for t in draws if probs[t] == 0.0]
        assert not outside, (temperature, top_p)  # nothing drawn that the nucleus excludes


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_honest_answers_pass(temperature: float) -> None:
    rng = random.Random(3)
    for i in range(60):
        a = _answer(_prompt(i), temperature=temperature, top_p=0.9 if i % 3 == 0 else 1.0, rng=rng)
        v = _verdict(a)
        assert v is not None and v.passed, (i, v, a.finish_reason, len(a.token_ids or ()))
        assert v.tokens == len(a.token_ids or ())


@pytest.mark.parametrize("cheat, failure", [
    ("random", {AuditFailure.WRONG_TOKENS, AuditFailure.IMPLAUSIBLE}),
    ("stop-early", {AuditFailure.EARLY_STOP}),
    ("other-prompt", {AuditFailure.WRONG_TOKENS, AuditFailure.IMPLAUSIBLE}),
    ("no-ids", {AuditFailure.NO_TOKEN_IDS}),
])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cheats_fail(cheat: str, failure: set[AuditFailure], temperature: float) -> None:
    rng = random.Random(4)
    caught = 0
    for i in range(20):
        a = _answer(_prompt(100 + i), temperature=temperature, max_tokens=48, rng=rng, cheat=cheat)
        if cheat == "stop-early" and a.max_tokens <= 2:
            continue
        v = _verdict(a)
        assert v is not None
        if not v.passed:
            assert v.failure in failure, (cheat, v)
            caught += 1
    assert caught >= 19, (cheat, temperature, caught)


def test_a_text_that_its_ids_do_not_spell_fails() -> None:
    a = _answer(_prompt(7), temperature=0.0, rng=random.Random(5))
    v = _verdict(dataclasses.replace(a, text=a.text + " extra"))
    assert v is not None and v.failure == AuditFailure.TEXT_MISMATCH


def _seeded(i: int, seed: int, temperature: float, top_p: float = 1.0, max_tokens: int = 48) -> Answer:
    messages = _prompt(i)
    sampling = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
    ids, ended = M.generate(M.key(messages), max_tokens, sampling, random.Random(i))
    text = b"".join(M.piece(t) for t in ids).decode()
    return Answer(messages=messages, sampling=sampling, max_tokens=max_tokens, stop=(), text=text,
                  token_ids=tuple(ids) + ((M.eot,) if ended else ()), finish_reason="stop" if ended else "length")


def test_a_seeded_answer_is_the_seeds_and_the_audit_replays_it() -> None:
    """Like the subnet sampler's: the same seed gives the same answer (a client's seed is repeatable on a simulated
    card), another seed another one, and the audit replays the draw exactly, so an honest answer never fails it
    (judged by plausibility instead, 5 of 3,000 honest toy answers failed) and an answer to another seed does."""
    a, b = _seeded(1, 42, 0.9), _seeded(1, 42, 0.9)
    assert a.token_ids == b.token_ids
    assert _seeded(1, 43, 0.9).token_ids != a.token_ids
    rng = random.Random(6)
    for i in range(400):
        t = rng.uniform(0.2, 1.2)
        a = _seeded(i, rng.randrange(1 << 62), t, top_p=rng.choice((0.8, 0.9, 1.0)), max_tokens=rng.choice((8, 48)))
        v = _verdict(a)
        assert v is not None and v.passed and v.misses == 0, (i, t, v)
    a = _seeded(3, 7, 1.0)
    v = _verdict(dataclasses.replace(a, sampling=dataclasses.replace(a.sampling, seed=8)))
    assert v is not None and v.failure == AuditFailure.WRONG_TOKENS, v


@pytest.mark.parametrize("cheat", ["random", "stop-early", "truncated-length"])
def test_seeded_cheats_fail(cheat: str) -> None:
    a = _seeded(11, 99, 1.0)
    ids = list(a.token_ids or ())
    if cheat == "random":
        rng = random.Random(1)
        ids = [rng.randrange(M.n) + (M.n if i == 0 else 0) for i in range(len(ids))]
        a = dataclasses.replace(a, token_ids=tuple(ids), text=b"".join(M.piece(t) for t in ids).decode())
        expected = AuditFailure.WRONG_TOKENS
    else:
        ids = ids[:3]
        finish = "stop" if cheat == "stop-early" else "length"
        a = dataclasses.replace(a, token_ids=tuple(ids), text=b"".join(M.piece(t) for t in ids).decode(),
                                finish_reason=finish)
        expected = AuditFailure.EARLY_STOP if cheat == "stop-early" else AuditFailure.FALSE_LENGTH
    v = _verdict(a)
    assert v is not None and v.failure == expected, v


async def test_a_simulated_card_reports_the_toy_models_logprobs_and_the_audit_checks_them() -> None:
    """Issue 41: the simulated card's logprobs were -0.25 with itself as its one alternative. Now each token's entry
    is its raw log-probability in the toy model's row with the asked alternatives best first (greedy: the token is
    the first), and the toy reference checks them as the real one does: a card reporting them 1.5 nats off fails."""
    from gateway.metering import StreamMeter
    from neurons.miner.runtimes.sim import PROFILES, SimulatedRuntime

    rt = SimulatedRuntime(dataclasses.replace(PROFILES["rtx5090"], time_scale=20.0), rng=random.Random(1))
    for temperature, seed in ((0.0, None), (1.0, 42)):
        body: dict[str, Any] = {"messages": _prompt(4), "max_tokens": 12, "temperature": temperature, "seed": seed,
                                "logprobs": True, "top_logprobs": 3}
        meter = StreamMeter(max_tokens=12, started_at=0.0, keep_answer=True)
        entries: list[dict[str, Any]] = []
        async for frames in rt.stream(body):
            for chunk in meter.feed(frames, now=1.0):
                entries += (chunk.logprobs or {}).get("content") or []
        assert meter.done and len(entries) == len(meter.ids) == len(meter.logprobs)
        for e in entries:
            alts = [a["logprob"] for a in e["top_logprobs"]]
            assert len(alts) == 3 and alts == sorted(alts, reverse=True) and e["logprob"] <= alts[0] < 0
            if temperature == 0.0:
                assert e["logprob"] == alts[0]
        sampling = SamplingParams(temperature=temperature, seed=seed)
        a = Answer(messages=body["messages"], sampling=sampling, max_tokens=12, stop=(), text="".join(meter.text),
                   token_ids=tuple(meter.ids), finish_reason=meter.finish_reason, logprobs=tuple(meter.logprobs))
        v = await ToyReference().audit(a, AuditBands())
        assert v is not None and v.passed, v
        lied = tuple(x - 1.5 for x in meter.logprobs)
        v = await ToyReference().audit(dataclasses.replace(a, logprobs=lied), AuditBands())
        assert v is not None and v.failure == AuditFailure.WRONG_LOGPROBS, v
