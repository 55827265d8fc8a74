"""Issue 27: what each miner serves (models, features) from its signed /health, and routing by it."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from bittensor.sp_core import Keypair

from gateway.http.client import MinerClient
from gateway.offers import (
    SIGNATURE_HEADER,
    UNDECLARED,
    OfferError,
    read_offer,
    refresh_offers,
    signed_health,
)
from gateway.protocol.auditable import audit_skip
from gateway.router import Candidate, Router

BOB, EVE = Keypair.create_from_uri("//Bob"), Keypair.create_from_uri("//Eve")


def test_an_offer_is_read_only_from_the_miners_own_signed_health() -> None:
    body, headers = signed_health(BOB, {"models": ["org/a"], "features": ["tools", "telepathy"]})
    offer = read_offer(body, headers[SIGNATURE_HEADER], BOB.ss58_address)
    assert offer.models == {"org/a"} and offer.features == {"tools"}  # an unknown feature is ignored
    sig = headers[SIGNATURE_HEADER]
    forged, forged_headers = signed_health(EVE, {"models": ["org/a"]})
    for bad_body, bad_sig, hotkey in (
        (body, None, BOB.ss58_address),  # unsigned
        (body.replace(b"org/a", b"org/b"), sig, BOB.ss58_address),  # changed after signing
        (body, sig, EVE.ss58_address),  # another hotkey's endpoint serving Bob's declaration
        (forged, forged_headers[SIGNATURE_HEADER], BOB.ss58_address),  # Eve signing for Bob's axon
        (body, "0xzz", BOB.ss58_address),
    ):
        with pytest.raises(OfferError):
            read_offer(bad_body, bad_sig, hotkey)
    for models in ([1], ["x" * 129], [f"m{i}" for i in range(17)], "org/a"):
        b, h = signed_health(BOB, {"models": models})
        with pytest.raises(OfferError):
            read_offer(b, h[SIGNATURE_HEADER], BOB.ss58_address)


def test_the_router_picks_only_miners_that_serve_the_model_and_features() -> None:
    r = Router(rng=random.Random(3))
    r.default_model = "sub/model"
    r.sync([Candidate(uid=i, hotkey=f"h{i}", endpoint=f"127.0.0.1:{9000 + i}", slots=4) for i in range(4)])
    m = {x.uid: x for x in r.miners()}
    r.learn_offer(m[1], frozenset({"org/b"}), frozenset({"tools"}))
    r.learn_offer(m[2], frozenset({"sub/model", "org/b"}), frozenset({"tools", "logprobs"}))
    # uid 0 and 3 declared nothing: the subnet's model, plain chat

    def picks(model: str | None, needs: frozenset[str] = frozenset()) -> Counter[int]:
        out: Counter[int] = Counter()
        for _ in range(400):
            lease = r.acquire(model=model, needs=needs)
            assert lease is not None
            out[lease.miner.uid] += 1
            r.release(lease)
        return out

    assert set(picks("sub/model")) == {0, 2, 3}
    assert set(picks("org/b")) == {1, 2}
    assert set(picks("org/b", frozenset({"logprobs"}))) == {2}
    assert set(picks(None)) == {0, 1, 2, 3}  # no model asked (a probe's pick): anyone
    assert r.acquire(model="org/c") is None and r.acquire(model="sub/model", needs=frozenset({"min_p"})) is None
    assert r.offered() == {"sub/model", "org/b"}
    assert r.can_serve("org/b", {"tools"}) and not r.can_serve("org/b", {"min_p"})
    # the cached "everyone serves it" answer follows a change of offer
    for x in (0, 1, 3):
        r.learn_offer(m[x], frozenset({"sub/model"}), frozenset({"tools", "logprobs"}))
    assert set(picks("sub/model", frozenset({"tools"}))) == {0, 1, 2, 3}
    r.learn_offer(m[3], UNDECLARED.models, UNDECLARED.features)
    assert set(picks("sub/model", frozenset({"tools"}))) == {0, 1, 2}


async def test_refresh_reads_every_miners_offer_and_keeps_it_when_unreachable(make_miner) -> None:
    a = await make_miner(tag="a")
    a.models, a.features = ("org/a",), frozenset({"tools"})
    b = await make_miner(tag="b")
    b.features = frozenset()
    c = await make_miner(tag="c")
    c.sampler = None  # a stock runtime: its own RNG
    r = Router()
    r.sync([Candidate(uid=1, hotkey=a.hotkey, endpoint=a.endpoint), Candidate(uid=2, hotkey=b.hotkey,
                                                                               endpoint=b.endpoint),
            Candidate(uid=3, hotkey=a.hotkey, endpoint=b.endpoint),  # b's endpoint under a's hotkey: not a's
            Candidate(uid=4, hotkey=c.hotkey, endpoint=c.endpoint)])
    async with MinerClient() as client:
        counts = await refresh_offers(r, client, timeout_s=3)
        got = {m.uid: (set(m.models), set(m.features)) for m in r.miners()}
        assert got == {1: ({"org/a"}, {"tools"}), 2: (set(), set()), 3: (set(), set()), 4: (set(), c.features)}
        # the sampler is read with the offer: a miner's first sampled answer is seeded, not a free draw
        # (uid 3's /health failed its checks: what it declared is not read, its sampler left as it was)
        assert [m.declares_sampler for m in r.miners()] == [True, True, False, False]
        assert counts == {"read": 3, "kept": 0, "undeclared": 1}
        await a.stop()  # unreachable now: its last offer stands (a restarting miner keeps its routes)
        counts = await refresh_offers(r, client, timeout_s=3)
        assert counts["kept"] == 1 and r.get(1) is not None and r.get(1).models == {"org/a"}  # type: ignore[union-attr]


def test_audit_skip_names_what_the_reference_cannot_force() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    assert audit_skip({"messages": msgs, "logprobs": True, "top_logprobs": 2}, greedy=False) is None
    assert audit_skip({"messages": msgs, "tools": [{"type": "function"}]}, greedy=True) == "tools"
    history = [*msgs, {"role": "tool", "tool_call_id": "c", "content": "42"}]
    assert audit_skip({"messages": history}, greedy=True) == "tools"  # a reference that cannot render tools (toy)
    # a reference that renders the subnet's tool format audits tool answers, unless a call was forced (a runtime
    # constrains its decoding to the call)
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert audit_skip({"messages": history}, greedy=True, tools=True) is None
    assert audit_skip({"messages": msgs, "tools": tools, "tool_choice": "auto"}, greedy=False, tools=True) is None
    for forced in ("required", {"type": "function", "function": {"name": "f"}}):
        assert audit_skip({"messages": msgs, "tools": tools, "tool_choice": forced}, greedy=True,
                          tools=True) == "tool_choice"
        # a reference that masks by the subnet's grammar (llama.cpp's) forces the call as the runtime decoded it
        assert audit_skip({"messages": msgs, "tools": tools, "tool_choice": forced}, greedy=True, tools=True,
                          grammars=True) is None
    assert audit_skip({"messages": msgs, "response_format": {"type": "json_object"}}, greedy=True) == "response_format"
    assert audit_skip({"messages": msgs, "response_format": {"type": "json_object"}}, greedy=True,
                      grammars=True) is None
    assert audit_skip({"messages": msgs, "logit_bias": {"5": 1}}, greedy=True) == "logit_bias"
    assert audit_skip({"messages": msgs, "top_k": 5}, greedy=True) is None  # greedy is the argmax either way
    assert audit_skip({"messages": msgs, "top_k": 5}, greedy=False) == "top_k"
    assert audit_skip({"messages": msgs, "min_p": 0.1}, greedy=False) == "min_p"
    assert audit_skip({"model": "org/b", "messages": msgs}, greedy=True, model="org/a") == "model"
    assert audit_skip({"model": "org/a", "messages": msgs}, greedy=True, model="org/a") is None


async def test_a_request_using_a_feature_goes_only_to_miners_that_declared_it(make_miner, make_gateway) -> None:
    plain = await make_miner(tag="plain")
    plain.features = frozenset()
    rich = await make_miner(tag="rich")  # the scripted miner serves tools, JSON mode and logprobs
    h = await make_gateway([plain, rich])
    async with MinerClient() as client:
        await refresh_offers(h.router, client)
    for _ in range(6):
        async with h.chat({"model": "tensorgate/sim-5090", "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 3, "logprobs": True}) as r:
            assert r.status == 200 and r.headers["X-Tensorgate-Miner-Uid"] == "2"
    assert plain.requests == 0 and rich.requests == 6


def _deep_health(hotkey: str, levels: int = 7000) -> bytes:
    """A /health a hostile miner signs: its hotkey, and a field nested ``levels`` deep (14 kB at 7,000)."""
    return b'{"hotkey": "' + hotkey.encode() + b'", "models": ' + b"[" * levels + b"]" * levels + b"}"


def test_a_deeply_nested_health_declares_nothing_and_raises_nothing_else() -> None:
    """Issue 39 (1): 7,000 nested brackets under the size cap raised RecursionError out of read_offer."""
    body = _deep_health(BOB.ss58_address)
    assert len(body) < 16 * 1024
    with pytest.raises(OfferError, match="nested deeper"):
        read_offer(body, "0x" + bytes(BOB.sign(body)).hex(), BOB.ss58_address)


async def test_a_miner_with_a_deeply_nested_health_cannot_stop_the_validators_start(make_miner, tmp_path) -> None:
    from neurons.chain.base import ChainParams, NeuronInfo
    from neurons.keys import dev_keypair
    from neurons.validator.build import build_validator
    from neurons.validator.config import ValidatorConfig

    hostile, honest = await make_miner(tag="deep"), await make_miner(tag="ok")
    hostile.raw_health = _deep_health(hostile.hotkey)
    alice = dev_keypair("Alice")

    class Chain:
        netuid = 1

        async def metagraph(self) -> list[NeuronInfo]:
            def n(uid: int, hotkey: str, endpoint: str | None, stake: float = 0.0) -> NeuronInfo:
                return NeuronInfo(uid=uid, hotkey=hotkey, endpoint=endpoint, validator_permit=stake > 0,
                                  validator_trust=0.0, stake=stake)

            return [n(0, alice.ss58_address, None, 1e4), n(1, hostile.hotkey, hostile.endpoint),
                    n(2, honest.hotkey, honest.endpoint)]

        async def params(self) -> ChainParams:
            return ChainParams(tempo=360, weights_rate_limit=10, commit_reveal=False, max_weight_limit=1.0,
                               min_allowed_weights=1, block_time=12.0)

        async def block(self) -> int:
            return 1

        async def close(self) -> None:
            return None

    v = build_validator(ValidatorConfig(state_dir=tmp_path, gateway_port=0, audit_off=True), Chain(),  # type: ignore[arg-type]
                        alice)
    try:
        await v.start()  # raised RecursionError here before the fix: the validator exited 1
        m = {x.uid: x for x in v.router.miners()}
        assert not m[1].models and not m[1].features  # undeclared: serves the subnet's model, plain chat
        assert m[2].features == honest.features  # the honest miner's offer is read as usual
    finally:
        await v.stop()
