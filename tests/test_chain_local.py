"""The chain seam over the local chain: the SDK's real read/conform/preflight/commit code, offline."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from pathlib import Path

import pytest
from bittensor import calls
from bittensor.sp_core import Keypair
from loguru import logger

from neurons.chain import (
    ChainUnavailable,
    LocalChain,
    LocalSubstrate,
    NotRegistered,
    StateDirLocked,
    SubtensorChain,
)

BLOCK = 0.25
NETUID = 1


class FakeClock:
    """Wall clock under test control: blocks advance only when a test says so."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance_blocks(self, n: int) -> None:
        self.t += n * BLOCK


@pytest.fixture(autouse=True)
def _token_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BTCLI_TOKEN_SYMBOLS_CACHE", str(tmp_path / "token_symbols.json"))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


VALI = Keypair.create_from_uri("//Alice")
MINERS = [Keypair.create_from_uri(f"//Miner{i}") for i in range(4)]


def open_chain(state_dir: Path, clock: FakeClock, wallet: Keypair = VALI, **hp: object) -> LocalChain:
    hp = {"weights_rate_limit": 5, "min_allowed_weights": 1, **hp}
    return LocalChain.open(state_dir, NETUID, wallet, block_time=BLOCK, clock=clock, **hp)


def populate(chain: LocalChain, n_miners: int = 3) -> list[int]:
    sub = chain.substrate
    sub.register(VALI.ss58_address, VALI.ss58_address, endpoint=None, validator_permit=True, stake=1000.0)
    return [sub.register(m.ss58_address, m.ss58_address, endpoint=f"127.0.0.1:{9100 + i}")
            for i, m in enumerate(MINERS[:n_miners])]


async def test_metagraph_round_trip_through_the_sdk(tmp_path: Path, clock: FakeClock) -> None:
    chain = open_chain(tmp_path, clock)
    try:
        uids = populate(chain, 2)
        v6 = chain.substrate.register(MINERS[3].ss58_address, VALI.ss58_address, endpoint="[::1]:8443", stake=2.5)
        neurons = await chain.metagraph()
        assert [n.uid for n in neurons] == [0, *uids, v6]
        by_uid = {n.uid: n for n in neurons}
        assert by_uid[0].hotkey == VALI.ss58_address and by_uid[0].validator_permit and by_uid[0].endpoint is None
        assert by_uid[0].stake == pytest.approx(1000.0)
        for i, uid in enumerate(uids):
            assert by_uid[uid].hotkey == MINERS[i].ss58_address
            assert by_uid[uid].endpoint == f"127.0.0.1:{9100 + i}"
            assert not by_uid[uid].validator_permit
        assert by_uid[v6].endpoint == "[::1]:8443" and by_uid[v6].stake == pytest.approx(2.5)
        assert await chain.my_uid() == 0
        # The raw SDK object agrees (coldkeys too, which NeuronInfo does not carry).
        mg = await (await chain.client()).subnets.metagraph(NETUID, commitments=False)
        assert mg is not None and mg.neurons[v6].coldkey == VALI.ss58_address
        # Re-registering keeps the uid and updates the endpoint (a restarted miner).
        assert chain.substrate.register(MINERS[0].ss58_address, MINERS[0].ss58_address,
                                        endpoint="127.0.0.1:9999") == uids[0]
        assert {n.uid: n.endpoint for n in await chain.metagraph()}[uids[0]] == "127.0.0.1:9999"
    finally:
        await chain.close()


async def test_params_reflect_hyperparameters(tmp_path: Path, clock: FakeClock) -> None:
    chain = open_chain(tmp_path, clock, tempo=7, max_weight_limit=0.25, min_allowed_weights=2, commit_reveal=True)
    try:
        p = await chain.params()
        assert (p.tempo, p.weights_rate_limit, p.min_allowed_weights, p.commit_reveal) == (7, 5, 2, True)
        assert p.max_weight_limit == pytest.approx(0.25, abs=1e-4)
        assert p.block_time == BLOCK
    finally:
        await chain.close()


async def test_plaintext_weights_land_and_read_back(tmp_path: Path, clock: FakeClock) -> None:
    chain = open_chain(tmp_path, clock)
    try:
        uids = populate(chain)
        clock.advance_blocks(3)
        block = await chain.block()
        want = {uids[0]: 0.5, uids[1]: 0.3, uids[2]: 0.2}
        out = await chain.set_weights(want)
        assert out.ok and not out.commit_reveal, out.message
        assert out.block == block
        rows = await (await chain.client()).weights.weights(NETUID)
        assert set(rows) == {0}
        assert rows[0] == pytest.approx(want, abs=2 / 65535)
        assert await chain.blocks_since_last_update(0) == 0
        clock.advance_blocks(4)
        assert await chain.blocks_since_last_update(0) == 4
        applied = [e for e in chain.substrate.extrinsics(block) if e["call"].endswith("set_mechanism_weights")]
        assert len(applied) == 1 and applied[0]["ok"] and applied[0]["signer"] == VALI.ss58_address
    finally:
        await chain.close()


