"""Audit bands per reference (neurons.reference.bands): derived from an honest spread, saved, loaded, wired."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neurons.reference.bands import (
    CEILING,
    BandsFileError,
    HonestSpread,
    bands_from,
    describe,
    load_bands,
    over_ceiling,
    save_bands,
)
from scoring.audit import AuditBands
from scoring.audit.sequential import SequentialTest


def test_a_tight_honest_spread_keeps_the_defaults_and_a_wide_one_widens_them() -> None:
    tight = HonestSpread(gaps=[0.0] * 5000 + [0.3], misses=0, positions=5001, z=[1.0, 2.5], nucleus_excess=[0.05])
    bands, test = bands_from(tight)
    assert bands == AuditBands() and test == SequentialTest()  # never narrower than the defaults
    wide = HonestSpread(gaps=[0.0] * 990 + [0.6] * 10, misses=10, positions=1000, z=[6.0],
                        nucleus_excess=[0.03, 0.12])  # a GPU runtime's nucleus edge further from the reference's
    bands, test = bands_from(wide)
    assert bands.greedy_gap == pytest.approx(0.75)  # 1.25x the honest 99.9th percentile
    assert bands.greedy_hard_gap >= 1.5 * 0.6 and bands.z_limit == pytest.approx(7.8)
    assert bands.seeded_nucleus_slack == pytest.approx(0.15)  # 1.25x the farthest honest token beyond the nucleus
    assert test.p0 == pytest.approx(4 * 11 / 1001) and test.p1 == pytest.approx(10 * test.p0)
    assert "near-tie 0.75" in describe(bands, test) and "nucleus slack 0.15" in describe(bands, test)
    far = HonestSpread(gaps=[0.0], misses=0, positions=1, z=[], nucleus_excess=[0.7])
    assert bands_from(far)[0].seeded_nucleus_slack == 0.5  # no wider: beyond it the nucleus is not checked at all


def test_one_tail_position_of_a_short_calibration_is_a_miss_not_the_band() -> None:
    """A 6-answer calibration of an honest llama.cpp miner against the llama.cpp reference (about 200 positions)
    now and then has one position 1.2-1.3 nats off: its 99.9th percentile was that one position, the near-tie band
    1.25x it, over the ceiling, and calibrate refused an honest miner. One position never sets the band; two do,
    and the hard gap still sits above the worst."""
    one = HonestSpread(gaps=[0.0] * 190 + [0.1] * 9 + [1.33], misses=1, positions=200, z=[])
    bands, test = bands_from(one)
    assert bands.greedy_gap == AuditBands().greedy_gap and over_ceiling(bands, test) == []
    assert bands.greedy_hard_gap >= 1.5 * 1.33
    two = HonestSpread(gaps=[0.0] * 190 + [0.1] * 8 + [1.3, 1.33], misses=2, positions=200, z=[])
    assert bands_from(two)[0].greedy_gap == pytest.approx(1.25 * 1.3)
    assert bands_from(HonestSpread(gaps=[1.0], misses=1, positions=1, z=[]))[0].greedy_gap == pytest.approx(1.25)


def test_bands_round_trip_and_a_bad_file_is_refused_with_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "bands.json"
    bands, test = AuditBands(greedy_gap=0.7), SequentialTest(p0=0.004, p1=0.04)
    save_bands(path, bands, test, measured={"answers": 3})
    assert load_bands(path) == (bands, test)
    assert json.loads(path.read_text())["measured"] == {"answers": 3}
    doc = json.loads(path.read_text())
    for change, why in (({"format": "other"}, "not a bands file"),
                        ({"bands": {**doc["bands"], "greedy_gap": -1}}, "greedy_gap"),
                        ({"bands": {**doc["bands"], "typo": 1}}, "unknown AuditBands fields"),
                        ({"sequential": {"p0": 0.5, "p1": 0.1, "threshold": 15}}, "p0 < p1")):
        path.write_text(json.dumps({**doc, **change}))
        with pytest.raises(BandsFileError, match=why):
            load_bands(path)
    path.write_text("{")
    with pytest.raises(BandsFileError, match="JSON"):
        load_bands(path)


def test_a_poisoned_spread_is_over_the_ceiling_and_a_file_over_it_is_refused(tmp_path: Path) -> None:
    """Issue 37: calibrating against a miner that declares the sampler and draws with its own RNG measured gaps up
    to ~20 nats and wrote a near-tie band of 24.56; a validator loaded it. Such bands are over the ceiling, and a
    file holding them (whoever wrote it) is refused with what is over."""
    poisoned = HonestSpread(gaps=[0.0] * 700 + [3.0] * 200 + [19.65] * 100, misses=300, positions=1000, z=[])
    bands, test = bands_from(poisoned)
    assert bands.greedy_gap == pytest.approx(24.56, abs=0.01)
    over = over_ceiling(bands, test)
    assert any(o.startswith("greedy_gap 24.5") for o in over) and any(o.startswith("greedy_hard_gap") for o in over)
    assert over_ceiling(AuditBands(), SequentialTest()) == []
    at_ceiling = AuditBands(greedy_gap=CEILING["greedy_gap"], greedy_hard_gap=CEILING["greedy_hard_gap"],
                            z_limit=CEILING["z_limit"])
    assert over_ceiling(at_ceiling, SequentialTest(p0=CEILING["p0"], p1=0.5)) == []
    path = tmp_path / "bands.json"
    save_bands(path, bands, test, measured={})
    with pytest.raises(BandsFileError, match="over the ceiling.*greedy_gap 24.5"):
        load_bands(path)
    save_bands(path, AuditBands(), SequentialTest(p0=0.06, p1=0.5), measured={})
    with pytest.raises(BandsFileError, match="p0 0.06 > 0.05"):
        load_bands(path)


def test_the_validator_audits_with_the_bands_file_it_is_given(tmp_path: Path) -> None:
    from neurons.keys import dev_keypair
    from neurons.validator.build import build_parts
    from neurons.validator.config import ValidatorConfig

    path = tmp_path / "bands.json"
    save_bands(path, AuditBands(greedy_gap=0.9), SequentialTest(p0=0.01, p1=0.1), measured={})
    parts = build_parts(ValidatorConfig(gateway_port=0, audit_model="toy", audit_bands=path), dev_keypair("Alice"))
    assert parts.auditor is not None
    assert parts.auditor.bands.greedy_gap == 0.9 and parts.auditor.book.policy.sequential.p0 == 0.01
    plain = build_parts(ValidatorConfig(gateway_port=0, audit_model="toy"), dev_keypair("Alice"))
    assert plain.auditor is not None and plain.auditor.bands == AuditBands()
