"""Client API keys: loaded from a file and/or ``TENSORGATE_API_KEYS``, kept only as sha256 hashes.

Hashing means a memory dump or a status page can never leak a usable key; comparing digests with
``hmac.compare_digest`` against every stored hash keeps the check's timing independent of the key.

Example::

    hashes = load_key_hashes(keys_file="keys.txt", keys=["sk-local"], env={})
    auth = ApiKeyAuth(hashes)
    auth.check("Bearer sk-local")   # True
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

ENV_VAR = "TENSORGATE_API_KEYS"


def hash_key(key: str) -> str:
    """The stored form of an API key."""
    return hashlib.sha256(key.encode()).hexdigest()


def parse_keys_text(text: str) -> list[str]:
    """One key per line; blank lines and ``#`` comments (whole-line or trailing) are ignored."""
    keys = []
    for line in text.splitlines():
        key = line.split("#", 1)[0].strip()
        if key:
            keys.append(key)
    return keys


def load_key_hashes(
    keys_file: str | Path | None = None,
    keys: Iterable[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> frozenset[str]:
    """Hashes of every key from the file, the explicit list and the env var (``os.environ`` by default)."""
    found: list[str] = []
    if keys_file:
        found += parse_keys_text(Path(keys_file).read_text())
    if keys:
        found += [k.strip() for k in keys if k and k.strip()]
    env = os.environ if env is None else env
    found += [k.strip() for k in env.get(ENV_VAR, "").split(",") if k.strip()]
    return frozenset(hash_key(k) for k in found)


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class ApiKeyAuth:
    """Checks bearer tokens against stored hashes in constant time (per stored hash)."""

    def __init__(self, key_hashes: Iterable[str]) -> None:
        self._hashes = tuple(sorted({h.lower() for h in key_hashes}))

    def __len__(self) -> int:
        return len(self._hashes)

    def check(self, authorization: str | None) -> bool:
        token = bearer_token(authorization)
        if token is None:
            return False
        digest = hash_key(token).encode()
        ok = False
        for h in self._hashes:  # no early exit: the time taken does not say which hash matched
            ok |= hmac.compare_digest(digest, h.encode())
        return ok