async def test_sdk_clips_to_max_weight_limit(tmp_path: Path, clock: FakeClock) -> None:
    chain = open_chain(tmp_path, clock, max_weight_limit=0.4)
    try:
        uids = populate(chain, 4)
        out = await chain.set_weights({uids[0]: 0.8, uids[1]: 0.1, uids[2]: 0.05, uids[3]: 0.05})
        assert out.ok, out.message
        row = (await (await chain.client()).weights.weights(NETUID))[0]
        # Clipped, not dropped: the top weight sits at the cap and the rest share what was cut.
        want = {uids[0]: 0.4, uids[1]: 0.3, uids[2]: 0.15, uids[3]: 0.15}
        assert row == pytest.approx(want, abs=1e-4)
        # The chain's own check refuses a vector over the cap that skips the SDK's conforming.
        clock.advance_blocks(5)
        raw = calls.SubtensorModule.set_mechanism_weights(netuid=NETUID, mecid=0, dests=[uids[0], uids[1]],
                                                         weights=[65535, 10000], version_key=0)
        res = await (await chain.client()).submit_call(raw, VALI, signer="hotkey")
        assert not res.success and res.error is not None and res.error.name == "MaxWeightExceeded"
    finally:
        await chain.close()


async def test_min_allowed_weights_refused_before_signing(tmp_path: Path, clock: FakeClock) -> None:
    chain = open_chain(tmp_path, clock, min_allowed_weights=3)
    try:
        uids = populate(chain)
        before = len(chain.substrate.extrinsics())
        out = await chain.set_weights({uids[0]: 0.5, uids[1]: 0.5})
        assert not out.ok
        assert "invalid_argument" in out.message and "at least 3" in out.message
        assert len(chain.substrate.extrinsics()) == before  # nothing was submitted
        assert await (await chain.client()).weights.weights(NETUID) == {}
        assert (await chain.set_weights(dict.fromkeys(uids, 1.0))).ok
    finally:
        await chain.close()


async def test_rate_limit_blocks_then_allows(tmp_path: Path, clock: FakeClock) -> None:
    chain = open_chain(tmp_path, clock, weights_rate_limit=5)
    try:
        uids = populate(chain)
        assert (await chain.set_weights({uids[0]: 1.0})).ok
        clock.advance_blocks(4)
        second = await chain.set_weights({uids[1]: 1.0})
        assert not second.ok
        assert "rate_limited" in second.message and "rate limit is 5 blocks" in second.message
        clock.advance_blocks(1)
        third = await chain.set_weights({uids[1]: 1.0})
        assert third.ok, third.message
        assert (await (await chain.client()).weights.weights(NETUID))[0] == {uids[1]: 1.0}
    finally:
        await chain.close()


async def test_chain_side_checks_the_sdk_does_not_preflight(tmp_path: Path, clock: FakeClock) -> None:
    chain = open_chain(tmp_path, clock, weights_rate_limit=5)
    try:
        uids = populate(chain)
        client = await chain.client()
        # The rate limit is enforced at submit too: a raw call skips the SDK's preflight.
        assert (await chain.set_weights({uids[0]: 1.0})).ok
        raw = calls.SubtensorModule.set_mechanism_weights(netuid=NETUID, mecid=0, dests=[uids[1]],
                                                         weights=[65535], version_key=0)
        res = await client.submit_call(raw, VALI, signer="hotkey")
        assert not res.success and res.error is not None and res.error.name == "SettingWeightsTooFast"
        # A registered neuron without a validator permit may not weight others.
        miner = LocalChain(chain.substrate, NETUID, MINERS[0])
        out = await miner.set_weights({uids[1]: 1.0})
        assert not out.ok and "NeuronNoValidatorPermit" in out.message
        await miner.close()  # a second key's chain does not own the substrate: the owner keeps writing
        clock.advance_blocks(5)
        assert (await chain.set_weights({uids[2]: 1.0})).ok
    finally:
        await chain.close()


