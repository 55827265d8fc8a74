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
import codecs
import contextlib
import random
import secrets
import threading
import time
from collections import deque
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
from gateway.protocol.sse import DONE_FRAME, ChunkFramer, frame
from gateway.protocol.structure import structure_of
from gateway.protocol.tools import prompt_messages
from neurons.model.engine import ContextOverflow, EngineThread, LlamaEngine, Reported
from neurons.model.grammar import GrammarError, gbnf
from neurons.model.packaged import MODEL_ID, ModelUnavailable

from .base import RuntimeFailure, RuntimeHealth
from .features import CallGate

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
        options, named = payload.get("stream_options"), payload.get("model")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        out = ChunkFramer("chatcmpl-" + secrets.token_hex(12), int(time.time()),
                          named if isinstance(named, str) else self.model)
        framing = _Framing(out, _stop_strings(payload.get("stop")), want_ids=payload.get("return_token_ids") is True,
                           gate=payload.get("tools") and payload.get("tool_choice", "auto") != "none",
                           logprobs=top_logprobs is not None)
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


class _Framing:
    """One answer's tokens as frames: UTF-8 decoded across token boundaries, the client's stop strings honoured
    (:class:`StopMatcher`), an answer that may be a tool call held back (:class:`~.features.CallGate`, with
    ``gate``), each chunk naming its ids when asked (``want_ids``) and its tokens' logprobs (``logprobs``: an entry
    a token, OpenAI's shape, from what the decoding thread reported)."""

    def __init__(self, out: ChunkFramer, stops: tuple[str, ...], *, want_ids: bool, gate: Any,
                 logprobs: bool = False) -> None:
        self.out = out
        self.want_ids = want_ids
        self.logprobs: deque[dict[str, Any]] | None = deque() if logprobs else None  # entries of tokens not framed
        self.gate = CallGate() if gate else None
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text_out = StopMatcher(stops)
        self.held: list[int] = []  # ids of bytes not yet a whole character
        self.completion = 0

    @property
    def stopped(self) -> bool:
        return self.text_out.stopped

    def _framed(self, pieces: list[tuple[str, list[int]]]) -> list[bytes]:
        out, want_ids, entries = self.out, self.want_ids, self.logprobs
        if entries is not None:
            return [frame(out.chunk({"content": t}, None, {"content": [entries.popleft() for _ in ids if entries]},
                                    token_ids=ids if want_ids else None)) for t, ids in pieces if t or ids]
        return [out.tokens(t, ids) if want_ids else out.content(t) for t, ids in pieces if t or ids]

    def _chunks(self, pieces: list[tuple[str, list[int]]]) -> list[bytes]:
        return self._framed(pieces if self.gate is None else self.gate.feed(pieces))

    def feed(self, item: list[tuple[Any, ...]]) -> bytes:
        """A batch of (id, bytes[, reported]) from the decoding thread: the frames that may be sent now."""
        batch: list[bytes] = []
        for token_id, piece, *reported in item:
            if self.logprobs is not None:
                self.logprobs.append(_entry(piece, reported[0] if reported else None))
            self.completion += 1
            self.held.append(token_id)
            text = self.decoder.decode(piece)
            if text:
                batch += self._chunks(self.text_out.feed(text, self.held))
                self.held = []
                if self.text_out.stopped:
                    break
        return b"".join(batch)

    def close(self, finish: str, prompt_tokens: int | None) -> bytes:
        """What is left, the finish chunk (``tool_calls`` when the held answer was a call), the usage chunk with
        ``prompt_tokens``, and ``[DONE]``."""
        tail: list[bytes] = []
        if not self.text_out.stopped:
            tail_text = self.decoder.decode(b"", final=True)
            tail += self._chunks(self.text_out.feed(tail_text, self.held) if tail_text or self.held else [])
            tail += self._chunks(self.text_out.flush())
        if self.gate is not None:
            frames, called = self.gate.close(self.out, self._framed, self.want_ids)
            tail += frames
            finish = "tool_calls" if called else finish
        tail.append(frame(self.out.chunk({}, finish)))
        if prompt_tokens is not None:
            n = self.completion
            tail.append(self.out.usage({"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                        "total_tokens": prompt_tokens + n}))
        tail.append(DONE_FRAME)
        return b"".join(tail)


def _entry(piece: bytes, reported: Reported | None) -> dict[str, Any]:
    """One token's ``logprobs.content`` entry (a token whose runtime reported nothing gets a logprob of 0)."""
    logprob, top = reported if reported is not None else (0.0, ())
    return {"token": piece.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(piece),
            "top_logprobs": [{"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}
                             for b, lp in top]}


class StopMatcher:
    """Streams text with the client's ``stop`` strings honoured, as OpenAI and vLLM do: the answer ends before the
    first stop string, which is not sent.

    Text that could be the start of a stop string is held back until it is known not to be one, a whole
    token at a time: every chunk still names exactly the ids that spell it, and a stop string's own tokens
    (and anything after it within its last token) go with the last chunk's ids, so the audit sees the ids
    the model produced (:func:`scoring.audit.verdict.check_ids` allows that tail after a stop string).
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.stopped = False
        self._pending: list[tuple[str, list[int]]] = []  # tokens held back, with their ids

    def feed(self, text: str, ids: list[int]) -> list[tuple[str, list[int]]]:
        """One decoded token's text and the ids that spell it; returns what may be sent now."""
        if not self.stops:
            return [(text, ids)]
        self._pending.append((text, list(ids)))
        joined = "".join(t for t, _ in self._pending)
        hits = [i for i in (joined.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            all_ids = [i for _, tok in self._pending for i in tok]
            self._pending = []
            return [(joined[:min(hits)], all_ids)]
        keep = max((k for s in self.stops for k in range(1, min(len(s), len(joined) + 1))
                    if joined.endswith(s[:k])), default=0)
        ready: list[tuple[str, list[int]]] = []
        sent = 0
        while self._pending and sent + len(self._pending[0][0]) <= len(joined) - keep:
            token = self._pending.pop(0)
            sent += len(token[0])
            ready.append(token)
        return ready

    def flush(self) -> list[tuple[str, list[int]]]:
        """The end of the answer: whatever was held back is not a stop string after all."""
        ready, self._pending = self._pending, []
        return ready


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
