"""Cheating miners, for the audit's tests, its benchmark and the local subnet's demonstration.

Each is a :data:`~neurons.miner.runtimes.llama.Generate` function for :class:`LlamaRuntime`: the
same real model, the same miner, the same wire (token ids that spell the text the client receives),
only the answer is not the one the subnet pays for. They are the attacks a miner without the model,
or with a cheaper setting of it, would try:

* ``random``: fast random tokens of the vocabulary (no model work at all);
* ``stop-early``: one real token, then ``finish_reason: "stop"`` (cheap, "complete" answers);
* ``cached``: the model's real answer to a *different* prompt (a cache of stock answers);
* ``hot``: the model with the temperature raised by 0.7 (or sampling where greedy was asked), with
  the request's seed: the subnet's sampler at another temperature;
* ``greedy``: always greedy decoding, whatever temperature was asked (cheaper and steadier);
* ``truncated``: the model's answer to the last message alone, its first third cut (drops the
  system prompt and history: less prefill).
* ``own-rng``: the model's honest draw from the asked distribution with its own RNG, the seed ignored, while
  the miner declares the subnet's sampler: a stock vLLM claiming the plugin, to be paid for free draws.

Subtler ones, for the sequential test (``scripts/bench_audit.py``; not in :data:`CHEATS`, which every
audit must catch answer by answer): :func:`warm` (the temperature 0.1 too high), :func:`no_nucleus` (the
asked ``top_p`` ignored) and :func:`requantized` (the model at fewer bits, served honestly).

Example::

    rt = LlamaRuntime(model_path(), generate=CHEATS["random"])
"""

from __future__ import annotations

import dataclasses
import random
import threading
from pathlib import Path
from typing import Any

from gateway.protocol.sampling import SamplingParams
from neurons.model.engine import LlamaEngine

from .llama import Generate, Put, decode

_CACHED_PROMPT = [{"role": "user", "content": "Tell me about the weather in Paris in spring."}]


def random_tokens(engine: LlamaEngine, messages: list[dict[str, Any]], max_tokens: int, sampling: SamplingParams,
                  rng: random.Random, cancel: threading.Event, put: Put) -> str | None:
    put(len(engine.prompt_ids(messages)))
    for _ in range(max_tokens):
        token = rng.randrange(engine.vocab_size)
        while token in engine.stop_ids or not engine.piece(token):
            token = rng.randrange(engine.vocab_size)
        put([(token, engine.piece(token))])
    return "length"


def stop_early(engine: LlamaEngine, messages: list[dict[str, Any]], max_tokens: int, sampling: SamplingParams,
               rng: random.Random, cancel: threading.Event, put: Put) -> str | None:
    decode(engine, engine.prompt_ids(messages), min(1, max_tokens), sampling, rng, cancel, put)
    return "stop"


def _answer_to(other: list[dict[str, Any]], engine: LlamaEngine, messages: list[dict[str, Any]], max_tokens: int,
               sampling: SamplingParams, rng: random.Random, cancel: threading.Event, put: Put) -> str | None:
    """The model's real answer to ``other``, sent as the answer to ``messages`` (whose prompt size is reported)."""
    put(len(engine.prompt_ids(messages)))
    return decode(engine, engine.prompt_ids(other), max_tokens, sampling, rng, cancel,
                  lambda item: None if isinstance(item, int) else put(item))


def cached(engine: LlamaEngine, messages: list[dict[str, Any]], max_tokens: int, sampling: SamplingParams,
           rng: random.Random, cancel: threading.Event, put: Put) -> str | None:
    return _answer_to(_CACHED_PROMPT, engine, messages, max_tokens, sampling, rng, cancel, put)


def hot(engine: LlamaEngine, messages: list[dict[str, Any]], max_tokens: int, sampling: SamplingParams,
        rng: random.Random, cancel: threading.Event, put: Put) -> str | None:
    warmer = dataclasses.replace(sampling, temperature=sampling.temperature + 0.7)  # same seed: as close as it gets
    return decode(engine, engine.prompt_ids(messages), max_tokens, warmer, rng, cancel, put)


def greedy(engine: LlamaEngine, messages: list[dict[str, Any]], max_tokens: int, sampling: SamplingParams,
           rng: random.Random, cancel: threading.Event, put: Put) -> str | None:
    return decode(engine, engine.prompt_ids(messages), max_tokens, SamplingParams(temperature=0.0), rng, cancel,
                  put)


def truncated(engine: LlamaEngine, messages: list[dict[str, Any]], max_tokens: int, sampling: SamplingParams,
              rng: random.Random, cancel: threading.Event, put: Put) -> str | None:
    words = str(messages[-1].get("content", "")).split(" ")
    short = [{"role": "user", "content": " ".join(words[max(1, len(words) // 3):])}]
    return _answer_to(short, engine, messages, max_tokens, sampling, rng, cancel, put)


def requantized(source: Path, kind: str, out_dir: Path) -> Path:
    """The model at ``source`` requantized to ``kind`` (``Q2_K``, ``Q3_K_M``, ...) with llama.cpp's own quantizer:
    the cheapest real-world cheat (less memory, faster), served honestly otherwise. Requantizing an already
    quantized file needs ``allow_requantize``; on Gemma 3 270M many tensors (640 columns, not a multiple of 256)
    fall back to Q4_0/Q5_0, which llama.cpp reports. About 1.5 s here; the file is written once per ``out_dir``.
    """
    import ctypes

    import llama_cpp

    out = out_dir / f"{source.stem}-{kind}.gguf"
    if out.is_file():
        return out
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}", None)
    if ftype is None:
        raise ValueError(f"llama.cpp has no quantization type {kind!r}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = 1
    partial = out.with_suffix(".partial")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not requantize {source} to {kind}")
    partial.replace(out)
    return out


def warm(engine: LlamaEngine, messages: list[dict[str, Any]], max_tokens: int, sampling: SamplingParams,
         rng: random.Random, cancel: threading.Event, put: Put) -> str | None:
    """The subnet's sampler with the temperature 0.1 above the asked one (same seed): the smallest shift tried."""
    shifted = dataclasses.replace(sampling, temperature=sampling.temperature + 0.1)
    return decode(engine, engine.prompt_ids(messages), max_tokens, shifted, rng, cancel, put)


def no_nucleus(engine: LlamaEngine, messages: list[dict[str, Any]], max_tokens: int, sampling: SamplingParams,
               rng: random.Random, cancel: threading.Event, put: Put) -> str | None:
    """The subnet's sampler over the whole vocabulary, the asked ``top_p`` ignored (same seed). What the audit's
    nucleus slack could hide: its tokens within the slack pass, those beyond it are misses the sequential test sums."""
    whole = dataclasses.replace(sampling, top_p=1.0)
    return decode(engine, engine.prompt_ids(messages), max_tokens, whole, rng, cancel, put)


def own_rng(engine: LlamaEngine, messages: list[dict[str, Any]], max_tokens: int, sampling: SamplingParams,
            rng: random.Random, cancel: threading.Event, put: Put) -> str | None:
    """The asked distribution drawn with the miner's own RNG: what a stock runtime does with a seed."""
    unseeded = dataclasses.replace(sampling, seed=None)
    return decode(engine, engine.prompt_ids(messages), max_tokens, unseeded, rng, cancel, put)


CHEATS: dict[str, Generate] = {
    "random": random_tokens,
    "stop-early": stop_early,
    "cached": cached,
    "hot": hot,
    "greedy": greedy,
    "truncated": truncated,
    "own-rng": own_rng,
}
