"""Yuma 3 (scoring.yuma) against the chain's own test vectors (opentensor/subtensor,
``pallets/subtensor/src/tests/epoch.rs``) and a test per step that fails when the step is wrong."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pytest

from scoring.yuma import U16_MAX, Epoch, EpochInput, YumaParams, consensus_of, run_epoch, weighted_median

TOLERANCE = 1e-3  # the chain's tests' epsilon


@dataclass
class Chain:
    """The few pieces of chain state an epoch reads, advanced block by block as the chain's tests do."""

    stake: list[float]
    params: YumaParams
    block: int = 1
    permit: list[bool] = field(default_factory=list)
    last_update: list[int] = field(default_factory=list)
    registered: list[int] = field(default_factory=list)
    weights: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    bonds: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    last_epoch: int | None = None

    def __post_init__(self) -> None:
        n = len(self.stake)
        self.permit = self.permit or [False] * n
        self.last_update = self.last_update or [0] * n
        self.registered = self.registered or [0] * n

    def set_weights(self, uid: int, dests: list[int], values: list[int]) -> None:
        top = max(values)  # the chain stores a row max-upscaled to u16
        self.weights[uid] = [(d, round(v * U16_MAX / top)) for d, v in zip(dests, values, strict=True) if v]
        self.last_update[uid] = self.block

    def epoch(self) -> Epoch:
        e = run_epoch(_input(self), self.params)  # at the next block (next_block_no_epoch)
        self.block += 1
        self.permit = [bool(p) for p in e.validator_permit]
        self.bonds = e.bonds
        self.last_epoch = self.block
        return e

    def bond_shares(self, validators: int, miners: list[int]) -> list[list[float]]:
        rows = []
        for i in range(validators):
            row = dict(self.bonds.get(i, []))
            rows.append([row.get(j, 0) / U16_MAX for j in miners])
        return rows


def _yuma3_scenario(stakes: list[float], *, liquid: bool) -> Chain:
    """``setup_yuma_3_scenario``: 3 validators, 2 servers, tempo 1, kappa 0.5, bonds penalty 0, moving average
    0.975, liquid alpha (0.1, 0.3) at steepness 1000, 3 validator permits; one epoch to hand out the permits."""
    params = YumaParams(kappa=U16_MAX // 2, bonds_penalty=0, bonds_moving_average=975_000, liquid_alpha=liquid,
                        alpha_low=int(0.1 * U16_MAX), alpha_high=int(0.3 * U16_MAX), alpha_sigmoid_steepness=1000,
                        max_allowed_validators=3)
    chain = Chain(stake=stakes, params=params)
    chain.epoch()
    return chain


def test_yuma_3_liquid_alpha_disabled_matches_the_chain() -> None:
    """``test_yuma_3_liquid_alpha_disabled``: stakes 33/33/34, all on server 1 except epoch 2, when the 34 %
    validator alone picks server 2; its dividends fall and recover as the chain's test says."""
    chain = _yuma3_scenario([33, 33, 34, 0, 0], liquid=False)
    targets = [[0.33, 0.33, 0.34], [0.33, 0.33, 0.34], [0.3734, 0.3734, 0.2532], [0.3611, 0.3611, 0.2779],
               [0.3541, 0.3541, 0.2919], [0.3495, 0.3495, 0.3009]]
    for epoch, target in enumerate(targets):
        rows = [[U16_MAX, 0], [U16_MAX, 0], [0, U16_MAX]] if epoch == 2 else [[U16_MAX, 0]] * 3
        for uid, row in enumerate(rows):
            chain.set_weights(uid, [3, 4], row)
        e = chain.epoch()
        assert e.dividends[:3] == pytest.approx(target, abs=TOLERANCE), epoch
        assert e.dividends[3:] == pytest.approx([0, 0])


KAPPA_MOVES_FIRST_BONDS = [
    [[0.1013, 0.0000], [0.1013, 0.0000], [0.1013, 0.0000]],
    [[0.0908, 0.1013], [0.3697, 0.0000], [0.3697, 0.0000]],
    [[0.0815, 0.1924], [0.3170, 0.1013], [0.5580, 0.0000]],
    [[0.0731, 0.2742], [0.2765, 0.1924], [0.4306, 0.1013]],
    [[0.0656, 0.3478], [0.2435, 0.2742], [0.3589, 0.1924]],
    [[0.0588, 0.4139], [0.2157, 0.3478], [0.3089, 0.2742]],
]
KAPPA_MOVES_FIRST_DIVIDENDS = [[0.8, 0.1, 0.1], [1.0, 0.0, 0.0], [0.9382, 0.0618, 0.0], [0.8819, 0.0773, 0.0407],
                               [0.8564, 0.0844, 0.0592], [0.8418, 0.0884, 0.0697]]


