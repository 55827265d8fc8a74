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
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any

from gateway.protocol.openai import requested_max_tokens
from gateway.protocol.sampling import SamplingParams
from gateway.protocol.sse import DONE_FRAME, ChunkFramer, frame
from neurons.model.engine import ContextOverflow, EngineThread, LlamaEngine
from neurons.model.packaged import MODEL_ID, ModelUnavailable

from .base import RuntimeFailure, RuntimeHealth

_END = object()  # the worker's last item


class LlamaRuntime:
    """``slots`` llama.cpp contexts over one model file, each decoding on its own thread."""

    def __init__(self, path: Path, *, slots: int = 1, threads: int = 1, n_ctx: int = 2048,
                 model: str = MODEL_ID, seed: int | None = None, generate: Generate | None = None) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.name = f"llama.cpp:{model}"
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
        self._active = 0
        self._state = "not started"
        self._ready = False

    @property
    def active(self) -> int:
        return self._active

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
        messages = payload.get("messages")
        if not isinstance(messages, list):
            raise RuntimeFailure("messages must be a list", status=400, type="invalid_request_error",
                                 code="invalid_value")
        max_tokens = requested_max_tokens(payload)
        sampling = SamplingParams.of(payload)
        seed = payload.get("seed")
        rng = random.Random(seed) if isinstance(seed, int) and not isinstance(seed, bool) else \
            random.Random(self._rng.getrandbits(64))
        options = payload.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        want_ids = payload.get("return_token_ids") is True
        named = payload.get("model")
        out = ChunkFramer("chatcmpl-" + secrets.token_hex(12), int(time.time()),
                          named if isinstance(named, str) else self.model)

        worker = await self._free.get()
        self._active += 1
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[Any] = asyncio.Queue()
        cancel = threading.Event()
        self._cancels.add(cancel)

        def put(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(items.put_nowait, item)
            except RuntimeError:  # the event loop is gone (shutdown): nobody is reading, stop
                cancel.set()

        def slot_free(_job: object) -> None:
            with contextlib.suppress(RuntimeError):  # at shutdown the loop may be closed: no pool to return to
                loop.call_soon_threadsafe(self._free.put_nowait, worker)

        job = worker.submit(_run, self._generate, messages, max_tokens, sampling, rng, cancel, put)
        try:
            first = await items.get()
            if isinstance(first, BaseException):
                raise _failure(first)
            if not isinstance(first, int):
                raise RuntimeFailure("runtime ended before the prompt was read", status=500, type="server_error",
                                     code="runtime_error")
            prompt_tokens = int(first)
            yield frame(out.chunk({"role": "assistant"}, None))
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            held: list[int] = []
            completion = 0
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
                batch: list[bytes] = []
                for token_id, piece in item:
                    completion += 1
                    held.append(token_id)
                    text = decoder.decode(piece)
                    if text:
                        batch.append(out.tokens(text, held) if want_ids else out.content(text))
                        held = []
                if batch:
                    yield b"".join(batch)
            tail_text = decoder.decode(b"", final=True)
            tail: list[bytes] = []
            if tail_text or held:
                tail.append(out.tokens(tail_text, held) if want_ids else out.content(tail_text))
            tail.append(frame(out.chunk({}, finish)))
            if include_usage:
                tail.append(out.usage({"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                                       "total_tokens": prompt_tokens + completion}))
            tail.append(DONE_FRAME)
            yield b"".join(tail)
        finally:
            cancel.set()
            self._cancels.discard(cancel)
            self._active -= 1
            # the slot is free once its thread has left the job (a cancelled job stops at its next token)
            job.add_done_callback(slot_free)


def _failure(e: BaseException) -> RuntimeFailure:
    if isinstance(e, RuntimeFailure):
        return e
    if isinstance(e, ContextOverflow):
        return RuntimeFailure(str(e), status=400, type="invalid_request_error", code="context_length_exceeded")
    return RuntimeFailure(f"llama.cpp failed: {type(e).__name__}: {e}", status=500, type="server_error",
                          code="runtime_error")


Put = Callable[[Any], None]
# (engine, messages, max_tokens, sampling, rng, cancel, put) -> finish reason; see :func:`honest`
Generate = Callable[[LlamaEngine, list[dict[str, Any]], int, SamplingParams, random.Random, threading.Event, Put],
                    str | None]


def _run(engine: LlamaEngine, generate: Generate, messages: list[dict[str, Any]], max_tokens: int,
         sampling: SamplingParams, rng: random.Random, cancel: threading.Event, put: Put) -> None:
    """On the engine's thread: one request, every outcome (finish, failure) sent through ``put``, then the end."""
    try:
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

    Sends the prompt's token count first, then each token as ``[(id, bytes)]``.
    """
    engine.check_fits(len(prompt), max_tokens)
    engine.begin(prompt)
    put(len(prompt))
    for position in range(max_tokens):
        if cancel.is_set():
            return None
        token = engine.choose(engine.next_logits(), sampling, rng, position)
        if token in engine.stop_ids:
            return "stop"
        put([(token, engine.piece(token))])
        engine.push(token)
    return "length"


def honest(engine: LlamaEngine, messages: list[dict[str, Any]], max_tokens: int, sampling: SamplingParams,
           rng: random.Random, cancel: threading.Event, put: Put) -> str | None:
    """What the subnet pays for: the model's own answer to the prompt, drawn as the request asked."""
    return decode(engine, engine.prompt_ids(messages), max_tokens, sampling, rng, cancel, put)


def answer_once(engine: LlamaEngine, messages: list[dict[str, Any]], max_tokens: int, sampling: SamplingParams,
                rng: random.Random, generate: Generate | None = None) -> tuple[str, list[int], str]:
    """One answer without HTTP (benchmarks, tests): (text as streamed, token ids, finish reason)."""
    ids: list[int] = []
    pieces: list[bytes] = []
    finish: list[str] = []

    def put(item: Any) -> None:
        if isinstance(item, list):
            for token_id, piece in item:
                ids.append(token_id)
                pieces.append(piece)
        elif isinstance(item, str):
            finish.append(item)
        elif isinstance(item, BaseException):
            raise item

    done = (generate or honest)(engine, messages, max_tokens, sampling, rng, threading.Event(), put)
    return b"".join(pieces).decode("utf-8", errors="replace"), ids, done or (finish[-1] if finish else "length")
