"""Flag types that refuse what a setting cannot mean, at parse time: one line and exit 2, never a traceback later.

A number flag parsed with plain ``int``/``float`` took ``nan``, ``inf``, a port of 70,000 or a netuid of 10**20,
and the validator died with a traceback where the value was first used (``bind()``, ``int(nan)``, the audit
sampler). :func:`bound` gives each number flag its range; the parser's values from the environment and the
settings file go through the same types (:mod:`neurons.settings`), so all three sources are checked alike.

Example::

    bound(parser, {"gateway.port": (0, 65535), "audit.rate": (0.0, 1.0)})
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping
from typing import Any

LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "SUCCESS", "WARNING", "ERROR", "CRITICAL")  # loguru's
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def number(kind: Callable[[str], Any], lo: float, hi: float) -> Callable[[str], Any]:
    """A ``kind`` (int or float) parser that refuses non-finite values and values outside ``[lo, hi]``."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be within [{lo:g}, {hi:g}], got {text}")
        return value
    parse.__name__ = getattr(kind, "__name__", "number")  # argparse names the type in its messages
    return parse


def percents(text: str) -> list[float]:
    """``"50,30,20"``: shares in percent, each finite and within [0, 100], at least one above 0."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated percentages, like 50,30,20: got {text!r}") from None
    if not all(math.isfinite(v) and 0 <= v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"each share must be within [0, 100]: got {text!r}")
    return values


def log_level(text: str) -> str:
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"unknown log level {text!r}: one of {', '.join(LOG_LEVELS)}")
    return level


def redis_url(text: str) -> str:
    if not text.startswith(REDIS_SCHEMES):
        raise argparse.ArgumentTypeError(f"a Redis URL starts with {', '.join(REDIS_SCHEMES)}: got {text!r}")
    return text


def bound(parser: argparse.ArgumentParser, ranges: Mapping[str, tuple[float, float]]) -> None:
    """Give each number flag of ``parser`` its range from ``ranges`` (flag name without dashes); a number flag
    missing from ``ranges`` is a programming error (a new flag must say what it accepts)."""
    for action in parser._actions:  # argparse has no public list of its actions
        if action.type not in (int, float) or not action.option_strings:
            continue
        name = action.option_strings[0].lstrip("-")
        if name not in ranges:
            raise KeyError(f"number flag --{name} has no range")
        lo, hi = ranges[name]
        action.type = number(action.type, lo, hi)
