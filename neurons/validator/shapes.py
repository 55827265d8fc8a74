"""What real clients send, kept as shapes (never contents), so probes can be drawn like them.

A probe a miner can tell apart can be served better than users. Prompt text is one tell; the
parameters are another (issue 14: a 2-decimal temperature on every probe, ``max_tokens`` from a
7-value menu, no request ever omitting ``temperature``). The gateway hands every admitted organic
request to :meth:`ShapeSample.observe`, which keeps, for a bounded random sample of recent requests,
only their shape: the roles of the messages, the prompt's size, ``max_tokens`` and the sampling
parameters exactly as the client set them (absent ones stay absent). No text, no key, no client
address: nothing that identifies who asked. :class:`~neurons.validator.prompts.PromptGenerator` then
draws a shape and writes new content of that size.

Example::

    sample = ShapeSample(capacity=1000, rng=random.Random(0))
    sample.observe(chat_request)         # from the gateway, per admitted organic request
    shape = sample.draw()                # RequestShape, or None before any traffic
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from gateway.protocol.openai import ChatRequest

from .reservoir import Reservoir

# sampling parameters a probe copies (``seed`` and ``stop`` are left out: they can single a client out)
_COPIED = ("temperature", "top_p", "presence_penalty", "frequency_penalty")


@dataclass(frozen=True, slots=True)
class RequestShape:
    """One organic request without its contents."""

    roles: tuple[str, ...]
    prompt_tokens: int
    max_tokens: int
    sampling: dict[str, Any] = field(default_factory=dict)


class ShapeSample:
    """A uniform random sample (:class:`~neurons.validator.reservoir.Reservoir`) of the last organic
    requests' shapes; O(1) per request."""

    def __init__(self, capacity: int = 1000, rng: random.Random | None = None) -> None:
        self._sample: Reservoir[RequestShape] = Reservoir(capacity, rng)

    @property
    def seen(self) -> int:
        return self._sample.seen

    def observe(self, req: ChatRequest) -> None:
        """Keep ``req``'s shape with the reservoir's probability (never raises into the serving path)."""
        self._sample.offer(lambda: shape_of(req))

    def draw(self) -> RequestShape | None:
        return self._sample.draw()

    def __len__(self) -> int:
        return len(self._sample)


def shape_of(req: ChatRequest) -> RequestShape:
    roles = tuple(str(m.get("role", "user")) for m in req.messages if isinstance(m, dict))
    sampling = {k: req.sampling[k] for k in _COPIED if k in req.sampling}
    return RequestShape(roles or ("user",), max(1, req.prompt_tokens), req.max_tokens, sampling)
