"""Measuring one miner stream from its bytes: pure code, fed the body as it arrives, with the time it arrived.

Everything the validator pays on is decided here, so it is kept apart from sockets and tested byte by
byte: TTFT ends at the first chunk that carries content (a role-only prelude does not count);
completion tokens are counted here, never taken from the miner's usage claim: the token ids a chunk
names (``choice.token_ids``), or one per content chunk from a miner that names none; a stream is
complete only with ``[DONE]`` or a finish reason followed by a clean end. Whatever a miner sends that
breaks these rules raises :class:`MeterFailure` with the :class:`~gateway.protocol.measurement.FailureReason`
it earns: garbage (invalid SSE, JSON, UTF-8, NaN, wrong shape, more text than its tokens can
spell), overlong (more tokens than ``max_tokens``), empty (finished without content), dropped (an
error event, or the end before a finish).

Example::

    meter = StreamMeter(max_tokens=64, started_at=t0)
    chunks = meter.feed(b'data: {"choices":[{"delta":{"content":"Hi"}}]}\\n\\n', now=t0 + 0.3)
    meter.ttft_s, meter.tokens          # 0.3, 1
    meter.feed(b"data: [DONE]\\n\\n", now=t0 + 0.4)
    meter.done                          # True
"""

from __future__ import annotations

from typing import Any

from gateway.protocol.measurement import FailureReason

from .protocol.sse import DONE, ChunkInfo, SSEErrorEvent, SSEGarbage, SSEParser, fold_tool_calls, parse_chunk

CHARS_PER_TOKEN_CAP = 32  # characters of answer text allowed per token of max_tokens (plus one chunk's worth)
HELD_CHUNK_OVERHEAD = 64  # what holding one more piece of text costs beyond its characters (a str object)
CHARS_PER_TOKEN_ESTIMATE = 4  # what an answer without token ids is credited: its characters / 4


class AnswerBudget:
    """Characters of answer text the gateway may hold at once, across every stream that holds its answer
    (each piece charged :data:`HELD_CHUNK_OVERHEAD` more, so one-character chunks cannot hide their weight).

    One answer is capped (``StreamMeter.max_chars``); this caps them all together: a non-streamed answer
    is held whole until it is complete, and so is every answer kept for an audit. Issue 15 measured 16
    concurrent non-streamed answers at the limits of the time take the gateway from 82 to 446 MB.
    Running out is the validator's condition (``local_resources``: no miner blamed, the client gets 503).
    """

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max(0, max_chars)
        self.held = 0
        self.refused = 0

    def take(self, n: int) -> bool:
        if self.held + n > self.max_chars:
            self.refused += 1
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held = max(0, self.held - n)


