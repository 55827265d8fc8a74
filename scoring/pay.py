"""Pay for verified work: what one request is worth in card time, and what a round is worth to a miner.

A miner is paid for the work it did for users, times how well it did it, never for merely being
there. The unit is the **card-second**: the time one honest card of the subnet's class needs for the
work, ``output tokens / its peak aggregate decode rate + prompt tokens / its prefill rate`` (the
:class:`~scoring.credit.CreditConfig` that also sets the quality bar). A round's **value** is the
card-seconds of paid work times the round's quality credit (mean request credit: TTFT and decode,
failures and refusals at 0), divided by the round's length: 1.0 is one card kept busy all round with
perfect answers. Weights are proportional to the settled value.

Why this shape, against what miners were seen doing (issue 14):

* One card split across N hotkeys does one card's work however it is split, so the N values add up to
  one card's, where N mean credits added up to N cards.
* A hotkey that serves nothing earns nothing, whatever its credit: recognising probes and serving
  only them, or leaving users hanging, pays 0. **Probes are not paid**: they measure quality (they are
  in the credit) and look like users, but a miner must not be able to live on the validator's own
  traffic.
* Tokens are the ids the stream names, or for an id-less stream no more than its characters / 4
  (:attr:`gateway.metering.StreamMeter.countable_tokens`): cutting text into more chunks earns nothing.
* An answer that stops before ``max_tokens`` is paid only when an audit confirmed the model chose to
  stop there (when the validator audits at all): two tokens and ``stop`` is otherwise worth 0, and an
  audited early stop that the model would have continued fails its audit.
* A **free draw** is not paid (where the validator audits): a sampled answer from a miner that did not declare the
  subnet's sampler (a stock runtime drawing with its own RNG) can only be judged plausible, and plausibility
  misses the cheats that matter. Measured on Gemma 3 270M (``scripts/bench_audit.py --free-sampling``, issue 25),
  the plausibility rule caught per answer: cached answers 65 %, a truncated prompt 48 %, always-greedy 0 %, and
  it adds no evidence to the per-miner sequential test that catches a requantized model. Paid "in proportion to
  what the rule can detect" means paid at its weakest cheat's rate, 0: such a miner is paid for what can be
  checked exactly (its greedy answers, and every answer once it runs the sampler: the vLLM plugin,
  :mod:`neurons.miner.vllm_plugin`). So declaring no sampler never pays more than running it, and declaring it
  without running it fails the audits (``wrong_tokens``).
* An answer **no audit can check** is not paid either (where the validator audits), for the same reason: tools,
  JSON mode, a ``logit_bias``, ``top_k``/``min_p`` on a sampled answer, a model the validator has no reference
  for (:func:`gateway.protocol.auditable.audit_skip`). Those requests say what they are, so any pay for them would pay a
  miner for junk it sends on exactly those (issue 27). Each round's table counts them (``skip``).
* A prompt is paid at prefill speed, which is the work it takes; a long prompt answered fast earns no
  more than that, and never more than the time to first token shows was spent: an answer that comes
  before the prompt could have been read was not computed now (issue 23: a miner whose owner sent it
  long prompts through the gateway and answered them at once, precomputed, earned 1.05-1.06x an honest
  card on their prefill pay). Prefix caching an honest runtime does is paid as the time it takes.

Only verified work is paid (issue 23: 11,264 unaudited junk tokens were paid in one run). Where the
validator audits, a round's value comes in two parts: **verified** (answers an audit passed) and
**unverified** (answers no audit looked at). :class:`PayWindow` settles them over the trailing window:

* unverified pay is **held** until an audit of one of the same hotkey's *organic* answers in the window
  passes (a probe passing says nothing of how users are served), and **forfeited**: a failed audit, probe
  or organic, forfeits its own round's unverified pay, and :data:`FORFEIT_WINDOW_AT` failures in the
  window forfeit the whole window's. Junk served to users while probes are answered well pays nothing,
  however well the probes are recognised. Why not the whole window at the first failure: audits have
  honest false failures (the toy model's plausibility rule: 2 in 3,000 honest answers; the real model
  with the subnet's sampler: 0 in 500), and one of them cost an honest card 80 % of its weight in a soak
  run. A cheater that keeps to one failure a window serves junk on about one audited answer in a
  window's worth, and loses a round of pay for it;
* a window in which the hotkey was **quarantined** at any round's close settles at 0, verified work
  included: cycling in and out of quarantine costs the window, not only the rounds inside it;
* a round the hotkey was routed in before any capacity check had measured it (``unmeasured``, where the validator
  runs the checks) is paid at its measured card share, ``min(1, routing multiplier)``
  (:func:`scoring.capacity.card_share`), and held at 0 until a check measures it. Until then the router sends it half
  a card's traffic (:data:`scoring.capacity.UNMEASURED`), so one card as four new hotkeys was sent two cards' traffic,
  and, where every hotkey was new at once (a new validator, the soak), four times an honest card's: in the soak's
  8-round smoke (seed 1) the group served 35 of its 81 requests in those first two rounds and weighed 0.87x an honest
  card here, 1.08x in one CI run (issue 38); paid at its share, 0.73x (0.66x beside two CPU hogs). An honest card's
  share is 1 and it loses nothing.

Example::

    window = PayWindow(12)
    window.push({"hk": RoundPay(verified=0.05, unverified=0.4, passed=3)})
    window.settled()                                  # {"hk": 0.45}: an audit passed, the rest is paid
    window.push({"hk": RoundPay(verified=0.05, unverified=0.4, failed=1)})
    window.settled()                                  # {"hk": 0.25}: (0.45 + 0.05) / 2, that round's forfeited

Example::

    cfg = CreditConfig()
    work_s(measurement, cfg, audits=True)             # 64 / 440 + 100 / 24000 = 0.15 card-seconds
    round_value(work=30.0, quality=0.9, round_s=60.0) # 0.45 card-equivalents
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from gateway.protocol.measurement import Measurement
from scoring.credit import CreditConfig

FORFEIT_WINDOW_AT = 2  # failed audits in the window that forfeit all of its unverified pay (one: its own round's)


def peak_decode_rate(cfg: CreditConfig) -> float:
    """The highest aggregate tok/s of the card class: what one output token costs, in card time, at best."""
    return max(agg for _, agg in cfg.decode_curve)


def paid_tokens(m: Measurement, *, audits: bool) -> int:
    """Output tokens of ``m`` that are paid: none for probes, failures, an early stop no audit confirmed, or (where
    the validator audits) a free draw or an answer no audit can check (``skipped``)."""
    if m.probe or not m.ok:
        return 0
    if audits and (m.free_draw or m.skipped is not None):
        return 0
    if audits and m.stopped_early and not m.audited:
        return 0
    return max(0, min(m.completion_tokens, m.max_tokens))


def work_s(m: Measurement, cfg: CreditConfig, *, audits: bool) -> float:
    """Card-seconds of paid work in ``m`` (0.0 when nothing of it is paid)."""
    tokens = paid_tokens(m, audits=audits)
    if tokens == 0:
        return 0.0
    prompt = m.prompt_tokens if isinstance(m.prompt_tokens, int) and m.prompt_tokens > 0 else 0
    prefill_s = prompt / cfg.prefill_tok_s
    ttft = m.ttft_s
    if isinstance(ttft, int | float) and math.isfinite(ttft):
        prefill_s = min(prefill_s, max(0.0, ttft))
    return tokens / peak_decode_rate(cfg) + prefill_s


def round_value(work: float, quality: float, round_s: float) -> float:
    """Card-equivalents a miner earned in one round: paid work x quality / round length (0 for nonsense)."""
    if not all(math.isfinite(x) for x in (work, quality, round_s)) or round_s <= 0:
        return 0.0
    return max(0.0, work) * min(1.0, max(0.0, quality)) / round_s


@dataclass(frozen=True, slots=True)
class RoundPay:
    """What one round is worth to one hotkey before settlement: values in card-equivalents, audit outcomes."""

    verified: float = 0.0  # value of answers whose audit passed (all answers where the validator audits none)
    unverified: float = 0.0  # value of answers no audit looked at: paid only as PayWindow allows
    passed: int = 0  # audits of organic answers passed this round
    failed: int = 0  # audits failed this round
    quarantined: bool = False  # quarantined at the round's close
    unmeasured: bool = False  # routed before any capacity check measured the hotkey: paid at its card share

    @property
    def total(self) -> float:
        return self.verified + self.unverified


def _finite(x: float) -> float:
    return max(0.0, float(x)) if isinstance(x, int | float) and math.isfinite(x) else 0.0


class PayWindow:
    """The last ``window`` rounds' :class:`RoundPay` per hotkey; :meth:`settled` is what weights follow."""

    def __init__(self, window: int = 12) -> None:
        if window < 1:
            raise ValueError(f"pay window must be >= 1 round, got {window}")
        self.window = window
        self._rounds: deque[dict[str, RoundPay]] = deque(maxlen=window)

    def push(self, pays: Mapping[str, RoundPay]) -> None:
        """Append one closed round (NaN, inf and negative values count 0); the oldest falls out."""
        self._rounds.append({hk: RoundPay(_finite(p.verified), _finite(p.unverified), max(0, int(p.passed)),
                                          max(0, int(p.failed)), bool(p.quarantined), bool(p.unmeasured))
                             for hk, p in pays.items()})

    def settled(self, card_shares: Mapping[str, float] | None = None) -> dict[str, float]:
        """Settled value per hotkey in the window: verified pay, plus the unverified pay of rounds without a failed
        audit once an audit of an organic answer in the window passed, unless :data:`FORFEIT_WINDOW_AT` audits
        in it failed; 0 for a hotkey quarantined at any round's close in the window. An ``unmeasured`` round counts
        at the hotkey's share in ``card_shares`` (in [0, 1]), 0 where it has none yet."""
        if not self._rounds:
            return {}
        shares = card_shares or {}
        totals: dict[str, list[float]] = {}  # verified, unverified of rounds without a failure, passed, failed, q.
        for r in self._rounds:
            for hk, p in r.items():
                t = totals.setdefault(hk, [0.0, 0.0, 0.0, 0.0, 0.0])
                share = min(1.0, _finite(shares.get(hk, 0.0))) if p.unmeasured else 1.0
                t[0] += p.verified * share
                t[1] += 0.0 if p.failed else p.unverified * share
                t[2] += p.passed
                t[3] += p.failed
                t[4] += p.quarantined
        n = len(self._rounds)
        out: dict[str, float] = {}
        for hk, (verified, unverified, passed, failed, quarantined) in totals.items():
            if quarantined:
                out[hk] = 0.0
            else:
                released = passed and failed < FORFEIT_WINDOW_AT
                out[hk] = (verified + (unverified if released else 0.0)) / n
        return out

    def __len__(self) -> int:
        return len(self._rounds)
