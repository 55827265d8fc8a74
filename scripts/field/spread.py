"""Honest spread per pair of engines, and verification cost with each reference, over the same vLLM answers.

A vLLM miner's answers (vLLM with the plugin, behind the reference miner's proxy) are replayed on both references:

* ``collect`` (the project's venv, which has llama.cpp): asks the engine at ``--url`` for the answers (the field
  check's requests, tools included), replays each on the llama.cpp reference and writes them, with that
  reference's verdict, time and per-position numbers, to ``--out``;
* ``replay`` (the field venv, which has vLLM): replays the same answers on the vLLM reference
  (:mod:`neurons.reference.vllm`), prints the table and exits 0 only when every answer of the engine named
  ``honest`` passes on both and every other engine (``collect --name q2k``) is caught by the vLLM reference.

The spread of a pair is what an honest answer from the first engine shows when forced on the second: positions off
the near-tie band ("misses", what the sequential test counts), the worst gap, and, between the two references, how
far their log-probabilities of the same token lie apart. Verification cost is each reference's replay time over
the time vLLM took to generate the same answers. ``rig.py spread`` runs both steps::

    .venv/bin/python scripts/field/spread.py collect --url http://127.0.0.1:8011 --answers 18 --out spread.json
    PYTHONPATH=. .field/venv/bin/python scripts/field/spread.py replay --answers-file spread.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engines import FIELD  # noqa: E402

from gateway.protocol.measurement import Answer  # noqa: E402
from neurons.reference.base import ForcingEngine  # noqa: E402
from neurons.reference.llama import replay  # noqa: E402
from neurons.reference.protocol import decode_request, encode_request  # noqa: E402
from scoring.audit import AuditBands, Verdict  # noqa: E402

HONEST = "honest"
REFERENCES = ("llama.cpp", "vllm")


class KeepRows:
    """A :class:`ForcingEngine` that keeps the rows of its last forcing, so the numbers compared after a replay come
    from the very pass the replay judged (forcing through vLLM costs about what generating did: once is enough)."""

    def __init__(self, engine: ForcingEngine) -> None:
        self._engine = engine
        self.n_ctx, self.vocab_size, self.stop_ids = engine.n_ctx, engine.vocab_size, engine.stop_ids
        self._last: tuple[tuple[int, ...], tuple[int, ...], npt.NDArray[np.float32]] | None = None

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return self._engine.prompt_ids(messages)

    def piece(self, token_id: int) -> bytes:
        return self._engine.piece(token_id)

    def forced_logits(self, prompt_ids: list[int], completion_ids: list[int] | tuple[int, ...]
                      ) -> npt.NDArray[np.float32]:
        key = (tuple(prompt_ids), tuple(completion_ids))
        if self._last is None or self._last[:2] != key:
            self._last = (*key, self._engine.forced_logits(prompt_ids, completion_ids))
        return self._last[2]


def chosen_logprobs(engine: ForcingEngine, answer: Answer) -> tuple[list[float], list[int]]:
    """Each answer token's raw log-probability on ``engine`` and the engine's own top token there."""
    ids = list(answer.token_ids or ())
    rows = engine.forced_logits(engine.prompt_ids(answer.messages), ids)[:len(ids)].astype(np.float64)
    top = rows.max(axis=1, keepdims=True)
    logz = top[:, 0] + np.log(np.exp(rows - top).sum(axis=1))
    chosen: npt.NDArray[np.float64] = rows[np.arange(len(ids)), ids] - logz
    return [float(x) for x in chosen], [int(i) for i in rows.argmax(axis=1)]


def timed_replay(engine: ForcingEngine, answer: Answer, bands: AuditBands) -> tuple[Verdict | None, float]:
    started = time.monotonic()
    verdict = replay(engine, answer, bands)
    return verdict, time.monotonic() - started


def side(engine: ForcingEngine, answer: Answer, bands: AuditBands) -> dict[str, Any]:
    """One reference's view of one answer: its verdict, replay time and per-position numbers (from the rows the
    replay forced, unless it stopped before forcing)."""
    kept = KeepRows(engine)
    verdict, seconds = timed_replay(kept, answer, bands)
    logp, top = chosen_logprobs(kept, answer)
    return {"passed": bool(verdict and verdict.passed), "failure": None if verdict is None else str(verdict.failure),
            "positions": 0 if verdict is None else verdict.positions, "misses": 0 if verdict is None else
            verdict.misses, "seconds": seconds, "logp": logp, "top": top}


async def collect(args: argparse.Namespace) -> int:
    import aiohttp
    from check import answer, proxy, requests, tool_requests

    from neurons.model.engine import LlamaEngine
    from neurons.model.packaged import model_path

    reference = LlamaEngine(model_path(), n_ctx=4096, threads=1)
    bodies = requests(args.answers, args.seed) + tool_requests(args.tool_answers, args.seed, reference)
    bands = AuditBands()
    rows = []
    async with aiohttp.ClientSession() as session:
        rt = proxy(args.url, session)
        for body in bodies:
            got, seconds = await answer(rt, body)
            rows.append({"engine": args.name, "answer": json.loads(encode_request(got, bands)), "generation_s": seconds,
                         "llama.cpp": await asyncio.to_thread(side, reference, got, bands)})
    await asyncio.to_thread(Path(args.out).write_text, json.dumps(rows))
    print(f"{len(rows)} answers written to {args.out}")
    return 0


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def table(rows: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """Per engine that answered, each reference's verdicts, misses and time; then the two references apart."""
    lines = ["| answers from | reference | answers passed | misses / positions | verification / generation time |",
             "| --- | --- | --- | --- | --- |"]
    figures: dict[str, Any] = {}
    for engine in dict.fromkeys(r["engine"] for r in rows):
        mine = [r for r in rows if r["engine"] == engine]
        generation = sum(r["generation_s"] for r in mine)
        figures[engine] = {"answers": len(mine), "generation_s": generation}
        for name in REFERENCES:
            passed = sum(r[name]["passed"] for r in mine)
            misses = sum(r[name]["misses"] for r in mine)
            positions = sum(r[name]["positions"] for r in mine)
            seconds = sum(r[name]["seconds"] for r in mine)
            cost = seconds / generation if generation else 0.0
            figures[engine][name] = {"passed": passed, "misses": misses, "positions": positions, "seconds": seconds,
                                     "cost": cost}
            lines.append(f"| vLLM {engine} | {name} | {passed}/{len(mine)} | {misses}/{positions} | "
                         f"{seconds:.0f} / {generation:.0f} s ({cost:.2f}x) |")
    honest = [r for r in rows if r["engine"] == HONEST]
    deltas = [abs(a - b) for r in honest for a, b in zip(r["llama.cpp"]["logp"], r["vllm"]["logp"], strict=True)]
    agree = [a == b for r in honest for a, b in zip(r["llama.cpp"]["top"], r["vllm"]["top"], strict=True)]
    d = figures["references_apart"] = {
        "max": max(deltas, default=0.0), "p99": _pct(deltas, 99), "median": _pct(deltas, 50),
        "top1_agreement": sum(agree) / len(agree) if agree else 0.0, "positions": len(deltas)}
    lines.append("")
    lines.append(f"llama.cpp vs vLLM reference on the honest answers' {len(deltas)} positions: |delta logprob of the "
                 f"answer's token| median {d['median']:.4f}, p99 {d['p99']:.4f}, max {d['max']:.4f} nats; same top "
                 f"token at {100 * d['top1_agreement']:.1f} % of positions")
    return "\n".join(lines), figures