class MeterFailure(Exception):
    """The stream broke a rule; ``reason`` is what the miner is booked for."""

    def __init__(self, reason: FailureReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class StreamMeter:
    """The state of one stream's measurement. ``feed`` and ``end`` raise :class:`MeterFailure`."""

    def __init__(self, max_tokens: int, started_at: float, *, max_line_bytes: int = 64 * 1024,
                 max_content_chars: int = 4096, keep_answer: bool = False,
                 budget: AnswerBudget | None = None, must_hold: bool = False, timeline: bool = False) -> None:
        self.max_tokens = max_tokens
        self.started_at = started_at
        self._parser = SSEParser(max_line_bytes=max_line_bytes)
        self._max_content = max_content_chars
        self.tokens = 0
        self.ttft_s: float | None = None
        self.last_event_at = started_at  # any valid event: what the stall deadline counts from
        self.last_content_at = started_at
        self.finish_reason: str | None = None
        self.usage: dict[str, int] | None = None
        self.done = False  # [DONE] seen: the answer is complete
        self.pending: MeterFailure | None = None  # a failure found after valid chunks of the same read
        self._conc_area = 0.0
        self._first_in_flight = 1
        # the answer itself, for an audit: the text the client receives and the ids said to spell it
        self.keep_answer = keep_answer
        self.text: list[str] = []
        self.ids: list[int] = []
        self.calls: dict[int, dict[str, Any]] = {}  # tool calls streamed (sse.fold_tool_calls), kept with the text
        self.ids_complete = True  # every content chunk named its token ids
        self.logprobs: list[float] = []  # each id's reported logprob, where its chunk named one per id (kept answers)
        # What one answer may weigh: a non-streamed answer is held whole, so a miner sending 4 KB per
        # token at max_tokens would cost 16 MB a request (issue 15: 16 such requests took RSS 82 -> 446 MB).
        # No tokenizer's average token comes near 32 characters.
        self.max_chars = CHARS_PER_TOKEN_CAP * max_tokens + max_content_chars
        self.chars = 0
        self.budget = budget  # set when this stream's answer is held (non-streamed, or kept for an audit)
        self.must_hold = must_hold  # the answer is useless unless held whole (non-streamed): fail when it can't be
        self.held = 0  # characters taken from the budget; given back by release()
        # (seconds after the start, countable tokens so far) at each read that brought tokens: capacity-check
        # streams only (a check's streams are few; scoring reads what each delivered by a common deadline)
        self.arrivals: list[tuple[float, int]] | None = [] if timeline else None

    @property
    def countable_tokens(self) -> int:
        """The tokens decode rate and pay count: the ids named, or for a stream that left some out, its
        characters / 4 (the usual English average; at most ``max_tokens``) whatever its chunks, so cutting
        text into more chunks earns nothing."""
        if self.ids_complete:
            return self.tokens
        return min(self.max_tokens, -(-self.chars // CHARS_PER_TOKEN_ESTIMATE))

    @property
    def content_started(self) -> bool:
        return self.ttft_s is not None

    def feed(self, data: bytes, now: float, in_flight: int = 1) -> list[ChunkInfo]:
        """The chunks in ``data`` (one network read). ``in_flight``: the miner's streams delivering tokens
        right now, this one included.

        A rule broken after valid chunks of the same read is kept in ``pending`` and those chunks are
        returned (what the miner sent before breaking a rule still reaches the client); the next
        :meth:`feed` or :meth:`end` raises it. Bytes after ``[DONE]`` are ignored.
        """
        if self.pending is not None:
            raise self.pending
        if self.done or not data:
            return []
        out: list[ChunkInfo] = []
        before = self.countable_tokens if self.arrivals is not None else 0  # check streams only: the hot path skips it
        try:
            self._feed(data, now, in_flight, out)
        except MeterFailure as e:
            if not out:
                raise
            self.pending = e
        if self.arrivals is not None and self.countable_tokens > before:
            self.arrivals.append((now - self.started_at, self.countable_tokens))
        return out

    def _feed(self, data: bytes, now: float, in_flight: int, out: list[ChunkInfo]) -> None:
        try:
            events = self._parser.feed(data)
        except SSEGarbage as e:
            raise MeterFailure(FailureReason.GARBAGE, str(e)) from None
        for ev in events:
            if ev == DONE or (ev[:1] != "{" and ev.strip() == DONE):
                if self.tokens == 0:
                    raise MeterFailure(FailureReason.EMPTY, "[DONE] without content")
                self.done = True
                break
            try:
                chunk = parse_chunk(ev, self._max_content)
            except SSEErrorEvent as e:
                raise MeterFailure(FailureReason.DROPPED, str(e)) from None
            except SSEGarbage as e:
                raise MeterFailure(FailureReason.GARBAGE, str(e)) from None
            self.last_event_at = now
            ids = chunk.token_ids
            text = chunk.text  # the content, and a tool call's name and arguments
            n = len(ids) if ids else (1 if text else 0)  # the ids it names, else one per content chunk
            if n:
                if self.tokens + n > self.max_tokens:
                    raise MeterFailure(FailureReason.OVERLONG, f"more than max_tokens={self.max_tokens} tokens")
                self.tokens += n
                if ids and self.keep_answer:
                    self.ids += ids
                    if chunk.logprobs is not None:  # the audit checks them against the reference's
                        self.logprobs += [e["logprob"] for e in chunk.logprobs.get("content") or ()][:len(ids)]
            if text:
                self.chars += len(text)
                if self.chars > self.max_chars:
                    raise MeterFailure(FailureReason.GARBAGE, f"more than {self.max_chars} characters of text for "
                                                              f"max_tokens={self.max_tokens}")
                if self.budget is not None:
                    self._hold(self.budget, len(text) + HELD_CHUNK_OVERHEAD)
                if not ids:
                    self.ids_complete = False
                if self.keep_answer:
                    self.text.append(chunk.content)
                    if chunk.tool_calls is not None:
                        fold_tool_calls(self.calls, chunk.tool_calls)
                if self.ttft_s is None:
                    self.ttft_s = now - self.started_at
                    self._first_in_flight = in_flight
                else:
                    self._conc_area += in_flight * (now - self.last_content_at)
                self.last_content_at = now
            if chunk.finish_reason is not None:
                self.finish_reason = chunk.finish_reason
            if chunk.usage is not None:
                self.usage = chunk.usage
            out.append(chunk)

    def _hold(self, budget: AnswerBudget, cost: int) -> None:
        """Count ``cost`` characters against the answers' budget. Over it, an answer the client waits for whole
        fails (the gateway's own memory, not the miner's fault); one kept only for a possible audit stops being
        kept, and the stream goes on."""
        if budget.take(cost):
            self.held += cost
        elif self.must_hold:
            raise MeterFailure(FailureReason.LOCAL_RESOURCES,
                               f"the gateway already holds {budget.held} characters of answers")
        else:
            self.release()
            self.budget, self.keep_answer = None, False
            self.text.clear()
            self.ids.clear()
            self.logprobs.clear()
            self.calls.clear()

    def release(self) -> None:
        """Give the held characters back to the budget (the stream ended; idempotent)."""
        if self.budget is not None and self.held:
            self.budget.give(self.held)
            self.held = 0

    def end(self) -> None:
        """The body ended without ``[DONE]``: complete only when a finish reason came after content."""
        if self.pending is not None:
            raise self.pending
        if self.done:
            return
        if self.finish_reason is not None and self.tokens > 0:
            self.done = True  # finished but forgot [DONE]: the answer is complete
        elif self.finish_reason is not None:
            raise MeterFailure(FailureReason.EMPTY, "finished without content")
        else:
            raise MeterFailure(FailureReason.DROPPED, "stream ended before finish")

    def decode_concurrency(self) -> float | None:
        """Time-weighted mean of the miner's delivering streams while this one decoded (itself included);
        for an answer that came in one read, the streams delivering at that moment. Streams that hang
        before their first byte are not load: leaving them open never lowers the bar a miner is held to."""
        if self.ttft_s is None:
            return None
        decode_s = self.last_content_at - (self.started_at + self.ttft_s)
        return self._conc_area / decode_s if decode_s > 0 else float(self._first_in_flight)