async def test_commit_reveal_hides_weights_until_the_reveal_epoch(tmp_path: Path, clock: FakeClock) -> None:
    chain = open_chain(tmp_path, clock, commit_reveal=True, tempo=9, reveal_period=1, weights_rate_limit=1)
    try:
        uids = populate(chain)
        client = await chain.client()
        out = await chain.set_weights({uids[0]: 3.0, uids[1]: 1.0})
        assert out.ok and out.commit_reveal, out.message
        commits = await client.weights.timelocked_weight_commits(NETUID)
        entries = [c for group in commits.values() for c in group]
        assert len(entries) == 1 and entries[0]["hotkey"] == VALI.ss58_address
        assert entries[0]["commit_block"] == out.block and entries[0]["ciphertext"].startswith("0x")
        assert await chain.blocks_since_last_update(0) == 0  # LastUpdate bumps at commit time
        assert await client.weights.weights(NETUID) == {}
        subnet = chain.substrate.subnet(NETUID)
        reveal_block = subnet.epoch_block(subnet.epoch_index(out.block) + 1)
        assert out.block < reveal_block <= out.block + 10
        clock.advance_blocks(reveal_block - 1 - out.block)
        assert await client.weights.weights(NETUID) == {}  # one block before the epoch: still sealed
        clock.advance_blocks(1)
        row = (await client.weights.weights(NETUID))[0]
        assert row == pytest.approx({uids[0]: 0.75, uids[1]: 0.25}, abs=2 / 65535)
        assert await client.weights.timelocked_weight_commits(NETUID) == {}
        assert any(e["call"] == "reveal" and e["ok"] for e in chain.substrate.extrinsics(reveal_block))
    finally:
        await chain.close()


async def test_commit_without_local_plaintext_is_dropped(tmp_path: Path, clock: FakeClock) -> None:
    local = open_chain(tmp_path, clock, commit_reveal=True, tempo=4, weights_rate_limit=1)
    uids = populate(local)
    plain = SubtensorChain("local", NETUID, VALI, substrate=local.substrate)  # no plaintext left alongside
    try:
        out = await plain.set_weights({uids[0]: 1.0})
        assert out.ok and out.commit_reveal
        clock.advance_blocks(2 * 5)
        assert await (await plain.client()).weights.weights(NETUID) == {}
        dropped = [e for e in local.substrate.extrinsics() if e["call"] == "reveal"]
        assert len(dropped) == 1 and not dropped[0]["ok"] and "plaintext" in dropped[0]["detail"]
    finally:
        await plain.close()
        await local.close()


async def test_state_persists_across_reopen(tmp_path: Path, clock: FakeClock) -> None:
    chain = open_chain(tmp_path, clock, tempo=11)
    uids = populate(chain)
    assert (await chain.set_weights({uids[0]: 1.0, uids[2]: 1.0})).ok
    clock.advance_blocks(7)
    block = await chain.block()
    await chain.close()

    again = LocalChain.open(tmp_path, NETUID, VALI, block_time=BLOCK, clock=clock)
    try:
        assert await again.block() >= block
        assert [n.hotkey for n in await again.metagraph()] == [VALI.ss58_address] + [m.ss58_address for m in MINERS[:3]]
        assert (await again.params()).tempo == 11
        assert (await (await again.client()).weights.weights(NETUID))[0] == pytest.approx({uids[0]: 0.5, uids[2]: 0.5})
        assert await again.blocks_since_last_update(0) >= 7
    finally:
        await again.close()


async def test_one_writer_and_a_live_reader(tmp_path: Path, clock: FakeClock) -> None:
    chain = open_chain(tmp_path, clock)
    try:
        uids = populate(chain)
        with pytest.raises(StateDirLocked):
            LocalSubstrate.open(tmp_path, block_time=BLOCK, clock=clock)
        reader = LocalSubstrate.open(tmp_path, read_only=True, clock=clock)
        assert len(reader.subnet(NETUID).neurons) == 4
        assert (await chain.set_weights({uids[1]: 1.0})).ok
        assert reader.subnet(NETUID).weights == {0: [[uids[1], 65535]]}
    finally:
        await chain.close()


