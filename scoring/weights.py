"""Settled values -> on-chain weights for the UIDs the metagraph has now.

Weights are proportional to settled values (the paid work x credit of :mod:`scoring.pay`, averaged
over the window; normalised to sum 1, which is informative only: the
SDK clips to ``MaxWeightsLimit``, rescales to u16 and drops zeros itself, so that is not redone
here). The hotkey -> uid map comes from the current metagraph; a hotkey no longer in it is dropped,
which is also how a re-registered UID avoids inheriting its predecessor's score. When nothing is
left worth paying the result is empty, and :func:`why_empty` says why, for the caller's log line
(the SDK refuses all-zero weights, so the caller skips setting them).

Example::

    compute_weights({"hk-a": 0.9, "hk-b": 0.3, "gone": 1.0}, {"hk-a": 4, "hk-b": 7})
    # {4: 0.75, 7: 0.25}
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def _payable(score: float) -> bool:
    return isinstance(score, int | float) and math.isfinite(score) and score > 0


def compute_weights(settled: Mapping[str, float], hotkey_to_uid: Mapping[str, int]) -> dict[int, float]:
    """``{uid: weight}`` proportional to each hotkey's settled value, summing to 1; empty when nothing is payable."""
    raw: dict[int, float] = {}
    for hk, score in settled.items():
        uid = hotkey_to_uid.get(hk)
        if uid is None or not _payable(score):
            continue
        raw[uid] = raw.get(uid, 0.0) + float(score)
    total = sum(raw.values())
    if total <= 0:
        return {}
    return {uid: s / total for uid, s in sorted(raw.items())}


def why_empty(settled: Mapping[str, float], hotkey_to_uid: Mapping[str, int]) -> str:
    """A one-line reason :func:`compute_weights` returned nothing (for logs)."""
    if not settled:
        return "no miner has a settled value yet"
    registered = [hk for hk in settled if hk in hotkey_to_uid]
    if not registered:
        return f"none of the {len(settled)} scored hotkeys is in the metagraph any more"
    return f"all {len(registered)} scored miners in the metagraph settled at 0"