def verdicts_hold(rows: list[dict[str, Any]]) -> bool:
    """Every honest answer passes on both references; every other engine fails some answer on the vLLM one."""
    engines = {r["engine"] for r in rows}
    honest_ok = all(r["llama.cpp"]["passed"] and r["vllm"]["passed"] for r in rows if r["engine"] == HONEST)
    caught = all(any(not r["vllm"]["passed"] for r in rows if r["engine"] == e) for e in engines - {HONEST})
    return HONEST in engines and honest_ok and caught


def replay_all(args: argparse.Namespace) -> int:
    from neurons.reference.vllm import VllmEngine

    rows = [row for f in args.answers_file for row in json.loads(Path(f).read_text())]
    engine = VllmEngine(Path(args.model), n_ctx=4096, dtype="float32", max_num_seqs=4, enforce_eager=True)
    for r in rows:
        got, bands = decode_request(r["answer"])
        r["vllm"] = side(engine, got, bands)
    text, figures = table(rows)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0 if verdicts_hold(rows) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="step", required=True)
    c = sub.add_parser("collect", help="answers from a vLLM engine, replayed on llama.cpp (project venv)")
    c.add_argument("--url", required=True)
    c.add_argument("--name", default=HONEST, help="the engine's name: 'honest' must pass, others be caught")
    c.add_argument("--answers", type=int, default=12)
    c.add_argument("--tool-answers", type=int, default=6)
    c.add_argument("--seed", type=int, default=41)
    c.add_argument("--out", required=True)
    r = sub.add_parser("replay", help="the same answers on the vLLM reference, and the table (field venv)")
    r.add_argument("--answers-file", required=True, action="append", help="a file collect wrote (repeatable)")
    r.add_argument("--model", default=str(FIELD / "model"), help="the dequantized model folder (rig.py prepare)")
    r.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    return asyncio.run(collect(args)) if args.step == "collect" else replay_all(args)


if __name__ == "__main__":
    raise SystemExit(main())
