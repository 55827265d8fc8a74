"""Signs every validator -> miner request with ``bt.http_auth`` (btauth/1), nonces strictly increasing.

Miners keep a replay cache keyed by (hotkey, nonce). Two concurrent requests signed in the same
``time.time_ns()`` tick would share a nonce and the second would be rejected as a replay, so the
nonce is ``max(time.time_ns(), last + 1)``, under a lock (signing may run in threads too).

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


class RequestSigner:
    """The validator's hotkey as an HTTP request signer."""

    def __init__(self, keypair: Any) -> None:
        self._keypair = keypair
        self._last = 0
        self._lock = threading.Lock()

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
        return bt.http_auth.sign(self._keypair, method=method, path=path, body=body,
                                 receiver_ss58=receiver_ss58, nonce_ns=self.next_nonce())
