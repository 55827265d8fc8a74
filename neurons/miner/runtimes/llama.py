"""A real runtime: the packaged Gemma 3 270M on llama.cpp, in process, one context per slot.

Why in process rather than behind ``llama-cpp-python``'s OpenAI server: that server names no token
ids (an audit needs them), returns log-probabilities only through a per-token Python sort over the
262k-token vocabulary, and interrupts in-flight streams on a new request by default. Here each slot
owns a :class:`~neurons.model.engine.LlamaEngine` on a thread of its own, decodes token by token and
samples from exactly the distribution the request asked for
(:mod:`gateway.protocol.sampling`), and every content chunk names the ids that spell it.

Streams are valid UTF-8 text: a token that ends inside a multi-byte character is held back and
sent with the token that completes it (one chunk, both ids). A request that does not fit the context
is the client's fault: a 400 ``context_length_exceeded`` before the first byte, as vLLM answers.

Example::

    rt = LlamaRuntime(model_path(), slots=2)
    await rt.start()                                   # loads one context per slot (about a second each)
    async for frames in rt.stream({"messages": [...], "max_tokens": 32, "temperature": 0}):
        ...
    await rt.aclose()
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import threading
import time
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any

from gateway.protocol.openai import (
    GRAMMAR,
    LOGPROBS,
    MODEL_CONTEXT,
    RESPONSE_FORMAT,
    SUBNET_SAMPLER,
    TOOLS,
    requested_max_tokens,
)
from gateway.protocol.sampling import SamplingParams
from gateway.protocol.sse import ChunkFramer, frame
from gateway.protocol.structure import structure_of
from gateway.protocol.tools import prompt_messages
from neurons.model.engine import ContextOverflow, EngineThread, LlamaEngine
from neurons.model.grammar import GrammarError, gbnf
from neurons.model.packaged import MODEL_ID, ModelUnavailable

from .base import RuntimeFailure, RuntimeHealth
from .framing import Framing

_END = object()  # the worker's last item


class LlamaRuntime:
    """``slots`` llama.cpp contexts over one model file, each decoding on its own thread."""

    def __init__(self, path: Path, *, slots: int = 1, threads: int = 1, n_ctx: int = MODEL_CONTEXT,
                 model: str = MODEL_ID, seed: int | None = None, generate: Generate | None = None) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.name = f"llama.cpp:{model}"
        self.sampler: str | None = SUBNET_SAMPLER  # seeded requests are drawn with it (LlamaEngine.choose)
        # tools in the subnet's tool format (gateway.protocol.tools); JSON output and forced tool calls decoded under
        # the subnet's grammar (neurons.model.grammar)
        self.features: frozenset[str] = frozenset({TOOLS, RESPONSE_FORMAT, GRAMMAR, LOGPROBS})  # logprobs: raw
        self.model = model
        self._path = path
        self._slots = slots
        self._threads = threads
        self._n_ctx = n_ctx
        self._rng = random.Random(seed)
        self._generate = generate or honest
        self._workers: list[EngineThread] = []
        self._free: asyncio.Queue[EngineThread] = asyncio.Queue()
        self._cancels: set[threading.Event] = set()  # of the jobs running now, so aclose can stop them
        self._releasing = 0  # contexts whose stream ended, not yet back in the pool (a left caller's: within a batch)
        self._active = 0
        self._state = "not started"
        self._ready = False

    @property
    def active(self) -> int:
        return self._active

    @property
    def capacity(self) -> int:
        """Streams it can run at once, in all: one a context (the miner's ``/health`` says so)."""
        return self._slots

    async def _context(self) -> EngineThread:
        """A free context, or a 429 at once: a request never waits behind another caller's work (the validator
        would book the wait as this miner's TTFT). Only a context being released (its caller left; it stops
        within one prefill batch or one token) is waited for."""
        if self._free.empty() and self._releasing == 0:
            raise RuntimeFailure(f"all {self._slots} contexts are busy", status=429, type="busy", code="busy",
                                 headers={"Retry-After": "0"})
        try:
            async with asyncio.timeout(RELEASE_WAIT_S):
                return await self._free.get()
        except TimeoutError:
            raise RuntimeFailure(f"all {self._slots} contexts are busy", status=429, type="busy", code="busy",
                                 headers={"Retry-After": "0"}) from None

    def health(self) -> RuntimeHealth:
        return RuntimeHealth(ok=self._ready, detail=self._state)

    async def start(self) -> None:
        """Load one context per slot; raises :class:`ModelUnavailable` (and reports it) when it cannot."""
        self._state = "loading"
        try:
            for i in range(self._slots):
                w = EngineThread(f"llama-slot{i}")
                self._workers.append(w)
                await w.load(self._path, n_ctx=self._n_ctx, threads=self._threads)
                self._free.put_nowait(w)
        except ModelUnavailable as e:
            self._state = f"failed: {e}"
            raise
        self._ready = True
        self._state = f"ready: {self._slots} slot(s), {self._threads} thread(s) each, context {self._n_ctx}"

    async def aclose(self) -> None:
        """Stop every job at its next token and wait for the threads, so none outlives the event loop."""
        self._ready = False
        self._state = "stopped"
        for cancel in list(self._cancels):
            cancel.set()
        for w in self._workers:
            await w.aclose()

    async def stream(self, payload: dict[str, Any]) -> AsyncGenerator[bytes, None]:
        if not self._ready:
            raise RuntimeFailure(f"runtime not ready ({self._state})", status=503, type="server_error",
                                 code="runtime_not_ready")
        if not isinstance(payload.get("messages"), list):
            raise RuntimeFailure("messages must be a list", status=400, type="invalid_request_error",
                                 code="invalid_value")
        messages = prompt_messages(payload)  # tools in the subnet's format: the prompt the reference renders too
        max_tokens = requested_max_tokens(payload)
        sampling = SamplingParams.of(payload)
        grammar = _grammar_of(payload)
        top_logprobs = _top_logprobs(payload)
        seed = payload.get("seed")
        rng = random.Random(seed) if isinstance(seed, int) and not isinstance(seed, bool) else \
            random.Random(self._rng.getrandbits(64))
        out, framing, include_usage = self._framing(payload, logprobs=top_logprobs is not None)
        worker = await self._context()
        self._active += 1
        bridge = _Bridge(asyncio.get_running_loop())
        items, cancel = bridge.items, bridge.cancel
        self._cancels.add(cancel)
        job = worker.submit(_run, self._generate, (grammar, top_logprobs), messages, max_tokens, sampling, rng, cancel,
                            bridge.put)
        try:
            first = await items.get()
            if isinstance(first, BaseException):
                raise _failure(first)
            if not isinstance(first, int):
                raise RuntimeFailure("runtime ended before the prompt was read", status=500, type="server_error",
                                     code="runtime_error")
            prompt_tokens = int(first)
            yield frame(out.chunk({"role": "assistant"}, None))
            finish = "length"
            while True:
                item = await items.get()
                if item is _END:
                    break
                if isinstance(item, str):
                    finish = item
                    continue
                if isinstance(item, BaseException):
                    raise _failure(item)
                data = framing.feed(item)
                if data:
                    yield data
                if framing.stopped:  # a stop string: the rest is not generated
                    cancel.set()
                    finish = "stop"
                    break
            yield framing.close(finish, prompt_tokens if include_usage else None)
        finally:
            cancel.set()
            self._cancels.discard(cancel)
            self._active -= 1
            # the context is free once its thread has left the job (a cancelled job stops at its next token or
            # prefill batch) and it is back in the pool; until then it is being released, and waited for
            self._releasing += 1
            job.add_done_callback(lambda _job: bridge.call_soon(self._return, worker))

    def _framing(self, payload: dict[str, Any], *, logprobs: bool) -> tuple[ChunkFramer, Framing, bool]:
        """The answer's chunk framer, the framing of its tokens (stop strings, a held tool call, ids and logprobs as
        asked) and whether the client asked for usage."""
        options, named = payload.get("stream_options"), payload.get("model")
        out = ChunkFramer("chatcmpl-" + secrets.token_hex(12), int(time.time()),
                          named if isinstance(named, str) else self.model)
        framing = Framing(out, _stop_strings(payload.get("stop")), want_ids=payload.get("return_token_ids") is True,
                          gate=payload.get("tools") and payload.get("tool_choice", "auto") != "none",
                          logprobs=logprobs)
        return out, framing, isinstance(options, dict) and options.get("include_usage") is True

    def _return(self, worker: EngineThread) -> None:
        self._releasing -= 1
        self._free.put_nowait(worker)


RELEASE_WAIT_S = 5.0  # the most a request waits for a context its last caller left (one prefill batch, measured)
MAX_STOPS = 4  # OpenAI's limit on stop strings


def _stop_strings(raw: Any) -> tuple[str, ...]:
    """The request's ``stop``: a string or a list of up to four; anything else is the client's error (400)."""
    if raw is None:
        return ()
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(x, str) for x in stops):
        raise RuntimeFailure(f"stop must be a string or a list of at most {MAX_STOPS} strings", status=400,
                             type="invalid_request_error", code="invalid_value")
    return tuple(x for x in stops if x)


