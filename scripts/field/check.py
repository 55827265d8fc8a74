"""Audit real vLLM engines as a validator does: the same requests to each, every answer replayed on the reference.

Each engine sits behind the reference miner's proxy runtime declaring the subnet sampler
(``--runtime.sampler subnet``), so every seeded request asks vLLM for the plugin's tokens. Requests come from the
validator's own prompt generator: a third greedy, the rest sampled with a seed (a third of those in a 0.9 nucleus).
Each answer is replayed on the llama.cpp reference (the packaged GGUF) at the default bands, and the per-miner
sequential test sums the evidence as the validator does.

An engine named ``honest`` must pass every answer and never alarm; every other engine is a cheat (a vLLM without
the plugin that still declares it, a cheaper copy of the model) and must be caught: a failed audit or the
sequential test's alarm. Exit 0 only when both hold. Run with the project's venv (llama.cpp and the reference)::

    .venv/bin/python scripts/field/check.py --engine honest=http://127.0.0.1:8011 \\
        --engine no-plugin=http://127.0.0.1:8012 --engine bf16=http://127.0.0.1:8013 --answers 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gateway.metering import StreamMeter  # noqa: E402
from gateway.protocol.measurement import Answer  # noqa: E402
from gateway.protocol.miner_request import MinerRequest  # noqa: E402
from gateway.protocol.openai import GRAMMAR, SUBNET_SAMPLER, TOOLS  # noqa: E402
from gateway.protocol.tools import call_text  # noqa: E402
from gateway.upstream.record import answer_of  # noqa: E402
from neurons.miner.runtimes.proxy import ProxyRuntime  # noqa: E402
from neurons.model.engine import LlamaEngine  # noqa: E402
from neurons.model.packaged import MODEL_ID, model_path  # noqa: E402
from neurons.reference.llama import replay  # noqa: E402
from neurons.validator.prompts import MIXES, PromptGenerator  # noqa: E402
from scoring.audit import AuditBands  # noqa: E402
from scoring.audit.sequential import SequentialTest  # noqa: E402

HONEST = "honest"


def requests(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` chat bodies as the validator's generator writes them: every third greedy, the rest seeded."""
    prompts = PromptGenerator(random.Random(seed), MIXES["cpu"])
    rng = random.Random(seed + 1)
    out = []
    for i in range(n):
        body = prompts.payload(MODEL_ID)
        if i % 3 == 0:
            body["temperature"] = 0.0
        else:
            if float(body.get("temperature") or 0.0) < 0.3:
                body["temperature"] = 0.7
            body["seed"] = rng.getrandbits(62)
            if i % 3 == 2:
                body["top_p"] = 0.9
        out.append(body)
    return out


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}
CITIES = ("Paris", "Lagos", "Osaka", "Lima", "Perth", "Quito", "Hanoi", "Delhi")


def _call(city: str) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_0", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}


def tool_requests(n: int, seed: int, reference: LlamaEngine | None = None) -> list[dict[str, Any]]:
    """``n`` chat bodies offering one tool (``tool_choice`` auto, so audited) after one earlier call and its result
    (the 270M model imitates that call; asked cold it echoes the tool preamble): every other one greedy, the rest
    seeded. With ``reference``, a greedy request's ``max_tokens`` is the length in tokens of the call it should write
    (the model runs on past ``</tool_call>``, which would make the answer text)."""
    rng = random.Random(seed + 2)
    out = []
    for i in range(n):
        city = CITIES[i % len(CITIES)]
        history = [{"role": "user", "content": "What is the weather in Oslo?"}, _call("Oslo"),
                   {"role": "tool", "tool_call_id": "call_0", "content": "cold, 2 C"},
                   {"role": "assistant", "content": "It is cold in Oslo: 2 C."}]
        body: dict[str, Any] = {"model": MODEL_ID, "max_tokens": 48, "tools": [WEATHER],
                                "messages": [*history, {"role": "user", "content": f"What is the weather in {city}?"}]}
        if i % 2 == 0:
            body["temperature"] = 0.0
            if reference is not None:
                body["max_tokens"] = len(reference.text_ids(call_text("get_weather", json.dumps({"city": city}))))
        else:
            body["temperature"] = 0.7
            body["seed"] = rng.getrandbits(62)
        out.append(body)
    return out


