"""A simulated RTX 5090 inference runtime: OpenAI chat-completion SSE frames with a card's timing.

The local subnet, the tests and the soak runs need miners that behave like a real card under load
without a GPU. The load model is a handful of parameters (:class:`CardProfile`); the timing comes
from real ``asyncio`` sleeps, so the validator measures it exactly as it would a real card. What it
says is the toy model's answer (:mod:`neurons.model.toy`), each token's id named, so the validator
can audit it as it would a real model's.

Load model (all durations divided by ``time_scale``):

* TTFT = queued prefill of others + own prefill (``prompt_tokens / prefill_tok_s``) + ``base_ttft_s``
  + ``ttft_per_stream_s`` x (other streams active at arrival), times a small jitter, plus ``hang_s``.
  Prefill is serial on the card: a request arriving while others are still prefilling waits for them.
* Decode: every active stream (prefilling or decoding) shares the card. One stream decodes at
  ``single_tok_s`` (440 tok/s); with n >= 2 each gets ``aggregate_tok_s / n`` (300 tok/s in total).
  The rate is recomputed every tick, so it follows streams joining and leaving.

Cheap on a 2-core machine: one sleep per tick (``tick_s`` of real time, not scaled: a compressed run
emits more tokens per tick instead of waking more often); the tokens due in a tick are written as
separate chunks in one ``yield``. Tokens accrue from the time actually elapsed, so a late wake-up
under load does not lower the rate, and from when the first token was due, not from when the loop
got round to sending it: a GPU's decode does not wait for this machine's CPU, and a stream stretched by
every late wake-up stays active longer and slows the card's other streams (beside two CPU hogs, a card
carrying other validators' streams read 10 % fewer cards than quiet, issue 38).

Example::

    rt = SimulatedRuntime(parse_profile("rtx5090:time_scale=10"), rng=random.Random(0))
    async for frames in rt.stream({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}):
        print(frames.decode(), end="")     # data: {...chat.completion.chunk...}\\n\\n ... data: [DONE]\\n\\n
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import secrets
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from gateway.protocol.openai import SUBNET_SAMPLER, requested_max_tokens
from gateway.protocol.sampling import SamplingParams
from gateway.protocol.sse import DONE_FRAME, ChunkFramer, frame
from gateway.protocol.tokens import estimate_prompt_tokens

from ...model.toy import MODEL, STOP_SHARE
from .base import RuntimeFailure, RuntimeHealth
from .features import (
    SIMULATED_FEATURES,
    as_json,
    call_arguments,
    call_frames,
    pieces,
    schema_problem,
    tool_to_call,
    toy_logprobs,
    wants_json,
)


@dataclass(frozen=True, slots=True)
class CardProfile:
    """The load model of one card, plus fault knobs for tests (probabilities are per request)."""

    name: str = "rtx5090"
    base_ttft_s: float = 0.45
    prefill_tok_s: float = 24000.0
    ttft_per_stream_s: float = 0.02  # each other active stream adds this much to a new request's TTFT
    single_tok_s: float = 440.0
    aggregate_tok_s: float = 300.0  # total decode throughput once 2+ streams share the card
    jitter: float = 0.03  # relative std of a per-request factor on TTFT and decode rate
    time_scale: float = 1.0
    tick_s: float = 0.015  # real seconds between writes while decoding
    max_completion_tokens: int = 4096  # like a runtime's context limit: longer requests are clamped
    stop_rate: float = STOP_SHARE  # share of prompts the model ends between 50 % and 100 % of max_tokens (a
    #                                 different share is a different model: it fails the toy reference's audits)
    # fault knobs
    fail_rate: float = 0.0  # refuse before the first byte (HTTP 500)
    hang_s: float = 0.0  # extra wait before the first token
    drop_after_tokens: int = 0  # > 0: end the stream abruptly after this many tokens (no finish, no [DONE])
    garbage: float = 0.0  # chance of an invalid-JSON frame after the first token
    overlong: float = 0.0  # chance of ignoring max_tokens (25 % more tokens, at least 8)
    nan_usage: float = 0.0  # chance of NaN in the usage chunk
    # cheats (the soak's adversarial scenario): what a dishonest miner does with a real card
    stop_after_tokens: int = 0  # > 0: answer this many tokens, then claim the model stopped ("stop")
    chunks_per_token: int = 1  # > 1: cut each token's text into this many chunks and name no token ids
    random_words: int = 0  # 1: no model at all: random words (with ids), fast, to max_tokens

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"CardProfile.{f.name} must be finite, got {v!r}")
        positive = ("base_ttft_s", "prefill_tok_s", "single_tok_s", "aggregate_tok_s", "time_scale", "tick_s")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"CardProfile.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("ttft_per_stream_s", "jitter", "hang_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"CardProfile.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("stop_rate", "fail_rate", "garbage", "overlong", "nan_usage"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"CardProfile.{name} is a probability in [0, 1], got {getattr(self, name)!r}")
        if self.max_completion_tokens < 1 or self.drop_after_tokens < 0 or self.stop_after_tokens < 0:
            raise ValueError("max_completion_tokens must be >= 1, drop_after_tokens and stop_after_tokens >= 0")
        if self.chunks_per_token < 1:
            raise ValueError(f"chunks_per_token must be >= 1, got {self.chunks_per_token}")

    def per_stream_tok_s(self, n: int) -> float:
        """Simulated decode rate of each of ``n`` streams sharing the card."""
        if n <= 1:
            return self.single_tok_s
        return self.aggregate_tok_s / n

    def ttft_s(self, prompt_tokens: int, others: int, queued_prefill_s: float = 0.0) -> float:
        """Simulated TTFT without jitter or hang, for a request arriving with ``others`` streams active."""
        prefill = prompt_tokens / self.prefill_tok_s
        return queued_prefill_s + prefill + self.base_ttft_s + self.ttft_per_stream_s * others


PROFILES: dict[str, CardProfile] = {
    "rtx5090": CardProfile(),
    "rtx5090-slow": CardProfile(name="rtx5090-slow", base_ttft_s=0.9, prefill_tok_s=12000.0,
                                single_tok_s=220.0, aggregate_tok_s=150.0),
    "rtx5090-flaky": CardProfile(name="rtx5090-flaky", fail_rate=0.05, garbage=0.02),
}


def _coerce(name: str, raw: str) -> int | float:
    """Overrides take the type of the field's default (``int`` or ``float``)."""
    return int(raw) if isinstance(getattr(CardProfile(), name), int) else float(raw)


