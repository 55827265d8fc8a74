"""API keys (gateway.auth) and btauth request signing (gateway.protocol.signing): pure, no sockets."""

from __future__ import annotations

import threading

import bittensor as bt
import pytest

from gateway.auth import ApiKeyAuth, bearer_token, hash_key, load_keys
from gateway.protocol.signing import RequestSigner


def test_api_keys_from_file_list_and_env(tmp_path):
    f = tmp_path / "keys.txt"
    f.write_text("# operators\nsk-file-1\n\n  sk-file-2   # trailing comment\n#sk-disabled\n")
    policies = load_keys(keys_file=f, keys=["sk-list"], env={"TENSORGATE_API_KEYS": "sk-env-1, sk-env-2,"})
    hashes = set(policies)
    assert hashes == {hash_key(k) for k in ("sk-file-1", "sk-file-2", "sk-list", "sk-env-1", "sk-env-2")}
    assert not any("sk-" in h for h in hashes)  # only hashes are kept
    auth = ApiKeyAuth(policies)
    assert auth.check("Bearer sk-file-2") and auth.check("bearer sk-env-1")
    for bad in (None, "", "Bearer", "Bearer sk-disabled", "sk-list", "Basic sk-list", "Bearer sk-list-2"):
        assert not auth.check(bad)
    assert bearer_token("Bearer  abc ") == "abc"
    assert not ApiKeyAuth({}).check("Bearer anything")


def test_signer_nonces_strictly_increase_across_threads(alice):
    signer = RequestSigner(alice)
    per_thread: list[list[int]] = [[] for _ in range(4)]

    def run(out: list[int]) -> None:
        for _ in range(500):
            out.append(signer.next_nonce())

    threads = [threading.Thread(target=run, args=(out,)) for out in per_thread]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [n for out in per_thread for n in out]
    assert len(set(every)) == 2000
    assert all(out == sorted(out) and len(set(out)) == len(out) for out in per_thread)


def test_signed_request_verifies_at_the_receiver_only(alice, miner_keys):
    signer = RequestSigner(alice)
    bob, charlie = miner_keys[0].ss58_address, miner_keys[1].ss58_address
    body_bytes = b'{"x": 1}'
    store = bt.http_auth.InMemoryNonceStore()
    h1 = signer.sign(path="/v1/chat/completions", body=body_bytes, receiver_ss58=bob)
    h2 = signer.sign(path="/v1/chat/completions", body=body_bytes, receiver_ss58=bob)  # same instant, same body
    for h in (h1, h2):
        caller = bt.http_auth.verify(h, body_bytes, method="POST", path="/v1/chat/completions",
                                     self_hotkey_ss58=bob, nonce_store=store)
        assert caller.hotkey_ss58 == alice.ss58_address
    with pytest.raises(bt.http_auth.ReplayedRequest):
        bt.http_auth.verify(h1, body_bytes, method="POST", path="/v1/chat/completions", self_hotkey_ss58=bob,
                            nonce_store=store)
    with pytest.raises(bt.http_auth.WrongReceiver):
        bt.http_auth.verify(h1, body_bytes, method="POST", path="/v1/chat/completions", self_hotkey_ss58=charlie)


def test_signer_fast_path_signs_like_the_sdk(alice, miner_keys):
    signer = RequestSigner(alice)
    bob = miner_keys[0].ss58_address
    store = bt.http_auth.InMemoryNonceStore()
    sdk = bt.http_auth.sign(alice, method="POST", path="/p", body=b"{}", receiver_ss58=bob, nonce_ns=1)
    per_request = {bt.http_auth.HEADER_NONCE, bt.http_auth.HEADER_SIGNATURE}
    for i in range(3):  # the first goes through the SDK, later ones through the cached signer
        body_bytes = f'{{"i": {i}}}'.encode()
        h = signer.sign(path="/p", body=body_bytes, receiver_ss58=bob)
        assert set(h) == set(sdk)
        assert {k: v for k, v in h.items() if k not in per_request} == {k: v for k, v in sdk.items()
                                                                          if k not in per_request}
        caller = bt.http_auth.verify(h, body_bytes, method="POST", path="/p", self_hotkey_ss58=bob, nonce_store=store)
        assert caller.hotkey_ss58 == alice.ss58_address
        with pytest.raises(bt.http_auth.BadSignature):
            bt.http_auth.verify(h, body_bytes + b" ", method="POST", path="/p", self_hotkey_ss58=bob)
