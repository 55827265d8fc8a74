"""Recent organic requests, re-sent as probes: the only probe text a miner cannot index.

A probe a miner can tell apart is served better than users. Generated probes carry their generator's
tells: issue 23 built a detector from nothing but :mod:`neurons.validator.prompts`' public templates
and an index of the standard library's docstrings (its corpus), and it flagged 99.1-99.3 % of probes
and 0 % of organic requests. Any fixed template set or corpus can be indexed the same way. What cannot
be indexed is what users send: a probe that *is* a recent user request, sent to another miner, is a
user request in every byte a miner sees (text, roles, sizes, parameters).

:class:`ReplaySample` keeps a bounded random sample (reservoir) of recent admitted organic requests, in
memory only: never written to disk, gone at restart. A replay is sent with the request's messages,
``max_tokens`` and sampling exactly as the client set them, less ``seed`` (the wire seed is fresh, so the
answer is not the original's) and less ``user``. Its answer goes to the audit and the credit like any
probe's and is never shown to anyone.

What it costs and what it leaves open, on purpose:

* a user's prompt reaches a second miner of the subnet. Operators whose users must not have that turn
  it off (``--probes.replay off``): probes are then generated only, and recognisable as issue 23 found.
* a miner that served the original can recognise the replay ("seen this prompt before"); with ``N``
  miners about one replay in ``N`` lands on the miner that served the original (measured by
  ``scripts/bench_probes.py``; each request is replayed once at most), and several hotkeys of one owner
  comparing notes see more.
* before any organic traffic there is nothing to replay: probes are generated.

Example::

    replays = ReplaySample(capacity=256, rng=random.Random(0))
    replays.observe(chat_request)         # from the gateway, per admitted organic request
    payload = replays.draw("model-name")  # a streamed request body, or None before any traffic
"""

from __future__ import annotations

import copy
import random
from typing import Any

from gateway.protocol.openai import ChatRequest

from .reservoir import Reservoir

# what a replay leaves out of the client's parameters: its seed (a fresh one is drawn on the wire)
_DROPPED = frozenset({"seed", "user"})
MAX_PROMPT_TOKENS = 8192  # longer requests are not kept: the sample's memory stays under ~capacity x 32 KB


class ReplaySample:
    """A uniform random sample of the last organic requests, re-sendable as probes; O(1) per request."""

    def __init__(self, capacity: int = 256, rng: random.Random | None = None) -> None:
        self._sample: Reservoir[ChatRequest] = Reservoir(capacity, rng)

    @property
    def seen(self) -> int:
        return self._sample.seen

    def observe(self, req: ChatRequest) -> None:
        """Keep ``req`` with the reservoir's probability (requests over :data:`MAX_PROMPT_TOKENS` never)."""
        if req.prompt_tokens <= MAX_PROMPT_TOKENS:
            self._sample.offer(lambda: req)

    def draw(self, model: str) -> dict[str, Any] | None:
        """A probe body replaying one kept request, which leaves the sample: a request is replayed once at most
        (a second replay could land on the miner that had the first)."""
        req = self._sample.take()
        if req is None:
            return None
        sampling = {k: copy.deepcopy(v) for k, v in req.sampling.items() if k not in _DROPPED}
        return {"model": model, "messages": copy.deepcopy(req.messages), "max_tokens": req.max_tokens, **sampling,
                "stream": True}

    def __len__(self) -> int:
        return len(self._sample)
