"""A toy language model for simulated cards: cheap to sample on the miner, exact to replay on the validator.

A simulated 5090 used to stream random words, so nothing it said could be audited, and the default
local subnet and the soak paid every answer unchecked. This model gives the simulated card a real
(if trivial) distribution that both sides compute the same way:

* the vocabulary is the simulation's words twice: ``" word"`` (ids ``0..n-1``) and ``"Word"`` (ids
  ``n..2n-1``, only at the first position), plus an end-of-turn id ``2n``;
* the prompt decides everything: a key hashed from the request's messages gives, per position, one
  *favourite* word (logit 6, the others 0, the wrong case -30) and the answer's natural length (with
  probability :data:`STOP_SHARE` it ends between half and all of ``max_tokens``: end-of-turn logit 9
  there, -12 elsewhere);
* a row does not depend on the tokens before it, so teacher forcing is just the rows.

The miner samples analytically (a few float operations a token, no numpy: the soak streams tens of
thousands of tokens a second); the reference builds the same rows as numpy arrays for
:func:`scoring.audit.force` and :func:`scoring.audit.judge`, the code that judges the real model.
Honest cards pass; random words, a different prompt, two tokens and "stop", or no token ids fail.

A request with the subnet's seed is drawn from the seed, like the real subnet sampler's answers: the uniforms a
position's draw takes are hashed from ``(seed, position, k)`` (:class:`SeededDraws`), so the same seed gives the
same answer and the reference replays it exactly (:meth:`ToyModel.generate` on both sides). Judged instead by
plausibility (a z-score of 8 tokens against the real model's bands), 5 in 3,000 honest toy answers failed: this
distribution is far from a real model's, and the honest card that drew two of them in a window lost the window's
pay in a soak run. The subnet sampler's own Gumbel-max draw hashes every token of the vocabulary, too slow here.

Example::

    key = MODEL.key(messages)
    ids, ended = MODEL.generate(key, 64, SamplingParams(temperature=0.0), random.Random(0))
    MODEL.rows(key, n=len(ids), max_tokens=64)   # (len + 1, vocab_size) float32: the forced rows
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from gateway.protocol.sampling import GOLDEN, SamplingParams, mix64

WORDS = (
    "the of and to in is that for it as with was on be by this are from or at an which have not had "
    "they you but all were we there can been one their has more will would so if its some other into "
    "time only new could these two may first then do any like my now over such our man me even most "
    "made after also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see men work "
    "long get here between both life being under never day same another know while last might us great "
    "old year off come since against go came right used take three card token stream model gradient "
    "tensor kernel memory cache batch decode prefill latency signal network miner validator subnet"
).split()

STOP_SHARE = 0.1  # answers whose natural end falls before max_tokens (between half and all of it)
FAVOURITE = 6.0  # at temperature 1 the favourite takes ~65 % of the mass: peaked enough to tell answers apart
WRONG_CASE = -30.0
EOT_HERE = 9.0
EOT_ELSEWHERE = -12.0


class ToyModel:
    """The model a simulated card runs and a simulated subnet's reference replays."""

    def __init__(self) -> None:
        self.n = len(WORDS)
        self.vocab_size = 2 * self.n + 1
        self.eot = 2 * self.n
        self.stop_ids = frozenset({self.eot})
        self._pieces = [(" " + w).encode() for w in WORDS] + [w.capitalize().encode() for w in WORDS] + [b""]

    def piece(self, token_id: int) -> bytes:
        return self._pieces[token_id]

    @staticmethod
    def key(messages: Any) -> int:
        """The prompt's key: both sides hash the same messages the same way."""
        raw = json.dumps(messages, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
        return int.from_bytes(hashlib.sha256(raw.encode()).digest()[:8], "big")

    def natural_end(self, key: int, max_tokens: int, share: float = STOP_SHARE) -> int | None:
        """Where the model puts its end-of-turn (a position), or None when it would go past ``max_tokens``."""
        h = mix64(key ^ 0x5EED)
        if (h & 0xFFFF) / 65536.0 >= share:
            return None
        u = ((h >> 16) & 0xFFFF) / 65536.0
        end = max(1, int(max_tokens * (0.5 + 0.5 * u)))
        return end if end < max_tokens else None

    def favourite(self, key: int, pos: int) -> int:
        word = mix64(key + pos * 0x1000193) % self.n
        return word + self.n if pos == 0 else word

    # -- the miner's side: sampling without numpy --------------------------------------------------

    def next_token(self, key: int, pos: int, end: int | None, sampling: SamplingParams, rng: Draws) -> int:
        """One token at ``pos``, drawn as ``asked_logprobs`` defines it (temperature, then the nucleus)."""
        fav = self.favourite(key, pos)
        eot = EOT_HERE if pos == end else EOT_ELSEWHERE
        if sampling.greedy:
            return self.eot if eot > FAVOURITE else fav
        t = sampling.temperature
        # levels of equal logit, best first: (logit, how many tokens); the right case's others sit at 0
        levels = sorted([(FAVOURITE, 1, "fav"), (eot, 1, "eot"), (0.0, self.n - 1, "other"),
                         (WRONG_CASE, self.n, "wrong")], key=lambda x: -x[0])
        top = levels[0][0]
        weights = [(k * math.exp((v - top) / t), tag) for v, k, tag in levels]
        total = sum(w for w, _ in weights)
        if sampling.top_p < 1.0:  # the nucleus keeps whole levels (ties are kept together)
            kept, cum = [], 0.0
            for w, tag in weights:
                kept.append((w, tag))
                cum += w / total
                if cum >= sampling.top_p:
                    break
            weights = kept
            total = sum(w for w, _ in weights)
        r = rng.random() * total
        for w, tag in weights:
            if r < w:
                return self._member(tag, fav, pos, rng)
            r -= w
        return self._member(weights[-1][1], fav, pos, rng)

    def generate(self, key: int, max_tokens: int, sampling: SamplingParams, rng: random.Random, *,
                 total: int | None = None, share: float = STOP_SHARE) -> tuple[list[int], bool]:
        """The answer's ids (at most ``total``, default ``max_tokens``) and whether the model ended it; a seeded
        ``sampling`` draws from its seed (the same answer every time), anything else from ``rng``."""
        end = self.natural_end(key, max_tokens, share)
        out: list[int] = []
        seed = sampling.seed if sampling.seeded else None
        for pos in range(max_tokens if total is None else total):
            t = self.next_token(key, pos, end, sampling, rng if seed is None else SeededDraws(seed, pos))
            if t == self.eot:
                return out or [self.favourite(key, 0)], True  # never an empty answer
            out.append(t)
        return out, False

    def _member(self, tag: str, fav: int, pos: int, rng: Draws) -> int:
        if tag == "fav":
            return fav
        if tag == "eot":
            return self.eot
        base = self.n if pos == 0 else 0
        wrong = 0 if pos == 0 else self.n
        if tag == "wrong":
            return wrong + rng.randrange(self.n)
        i = rng.randrange(self.n - 1)
        return base + (i if base + i < fav else i + 1)

    # -- the reference's side: the rows ------------------------------------------------------------

    def rows(self, key: int, n: int, max_tokens: int) -> npt.NDArray[np.float32]:
        """The logits of positions ``0..n`` (``n`` answer tokens, then the row after them: the stop check)."""
        end = self.natural_end(key, max_tokens)
        out = np.zeros((n + 1, self.vocab_size), dtype=np.float32)
        out[0, : self.n] = WRONG_CASE
        out[1:, self.n : 2 * self.n] = WRONG_CASE
        for pos in range(n + 1):
            out[pos, self.favourite(key, pos)] = FAVOURITE
            out[pos, self.eot] = EOT_HERE if pos == end else EOT_ELSEWHERE
        return out


class Draws(Protocol):
    """Where a position's draw takes its uniforms: ``random.Random``, or :class:`SeededDraws`."""

    def random(self) -> float: ...
    def randrange(self, n: int, /) -> int: ...


class SeededDraws:
    """The uniforms of one position of a seeded answer: the k-th is hashed from ``(seed, position, k)``, so the
    miner's draw and the reference's replay of it take the same ones."""

    __slots__ = ("_base", "_k")

    def __init__(self, seed: int, pos: int) -> None:
        self._base = mix64(seed ^ mix64(pos))
        self._k = 0

    def random(self) -> float:
        self._k += 1
        return (mix64((self._base + self._k * GOLDEN) & 0xFFFFFFFFFFFFFFFF) >> 11) / float(1 << 53)

    def randrange(self, n: int, /) -> int:
        return min(n - 1, int(self.random() * n))


MODEL = ToyModel()  # stateless: the one instance simulated cards, the soak's cheaters and the reference share
