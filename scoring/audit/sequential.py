"""The per-miner sequential test: evidence summed over every audited token, so a small steady shift is caught.

Why: each answer is judged alone (:mod:`scoring.audit.verdict`), with bands wide enough that no honest
answer fails. A cheat that moves every answer a little stays inside them answer by answer. For example,
a copy of the model requantized to fewer bits is cheaper to serve and picks another token now and then:
on Gemma 3 270M, Q3_K_M was off the reference's choice at 9.7 % of positions, yet passed a third of its
answers. Published anchors accumulate evidence instead. Token-DiFR (seeded Gumbel-max, this subnet's
sampler) tells a 4-bit quantization apart within ~300 tokens.

The test is a Bernoulli CUSUM over the positions of greedy or seeded answers. At each position the
reference's choice was either hit or missed (off it by more than the near-tie band). A miss adds
``log(p1/p0)``; a hit adds ``log((1-p1)/(1-p0))`` (negative). The sum is floored at 0, and the miner
**alarms** at ``threshold``:

* ``p0`` is the miss rate an honest runtime may show. Measured CPU against CPU, it was 6 in 11,171
  positions, 5.4e-4. The default, 2e-3, leaves 4x for other hardware's near-ties (unmeasured without a
  GPU); the calibration for a reference sets it from measurement.
* ``p1`` is the rate to catch quickly (10x ``p0``).
* ``threshold`` 15 needs about 7 misses close together. An honest miner at 5.4e-4 crosses it about once
  in 10^9 tokens. A miner at 9.7 % (Q3_K_M) crosses it in ~75 audited tokens, and one at 2 % in ~700.

An alarm is booked like a quarantine (:class:`scoring.audit.strikes.StrikeBook`), and pay and routing
follow it the way they follow quarantine.

Example::

    test = SequentialTest()
    s = test.update(0.0, positions=64, misses=0)     # 0.0: honest evidence drains the sum
    s = test.update(s, positions=64, misses=6)       # 6 misses in 64 tokens: near the threshold
    test.alarmed(s)
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SequentialTest:
    p0: float = 2e-3  # the miss rate an honest runtime may show (the calibration's figure, with margin)
    p1: float = 2e-2  # the miss rate the test is tuned to catch fast
    threshold: float = 15.0

    def __post_init__(self) -> None:
        if not (0.0 < self.p0 < self.p1 < 1.0) or not (math.isfinite(self.threshold) and self.threshold > 0):
            raise ValueError(f"need 0 < p0 < p1 < 1 and a positive threshold: {self}")

    @property
    def miss_weight(self) -> float:
        return math.log(self.p1 / self.p0)

    @property
    def hit_weight(self) -> float:
        return math.log((1.0 - self.p1) / (1.0 - self.p0))

    def update(self, evidence: float, *, positions: int, misses: int) -> float:
        """The sum after one audited answer, ``misses`` of its ``positions`` off the reference's choice.

        The answer's positions are taken in order, with the misses spread evenly among them, and the sum is
        floored at 0 after each one. Neither side can game where a miss falls in an answer: the validator
        sees only the count, and the even spread is the slowest way for misses to raise the sum.
        """
        positions = max(0, int(positions))
        misses = min(max(0, int(misses)), positions)
        s = max(0.0, float(evidence))
        if not positions:
            return s
        hits = positions - misses
        if not misses:
            return max(0.0, s + hits * self.hit_weight)
        # misses spread evenly: runs of hits between them, each run floored at 0 before the next miss
        run, extra = divmod(hits, misses + 1)
        for i in range(misses + 1):
            s = max(0.0, s + (run + (1 if i < extra else 0)) * self.hit_weight)
            if i < misses:
                s += self.miss_weight
        return s

    def alarmed(self, evidence: float) -> bool:
        return evidence >= self.threshold