class _Bridge:
    """What one answer's decoding thread hands the event loop: its items through a queue, and the cancel it checks
    at every token and prefill batch."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: asyncio.Queue[Any] = asyncio.Queue()
        self.cancel = threading.Event()

    def put(self, item: Any) -> None:
        """On the decoding thread: one item for the stream."""
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is reading, stop
            self.cancel.set()

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # at shutdown the loop may be closed: nothing to hand back to
            self.loop.call_soon_threadsafe(fn, *args)


def _top_logprobs(payload: dict[str, Any]) -> int | None:
    """The alternatives each token's logprobs entry names (None: no logprobs asked)."""
    if payload.get("logprobs") is not True:
        return None
    top = payload.get("top_logprobs")
    return min(20, top) if isinstance(top, int) and not isinstance(top, bool) and top > 0 else 0


def _grammar_of(payload: dict[str, Any]) -> str | None:
    """The grammar the answer is decoded under (None: free text); a schema it cannot be written for is the client's
    request's fault, a 400 before any context is taken."""
    structure = structure_of(payload)
    try:
        return None if structure is None else gbnf(structure)
    except GrammarError as e:
        raise RuntimeFailure(str(e), status=400, type="invalid_request_error", code="invalid_value") from None


def _failure(e: BaseException) -> RuntimeFailure:
    if isinstance(e, RuntimeFailure):
        return e
    if isinstance(e, GrammarError):
        return RuntimeFailure(str(e), status=400, type="invalid_request_error", code="invalid_value")
    if isinstance(e, ContextOverflow):
        return RuntimeFailure(str(e), status=400, type="invalid_request_error", code="context_length_exceeded")
    return RuntimeFailure(f"llama.cpp failed: {type(e).__name__}: {e}", status=500, type="server_error",
                          code="runtime_error")


