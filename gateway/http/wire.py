"""Header fields as HTTP/1.1 wire bytes, shared by the server (``http_server``) and the miner client (``miner_http``).

A field value with a line break would let whoever chose it inject headers or a whole second message,
so both directions refuse it here, in one place, rather than each checking on its own.

Example::

    header_fields({"Content-Type": "application/json"})   # b"Content-Type: application/json\\r\\n"
    header_fields({"X": "a\\r\\nSet-Cookie: b"})           # ValueError
"""

from __future__ import annotations

from collections.abc import Mapping


def header_fields(headers: Mapping[str, str]) -> bytes:
    """``name: value\\r\\n`` per field (latin-1); ValueError if a name or value holds a line break."""
    lines = []
    for k, v in headers.items():
        if "\r" in k or "\n" in k or "\r" in v or "\n" in v:
            raise ValueError(f"header {k!r} contains a line break")
        lines.append(f"{k}: {v}\r\n")
    return "".join(lines).encode("latin-1")
