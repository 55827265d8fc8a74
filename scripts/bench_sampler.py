#!/usr/bin/env python3
"""The subnet sampler's cost on the in-process runtime, before and after, side by side in one run: every token
hashed one expression a step (as it was), against the shipped sampler (the hash in place on two buffers, and
only the tokens that can still win hashed: ``gateway.protocol.sampling``).

Gemma 3 270M (the packaged model) on llama.cpp, one thread, decodes the same seeded requests twice per
repetition, once with each sampler, interleaved so background load hits both alike. Printed per sampler:
tokens/s of the whole decode loop, the sampler's own milliseconds a token, and (pruned) the share of the
262k vocabulary hashed. Every token both samplers pick is compared: the run fails if any differs.

Where torch is installed (the ``plugin`` extra), the vLLM plugin's sampler (``neurons.miner.vllm_plugin.sampler``)
is timed on rows of the same logits, on this CPU, one row a call as a single stream would: pruned (shipped)
against every token hashed, per temperature, and its tokens compared with the spec's. A GPU's figures differ
(no GPU here); the share hashed does not.

Example::

    .venv/bin/python scripts/bench_sampler.py --smoke        # seconds
    .venv/bin/python scripts/bench_sampler.py --tokens 400 --repeat 3
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_lib.stats import table  # noqa: E402

from gateway.protocol.sampling import (  # noqa: E402
    GOLDEN,
    MIX1,
    MIX2,
    SamplingParams,
    asked_logprobs,
    contenders,
    mix64,
    seeded_token,
)
from neurons.model.engine import LlamaEngine  # noqa: E402
from neurons.model.packaged import model_path  # noqa: E402

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how vaccines train the immune system.",
           "List ten uses for a paperclip, one per line.", "Describe the water cycle to a child."]


def spec_gumbel(seed: int, position: int, vocab: int) -> np.ndarray:
    """The variates as the spec writes them (and as the sampler computed them before): one expression a step."""
    def mix(x: np.ndarray) -> np.ndarray:
        x = x + np.uint64(GOLDEN)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(MIX1)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(MIX2)
        return x ^ (x >> np.uint64(31))

    base = np.uint64(mix64(seed ^ mix64(position)))
    with np.errstate(over="ignore"):
        h = mix(base + np.arange(vocab, dtype=np.uint64) * np.uint64(GOLDEN))
    u = ((h >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))
    return -np.log(-np.log(u))


def full_token(row: np.ndarray, sampling: SamplingParams, position: int) -> int:
    """The sampler before: every token of the vocabulary hashed, one expression a step."""
    assert sampling.seed is not None
    r = np.asarray(row, dtype=np.float64)
    score = r / sampling.temperature + spec_gumbel(sampling.seed, position, r.shape[0])
    if sampling.top_p < 1.0:
        score[~np.isfinite(asked_logprobs(r, sampling.temperature, sampling.top_p)[0])] = -np.inf
    return int(np.argmax(score))


Row = tuple[np.ndarray, SamplingParams, int]  # logits, sampling, position: kept for the plugin's timing


def decode(engine: LlamaEngine, prompt: str, sampling: SamplingParams, tokens: int, pruned: bool,
           keep: list[Row] | None = None) -> tuple[list[int], float, float, list[float]]:
    """(ids, wall seconds of the decode loop, seconds in the sampler, share hashed per token); every 8th row of
    logits appended to ``keep``."""
    ids = engine.prompt_ids([{"role": "user", "content": prompt}])
    engine.begin(ids)
    out: list[int] = []
    in_sampler = 0.0
    shares: list[float] = []
    wall = 0.0
    for position in range(tokens):
        t0 = time.perf_counter()
        row = engine.next_logits()
        s0 = time.perf_counter()
        if pruned:
            token = seeded_token(row, sampling, position)
        else:
            token = full_token(row, sampling, position)
        in_sampler += time.perf_counter() - s0
        if token in engine.stop_ids:
            engine.begin(ids)  # keep decoding the same length: restart rather than stop
        else:
            engine.push(token)
        wall += time.perf_counter() - t0
        out.append(token)
        if keep is not None and position % 8 == 0:
            keep.append((np.array(row, dtype=np.float32), sampling, position))
        if pruned:  # untimed: how much of the vocabulary the pruned sampler hashed
            assert sampling.seed is not None
            hashed, _ = contenders(np.asarray(row, dtype=np.float64) / sampling.temperature, sampling.seed, position)
            shares.append(hashed.shape[0] / row.shape[0])
    return out, wall, in_sampler, shares


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=200, help="tokens decoded per request")
    p.add_argument("--repeat", type=int, default=2, help="repetitions of the whole set")
    p.add_argument("--smoke", action="store_true", help="30 tokens, one repetition")
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.repeat = 30, 1
    engine = LlamaEngine(model_path(), n_ctx=2048, threads=1)
    rng = random.Random(11)
    wall = {False: 0.0, True: 0.0}
    sampler = {False: 0.0, True: 0.0}
    counted = {False: 0, True: 0}
    shares: list[float] = []
    by_temp: dict[tuple[bool, float], list[float]] = {}  # (shipped, temperature) -> [sampler s, tokens, shares]
    differ = 0
    kept: list[Row] = []
    for rep in range(args.repeat):
        for prompt in PROMPTS:
            sampling = SamplingParams(rng.choice([0.3, 0.7, 1.0]), rng.choice([1.0, 0.95]), seed=rng.getrandbits(62))
            picked: dict[bool, list[int]] = {}
            for pruned in ((False, True) if rep % 2 == 0 else (True, False)):
                ids, w, s, sh = decode(engine, prompt, sampling, args.tokens, pruned, kept if pruned else None)
                acc = by_temp.setdefault((pruned, sampling.temperature), [0.0, 0.0, 0.0])
                acc[0] += s
                acc[1] += len(ids)
                acc[2] += sum(sh)
                picked[pruned] = ids
                wall[pruned] += w
                sampler[pruned] += s
                counted[pruned] += len(ids)
                shares += sh
            differ += sum(a != b for a, b in zip(picked[False], picked[True], strict=True))
    rows = []
    for pruned in (False, True):
        n = counted[pruned]
        rows.append(["shipped" if pruned else "before", str(n), f"{n / wall[pruned]:.1f}",
                     f"{1000 * sampler[pruned] / n:.2f}",
                     f"{100 * float(np.median(shares)):.1f} %" if pruned else "100 %"])
    print(table(["sampler", "tokens", "tokens/s", "sampler ms/token", "vocabulary hashed (median)"], rows))
    temps = sorted({t for _, t in by_temp})
    print()
    print(table(["temperature", "before ms/token", "shipped ms/token", "vocabulary hashed"],
                [[f"{t:g}", f"{1000 * by_temp[(False, t)][0] / by_temp[(False, t)][1]:.2f}",
                  f"{1000 * by_temp[(True, t)][0] / by_temp[(True, t)][1]:.2f}",
                  f"{100 * by_temp[(True, t)][2] / by_temp[(True, t)][1]:.1f} %"] for t in temps
                 if (False, t) in by_temp and (True, t) in by_temp]))
    print(f"tokens that differ between the two samplers: {differ} of {counted[True]}")
    return 1 if differ or plugin_report(kept) else 0


def plugin_report(rows: list[Row]) -> int:
    """The vLLM plugin's sampler on these rows, pruned against full hashing; returns how many tokens differ from
    the spec's (0 when torch is not installed: nothing to report)."""
    try:
        import torch

        from neurons.miner.vllm_plugin.sampler import row_base, subnet_tokens
    except ImportError:
        print("\n(torch not installed: the vLLM plugin's sampler was not timed; install '.[plugin]')")
        return 0
    torch.set_num_threads(1)
    by_temp: dict[float, list[float]] = {}  # temperature -> [full s, pruned s, rows]
    differ = 0
    for row, sampling, position in rows:
        assert sampling.seed is not None
        logits = torch.from_numpy(row).unsqueeze(0)
        t, p = torch.tensor([sampling.temperature]), torch.tensor([sampling.top_p])
        base = torch.tensor([row_base(sampling.seed, position)])
        t0 = time.perf_counter()
        token = int(subnet_tokens(logits, t, p, base)[0])
        t1 = time.perf_counter()
        full = int(subnet_tokens(logits, t, p, base, prune=False)[0])
        t2 = time.perf_counter()
        acc = by_temp.setdefault(sampling.temperature, [0.0, 0.0, 0.0])
        acc[0] += t2 - t1
        acc[1] += t1 - t0
        acc[2] += 1
        differ += (token != seeded_token(row, sampling, position)) + (full != token)
    print()
    print(table(["temperature", "rows", "plugin, every token hashed ms/row", "plugin, pruned ms/row"],
                [[f"{t:g}", str(int(a[2])), f"{1000 * a[0] / a[2]:.2f}", f"{1000 * a[1] / a[2]:.2f}"]
                 for t, a in sorted(by_temp.items())]))
    print(f"vLLM plugin (torch {torch.__version__}, CPU, 1 thread): tokens that differ from the spec's: {differ} of "
          f"{len(rows)}")
    return differ


if __name__ == "__main__":
    sys.exit(main())
