"""A varied prompt generator for probe traffic.

Probes must look like organic traffic, so a miner cannot serve them better than real requests: the
generator mixes chat shapes (single question, system + user, multi-turn), lengths from one sentence to
a few thousand tokens, and varied ``max_tokens``. Pure and seeded, so tests can pin distributions.

Two things make it hard to tell apart (issue 14 told 100 % of the old template probes apart):

* **Content** from a large source: with ``corpus`` (:func:`neurons.validator.corpus.stdlib_passages`,
  thousands of human-written passages) the questions are about, and the documents made of, real
  text; without it, a small built-in template set (tests, the soak).
* **Shapes** of real clients: with ``shapes`` (:class:`neurons.validator.shapes.ShapeSample`, fed by
  the gateway) most probes copy a recent organic request's message roles, prompt size, ``max_tokens``
  and sampling parameters, absent ones included. Before any organic traffic, parameters are drawn
  the way clients set them: the common round temperatures or none at all, ``top_p`` now and then.
* **Replays** (issue 23: templates and a public corpus can be indexed, and were, 99 % of probes told
  apart): with ``replays`` (:class:`neurons.validator.replays.ReplaySample`) ``replay_share`` of the
  probes are recent organic requests themselves, re-sent with a fresh seed; the rest are generated.

Example::

    import random
    gen = PromptGenerator(random.Random(1))
    payload = gen.payload(model="tensorgate/sim-5090")
    payload["messages"][-1]["role"]   # "user"
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.protocol.sampling import SamplingParams

from .replays import ReplaySample
from .shapes import RequestShape, ShapeSample

_TOPICS = (
    "the history of the printing press", "how vaccines train the immune system", "binary search trees",
    "the water cycle", "writing a cover letter", "photosynthesis", "the causes of the French Revolution",
    "TCP congestion control", "baking sourdough bread", "the rules of chess", "black holes",
    "compound interest", "the Rust borrow checker", "plate tectonics", "how a transistor works",
    "training for a marathon", "the economics of renewable energy", "public key cryptography",
    "the plot of Hamlet", "designing a REST API", "coral reef ecosystems", "the Roman road network",
)
_ASKS = (
    "Explain {t} to a curious teenager.", "Write a short summary of {t}.", "List five key facts about {t}.",
    "What are common misconceptions about {t}?", "Give a step-by-step overview of {t}.",
    "Compare two different perspectives on {t}.", "Write a haiku about {t}.",
    "Draft three quiz questions about {t}, with answers.",
)
_SYSTEMS = (
    "You are a helpful assistant.", "You are a concise technical writer. Answer in plain language.",
    "You are a patient teacher who uses examples.", "Answer as briefly as possible.",
)
_ABOUT = (  # questions about a passage of real text
    "Explain what this means, with an example:\n\n{p}", "Summarize this in a few bullet points:\n\n{p}",
    "Rewrite this for a beginner:\n\n{p}", "{p}\n\nWhat would be a good name for this?",
    "Translate into {lang}:\n\n{p}", "Write unit tests for code documented like this:\n\n{p}",
    "What questions would a reviewer ask about this?\n\n{p}", "{p}\n\nIs anything here unclear? Fix it.",
    "Write a short story inspired by this: {first}", "Turn this into an FAQ:\n\n{p}",
    "{p}", "Can you help me understand this?\n{p}", "tl;dr:\n{p}",
)
_LANGS = ("French", "Spanish", "German", "Japanese", "Portuguese", "Italian", "Korean", "plain English")
# what clients set: mostly round values, sometimes nothing at all (the server's default then applies)
_TEMPERATURES = (0.0, 0.0, 0.1, 0.2, 0.3, 0.5, 0.6, 0.7, 0.7, 0.7, 0.8, 0.9, 1.0, 1.0, 1.2)
_FILLER = (
    "The committee reviewed the quarterly figures and noted that shipping costs had risen again, "
    "while the warehouse in the north reported fewer delays than in the previous period. "
    "Several customers asked for clearer invoices, and the support team proposed a new template. "
    "Engineering flagged two outages caused by an expired certificate and a misconfigured load balancer. "
)


@dataclass(frozen=True, slots=True)
class PromptMix:
    """Sizes and sampling of generated requests, fitted to the hardware the subnet serves on.

    ``lengths``: (probability, (min, max) approximate prompt tokens); ``greedy_share``: requests sent
    with temperature 0 (the rest draw it from ``temperature``).
    """

    lengths: tuple[tuple[float, tuple[int, int]], ...]
    max_tokens: tuple[int, ...]
    greedy_share: float = 0.25
    temperature: tuple[float, float] = (0.2, 1.2)


MIXES: dict[str, PromptMix] = {
    # An RTX 5090: most prompts short, a tail of long documents; answers up to 512 tokens.
    "gpu": PromptMix(lengths=((0.45, (8, 60)), (0.30, (60, 400)), (0.18, (400, 1500)), (0.07, (1500, 3500))),
                     max_tokens=(16, 32, 64, 128, 128, 256, 256, 384, 512)),
    # Gemma 3 270M on a CPU core (~20 tok/s): the same shapes, sized to finish in seconds.
    "cpu": PromptMix(lengths=((0.6, (8, 60)), (0.3, (60, 200)), (0.1, (200, 500))),
                     max_tokens=(8, 16, 24, 32, 48, 64)),
}


def _approx_tokens(text: str) -> int:
    return max(1, len(text) // 4)


class PromptGenerator:
    """Seeded generator of chat-completion payloads for probes.

    ``corpus``: passages to ask about and build documents from; ``shapes``: organic requests' shapes,
    copied by ``shape_share`` of the probes once there are any.
    """

    def __init__(self, rng: random.Random | None = None, mix: PromptMix = MIXES["gpu"], *,
                 corpus: Sequence[str] = (), shapes: ShapeSample | None = None, shape_share: float = 0.8,
                 replays: ReplaySample | None = None, replay_share: float = 0.8) -> None:
        self._rng = rng if rng is not None else random.Random()
        self.mix = mix
        self.corpus = corpus
        self.shapes = shapes
        self.shape_share = shape_share
        self.replays = replays
        self.replay_share = replay_share

    def _target_tokens(self) -> int:
        r = self._rng.random()
        for p, (lo, hi) in self.mix.lengths:
            if r < p:
                return self._rng.randint(lo, hi)
            r -= p
        lo, hi = self.mix.lengths[-1][1]
        return self._rng.randint(lo, hi)

    def _ask(self) -> tuple[str, str]:
        """(a question, a short line on the same subject for earlier turns)."""
        rng = self._rng
        if self.corpus and rng.random() < 0.85:
            p = rng.choice(self.corpus)
            first = p.split("\n", 1)[0]
            return rng.choice(_ABOUT).format(p=p, first=first, lang=rng.choice(_LANGS)), first
        topic = rng.choice(_TOPICS)
        return rng.choice(_ASKS).format(t=topic), f"I have a question about {topic}."

    def _document(self, chars: int) -> str:
        """About ``chars`` characters of text: passages of the corpus, or the built-in filler."""
        rng = self._rng
        if self.corpus:
            parts: list[str] = []
            while sum(len(x) for x in parts) < chars:
                parts.append(rng.choice(self.corpus))
            return "\n\n".join(parts)[:chars]
        reps = chars // len(_FILLER) + 1
        start = rng.randrange(len(_FILLER))
        return (_FILLER * (reps + 1))[start : start + chars]

    def messages(self, roles: Sequence[str] | None = None, target: int | None = None) -> list[dict[str, str]]:
        """A conversation with these ``roles`` (drawn when None) of about ``target`` prompt tokens."""
        rng = self._rng
        ask, opener = self._ask()
        target = self._target_tokens() if target is None else target
        if roles is None:
            roles = (["system"] if rng.random() < 0.5 else []) + (["user", "assistant"] if rng.random() < 0.25
                                                                 else []) + ["user"]
        msgs: list[dict[str, str]] = []
        for i, role in enumerate(roles[:-1]):
            if role == "system":
                content = rng.choice(_SYSTEMS)
            elif role == "assistant":
                content = "Of course. What would you like to know?" if not self.corpus else \
                    self._document(rng.randint(80, 600))
            else:
                content = opener if i == 0 or not self.corpus else self._ask()[0]
            msgs.append({"role": role, "content": content})
        have = sum(_approx_tokens(m["content"]) for m in msgs) + _approx_tokens(ask)
        if target > have + 20:
            doc = self._document((target - have) * 4)
            ask = f"Here is a document:\n\n{doc}\n\nWith that context: {ask}"
        msgs.append({"role": roles[-1] if roles else "user", "content": ask})
        return msgs

    def _sampling(self) -> dict[str, Any]:
        """Parameters as clients set them: a common temperature or none, ``top_p`` now and then."""
        rng = self._rng
        out: dict[str, Any] = {}
        r = rng.random()
        if r < self.mix.greedy_share:
            out["temperature"] = 0.0
        elif r < 0.85:
            lo, hi = self.mix.temperature
            t = rng.choice(_TEMPERATURES) if rng.random() < 0.7 else round(rng.uniform(lo, hi), rng.choice((1, 2)))
            out["temperature"] = t
        if rng.random() < 0.15:
            out["top_p"] = rng.choice((0.9, 0.95, 1.0, 0.8))
        return out

    def payload(self, model: str) -> dict[str, Any]:
        """A request body exactly like an organic streaming client would send (or did: a replay)."""
        rng = self._rng
        if self.replays is not None and len(self.replays) and rng.random() < self.replay_share:
            replay = self.replays.draw(model)
            if replay is not None:
                return replay
        shape: RequestShape | None = None
        if self.shapes is not None and len(self.shapes) and rng.random() < self.shape_share:
            shape = self.shapes.draw()
        if shape is not None:
            roles = shape.roles if shape.roles[-1] == "user" else (*shape.roles, "user")
            return {"model": model, "messages": self.messages(roles, shape.prompt_tokens),
                    "max_tokens": shape.max_tokens, **shape.sampling, "stream": True}
        max_tokens = rng.choice(self.mix.max_tokens)
        if rng.random() < 0.3:  # not every client picks from a menu
            max_tokens = rng.randint(min(self.mix.max_tokens), max(self.mix.max_tokens))
        return {"model": model, "messages": self.messages(), "max_tokens": max_tokens, **self._sampling(),
                "stream": True}


def asking_nucleus(payload: dict[str, Any], top_p: float) -> dict[str, Any]:
    """``payload`` with a sampled request asking for nucleus ``top_p`` (a greedy one stays as it is).

    The mix asks for a nucleus only now and then, and a nucleus's edge is where two runtimes' numerics disagree
    most: a calibration or a benchmark that measures that spread asks for one on every sampled request.
    """
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be within (0, 1], got {top_p!r}")
    return payload if SamplingParams.of(payload).greedy else {**payload, "top_p": top_p}
