"""One answer's tokens as the frames a runtime streams: UTF-8 decoded across token boundaries, the client's stop
strings honoured, a tool call held back and sent as tool-call deltas, each chunk naming its ids and its tokens'
logprobs when asked. The llama.cpp runtime's decoding thread hands its tokens here on the event loop.

Example::

    framing = Framing(out, ("\n\n",), want_ids=True, gate=False, logprobs=True)
    data = framing.feed([(token_id, piece, reported)])     # the frames that may be sent now
    tail = framing.close("stop", prompt_tokens)            # what is left, the finish, usage and [DONE]
"""

from __future__ import annotations

import codecs
from collections import deque
from typing import Any

from gateway.protocol.sse import DONE_FRAME, ChunkFramer, frame
from neurons.model.engine import Reported

from .features import CallGate


class Framing:
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
