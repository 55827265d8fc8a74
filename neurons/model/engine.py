"""One llama.cpp context over the model file: prompt tokens, one decoding step, and teacher forcing.

Built on ``llama-cpp-python``'s public API (``Llama``, ``llama_get_logits_ith``). Generation samples
here, in numpy, from :func:`gateway.protocol.sampling.asked_logprobs` rather than with llama.cpp's
sampler chain, because that chain applies ``top_p`` before the temperature and keeps top-k/min-p
cuts by default; the audit checks answers against the distribution OpenAI and vLLM define, so the
miner must draw from that same one.

A context is not thread-safe and its calls hold a CPU core for milliseconds to seconds, so every
engine lives on one worker thread of its own (:class:`EngineThread`); the event loop never runs model
code. llama.cpp releases the GIL while it computes.

Example::

    engine = LlamaEngine(model_path(), n_ctx=2048, threads=1)
    ids = engine.prompt_ids([{"role": "user", "content": "Hi"}])
    engine.begin(ids); logits = engine.next_logits(); engine.push(int(logits.argmax()))
    rows = engine.forced_logits(ids, completion_ids)  # (len(completion) + 1, vocab): teacher forcing
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from gateway.protocol.sampling import SamplingParams, asked_logprobs, log_softmax, seeded_token

from .chat_template import END_OF_TURN, render
from .grammar import Grammar, constrained
from .packaged import ModelUnavailable, require_runtime

_T = TypeVar("_T")


class ContextOverflow(ValueError):
    """Prompt plus completion do not fit the context: the caller's request is too long for this runtime."""


PREFILL_STEP = 64  # prompt tokens evaluated between two looks at a request's cancel


