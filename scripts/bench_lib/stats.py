"""Small statistics and table formatting for the benchmarks: no numpy, so a clean clone can run them.

Example::

    percentile([1.0, 2.0, 3.0, 4.0], 50)     # 2.5
    slope([0, 1, 2], [10.0, 12.0, 14.0])     # 2.0
    print(table(["a", "b"], [[1, 2.5]]))
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method); NaN for an empty sequence."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys over xs; needs at least two distinct xs."""
    n = len(xs)
    if n != len(ys) or n < 2:
        raise ValueError("slope needs two or more (x, y) pairs")
    mx = sum(xs) / n
    my = sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("slope needs distinct xs")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def fmt(value: object, digits: int = 2) -> str:
    """A table cell: floats rounded, NaN/None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return "-"
        return f"{value:.{digits}f}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], digits: int = 2) -> str:
    """A plain monospace table with right-aligned cells."""
    cells = [[fmt(v, digits) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(out)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"
