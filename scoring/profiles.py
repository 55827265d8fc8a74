"""Hardware profiles: the speed bar that earns full credit, by name or from a calibration file.

Credit compares what a miner delivers with what an honest card of the subnet's class delivers
(:class:`~scoring.credit.CreditConfig`). That bar belongs to the hardware, not to the code: an RTX
5090 bar scores a correct CPU runtime 0 on every request, and a CPU bar pays a 5090 for idling. So
the bar is a named profile, and a new one is *measured*, not typed: ``python scripts/calibrate.py``
runs the reference runtime and writes a JSON file this module loads.

Example::

    cfg = load_profile("rtx5090")                 # the built-in default
    cfg = load_profile("~/.tensorgate/cpu.json")  # written by scripts/calibrate.py
    save_profile(cfg, path, measured={...})       # what calibrate.py does
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from scoring.credit import CreditConfig

PROFILES: dict[str, CreditConfig] = {
    # One RTX 5090 serving the subnet's model (vLLM): the defaults the soak was tuned on.
    "rtx5090": CreditConfig(),
    # Gemma 3 270M Q4_K_M on llama.cpp, one thread per stream. scripts/calibrate.py on the project's 2-core
    # machine, idle (2026-12-03): prefill 242 tok/s, TTFT residual p95 0.05 s, 24.6 tok/s at 1 stream, 49.5
    # aggregate at 2. The rates are kept; the TTFT band and the tolerance are widened for the local subnet,
    # where the validator, its reference and the miners share those 2 cores (TTFT p95 up to 1.5 s measured).
    "cpu-gemma270m": CreditConfig(full_band_s=0.6, zero_band_s=2.0, prefill_tok_s=242.0,
                                  decode_curve=((1, 24.6), (2, 49.5)), tolerance_ratio=0.5, floor_ratio=0.2),
}


class ProfileError(ValueError):
    """A profile name that does not exist or a calibration file that cannot be used."""


_FIELDS = ("full_band_s", "zero_band_s", "prefill_tok_s", "floor_ratio", "tolerance_ratio", "min_decode_tokens")


def load_profile(spec: str) -> CreditConfig:
    """A built-in profile by name, or a JSON file written by ``scripts/calibrate.py``."""
    if spec in PROFILES:
        return PROFILES[spec]
    path = Path(spec).expanduser()
    if not path.suffix == ".json" and not path.exists():
        raise ProfileError(f"unknown credit profile {spec!r}: one of {', '.join(sorted(PROFILES))}, "
                           "or a JSON file from 'python scripts/calibrate.py'")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ProfileError(f"credit profile {path}: cannot read it ({e})") from None
    try:
        credit = data["credit"]
        kw: dict[str, Any] = {k: credit[k] for k in _FIELDS if k in credit}
        kw["decode_curve"] = tuple((int(n), float(r)) for n, r in credit["decode_curve"])
        return CreditConfig(**kw)
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(f"credit profile {path}: not a calibration file ({e!r})") from None


def save_profile(cfg: CreditConfig, path: Path, *, measured: dict[str, Any]) -> None:
    """Write ``cfg`` (and the figures it was derived from) where :func:`load_profile` reads it."""
    for v in measured.values():
        if isinstance(v, float) and not math.isfinite(v):
            raise ProfileError("refusing to save a profile from non-finite measurements")
    credit: dict[str, Any] = {k: getattr(cfg, k) for k in _FIELDS}
    credit["decode_curve"] = [list(p) for p in cfg.decode_curve]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"credit": credit, "measured": measured}, indent=2, sort_keys=True) + "\n")