def test_yuma_3_kappa_moves_first_matches_the_chain() -> None:
    """``test_yuma_3_kappa_moves_first``: liquid alpha on, stakes 8/1/1; the big validator moves to server 2 first,
    the eager small one next, the lazy one last. Dividends and bonds per epoch as the chain's test lists them."""
    chain = _yuma3_scenario([8, 1, 1, 0, 0], liquid=True)
    one, two = [U16_MAX, 0], [0, U16_MAX]
    moves = {0: [one, one, one], 1: [two, one, one], 2: [two, two, one], 3: [two, two, two]}
    for epoch, (bonds, dividends) in enumerate(zip(KAPPA_MOVES_FIRST_BONDS, KAPPA_MOVES_FIRST_DIVIDENDS,
                                                   strict=True)):
        for uid, row in enumerate(moves.get(epoch, [])):
            chain.set_weights(uid, [3, 4], row)
        e = chain.epoch()
        assert e.dividends[:3] == pytest.approx(dividends, abs=TOLERANCE), epoch
        assert np.array(chain.bond_shares(3, [3, 4])) == pytest.approx(np.array(bonds), abs=TOLERANCE), epoch


def _test_bonds_chain() -> Chain:
    """``test_bonds``: 4 validators staking 1..4 set [0.1, 0.2, 0.3, 0.4] (as u16 rows) on 4 servers."""
    chain = Chain(stake=[1, 2, 3, 4, 0, 0, 0, 0], params=YumaParams(max_allowed_validators=8))
    chain.epoch()  # hands out the permits
    for uid in range(4):
        chain.set_weights(uid, [4, 5, 6, 7], [U16_MAX // 4, U16_MAX // 2, (U16_MAX // 4) * 3, U16_MAX])
    return chain


def test_bonds_first_epoch_matches_the_chain_trace() -> None:
    """The first epoch of ``test_bonds`` (its trace): consensus = the weights, every vtrust 1, incentive = the
    weights, dividends = the stake shares, emission half to each side. (Its bonds are Yuma 1/2's: not modelled.)"""
    e = _test_bonds_chain().epoch()
    c = [0.0999975584, 0.2000012207, 0.2999926754, 0.400008545]
    assert list(e.validator_permit) == [True] * 4 + [False] * 4
    assert e.consensus[4:] == pytest.approx(c, abs=1e-6)
    assert e.validator_trust[:4] == pytest.approx([1.0] * 4, abs=1e-6)
    assert e.incentive[4:] == pytest.approx(c, abs=1e-6)
    assert e.dividends[:4] == pytest.approx([0.1, 0.2, 0.3, 0.4], abs=1e-6)
    assert e.emission == pytest.approx([0.05, 0.1, 0.15, 0.2, *(x / 2 for x in c)], abs=1e-6)


def test_a_self_weight_is_masked_and_its_validator_trust_is_zero() -> None:
    """``test_bonds``' second epoch: validator 0 sets only a weight on itself; it is masked (not the owner's), so
    its vtrust is 0, and the others' weights alone set consensus and incentive."""
    chain = _test_bonds_chain()
    chain.epoch()
    chain.set_weights(0, [0], [U16_MAX])
    e = chain.epoch()
    assert e.validator_trust[:4] == pytest.approx([0.0, 1.0, 1.0, 1.0], abs=1e-6)
    assert e.consensus[4:] == pytest.approx([0.1, 0.2, 0.3, 0.4], abs=1e-4)
    assert e.weights[0].sum() == 0
    owner = run_epoch(replace(_input(chain), owner_uid=0), chain.params)  # the subnet owner's self-weight stays
    assert owner.weights[0, 0] == pytest.approx(1.0)


def _input(chain: Chain) -> EpochInput:
    return EpochInput(block=chain.block + 1, stake=chain.stake, validator_permit=chain.permit,
                      last_update=chain.last_update, registered_at=chain.registered, weights=chain.weights,
                      bonds=chain.bonds, last_epoch_block=chain.last_epoch, tempo=1)


def test_consensus_is_the_kappa_weighted_median() -> None:
    """Stakes 0.3 / 0.3 / 0.4 weighting a miner 0.2 / 0.5 / 0.9: at kappa 0.5 the largest weight given by at least
    half the stake is 0.5; at kappa 0.3 it is 0.9; at kappa 0.8, 0.2. A wrong kappa gives another consensus."""
    stake = np.array([0.3, 0.3, 0.4])
    w = np.array([[0.2], [0.5], [0.9]])
    assert consensus_of(stake, w, 0.5)[0] == pytest.approx(0.5)
    assert consensus_of(stake, w, 0.3)[0] == pytest.approx(0.9)
    assert consensus_of(stake, w, 0.8)[0] == pytest.approx(0.2)
    assert weighted_median(np.array([1.0]), np.array([0.7]), 0.5, 1.0) == pytest.approx(0.7)
    assert weighted_median(np.array([]), np.array([]), 0.5, 1.0) == 0.0


def test_weights_above_consensus_are_clipped_and_cost_validator_trust_and_dividends() -> None:
    """A 70 % validator weights two miners [0.5, 0.5], a 30 % one [0.9, 0.1]: consensus [0.5, 0.5]; the minority's
    0.9 is clipped to 0.5, its vtrust is 0.6, incentive is the stake-weighted clipped weights, and its dividends
    fall below its stake share. Without the clip, its vtrust would be 1 and miner A's incentive 0.62."""
    chain = Chain(stake=[70, 30, 0, 0], params=YumaParams())
    chain.epoch()
    chain.set_weights(0, [2, 3], [1, 1])
    chain.set_weights(1, [2, 3], [9, 1])
    e = chain.epoch()
    assert e.consensus[2:] == pytest.approx([0.5, 0.5], abs=1e-4)
    assert e.validator_trust[:2] == pytest.approx([1.0, 0.6], abs=1e-4)
    ranks = np.array([0.7 * 0.5 + 0.3 * 0.5, 0.7 * 0.5 + 0.3 * 0.1])
    assert e.incentive[2:] == pytest.approx(ranks / ranks.sum(), abs=1e-4)
    # fresh bonds at alpha 0.1 from the clipped weights (bonds penalty 1): column shares of each validator
    bonds = 0.1 * np.array([[0.5, 0.5], [0.5, 0.1]])
    shares = bonds / bonds.sum(axis=0)
    d = (shares @ e.incentive[2:]) * np.array([0.7, 0.3])
    assert e.dividends[:2] == pytest.approx(d / d.sum(), abs=1e-4)
    assert e.dividends[1] < 0.3


def test_inactive_and_unpermitted_stake_sets_no_consensus() -> None:
    """A validator whose last update is older than the activity cutoff, or that holds no permit, is out of the
    consensus: the other validator alone sets it."""
    chain = Chain(stake=[50, 50, 0, 0], params=YumaParams(activity_cutoff=10))
    chain.epoch()
    chain.set_weights(0, [2, 3], [1, 0])
    chain.set_weights(1, [2, 3], [0, 1])
    chain.block += 20
    chain.last_update[1] = chain.block  # validator 0 last updated 20 blocks ago: inactive
    e = chain.epoch()
    assert list(e.active[:2]) == [False, True]
    assert e.consensus[2:] == pytest.approx([0.0, 1.0])
    assert e.incentive[2:] == pytest.approx([0.0, 1.0])
    unpermitted = run_epoch(replace(_input(chain), validator_permit=[False, True, False, False]), chain.params)
    assert unpermitted.weights[0].sum() == 0


def test_a_weight_set_before_a_miner_registered_is_dropped() -> None:
    """A uid registered after its validator's last update reads as a new neuron: the old weight on it is not
    counted (the chain's 'outdated' mask); with commit-reveal, an earlier live commit masks it the same way."""
    chain = Chain(stake=[100, 0, 0], params=YumaParams())
    chain.epoch()
    chain.set_weights(0, [1, 2], [1, 1])
    chain.registered[2] = chain.block + 1
    e = chain.epoch()
    assert e.weights[0] == pytest.approx([0.0, 1.0, 0.0])
    committed = run_epoch(replace(_input(chain), commit_blocks={0: chain.block - 5}), chain.params)
    assert committed.weights[0, 2] == 0.0


def test_no_weights_pays_validators_by_stake() -> None:
    """No weights counted: the epoch's emission goes to the validators by active stake (the chain's rule)."""
    chain = Chain(stake=[3, 1, 0], params=YumaParams())
    chain.epoch()
    e = chain.epoch()
    assert e.server_emission == pytest.approx([0, 0, 0])
    assert e.validator_emission[:2] == pytest.approx([0.75, 0.25])


def test_permits_go_to_the_top_k_stakes_and_a_lost_permit_clears_bonds() -> None:
    chain = Chain(stake=[5, 4, 3, 0], params=YumaParams(max_allowed_validators=2))
    e = chain.epoch()
    assert list(e.validator_permit) == [True, True, False, False]
    chain.set_weights(0, [3], [1])
    chain.set_weights(1, [3], [1])
    chain.epoch()
    assert chain.bonds[1]
    chain.stake = [5, 1, 3, 0]
    chain.epoch()
    assert chain.permit == [True, False, True, False] and chain.bonds[1] == []


def test_a_miner_registered_since_the_last_epoch_starts_with_no_bonds() -> None:
    """Bonds on a uid that registered again since the last epoch are dropped before the EMA: its new holder
    inherits none of the validators' bonds on the old one."""
    chain = Chain(stake=[100, 0, 0], params=YumaParams())
    chain.epoch()
    for _ in range(5):
        chain.set_weights(0, [1, 2], [1, 1])
        chain.epoch()
    built = chain.bond_shares(1, [1, 2])[0]
    assert built[0] == pytest.approx(built[1]) and built[1] > 0.2
    chain.block += 1
    chain.registered[2] = chain.block  # uid 2 re-registered to a new hotkey
    chain.block += 1
    chain.set_weights(0, [1, 2], [1, 1])
    chain.epoch()
    after = chain.bond_shares(1, [1, 2])[0]
    assert after[1] == pytest.approx(0.1 * 0.5, abs=1e-4)  # alpha 0.1 of the new weight, nothing inherited
    assert after[0] == pytest.approx(0.1 * 0.5 + 0.9 * built[0], abs=1e-4)