def parse_profile(spec: str) -> CardProfile:
    """``"rtx5090"`` or ``"rtx5090-slow:time_scale=10,fail_rate=0.1"`` -> a :class:`CardProfile`."""
    name, _, overrides = spec.strip().partition(":")
    if name not in PROFILES:
        raise ValueError(f"unknown card profile {name!r}; known: {', '.join(sorted(PROFILES))}")
    base = PROFILES[name]
    if not overrides.strip():
        return base
    fields = {f.name for f in dataclasses.fields(CardProfile)}
    changes: dict[str, Any] = {}
    for item in overrides.split(","):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key not in fields or key == "name":
            raise ValueError(f"bad profile override {item!r}; expected key=value with key one of "
                             f"{', '.join(k for k in fields if k != 'name')}")
        try:
            changes[key] = _coerce(key, raw.strip())
        except ValueError:
            raise ValueError(f"profile override {key}={raw!r} is not a number") from None
    return dataclasses.replace(base, **changes)


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _tail(frames: ChunkFramer, finish: str, usage: tuple[int, int] | None, *, nan_usage: bool) -> bytes:
    """The finish chunk, the usage chunk when asked for (``usage``: prompt and completion tokens), and ``[DONE]``."""
    tail = [frame(frames.chunk({}, finish))]
    if usage is not None:
        tail.append(_nan_usage(frames, usage[1]) if nan_usage else frames.usage(_usage(*usage)))
    tail.append(DONE_FRAME)
    return b"".join(tail)


def _nan_usage(frames: ChunkFramer, completion: int) -> bytes:
    """A usage chunk with NaN in it: a fault the gateway must catch (``frame`` itself refuses NaN)."""
    return frames.usage(_usage(0, completion)).replace(b'"prompt_tokens":0', b'"prompt_tokens":NaN')