@dataclass
class Tally:
    name: str
    answers: int = 0
    greedy: int = 0
    greedy_passed: int = 0
    seeded: int = 0
    seeded_passed: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    positions: int = 0
    misses: int = 0
    alarmed_at: int | None = None  # the answer at which the sequential test alarmed
    calls: int = 0  # answers that were tool calls (finish tool_calls), audited like any answer
    sampled_tokens: int = 0
    sampled_seconds: float = 0.0
    generation_seconds: float = 0.0  # every answer's stream, first byte to last
    audit_seconds: float = 0.0  # every answer's replay on the reference
    errors: list[str] = field(default_factory=list)

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    def ok(self) -> bool:
        if self.name == HONEST:
            return self.answers > 0 and self.failed == 0 and self.alarmed_at is None and not self.errors
        return self.failed > 0 or self.alarmed_at is not None


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
SHAPES: list[dict[str, Any]] = [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
    {"response_format": {"type": "json_object"}},
    {"tools": [WEATHER], "tool_choice": "required"},
]


def shaped_requests(n: int, seed: int) -> list[dict[str, Any]]:
    """:func:`requests` bound to a shape in turn: a JSON schema's instance, JSON mode, a forced tool call."""
    return [{**body, **SHAPES[(i // 3) % len(SHAPES)], "max_tokens": 48} for i, body in enumerate(requests(n, seed))]


def proxy(url: str, session: aiohttp.ClientSession, *, forward_seed: bool = True,
          grammar: bool = True) -> ProxyRuntime:
    """The reference miner's proxy in front of the engine at ``url``, as a vLLM miner runs it: the subnet sampler
    declared (``forward_seed=False``: declared, but the seed not passed on), tools in the subnet's format, and shaped
    requests decoded under the subnet's grammar (``grammar=False``: vLLM's own, from ``response_format``)."""
    return ProxyRuntime(url, session, model=MODEL_ID, sampler=SUBNET_SAMPLER if forward_seed else None,
                        features=frozenset({TOOLS, GRAMMAR} if grammar else {TOOLS}))


async def answer(rt: ProxyRuntime, body: dict[str, Any]) -> tuple[Answer, float]:
    """What the validator keeps of the engine's answer (gateway.upstream's own rule), and its seconds."""
    meter = StreamMeter(max_tokens=body["max_tokens"], started_at=0.0, keep_answer=True)
    start = time.monotonic()
    async for frames in rt.stream({**body, "return_token_ids": True}):
        meter.feed(frames, now=time.monotonic() - start)
    if not (meter.done and meter.ids_complete):
        raise RuntimeError("the stream ended without its token ids")
    request = MinerRequest.of(body)
    return answer_of(request, request.sampling, meter), time.monotonic() - start


async def audit_engine(name: str, url: str, bodies: list[dict[str, Any]], reference: LlamaEngine,
                       bands: AuditBands, *, forward_seed: bool = True, grammar: bool = True) -> Tally:
    """Ask ``url`` for ``bodies`` through the proxy runtime and replay each answer. ``forward_seed=False``: the
    proxy does not pass the seed to the plugin (as a miner whose vLLM runs without it), though the audit expects
    the subnet sampler's tokens as the miner declared."""
    tally = Tally(name)
    test = SequentialTest()
    evidence = 0.0
    async with aiohttp.ClientSession() as session:
        rt = proxy(url, session, forward_seed=forward_seed, grammar=grammar)
        for i, body in enumerate(bodies):
            try:
                a, seconds = await answer(rt, body)
            except Exception as e:  # noqa: BLE001 - a broken engine is a row of the table, not a crash
                tally.errors.append(f"{type(e).__name__}: {e}")
                continue
            started = time.monotonic()
            verdict = await asyncio.to_thread(replay, reference, a, bands)
            tally.audit_seconds += time.monotonic() - started
            tally.generation_seconds += seconds
            if verdict is None:
                tally.errors.append("too long to replay")
                continue
            tally.answers += 1
            tally.calls += a.tool_calls is not None
            seeded = a.sampling.seed is not None and a.sampling.temperature > 0
            if seeded:
                tally.seeded += 1
                tally.seeded_passed += verdict.passed
                tally.sampled_tokens += len(a.token_ids or ())
                tally.sampled_seconds += seconds
            else:
                tally.greedy += 1
                tally.greedy_passed += verdict.passed
            if not verdict.passed:
                tally.failures[str(verdict.failure)] += 1
            tally.positions += verdict.positions
            tally.misses += verdict.misses
            evidence = test.update(evidence, positions=verdict.positions, misses=verdict.misses)
            if tally.alarmed_at is None and test.alarmed(evidence):
                tally.alarmed_at = i + 1
    return tally


def table(tallies: list[Tally]) -> str:
    rows = ["| engine | answers | tool calls | greedy pass | seeded pass | failures | sequential test | "
            "sampled tok/s | audit / generation time | result |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t in tallies:
        fails = ", ".join(f"{k} {v}" for k, v in t.failures.most_common()) or "none"
        alarm = f"alarm at answer {t.alarmed_at}" if t.alarmed_at else "quiet"
        rate = f"{t.sampled_tokens / t.sampled_seconds:.1f}" if t.sampled_seconds else "-"
        want = "all pass" if t.name == HONEST else "caught"
        result = ("PASS" if t.ok() else "FAIL") + f" ({want})"
        cost = f"{t.audit_seconds:.0f} / {t.generation_seconds:.0f} s" if t.generation_seconds else "-"
        rows.append(f"| {t.name} | {t.answers} | {t.calls} | {t.greedy_passed}/{t.greedy} | "
                    f"{t.seeded_passed}/{t.seeded} | {fails} | {alarm} ({t.misses}/{t.positions} misses) | "
                    f"{rate} | {cost} | {result} |")
    for t in tallies:
        rows.extend(f"  {t.name}: {e}" for e in t.errors[:5])
    return "\n".join(rows)


async def run(args: argparse.Namespace) -> int:
    engines = []
    for spec in args.engine:
        name, _, url = spec.partition("=")
        if not name or not url.startswith("http"):
            print(f"--engine wants NAME=URL, got {spec!r}", file=sys.stderr)
            return 2
        engines.append((name, url))
    reference = LlamaEngine(model_path(), n_ctx=4096, threads=1)
    bodies = requests(args.answers, args.seed) + tool_requests(args.tool_answers, args.seed, reference)
    tallies = [await audit_engine(name, url, bodies, reference, AuditBands()) for name, url in engines]
    print(table(tallies))
    if args.json:
        figures = json.dumps([{**t.__dict__, "failures": dict(t.failures), "ok": t.ok()} for t in tallies], indent=2)
        await asyncio.to_thread(Path(args.json).write_text, figures)
    return 0 if all(t.ok() for t in tallies) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", action="append", required=True, help="NAME=URL; NAME 'honest' must pass, others "
                   "must be caught (repeatable)")
    p.add_argument("--answers", type=int, default=30)
    p.add_argument("--tool-answers", type=int, default=6, help="answers to requests offering a tool (vLLM renders "
                   "the proxy's tool turns; a call comes back as tool-call deltas)")
    p.add_argument("--seed", type=int, default=37)
    p.add_argument("--json", help="also write the figures here")
    return asyncio.run(run(p.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
