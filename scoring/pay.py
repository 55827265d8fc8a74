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
* A prompt is paid at prefill speed, which is the work it takes; a long prompt answered fast earns no
  more than that.

Example::

    cfg = CreditConfig()
    work_s(measurement, cfg, audits=True)             # 64 / 440 + 100 / 24000 = 0.15 card-seconds
    round_value(work=30.0, quality=0.9, round_s=60.0) # 0.45 card-equivalents
"""

from __future__ import annotations

import math

from scoring.credit import CreditConfig
from scoring.measurement import Measurement


def peak_decode_rate(cfg: CreditConfig) -> float:
    """The highest aggregate tok/s of the card class: what one output token costs, in card time, at best."""
    return max(agg for _, agg in cfg.decode_curve)


def paid_tokens(m: Measurement, *, audits: bool) -> int:
    """Output tokens of ``m`` that are paid: none for probes, failures, or an early stop no audit confirmed."""
    if m.probe or not m.ok:
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
    return tokens / peak_decode_rate(cfg) + prompt / cfg.prefill_tok_s


def round_value(work: float, quality: float, round_s: float) -> float:
    """Card-equivalents a miner earned in one round: paid work x quality / round length (0 for nonsense)."""
    if not all(math.isfinite(x) for x in (work, quality, round_s)) or round_s <= 0:
        return 0.0
    return max(0.0, work) * min(1.0, max(0.0, quality)) / round_s