class LlamaEngine:
    """A loaded model and one context. Use from one thread only."""

    def __init__(self, path: Path, *, n_ctx: int = 2048, threads: int = 1) -> None:
        require_runtime()
        import llama_cpp

        self._lib = llama_cpp
        try:
            self._llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=min(512, n_ctx),
                                        n_threads=threads, n_threads_batch=threads, verbose=False)
        except (ValueError, RuntimeError) as e:
            raise ModelUnavailable(f"llama.cpp could not load {path}: {e}") from e
        self.n_ctx = n_ctx
        self.vocab_size = int(self._llm.n_vocab())
        end_of_turn = self._llm.tokenize(END_OF_TURN.encode(), add_bos=False, special=True)
        self.stop_ids = frozenset({int(self._llm.token_eos()), *(int(t) for t in end_of_turn[:1])})
        self._pieces: dict[int, bytes] = {}
        self._grammar: Grammar | None = None  # the running job's (constrained): choose masks by it, push moves it
        self._top_logprobs: int | None = None  # the running job's (job): reported() names each token's logprob

    def grammar(self, text: str) -> Grammar:
        """llama.cpp's grammar sampler for ``text`` over this model's vocabulary (close it when done); raises
        :class:`~neurons.model.grammar.GrammarError` when llama.cpp refuses the grammar."""
        return Grammar(self._lib.llama_model_get_vocab(self._llm.model), text, self.vocab_size)

    @contextlib.contextmanager
    def job(self, grammar: str | None = None, top_logprobs: int | None = None) -> Iterator[None]:
        """One answer's decoding: under ``grammar`` (:meth:`constrained`), and with each token's log-probability
        and ``top_logprobs`` alternatives (:meth:`reported`) when that is not None."""
        self._top_logprobs = top_logprobs
        try:
            with self.constrained(grammar):
                yield
        finally:
            self._top_logprobs = None

    def reported(self, logits: npt.NDArray[np.float32], token: int) -> Reported | None:
        """What the answer reports of ``token`` when its job asked for logprobs (None otherwise): its log-probability
        under the model's raw distribution (before temperature, nucleus or grammar, as vLLM's default reports it and
        the audit recomputes it) and the most likely alternatives', best first."""
        if self._top_logprobs is None:
            return None
        logp = log_softmax(np.asarray(logits, dtype=np.float64)[None, :])[0]
        k = self._top_logprobs
        top = np.argpartition(-logp, k)[:k] if 0 < k < logp.shape[0] else np.arange(min(k, logp.shape[0]))
        top = top[np.argsort(-logp[top], kind="stable")]
        return float(logp[token]), tuple((self.piece(int(t)), float(logp[t])) for t in top)

    @contextlib.contextmanager
    def constrained(self, text: str | None) -> Iterator[None]:
        """Decode the sequence begun inside under the grammar ``text`` (None: free text): :meth:`choose` draws only
        tokens it allows, :meth:`push` moves it on."""
        if text is None:
            yield
            return
        with self.grammar(text) as g:
            self._grammar = g
            try:
                yield
            finally:
                self._grammar = None

    # -- tokens ----------------------------------------------------------------------------------

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt as the model sees it: the chat template, BOS first, special tokens parsed."""
        return [int(t) for t in self._llm.tokenize(render(messages).encode("utf-8"), add_bos=True, special=True)]

    def text_ids(self, text: str) -> list[int]:
        """``text`` as the model's tokens (no BOS, special tokens parsed): what it takes the model to write it."""
        return [int(t) for t in self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)]

    def piece(self, token_id: int) -> bytes:
        """The bytes one token adds to the text (special tokens add none)."""
        b = self._pieces.get(token_id)
        if b is None:
            b = self._pieces[token_id] = bytes(self._llm.detokenize([token_id], special=False))
        return b

    def check_fits(self, prompt: int, completion: int) -> None:
        if prompt + completion > self.n_ctx:
            raise ContextOverflow(f"{prompt} prompt tokens + {completion} completion tokens exceed this model's "
                                  f"context of {self.n_ctx} tokens")

    # -- generation ------------------------------------------------------------------------------

    def begin(self, prompt_ids: list[int], cancel: threading.Event | None = None) -> bool:
        """Start a new sequence: evaluate the prompt (prefill), :data:`PREFILL_STEP` tokens at a time; False when
        ``cancel`` was set between steps (a caller that left during a long prefill frees the context within one
        step, not at the end of the prompt: issue 24 saw the next request wait 4.79 s behind an abandoned prefill,
        and 512-token steps still left 5.03 s, issue 39). Measured on a 1,909-token prompt here: 64-token steps
        prefill as fast as 512-token ones (103-110 against 106-108 tok/s, side by side) and the longest step took
        0.75-1.0 s against 4.7-5.2 s, on a machine loaded by another job."""
        self._llm.reset()
        step = max(1, min(PREFILL_STEP, int(self._llm.n_batch)))
        for i in range(0, len(prompt_ids), step):
            if cancel is not None and cancel.is_set():
                return False
            self._llm.eval(prompt_ids[i:i + step])
        return True

    def next_logits(self) -> npt.NDArray[np.float32]:
        """The logits for the next token (a view into llama.cpp's buffer: use before the next call)."""
        ptr = self._lib.llama_get_logits_ith(self._llm.ctx, -1)
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.vocab_size,))

    def push(self, token_id: int) -> None:
        """Append one token to the sequence (decode step); under a grammar, it moves past the token too."""
        if self._grammar is not None:
            self._grammar.accept(token_id)
        self._llm.eval([token_id])

    def choose(self, logits: npt.NDArray[np.float32], sampling: SamplingParams, rng: random.Random,
               position: int) -> int:
        """The next token (``position`` in the answer) under the asked sampling.

        Greedy: the argmax. Seeded (every request a validator sends): the subnet's sampler. Otherwise
        (a client calling the miner directly, with no seed) one draw from ``rng``. Under a grammar
        (:meth:`constrained`), from the tokens it allows.
        """
        if self._grammar is not None:
            logits = constrained(logits, self._grammar, sampling, position)
        if sampling.greedy:
            return int(np.argmax(logits))
        if sampling.seed is not None:
            return seeded_token(logits, sampling, position)
        logp = asked_logprobs(logits, sampling.temperature, sampling.top_p)[0]
        cum = np.cumsum(np.exp(logp))
        return int(min(np.searchsorted(cum, rng.random() * cum[-1], side="right"), cum.shape[0] - 1))

    # -- teacher forcing -------------------------------------------------------------------------

    def forced_logits(self, prompt_ids: list[int], completion_ids: list[int] | tuple[int, ...]
                      ) -> npt.NDArray[np.float32]:
        """One batched pass over prompt + completion; the rows that predicted each completion token and the next.

        Row ``j`` is the distribution the model gave completion token ``j``; the last row is what comes
        after the completion (the stop check). Logits are asked only for those rows (through the
        public ``llama_batch``/``llama_decode`` API): the prompt's rows would cost a 262k-wide output
        projection each for nothing, and ``Llama(logits_all=True)`` would keep a context-sized buffer.
        """
        self.check_fits(len(prompt_ids), len(completion_ids))
        lib, ctx = self._lib, self._llm.ctx
        tokens = list(prompt_ids) + list(completion_ids)
        first = len(prompt_ids) - 1  # the prompt's last row predicts the first completion token
        out = np.empty((len(completion_ids) + 1, self.vocab_size), dtype=np.float32)
        self._llm.reset()
        lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        batch = lib.llama_batch_init(_PROMPT_BATCH, 0, 1)
        try:
            # the prompt without logits in large batches, then the rows that need logits in small ones
            spans = [(start, min(first, start + _PROMPT_BATCH)) for start in range(0, first, _PROMPT_BATCH)]
            spans += [(start, min(len(tokens), start + _FORCE_BATCH)) for start in range(first, len(tokens),
                                                                                        _FORCE_BATCH)]
            for lo, hi in spans:
                batch.n_tokens = hi - lo
                for i in range(hi - lo):
                    batch.token[i] = tokens[lo + i]
                    batch.pos[i] = lo + i
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = 0
                    batch.logits[i] = lo + i >= first
                rc = lib.llama_decode(ctx, batch)
                if rc != 0:
                    raise RuntimeError(f"llama_decode failed ({rc})")
                for i in range(max(0, first - lo), hi - lo):
                    ptr = lib.llama_get_logits_ith(ctx, i)
                    out[lo + i - first] = np.ctypeslib.as_array(
                        ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.vocab_size,))
        finally:
            lib.llama_batch_free(batch)
            lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        return out


