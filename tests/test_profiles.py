"""Credit profiles: built-in names, calibration files round-tripped, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from scoring.credit import CreditConfig, decode_credit
from scoring.profiles import PROFILES, ProfileError, load_profile, save_profile


def test_builtin_profiles_differ_where_the_hardware_does() -> None:
    gpu, cpu = load_profile("rtx5090"), load_profile("cpu-gemma270m")
    assert gpu == CreditConfig() and cpu is PROFILES["cpu-gemma270m"]
    # a correct CPU runtime at 22 tok/s: nothing under the 5090 bar, full credit under its own
    assert decode_credit(22.0, 1, gpu) == 0.0 and decode_credit(22.0, 1, cpu) == 1.0


def test_calibration_file_round_trip_and_errors(tmp_path: Path) -> None:
    cfg = CreditConfig(full_band_s=0.2, zero_band_s=0.6, prefill_tok_s=300.0, decode_curve=((1, 20.0), (2, 36.0)))
    path = tmp_path / "cpu.json"
    save_profile(cfg, path, measured={"aggregate_tok_s_at_1": 20.0})
    assert load_profile(str(path)) == cfg
    with pytest.raises(ProfileError, match="unknown credit profile"):
        load_profile("h100")
    (tmp_path / "bad.json").write_text('{"credit": {"decode_curve": "fast"}}')
    with pytest.raises(ProfileError, match="not a calibration file"):
        load_profile(str(tmp_path / "bad.json"))
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(str(tmp_path / "missing.json"))
    with pytest.raises(ProfileError, match="non-finite"):
        save_profile(cfg, path, measured={"x": float("nan")})
