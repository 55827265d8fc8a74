"""Audit bands per reference: measured from honest answers, written to a file, loaded by the validator.

Why: the bands in :class:`scoring.audit.AuditBands` and the sequential test's honest miss rate
(:class:`scoring.audit.sequential.SequentialTest`) were measured CPU against CPU. A reference on other
hardware, or miners on other runtimes, have their own numerics. The near-ties they flip are the honest
spread the bands must sit above. ``python -m neurons.reference.calibrate`` measures that spread between
this reference and a given miner and writes a bands file; ``--audit.bands FILE`` loads it, and the
validator logs the bands it uses at start.

The rules from measurement to bands (:func:`bands_from`) never narrow the defaults, only widen them:

* ``greedy_gap`` (the near-tie band) is at least 1.25x the 99.9th percentile of honest per-position gaps, never
  set by one position alone (:func:`near_tie_gap`);
* ``greedy_hard_gap`` is at least 1.5x the worst honest gap;
* ``z_limit`` is at least 1.3x the largest honest |z| of free draws;
* ``seeded_nucleus_slack`` is at least 1.25x the most probability mass an honest seeded token lay beyond its
  asked nucleus (at most 0.5: a slack that wide no longer checks the nucleus at all);
* the sequential test's ``p0`` is at least 4x the honest miss rate, counted with one extra miss so that
  zero misses is never read as a rate of zero; ``p1`` is 10x ``p0``.

Widening has a ceiling (:data:`CEILING`), because calibration trusts the miner it measures: one that declares the
subnet sampler and draws with its own RNG looked like an "honest spread" of 24.56 nats and wrote a near-tie band
that lets almost any token pass (issue 37). Honest runtimes measured here stay below it: llama.cpp against itself
(an honest llama.cpp miner, this reference; 404 answers, 13,101 positions, ``--top-p 0.9``): 17 positions over 0.3
nats, 4 over the default band, one at 1.17; vLLM 0.32 on the dequantized model against the llama.cpp reference:
0.57 nats, 2 of 1,374 positions off the default band. So ``calibrate`` refuses, writing nothing, when the miner's
determined answers miss more than :data:`MAX_HONEST_MISS_RATE` of positions at the default bands or need a band
above the ceiling, and :func:`load_bands` refuses a file over it, whoever wrote it.

Example::

    save_bands(path, bands, test, measured={"answers": 300})
    bands, test = load_bands(path)
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scoring.audit import AuditBands
from scoring.audit.sequential import SequentialTest

FORMAT = "tensorgate-audit-bands/1"
_MAX_NUCLEUS_SLACK = 0.5

# The widest band a calibration may write and a validator may load: 3x the default near-tie band and hard gap
# (honest vLLM-vs-llama.cpp worst gap 0.57 nats), a z limit of 8, a sequential-test p0 of 5 %.
CEILING: dict[str, float] = {"greedy_gap": 1.5, "greedy_hard_gap": 6.0, "z_limit": 8.0,
                             "seeded_nucleus_slack": _MAX_NUCLEUS_SLACK, "p0": 0.05}
# Honest runtimes miss 0-0.15 % of determined positions at the default bands; a miner that misses more than this
# is not one to calibrate from (it does not run the sampler it declares, or it serves another model).
MAX_HONEST_MISS_RATE = 0.02


@dataclass(frozen=True, slots=True)
class HonestSpread:
    """What honest answers showed against this reference: every determined position's gap, free draws' |z|."""

    gaps: Sequence[float]  # nats below the reference's choice, one per greedy or seeded position
    misses: int  # positions beyond the near-tie band the answers were judged with
    positions: int
    z: Sequence[float]  # |z| of free draws (empty when every request was seeded)
    nucleus_excess: Sequence[float] = ()  # seeded tokens beyond their asked nucleus: the mass it must widen by


def bands_from(spread: HonestSpread, base: AuditBands | None = None,
               test: SequentialTest | None = None) -> tuple[AuditBands, SequentialTest]:
    """Bands that sit above ``spread`` with margin, never narrower than ``base`` / ``test`` (the defaults)."""
    base = base or AuditBands()
    test = test or SequentialTest()
    gaps = sorted(g for g in spread.gaps if math.isfinite(g))
    near_tie = base.greedy_gap
    hard = base.greedy_hard_gap
    if gaps:
        near_tie = max(near_tie, 1.25 * near_tie_gap(gaps))
        hard = max(hard, 1.5 * gaps[-1], 2.0 * near_tie)
    z_limit = max([base.z_limit] + [1.3 * z for z in spread.z if math.isfinite(z)])
    rate = (spread.misses + 1) / (spread.positions + 1)
    p0 = min(0.05, max(test.p0, 4.0 * rate))
    excess = [e for e in spread.nucleus_excess if math.isfinite(e)]
    slack = min(_MAX_NUCLEUS_SLACK, max([base.seeded_nucleus_slack] + [1.25 * e for e in excess]))
    bands = dataclasses.replace(base, greedy_gap=near_tie, greedy_hard_gap=hard, z_limit=z_limit,
                                seeded_nucleus_slack=slack)
    return bands, dataclasses.replace(test, p0=p0, p1=min(0.5, max(test.p1, 10.0 * p0)))


def near_tie_gap(gaps: Sequence[float]) -> float:
    """The honest gap the near-tie band sits above: the 99.9th percentile of ``gaps`` (sorted), never the single
    worst. Under 1,000 positions the percentile is the worst, and one rare position is then the whole tail:
    llama.cpp's one-token decode and its batched replay of the same tokens differ by 0.5-3 nats of logit somewhere
    in each row (its batch-of-one kernels are not its batched ones), so now and then an honest position lands
    1.2-1.3 nats off (one of 13,101 here, another in a test's ~200), and a 6-answer calibration took that one for
    the band, over the ceiling, and refused an honest miner. Beyond the band a position is one miss, which an
    answer and the sequential test allow for; the hard gap still sits above the worst."""
    n = len(gaps)
    return gaps[max(0, min(n - 2, math.ceil(0.999 * n) - 1))]


def save_bands(path: Path, bands: AuditBands, test: SequentialTest, *, measured: dict[str, Any]) -> None:
    """Write the file ``--audit.bands`` loads (what was measured rides along, for the operator)."""
    doc = {"format": FORMAT, "bands": dataclasses.asdict(bands), "sequential": dataclasses.asdict(test),
           "measured": measured}
    tmp = path.with_suffix(path.suffix + ".partial")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


class BandsFileError(ValueError):
    """A bands file that cannot be used: the validator refuses to start with it (and says which field)."""


def over_ceiling(bands: AuditBands, test: SequentialTest) -> list[str]:
    """Each band above :data:`CEILING`, as ``name value > ceiling`` (empty when every band is within it)."""
    values = {**dataclasses.asdict(bands), "p0": test.p0}
    return [f"{name} {values[name]:g} > {limit:g}" for name, limit in CEILING.items()
            if not values[name] <= limit]  # NaN is over too


def load_bands(path: Path) -> tuple[AuditBands, SequentialTest]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BandsFileError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise BandsFileError(f"{path}: not a bands file (format {FORMAT!r} expected)")
    try:
        bands = _fields(AuditBands, doc.get("bands"))
        test = _fields(SequentialTest, doc.get("sequential"))
    except (TypeError, ValueError) as e:
        raise BandsFileError(f"{path}: {e}") from None
    over = over_ceiling(bands, test)
    if over:
        raise BandsFileError(f"{path}: bands over the ceiling ({', '.join(over)}): an audit this loose accepts "
                             "almost any token; recalibrate against an honest miner")
    return bands, test


def _fields(cls: Any, raw: Any) -> Any:
    if not isinstance(raw, dict):
        raise ValueError(f"'{cls.__name__}' must be an object")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields {unknown}")
    return cls(**raw)


def describe(bands: AuditBands, test: SequentialTest) -> str:
    """One line for the validator's start log."""
    return (f"near-tie {bands.greedy_gap:.2f} nats, hard {bands.greedy_hard_gap:.2f} nats, "
            f"misses allowed {bands.min_misses} (or {bands.greedy_miss_share:.0%}), z within ±{bands.z_limit:.1f}, "
            f"nucleus slack {bands.seeded_nucleus_slack:.2f}; "
            f"sequential test p0 {test.p0:g}, p1 {test.p1:g}, threshold {test.threshold:g}")
