"""JSON from a party the validator does not trust (a miner's /health, its error bodies, the tool calls it writes).

Why one helper: Python's JSON decoders recurse once per nesting level and raise :class:`RecursionError`, not
:class:`ValueError`, past the interpreter's limit. A miner's 14 kB body of 7,000 nested brackets did exactly that
inside the validator's start-up and stopped it (issue 39). Every parse of miner bytes goes through :func:`loads`,
which bounds the three things a hostile body can spend: size (``max_bytes``), depth (:data:`MAX_DEPTH`, checked
before any decoder recurses) and time (one linear scan plus the C decoder). Anything wrong is a
:class:`UntrustedJSONError`, a :class:`ValueError`, so callers' existing ``except ValueError`` contains it to the
miner that sent it.

Example::

    obj = loads(body, max_bytes=16 * 1024)   # raises UntrustedJSONError for garbage, a deep nest or a long body
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_DEPTH = 64  # nesting any honest body here needs is under 10; the interpreter's own limit is ~1,000 frames

# A string (to its closing quote, or to the end when it has none: one pass, never a rescan) or a bracket.
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|$)|[\[\]{}]', re.DOTALL)


class UntrustedJSONError(ValueError):
    """Bytes from an untrusted party that are not JSON this validator will read: malformed, too deep or too long."""


def depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in ``raw`` (brackets inside strings do not count)."""
    deepest = level = 0
    for m in _TOKEN.finditer(raw):
        token = m.group()
        if token in (b"[", b"{"):
            level += 1
            deepest = max(deepest, level)
        elif token in (b"]", b"}"):
            level -= 1
    return deepest


def loads(raw: bytes | str, *, max_bytes: int | None = None, max_depth: int = MAX_DEPTH) -> Any:
    """``raw`` decoded as JSON, or :class:`UntrustedJSONError`; never a :class:`RecursionError`."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if max_bytes is not None and len(data) > max_bytes:
        raise UntrustedJSONError(f"longer than {max_bytes} bytes")
    if data.count(b"[") + data.count(b"{") > max_depth and depth(data) > max_depth:
        raise UntrustedJSONError(f"nested deeper than {max_depth} levels")
    try:
        return json.loads(data)
    except RecursionError:  # unreachable past the depth check; kept so no decoder error ever escapes as one
        raise UntrustedJSONError("nested too deeply") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        raise UntrustedJSONError(f"not JSON: {e}") from None