# One token's reported log-probability and its best alternatives' (bytes, log-probability): LlamaEngine.reported
Reported = tuple[float, tuple[tuple[bytes, float], ...]]

_FORCE_BATCH = 64  # tokens per decode call that want logits: bounds llama.cpp's output buffer to 64 rows
_PROMPT_BATCH = 512  # prompt tokens per decode call (no logits): the context's n_batch


class EngineThread:
    """An engine and the one thread it may run on; ``await run(fn, ...)`` calls ``fn(engine, ...)`` there."""

    def __init__(self, name: str) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.engine: LlamaEngine | None = None

    async def load(self, path: Path, **kw: Any) -> LlamaEngine:
        loop = asyncio.get_running_loop()
        self.engine = await loop.run_in_executor(self._pool, lambda: LlamaEngine(path, **kw))
        return self.engine

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        if self.engine is None:
            raise RuntimeError("engine not loaded")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, self.engine, *args)

    def submit(self, fn: Callable[..., _T], *args: Any) -> concurrent.futures.Future[_T]:
        if self.engine is None:
            raise RuntimeError("engine not loaded")
        return self._pool.submit(fn, self.engine, *args)

    async def aclose(self) -> None:
        """Drop queued jobs and wait, off the event loop, until the running one has finished."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self._pool.shutdown, wait=True)
