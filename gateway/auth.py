"""Client API keys: loaded from a file and/or ``TENSORGATE_API_KEYS``, kept only as sha256 hashes.

Hashing means a memory dump or a status page can never leak a usable key; comparing digests with
``hmac.compare_digest`` against every stored hash keeps the check's timing independent of the key.

The keys file has one key per line, optionally followed by its name and limits
(:class:`gateway.quota.KeyPolicy`)::

    sk-alice-0123   name=alice rpm=60 tpm=100000 tpd=2000000 streams=4
    sk-bob-4567     name=bob                         # named, unlimited
    sk-anon-89ab                                     # named key-<first 8 hex of its hash>, unlimited

A line that cannot be read stops the start with its line number (a typo must not silently lift a
limit). Keys from the list or the environment are unlimited.

Example::

    policies = load_keys(keys_file="keys.txt", keys=["sk-local"], env={})
    auth = ApiKeyAuth(policies)
    auth.identify("Bearer sk-local")   # KeyPolicy(name='key-1a2b3c4d'), or None
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from .quota import KeyPolicy

ENV_VAR = "TENSORGATE_API_KEYS"
_LIMITS = ("rpm", "tpm", "tpd", "streams")


class KeysFileError(ValueError):
    """A line of the keys file that cannot be read."""


def hash_key(key: str) -> str:
    """The stored form of an API key."""
    return hashlib.sha256(key.encode()).hexdigest()


def default_name(key: str) -> str:
    """The name of a key that has none: a prefix of its hash, so logs never show the key."""
    return f"key-{hash_key(key)[:8]}"


def parse_keys_text(text: str) -> list[tuple[str, KeyPolicy]]:
    """``(key, policy)`` per line; blank lines and ``#`` comments (whole-line or trailing) are ignored.

    Raises :class:`KeysFileError` naming the line for an unknown field, a limit that is not a positive
    integer, or a name used twice.
    """
    out: list[tuple[str, KeyPolicy]] = []
    names: set[str] = set()
    for n, line in enumerate(text.splitlines(), start=1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        key, fields = words[0], words[1:]
        name = default_name(key)
        limits: dict[str, int] = {}
        for f in fields:
            k, sep, v = f.partition("=")
            if not sep or k not in ("name", *_LIMITS) or not v:
                raise KeysFileError(f"line {n}: {f!r} is not name=... or one of {', '.join(_LIMITS)}=N")
            if k == "name":
                name = v
            elif not v.isdigit() or int(v) < 1:
                raise KeysFileError(f"line {n}: {k}={v!r} must be a positive integer")
            else:
                limits[k] = int(v)
        if name in names:
            raise KeysFileError(f"line {n}: the name {name!r} is used twice (usage is counted by name)")
        names.add(name)
        out.append((key, KeyPolicy(name, **limits)))
    return out


def load_keys(
    keys_file: str | Path | None = None,
    keys: Iterable[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, KeyPolicy]:
    """``{hash: policy}`` of every key from the file, the explicit list and the env var (``os.environ``
    by default). A key given twice keeps the file's policy."""
    found: list[tuple[str, KeyPolicy]] = []
    if keys_file:
        try:
            text = Path(keys_file).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise KeysFileError(f"API keys file {keys_file}: cannot read it ({e})") from None
        try:
            found += parse_keys_text(text)
        except KeysFileError as e:
            raise KeysFileError(f"API keys file {keys_file}, {e}") from None
    extra = [k.strip() for k in keys or () if k and k.strip()]
    env = os.environ if env is None else env
    extra += [k.strip() for k in env.get(ENV_VAR, "").split(",") if k.strip()]
    found += [(k, KeyPolicy(default_name(k))) for k in extra]
    policies: dict[str, KeyPolicy] = {}
    for key, policy in found:
        policies.setdefault(hash_key(key), policy)
    return policies


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def bearer_matches(authorization: str | None, key: str) -> bool:
    """Whether ``Authorization`` carries ``key`` as its bearer token, in constant time; a header that is not UTF-8
    (aiohttp hands it over with surrogates) is a wrong key, never an error."""
    given = bearer_token(authorization) or ""
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), key.encode())


class ApiKeyAuth:
    """Checks bearer tokens against stored hashes in constant time (per stored hash).

    ``keys``: ``{hash: policy}``, as :func:`load_keys` returns them.
    """

    def __init__(self, keys: Mapping[str, KeyPolicy]) -> None:
        self._keys = tuple(sorted((h.lower(), p) for h, p in keys.items()))

    def __len__(self) -> int:
        return len(self._keys)

    def identify(self, authorization: str | None) -> KeyPolicy | None:
        """The policy of the key in ``Authorization: Bearer <key>``, or None."""
        token = bearer_token(authorization)
        if token is None:
            return None
        digest = hash_key(token).encode()
        found: KeyPolicy | None = None
        for h, policy in self._keys:  # no early exit: the time taken does not say which hash matched
            if hmac.compare_digest(digest, h.encode()):
                found = policy
        return found

    def check(self, authorization: str | None) -> bool:
        return self.identify(authorization) is not None