GARBAGE_FRAME = b'data: {"object": "chat.completion.chunk", "choices": [{"delta": {"content": \xff\xfe\n\n'


class SimulatedRuntime:
    """One simulated card shared by all the streams it serves."""

    def __init__(self, profile: CardProfile, rng: random.Random | None = None) -> None:
        self.profile = profile
        self.name = f"sim:{profile.name}"
        # A simulated card stands for a card that runs the subnet's sampler: its seeded answers are drawn from the
        # seed (neurons.model.toy.SeededDraws), so the same seed gives the same answer and the audit replays it.
        self.sampler: str | None = SUBNET_SAMPLER
        self.features = SIMULATED_FEATURES  # tools, JSON mode and logprobs, in the shapes a real server writes them
        self._rng = rng if rng is not None else random.Random()
        self._active = 0
        self._prefill_free_at = 0.0  # loop time when the card's prefill queue drains

    @property
    def active(self) -> int:
        return self._active

    def health(self) -> RuntimeHealth:
        return RuntimeHealth(ok=True, detail=f"simulated {self.profile.name}")

    def _factor(self) -> float:
        j = self.profile.jitter
        return max(0.5, 1.0 + self._rng.gauss(0.0, j)) if j > 0 else 1.0

    def _chunk(self, frames: ChunkFramer, token: int) -> bytes:
        """One token's chunk, naming its id, as vLLM's ``return_token_ids`` does."""
        text = MODEL.piece(token).decode()
        k = self.profile.chunks_per_token
        if k > 1:
            cut = [text[len(text) * j // k: len(text) * (j + 1) // k] for j in range(k)]
            return b"".join(frames.content(piece) for piece in cut if piece)
        return frames.tokens(text, [token])

    def _frames(self, frames: ChunkFramer, tokens: list[int],
                payload: dict[str, Any]) -> tuple[list[bytes] | None, str | None]:
        """The frames of an answer that uses a feature (:mod:`.features`), one a token, and the finish reason it
        forces; None for plain text, framed a tick at a time (a long answer framed at once would hold the event
        loop for milliseconds). JSON and tool calls name no ids: their text is not the toy model's."""
        tool = tool_to_call(payload)
        if tool is not None:
            text = b"".join(MODEL.piece(t) for t in tokens).decode(errors="replace")
            return call_frames(frames, [(tool, call_arguments(payload, tool, text))], None,
                               "call_" + secrets.token_hex(6), pieces_per_call=max(1, len(tokens) - 1)), "tool_calls"
        if wants_json(payload):
            text = b"".join(MODEL.piece(t) for t in tokens).decode(errors="replace")
            return [frames.content(p) for p in pieces(as_json(text, payload), len(tokens))], "stop"  # the object closed
        if payload.get("logprobs") is True:
            rows = MODEL.rows(MODEL.key(payload.get("messages")), len(tokens), requested_max_tokens(payload))
            top = payload.get("top_logprobs")
            top = top if isinstance(top, int) and not isinstance(top, bool) else 0
            return [frame(frames.chunk({"content": MODEL.piece(t).decode()}, None, toy_logprobs(rows[i], t, top),
                                       token_ids=[t])) for i, t in enumerate(tokens)], None
        return None, None

    def _tokens(self, payload: dict[str, Any], max_tokens: int, total: int) -> tuple[list[int], bool]:
        """The answer's ids and whether the model ended it: the toy model's draw (from the request's seed when the
        card runs the subnet's sampler), or random words for a card with no model at all."""
        p, rng = self.profile, self._rng
        if p.random_words:
            return [rng.randrange(MODEL.n) + (MODEL.n if i == 0 else 0) for i in range(total)], False
        sampling = SamplingParams.of(payload)
        if self.sampler != SUBNET_SAMPLER:  # a stock runtime's card: its own RNG, whatever the seed
            sampling = dataclasses.replace(sampling, seed=None)
        return MODEL.generate(MODEL.key(payload.get("messages")), max_tokens, sampling, rng, total=total,
                              share=p.stop_rate)

    def _answer(self, payload: dict[str, Any], max_tokens: int) -> tuple[list[int], str]:
        """The answer's ids and its finish reason, the profile's fault and cheat applied (overlong, an early stop)."""
        p = self.profile
        total = min(max_tokens, p.max_completion_tokens)
        if self._rng.random() < p.overlong:
            total = max_tokens + max(8, max_tokens // 4)
        tokens, ended = self._tokens(payload, max_tokens, total)
        if 0 < p.stop_after_tokens < len(tokens):
            return tokens[: p.stop_after_tokens], "stop"
        return tokens, "stop" if ended else "length"

    def _ttft_real(self, prompt_tokens: int, others: int, now: float) -> float:
        """Real seconds to the first token of a request arriving ``now``: its wait for the card's serial prefill
        queue, then its TTFT (scaled)."""
        p = self.profile
        start = max(now, self._prefill_free_at)
        self._prefill_free_at = start + prompt_tokens / p.prefill_tok_s / p.time_scale
        return start - now + (p.ttft_s(prompt_tokens, others) * self._factor() + p.hang_s) / p.time_scale

    def _refuse(self, payload: dict[str, Any]) -> None:
        """The profile's failures, and a schema a real runtime would not compile (the client's 400)."""
        if self.profile.fail_rate > 0 and self._rng.random() < self.profile.fail_rate:
            raise RuntimeFailure("simulated runtime failure", status=500, type="server_error", code="sim_failure")
        problem = schema_problem(payload)
        if problem is not None:
            raise RuntimeFailure(problem, status=400, type="invalid_request_error", code="invalid_value")

    async def stream(self, payload: dict[str, Any]) -> AsyncGenerator[bytes, None]:
        """Serve one chat completion as SSE frames; raises :class:`RuntimeFailure` before the first frame."""
        p = self.profile
        rng = self._rng
        self._refuse(payload)
        loop = asyncio.get_running_loop()
        ts = p.time_scale
        prompt_tokens = estimate_prompt_tokens(payload.get("messages"))
        tokens, finish = self._answer(payload, requested_max_tokens(payload))
        drop_at = p.drop_after_tokens if p.drop_after_tokens > 0 else None
        garbage = rng.random() < p.garbage
        nan_usage = rng.random() < p.nan_usage
        options, named = payload.get("stream_options"), payload.get("model")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        frames = ChunkFramer("chatcmpl-" + secrets.token_hex(12), int(time.time()),
                             named if isinstance(named, str) else f"sim/{p.name}")
        featured, forced = self._frames(frames, tokens, payload)
        finish = forced or finish
        total = len(tokens) if featured is None else len(featured)

        def chunks(a: int, b: int) -> bytes:
            if featured is not None:
                return b"".join(featured[a:b])
            return b"".join(self._chunk(frames, t) for t in tokens[a:b])

        others = self._active
        self._active += 1
        try:
            now = loop.time()
            first_at = now + self._ttft_real(prompt_tokens, others, now)  # the first token, on the card's own clock
            decode_factor = self._factor()
            yield frame(frames.chunk({"role": "assistant"}, None))
            await asyncio.sleep(max(0.0, first_at - loop.time()))

            yield chunks(0, 1) + (GARBAGE_FRAME if garbage else b"")
            emitted = 1
            last = min(first_at, loop.time())  # decode runs from the first token's time, not from a late wake-up
            owed = 0.0
            stop_at = min(total, drop_at) if drop_at is not None else total
            while emitted < stop_at:
                rate = p.per_stream_tok_s(self._active) * decode_factor * ts  # real tokens per second
                need = stop_at - emitted - owed
                await asyncio.sleep(min(p.tick_s, max(0.0, need / rate)))
                now = loop.time()
                owed += (now - last) * rate
                last = now
                k = min(int(owed), stop_at - emitted)
                if k <= 0:
                    continue
                owed -= k
                emitted += k
                yield chunks(emitted - k, emitted)
            if drop_at is not None and emitted >= drop_at:
                return  # abrupt end: no finish_reason, no [DONE]
            yield _tail(frames, finish, (prompt_tokens, emitted) if include_usage else None, nan_usage=nan_usage)
        finally:
            self._active -= 1