async def test_unregistered_hotkey_is_a_clear_error(tmp_path: Path, clock: FakeClock) -> None:
    chain = open_chain(tmp_path, clock)
    populate(chain)
    stranger = LocalChain(chain.substrate, NETUID, Keypair.create_from_uri("//Stranger"))
    try:
        with pytest.raises(NotRegistered, match="not registered on netuid 1"):
            await stranger.my_uid()
        out = await stranger.set_weights({1: 1.0})
        assert not out.ok and "not_registered" in out.message
        with pytest.raises(NotRegistered):
            await stranger.blocks_since_last_update(99)
    finally:
        await stranger.close()
        await chain.close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_unreachable_network_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ChainUnavailable, match="cannot reach"):
        await SubtensorChain.connect(f"ws://127.0.0.1:{_closed_port()}", NETUID, VALI, state_dir=tmp_path)
    with pytest.raises(ChainUnavailable, match="Unknown network"):
        await SubtensorChain.connect("nonesuch", NETUID, VALI)
    out = await SubtensorChain(f"ws://127.0.0.1:{_closed_port()}", NETUID, VALI).set_weights({1: 1.0})
    assert not out.ok and "cannot reach" in out.message


async def test_a_first_connection_is_retried_with_backoff_then_one_clear_error(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(ChainUnavailable, match="cannot reach .* after 3 attempts"):
        await SubtensorChain.connect(f"ws://127.0.0.1:{_closed_port()}", NETUID, VALI, state_dir=tmp_path,
                                     connect_retries=2, retry_backoff_s=0.2)
    assert time.monotonic() - t0 >= 0.2 + 0.4  # waited 0.2 s, then twice that


async def test_blocks_follow_the_real_clock(tmp_path: Path) -> None:
    chain = LocalChain.open(tmp_path, NETUID, VALI, block_time=0.05)
    try:
        client = await chain.client()
        first = await chain.block()
        await asyncio.sleep(0.2)
        assert await chain.block() >= first + 3  # 4 blocks of 50 ms have passed, at least
        # The SDK's subscription-based wait runs over the substrate's block stream.
        head = await asyncio.wait_for(client.wait_for_block(first + 8), timeout=10)
        assert head.number >= first + 8
    finally:
        await chain.close()


def test_sdk_logging_goes_to_loguru(tmp_path: Path) -> None:
    seen: list[str] = []
    LocalSubstrate.open(tmp_path, block_time=BLOCK).release()
    SubtensorChain("local", NETUID, VALI, state_dir=tmp_path)  # constructing one installs the handler
    sink = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING")
    try:
        logging.getLogger("bittensor.transport").warning("endpoint %s dropped", "ws://x")
    finally:
        logger.remove(sink)
    assert seen == ["bittensor.transport: endpoint ws://x dropped"]


def test_register_rejects_bad_addresses(tmp_path: Path, clock: FakeClock) -> None:
    sub = LocalSubstrate.open(tmp_path, block_time=BLOCK, clock=clock)
    try:
        sub.ensure_subnet(NETUID)
        with pytest.raises(ValueError, match="ss58"):
            sub.register("not-a-key", VALI.ss58_address)
        with pytest.raises(ValueError, match="ip:port"):
            sub.register(VALI.ss58_address, VALI.ss58_address, endpoint="localhost")
        assert sub.subnet(NETUID).neurons == []
    finally:
        sub.release()


def test_a_truncated_chain_file_is_a_clear_error_not_a_traceback(tmp_path: Path) -> None:
    from neurons.chain.local_files import STATE_FILE, CorruptChainState, StateFile
    from neurons.validator.cli import main

    state = tmp_path / "chain"
    state.mkdir()
    (state / STATE_FILE).write_text('{"subnets": {"1": {"neur')
    with pytest.raises(CorruptChainState, match="Move the file aside"):
        StateFile(state).read()
    assert main(["--local", "--local.rounds", "1", "--state-dir", str(tmp_path), "--gateway.port", "0"]) == 2
    assert (state / STATE_FILE).read_text() == '{"subnets": {"1": {"neur'  # never reset


async def test_weights_carry_the_subnets_version_key(tmp_path: Path, clock: FakeClock) -> None:
    """A subnet that raised WeightsVersionKey refuses key 0 (issue 15: every submission failed)."""
    chain = open_chain(tmp_path, clock, weights_version_key=7)
    try:
        uids = populate(chain)
        clock.advance_blocks(3)
        assert (await chain.params()).weights_version == 7
        out = await chain.set_weights({uids[0]: 0.6, uids[1]: 0.4})
        assert out.ok, out.message
        pinned_low = open_chain(tmp_path / "low", clock, weights_version_key=7)
        try:
            pinned_low.version_key = 3  # an operator pinning a stale key gets the chain's refusal, not a crash
            populate(pinned_low)
            clock.advance_blocks(3)
            refused = await pinned_low.set_weights({uids[0]: 1.0})
            assert not refused.ok and "IncorrectWeightVersionKey" in refused.message, refused.message
        finally:
            await pinned_low.close()
    finally:
        await chain.close()
