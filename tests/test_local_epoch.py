"""The local chain runs Yuma 3 at every tempo boundary (issue 57): several validators' weights, set through the SDK,
become vtrust, dividends, consensus and incentive that the SDK's metagraph read and ``neurons.weights`` show."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import bittensor as bt
import numpy as np
import pytest
from bittensor.sp_core import Keypair

from neurons.chain import LocalChain, LocalSubstrate
from neurons.chain.local_epoch import CATCH_UP_EPOCHS, EMISSION_PER_BLOCK_RAO, epoch_input
from scoring.yuma import U16_MAX, run_epoch
from tests.test_chain_local import BLOCK, FakeClock

NETUID = 1
TEMPO = 9
ROOT = Path(__file__).resolve().parents[1]
VALIDATORS = [Keypair.create_from_uri(f"//{n}") for n in ("Alice", "Bob", "Charlie")]
MINERS = [Keypair.create_from_uri(f"//Miner{i}") for i in range(3)]
STAKES = [500.0, 300.0, 200.0]


def _clock() -> FakeClock:
    """Under test control, started at the wall clock: a reader in another process (real clock) sees the same head."""
    return FakeClock(time.time())


@pytest.fixture(autouse=True)
def _token_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BTCLI_TOKEN_SYMBOLS_CACHE", str(tmp_path / "token_symbols.json"))


def _subnet(tmp_path: Path, clock: FakeClock, **hp: object) -> tuple[list[LocalChain], list[int]]:
    """Three validators (stakes 50/30/20 %) and three miners on one local chain with tempo ``TEMPO``."""
    first = LocalChain.open(tmp_path, NETUID, VALIDATORS[0], block_time=BLOCK, clock=clock, tempo=TEMPO,
                            weights_rate_limit=1, min_allowed_weights=1, **hp)
    sub = first.substrate
    for v, stake in zip(VALIDATORS, STAKES, strict=True):
        sub.register(v.ss58_address, v.ss58_address, endpoint=None, validator_permit=True, stake=stake)
    miners = [sub.register(m.ss58_address, m.ss58_address, endpoint=f"127.0.0.1:{9200 + i}")
              for i, m in enumerate(MINERS)]
    chains = [first] + [LocalChain(sub, NETUID, v) for v in VALIDATORS[1:]]
    clock.advance_blocks(1)  # weights count on neurons registered before the block they are set in
    return chains, miners


async def _close(chains: list[LocalChain]) -> None:
    for c in reversed(chains):
        await c.close()


async def _to_next_epoch(sub: LocalSubstrate, clock: FakeClock) -> int:
    """Move the clock to the next epoch block and tick the chain there; that block."""
    head = await sub.block_number()
    s = sub.subnet(NETUID)
    block = s.epoch_block(s.epoch_index(head) + 1)
    clock.advance_blocks(block - head)
    assert await sub.block_number() == block
    return block


async def test_an_epoch_turns_three_validators_weights_into_yuma_columns_the_sdk_reads(tmp_path: Path) -> None:
    """Alice and Bob agree, Charlie (20 %) puts most on the miner the others weight least: at the next tempo
    boundary the chain's metagraph (read through the SDK) holds Yuma 3's consensus, incentive, vtrust and dividends
    for exactly those weights; Charlie's vtrust and dividends fall below the others'."""
    clock = _clock()
    chains, miners = _subnet(tmp_path, clock)
    try:
        rows = [[0.4, 0.4, 0.2], [0.4, 0.4, 0.2], [0.1, 0.1, 0.8]]
        for chain, row in zip(chains, rows, strict=True):
            outcome = await chain.set_weights(dict(zip(miners, row, strict=True)))
            assert outcome.ok, outcome
        before = epoch_input(chains[0].substrate.subnet(NETUID), 0)
        block = await _to_next_epoch(chains[0].substrate, clock)
        want = run_epoch(replace(before, block=block))

        client = await bt.Subtensor("local", substrate=chains[0].substrate)
        try:
            mg = await client.subnets.metagraph(NETUID, commitments=False)
            bonds = await client.weights.bonds(NETUID)
        finally:
            await client.close()
        assert mg is not None and mg.last_step == block
        got = {n.uid: n for n in mg.neurons}
        vtrust = [v / U16_MAX for v in mg.raw["validator_trust"]]
        for uid in range(3):
            assert got[uid].dividends == pytest.approx(want.dividends[uid], abs=2e-5)
            assert vtrust[uid] == pytest.approx(want.validator_trust[uid], abs=2e-5)
        for uid in miners:
            assert got[uid].consensus == pytest.approx(want.consensus[uid], abs=2e-5)
            assert got[uid].incentive == pytest.approx(want.incentive[uid], abs=2e-5)
        assert 0 < vtrust[2] < vtrust[0] == pytest.approx(1.0, abs=1e-4)
        assert got[2].dividends / 0.2 < got[0].dividends / 0.5
        assert sum(n.emission.rao for n in mg.neurons) == pytest.approx(TEMPO * EMISSION_PER_BLOCK_RAO, rel=1e-6)
        assert set(bonds) == {0, 1, 2} and all(bonds[v][m] > 0 for v in range(3) for m in miners)
    finally:
        await _close(chains)


async def test_epochs_run_once_per_boundary_across_a_restart_and_catch_up_when_the_chain_was_away(
        tmp_path: Path) -> None:
    """An epoch runs at each tempo boundary once: bonds grow by the EMA step per epoch, a reopened chain does not
    run the same epoch again, and a chain reopened long after runs at most ``CATCH_UP_EPOCHS`` it missed."""
    clock = _clock()
    chains, miners = _subnet(tmp_path, clock)
    try:
        for chain in chains:
            assert (await chain.set_weights({miners[0]: 1.0})).ok
        first = await _to_next_epoch(chains[0].substrate, clock)
        bond = dict(chains[0].substrate.subnet(NETUID).bonds[0])[miners[0]]
        assert bond == pytest.approx(0.1 * U16_MAX, abs=2)  # alpha 0.1 of a whole weight
        await _to_next_epoch(chains[0].substrate, clock)
        grown = dict(chains[0].substrate.subnet(NETUID).bonds[0])[miners[0]]
        assert grown == pytest.approx((0.1 + 0.9 * 0.1) * U16_MAX, abs=3)
    finally:
        await _close(chains)
    again = LocalSubstrate.open(tmp_path, block_time=BLOCK, clock=clock)
    try:
        s = again.subnet(NETUID)
        assert s.last_step == first + TEMPO + 1 and dict(s.bonds[0])[miners[0]] == grown  # not run twice
        again.set_hyperparameters(NETUID, activity_cutoff_factor_milli=10**6)  # the validators stay active
        clock.advance_blocks(200 * (TEMPO + 1))  # 200 epochs missed
        s = again.subnet(NETUID)
        assert s.last_step == s.last_epoch_block(await again.block_number())
        caught_up = dict(s.bonds[0])[miners[0]] / U16_MAX
        expected = 1 - 0.9 ** (2 + CATCH_UP_EPOCHS)
        assert caught_up == pytest.approx(expected, abs=1e-3)
    finally:
        again.release()


async def test_a_commit_revealed_at_an_epoch_block_counts_in_that_epoch(tmp_path: Path) -> None:
    """Commit-reveal on: weights committed in one epoch are revealed at the next boundary and counted by the epoch
    at that block (reveals first, as the chain's block step orders them); before, the commit holds no weight."""
    clock = _clock()
    chains, miners = _subnet(tmp_path, clock, commit_reveal=True)
    try:
        for chain in chains:
            assert (await chain.set_weights({miners[1]: 1.0})).ok
        sub = chains[0].substrate
        assert sub.subnet(NETUID).weights == {}
        block = await _to_next_epoch(chains[0].substrate, clock)
        s = sub.subnet(NETUID)
        assert sorted(s.weights) == [0, 1, 2] and s.last_step == block
        assert s.neurons[miners[1]].incentive == U16_MAX and s.neurons[0].validator_trust > 0
    finally:
        await _close(chains)


def test_neurons_weights_prints_the_last_epochs_yuma_columns(tmp_path: Path) -> None:
    """``python -m neurons.weights --json`` gives per validator validator_trust, dividends and stake, per miner
    consensus and incentive, with the block of the epoch; the table says the same."""
    import asyncio

    clock = _clock()

    async def setup() -> int:
        chains, miners = _subnet(tmp_path, clock)
        try:
            for chain in chains:
                assert (await chain.set_weights({miners[0]: 0.5, miners[1]: 0.5})).ok
            return await _to_next_epoch(chains[0].substrate, clock)
        finally:
            await _close(chains)

    block = asyncio.run(setup())
    out = subprocess.run([sys.executable, "-m", "neurons.weights", "--state-dir", str(tmp_path), "--netuid",
                          str(NETUID), "--json"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    epoch = json.loads(out.stdout)["epoch"]
    # the chain's clock is real in the subprocess: the epoch read may be a later one, with the same weights
    assert epoch["block"] >= block
    stakes = [v["stake"] for v in epoch["validators"]]
    assert stakes == pytest.approx(STAKES)
    assert [v["validator_trust"] for v in epoch["validators"]] == pytest.approx([1.0] * 3, abs=1e-4)
    assert sum(v["dividends"] for v in epoch["validators"]) == pytest.approx(1.0, abs=1e-3)
    incentive = {m["uid"]: m["incentive"] for m in epoch["miners"]}
    assert np.array([incentive[3], incentive[4], incentive[5]]) == pytest.approx([0.5, 0.5, 0.0], abs=1e-4)
    table = subprocess.run([sys.executable, "-m", "neurons.weights", "--state-dir", str(tmp_path), "--netuid",
                            str(NETUID)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "last epoch at block" in table.stdout and "vtrust" in table.stdout and "incentive" in table.stdout


async def test_a_reader_shows_the_writers_last_epoch_not_epochs_of_its_own(tmp_path: Path) -> None:
    """A reader of a stopped run's chain (``neurons.weights`` after the local subnet ended) shows the last epoch the
    chain ran, with its figures, however long after: it runs no epochs of its own (in which the run's validators
    would have gone inactive and read 0)."""
    clock = _clock()
    chains, miners = _subnet(tmp_path, clock)
    try:
        for chain in chains:
            assert (await chain.set_weights({miners[0]: 1.0})).ok
        block = await _to_next_epoch(chains[0].substrate, clock)
        vtrust = chains[0].substrate.subnet(NETUID).neurons[0].validator_trust
        assert vtrust > 0
    finally:
        await _close(chains)
    clock.advance_blocks(50 * (TEMPO + 1))  # well past the activity cutoff
    reader = LocalSubstrate.open(tmp_path, read_only=True, clock=clock)
    s = reader.subnet(NETUID)
    assert s.last_step == block and s.neurons[0].validator_trust == vtrust
    client = await bt.Subtensor("local", substrate=reader)
    try:
        mg = await client.subnets.metagraph(NETUID, commitments=False)
    finally:
        await client.close()
    assert mg is not None and mg.last_step == block
