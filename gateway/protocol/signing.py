"""Signs every validator -> miner request with ``bt.http_auth`` (btauth/1), nonces strictly increasing.

Miners keep a replay cache keyed by (hotkey, nonce). Two concurrent requests signed in the same
``time.time_ns()`` tick would share a nonce and the second would be rejected as a replay, so the
nonce is ``max(time.time_ns(), last + 1)``, under a lock (signing may run in threads too).

Signing is on every dispatch's path. ``bt.http_auth.sign`` resolves the signer (protocol
``isinstance`` checks, ~12 µs) and re-reads the address on every call, so the first request goes
through it and the signer keeps what it learnt: the resolved signer and the headers that never change.
Later requests sign the SDK's own normative payload (``bt.http_auth.build_payload``) directly.

Example::

    from bittensor.sp_core import Keypair
    signer = RequestSigner(Keypair.create_from_uri("//Alice"))
    headers = signer.sign(path="/v1/chat/completions", body=b"{}", receiver_ss58=miner_hotkey)
"""

from __future__ import annotations

import threading
import time
from typing import Any

import bittensor as bt

_H = bt.http_auth
_PER_REQUEST = {_H.HEADER_NONCE, _H.HEADER_SIGNATURE, _H.HEADER_RECEIVER}


class RequestSigner:
    """The validator's hotkey as an HTTP request signer."""

    def __init__(self, keypair: Any) -> None:
        self._keypair = keypair
        self._last = 0
        self._lock = threading.Lock()
        self._signer: Any = None  # resolved on the first sign, which goes through the SDK
        self._fixed: dict[str, str] = {}
        self._scheme = ""

    @property
    def hotkey(self) -> str:
        return str(self._keypair.ss58_address)

    def next_nonce(self) -> int:
        """A nanosecond nonce greater than every nonce handed out before by this signer."""
        with self._lock:
            nonce = max(time.time_ns(), self._last + 1)
            self._last = nonce
            return nonce

    def sign(self, *, path: str, body: bytes, receiver_ss58: str, method: str = "POST") -> dict[str, str]:
        """The ``X-Bittensor-*`` headers for one request, bound to the receiving miner's hotkey."""
        nonce = self.next_nonce()
        signer = self._signer
        if signer is None:
            headers = _H.sign(self._keypair, method=method, path=path, body=body, receiver_ss58=receiver_ss58,
                              nonce_ns=nonce)
            self._learn(headers)
            return headers
        payload = _H.build_payload(scheme=self._scheme, method=method, path=path, body=body, nonce_ns=nonce,
                                   sender_ss58=self._fixed[_H.HEADER_HOTKEY], receiver_ss58=receiver_ss58)
        headers = dict(self._fixed)
        headers[_H.HEADER_NONCE] = str(nonce)
        headers[_H.HEADER_SIGNATURE] = "0x" + bytes(signer.sign(payload)).hex()
        headers[_H.HEADER_RECEIVER] = receiver_ss58
        return headers

    def _learn(self, headers: dict[str, str]) -> None:
        fixed = {k: v for k, v in headers.items() if k not in _PER_REQUEST}
        if fixed.get(_H.HEADER_VERSION) != _H.VERSION or _H.HEADER_HOTKEY not in fixed:
            return  # an SDK this code does not know: keep signing through it
        self._fixed = fixed
        self._scheme = fixed.get(_H.HEADER_CRYPTO, "sr25519")  # absent means sr25519 (btauth/1)
        self._signer = bt.resolve_signer(self._keypair, role="hotkey")
