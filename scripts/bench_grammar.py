#!/usr/bin/env python3
"""What decoding under the subnet's grammar costs on the real runtime, and its audit, side by side in one run.

Gemma 3 270M (the packaged model) on llama.cpp, one thread, answers the same prompts free and under a grammar (JSON
mode, a JSON schema, a forced tool call), interleaved so background load hits both alike: greedy, seeded, and seeded
with a nucleus ("nucleus", top_p 0.9: the whole vocabulary is masked a token, :mod:`neurons.model.grammar`). Printed
per draw: the decode loop's milliseconds a token free and constrained, and the reference's audit milliseconds a token
free and constrained. Every constrained answer must pass its audit and parse as its shape: the run fails otherwise.

Example::

    .venv/bin/python scripts/bench_grammar.py --smoke        # a minute
    .venv/bin/python scripts/bench_grammar.py --tokens 64 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_lib.stats import percentile, table, verdict  # noqa: E402

from gateway.protocol.measurement import Answer  # noqa: E402
from gateway.protocol.sampling import SamplingParams  # noqa: E402
from gateway.protocol.structure import structure_of  # noqa: E402
from gateway.protocol.tools import parse_tool_calls, prompt_messages  # noqa: E402
from neurons.miner.runtimes.llama import answer_once  # noqa: E402
from neurons.model.engine import LlamaEngine  # noqa: E402
from neurons.model.grammar import gbnf  # noqa: E402
from neurons.model.packaged import model_path  # noqa: E402
from neurons.reference.llama import replay  # noqa: E402
from scoring.audit import AuditBands  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SHAPES: list[tuple[str, dict[str, Any], str]] = [
    ("json_object", {"response_format": {"type": "json_object"}}, "Give three colours as JSON."),
    ("json_schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"]}}}}, "Describe a person."),
    ("tool_call", {"tools": TOOLS, "tool_choice": "required"}, "What is the weather in Paris?"),
]
DRAWS = [("greedy", SamplingParams(temperature=0.0)), ("seeded", SamplingParams(temperature=0.8, seed=11)),
         ("nucleus", SamplingParams(temperature=0.8, top_p=0.9, seed=11))]


def _shaped(kind: str, text: str, finish: str) -> bool:
    """A whole constrained answer is its shape (a cut one need not be)."""
    if finish != "stop":
        return True
    if kind == "tool_call":
        return parse_tool_calls(text) is not None
    return isinstance(json.loads(text), dict)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=48, help="max_tokens of each answer")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="one repetition of 24-token answers")
    args = ap.parse_args(argv)
    tokens, repeat = (24, 1) if args.smoke else (args.tokens, args.repeat)
    miner = LlamaEngine(model_path(), n_ctx=2048, threads=1)
    reference = LlamaEngine(model_path(), n_ctx=4096, threads=1)
    ms: dict[tuple[str, str], list[float]] = {}
    ok = True
    for _ in range(repeat):
        for kind, extra, question in SHAPES:
            payload = {"messages": [{"role": "user", "content": question}], **extra}
            structure = structure_of(payload)
            assert structure is not None
            grammar, messages = gbnf(structure), prompt_messages(payload)
            for name, sampling in DRAWS:
                for constrained in (False, True):
                    t0 = time.perf_counter()
                    text, ids, finish = answer_once(miner, messages, tokens, sampling, random.Random(1),
                                                    grammar=grammar if constrained else None)
                    t1 = time.perf_counter()
                    calls = parse_tool_calls(text) if constrained and kind == "tool_call" else None
                    answer = Answer(messages=messages, sampling=sampling, max_tokens=tokens, stop=(),
                                    text="" if calls else text, token_ids=tuple(ids),
                                    finish_reason="tool_calls" if calls else finish,
                                    tool_calls=tuple(calls) if calls else None,
                                    structure=structure if constrained else None)
                    v = replay(reference, answer, AuditBands())
                    t2 = time.perf_counter()
                    tag = "constrained" if constrained else "free"
                    ms.setdefault((name, f"decode {tag}"), []).append(1000 * (t1 - t0) / max(1, len(ids)))
                    ms.setdefault((name, f"audit {tag}"), []).append(1000 * (t2 - t1) / max(1, len(ids)))
                    if constrained and (v is None or not v.passed or not _shaped(kind, text, finish)):
                        ok = False
                        print(f"FAILED: {kind} {name}: {text[:80]!r} {v}")
    rows = [[name, *(percentile(ms[(name, col)], 50) for col in
                     ("decode free", "decode constrained", "audit free", "audit constrained"))]
            for name, _ in DRAWS]
    print(f"ms a token, median over {len(SHAPES)} shapes x {repeat} repetition(s), {tokens}-token answers")
    print(table(["draw", "decode free", "decode grammar", "audit free", "audit grammar"], rows, digits=1))
    print(f"{verdict(ok)}  every constrained answer audited, passed and shaped")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