Put = Callable[[Any], None]
# (engine, messages, max_tokens, sampling, rng, cancel, put) -> finish reason; see :func:`honest`
Generate = Callable[[LlamaEngine, list[dict[str, Any]], int, SamplingParams, random.Random, threading.Event, Put],
                    str | None]


def _run(engine: LlamaEngine, generate: Generate, job: tuple[str | None, int | None], messages: list[dict[str, Any]],
         max_tokens: int, sampling: SamplingParams, rng: random.Random, cancel: threading.Event, put: Put) -> None:
    """On the engine's thread: one request (``job``: its grammar, and the alternatives its logprobs name, either
    None), every outcome (finish, failure) sent through ``put``, then the end."""
    try:
        with engine.job(*job):
            finish = generate(engine, messages, max_tokens, sampling, rng, cancel, put)
        if finish is not None:
            put(finish)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the stream, or it hangs
        put(e)
    finally:
        put(_END)


def decode(engine: LlamaEngine, prompt: list[int], max_tokens: int, sampling: SamplingParams, rng: random.Random,
           cancel: threading.Event, put: Put) -> str | None:
    """Prefill ``prompt`` then decode until a stop token (``"stop"``), ``max_tokens`` (``"length"``) or cancel (None).

    Sends the prompt's token count first, then each token as ``[(id, bytes, reported)]`` (``reported``: its logprobs
    when the job asked for them, :meth:`~neurons.model.engine.LlamaEngine.reported`).
    """
    engine.check_fits(len(prompt), max_tokens)
    if not engine.begin(prompt, cancel):
        return None
    put(len(prompt))
    for position in range(max_tokens):
        if cancel.is_set():
            return None
        logits = engine.next_logits()
        token = engine.choose(logits, sampling, rng, position)
        if token in engine.stop_ids:
            return "stop"
        put([(token, engine.piece(token), engine.reported(logits, token))])
        engine.push(token)
    return "length"


def honest(engine: LlamaEngine, messages: list[dict[str, Any]], max_tokens: int, sampling: SamplingParams,
           rng: random.Random, cancel: threading.Event, put: Put) -> str | None:
    """What the subnet pays for: the model's own answer to the prompt, drawn as the request asked."""
    return decode(engine, engine.prompt_ids(messages), max_tokens, sampling, rng, cancel, put)


def answer_once(engine: LlamaEngine, messages: list[dict[str, Any]], max_tokens: int, sampling: SamplingParams,
                rng: random.Random, generate: Generate | None = None, grammar: str | None = None
                ) -> tuple[str, list[int], str]:
    """One answer without HTTP (benchmarks, tests), under ``grammar`` when given: (text as streamed, token ids,
    finish reason)."""
    ids: list[int] = []
    pieces: list[bytes] = []
    finish: list[str] = []

    def put(item: Any) -> None:
        if isinstance(item, list):
            for token_id, piece, *_ in item:
                ids.append(token_id)
                pieces.append(piece)
        elif isinstance(item, str):
            finish.append(item)
        elif isinstance(item, BaseException):
            raise item

    with engine.constrained(grammar):
        done = (generate or honest)(engine, messages, max_tokens, sampling, rng, threading.Event(), put)
    return b"".join(pieces).decode("utf-8", errors="replace"), ids, done or (finish[-1] if finish else "length")
