"""A varied built-in prompt generator for probe traffic.

Probes must look like organic traffic, so a miner cannot serve them better than real requests: the
generator mixes chat shapes (single question, system + user, multi-turn), lengths from one sentence to
a few thousand tokens, and varied ``max_tokens``. Pure and seeded, so tests can pin distributions.

Example::

    import random
    gen = PromptGenerator(random.Random(1))
    payload = gen.payload(model="tensorgate/sim-5090")
    payload["messages"][-1]["role"]   # "user"
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

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
    """Seeded generator of chat-completion payloads for probes."""

    def __init__(self, rng: random.Random | None = None, mix: PromptMix = MIXES["gpu"]) -> None:
        self._rng = rng if rng is not None else random.Random()
        self.mix = mix

    def _target_tokens(self) -> int:
        r = self._rng.random()
        for p, (lo, hi) in self.mix.lengths:
            if r < p:
                return self._rng.randint(lo, hi)
            r -= p
        lo, hi = self.mix.lengths[-1][1]
        return self._rng.randint(lo, hi)

    def messages(self) -> list[dict[str, str]]:
        rng = self._rng
        topic = rng.choice(_TOPICS)
        ask = rng.choice(_ASKS).format(t=topic)
        target = self._target_tokens()
        msgs: list[dict[str, str]] = []
        if rng.random() < 0.5:
            msgs.append({"role": "system", "content": rng.choice(_SYSTEMS)})
        if rng.random() < 0.25:
            msgs.append({"role": "user", "content": f"I have a question about {topic}."})
            msgs.append({"role": "assistant", "content": "Of course. What would you like to know?"})
        have = sum(_approx_tokens(m["content"]) for m in msgs) + _approx_tokens(ask)
        if target > have + 20:
            need_chars = (target - have) * 4
            reps = need_chars // len(_FILLER) + 1
            start = rng.randrange(len(_FILLER))
            doc = (_FILLER * (reps + 1))[start : start + need_chars]
            ask = f"Here is a document:\n\n{doc}\n\nWith that context: {ask}"
        msgs.append({"role": "user", "content": ask})
        return msgs

    def payload(self, model: str) -> dict[str, Any]:
        """A request body exactly like an organic streaming client would send."""
        rng = self._rng
        lo, hi = self.mix.temperature
        return {
            "model": model,
            "messages": self.messages(),
            "max_tokens": rng.choice(self.mix.max_tokens),
            "temperature": 0.0 if rng.random() < self.mix.greedy_share else round(rng.uniform(lo, hi), 2),
            "stream": True,
        }

