"""Yuma 3 consensus, as the chain runs it at every epoch: from the weights on chain and the stakes to each
validator's trust and dividends and each miner's consensus and incentive.

Why the validator carries its own copy: the local subnet's chain runs it at each tempo boundary, so what a newcomer
sees there (vtrust, dividends, incentive) is what finney would make of the same weights; and the soak with several
validators judges pay rules by what the chain pays, not by what one validator set. The steps and their order follow
``opentensor/subtensor``'s ``epoch_mechanism`` (``pallets/subtensor/src/epoch/run_epoch.rs``, the sparse path that
finney runs) with the Yuma 3 bonds (``Yuma3On``, the default for every subnet registered since March 2026), in
float64 where the chain uses I32F32: the chain's own test vectors hold within their tolerance (``tests/test_yuma.py``).

Out: Yuma 1/2 bonds (the column-normalised, stake-weighted ``ΔB``), the chain's fixed-point rounding inside a step,
and mechanisms other than 0. Pure: numbers in, numbers out; the caller stores the bonds between epochs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

U16_MAX = 65535


@dataclass(frozen=True)
class YumaParams:
    """The subnet's hyperparameters the epoch reads, at the chain's defaults (``runtime/src/lib.rs``)."""

    kappa: int = 32767  # u16: the share of active stake whose weight sets a miner's consensus
    bonds_penalty: int = U16_MAX  # u16: 1 = bonds are built from clipped weights only
    bonds_moving_average: int = 900_000  # per million: fixed bond EMA alpha = 1 - this
    liquid_alpha: bool = False
    alpha_low: int = 45_875  # u16 (0.7), liquid alpha only
    alpha_high: int = 58_982  # u16 (0.9), liquid alpha only
    alpha_sigmoid_steepness: float = 1000.0
    max_allowed_validators: int = 128
    activity_cutoff: int = 5000  # blocks without a weight update before a validator's stake stops counting
    stake_threshold: float = 0.0  # stake (in the caller's unit) under which a neuron's stake counts as 0


@dataclass(frozen=True)
class EpochInput:
    """The chain state one epoch reads. Vectors are per uid; ``weights`` maps a uid to its row of (uid, u16);
    ``bonds`` maps a uid to its stored row of (uid, u16) from the last epoch."""

    block: int
    stake: Sequence[float]
    validator_permit: Sequence[bool]  # permits held going into the epoch (the epoch hands out the next ones)
    last_update: Sequence[int]
    registered_at: Sequence[int]
    weights: Mapping[int, Sequence[tuple[int, int]]]
    bonds: Mapping[int, Sequence[tuple[int, int]]]
    last_epoch_block: int | None = None  # None: ``block - tempo`` (the chain's rule before its first step)
    tempo: int = 360
    owner_uid: int | None = None  # the subnet owner's self-weight is kept
    commit_blocks: Mapping[int, int] | None = None  # commit-reveal on: uid -> block of its earliest live commit


@dataclass(frozen=True)
class Epoch:
    """What one epoch leaves on chain (each vector per uid, in [0, 1])."""

    stake: np.ndarray  # normalised, under-threshold stake zeroed
    active_stake: np.ndarray  # of permitted validators active within the cutoff, normalised
    active: np.ndarray  # bool
    validator_permit: np.ndarray  # bool, the permits the epoch hands out (top-k stake)
    weights: np.ndarray  # the masked, row-normalised weights (n x n)
    consensus: np.ndarray
    clipped: np.ndarray  # weights clipped at consensus (n x n)
    validator_trust: np.ndarray
    incentive: np.ndarray
    dividends: np.ndarray
    bonds: dict[int, list[tuple[int, int]]]  # the rows to store, as the chain stores them (u16)
    server_emission: np.ndarray  # the epoch's emission share of each uid as a miner
    validator_emission: np.ndarray  # ... and as a validator

    @property
    def emission(self) -> np.ndarray:
        return self.server_emission + self.validator_emission


def u16_fraction(value: float) -> int:
    """The chain's ``fixed_proportion_to_u16``: a share in [0, 1] as u16, rounded down."""
    return int(min(U16_MAX, max(0.0, np.floor(value * U16_MAX + 1e-9))))


def normalize(x: np.ndarray) -> np.ndarray:
    """Sum to 1; a zero vector stays zero (the chain's ``inplace_normalize``)."""
    total = float(x.sum())
    return x / total if total != 0 else x.copy()


def col_normalize(m: np.ndarray) -> np.ndarray:
    sums = m.sum(axis=0)
    return np.divide(m, sums, out=np.zeros_like(m), where=sums != 0)


def weighted_median(stake: np.ndarray, score: np.ndarray, minority: float, hi: float) -> float:
    """The chain's stake-weighted median (``math.rs`` ``weighted_median``): a deterministic mid-pivot search for
    the largest score that validators holding more than ``1 - minority`` of the stake give at least."""
    idx = list(range(len(stake)))
    lo = 0.0
    for _ in range(len(idx) + 1):
        if not idx:
            return 0.0
        if len(idx) == 1:
            return float(score[idx[0]])
        pivot = float(score[idx[len(idx) // 2]])
        lower = [i for i in idx if score[i] < pivot]
        upper = [i for i in idx if score[i] > pivot]
        lo_stake = float(sum(stake[i] for i in lower))
        hi_stake = float(sum(stake[i] for i in upper))
        if minority < lo + lo_stake and lower:
            idx, hi = lower, lo + lo_stake
        elif hi - hi_stake <= minority and upper:
            idx, lo = upper, hi - hi_stake
        else:
            return pivot
    return 0.0


def consensus_of(active_stake: np.ndarray, weights: np.ndarray, kappa: float) -> np.ndarray:
    """Per miner (column), the weighted median of the weights of validators with active stake."""
    rows = active_stake > 0
    if not rows.any():
        return np.zeros(weights.shape[1])
    stake = normalize(active_stake[rows])
    total = float(stake.sum())
    minority = total - kappa
    return np.array([weighted_median(stake, weights[rows, j], minority, total) for j in range(weights.shape[1])])


def liquid_alphas(weights: np.ndarray, bonds: np.ndarray, consensus: np.ndarray, p: YumaParams) -> np.ndarray:
    """Per (validator, miner), the bond EMA's alpha (``alpha_sigmoid``): fast for a validator buying into a miner
    above consensus or selling out of one, slow otherwise."""
    low, high = p.alpha_low / U16_MAX, p.alpha_high / U16_MAX
    buy = np.clip(weights - consensus[None, :], 0.0, 1.0)
    sell = np.clip(bonds - weights, 0.0, 1.0)
    diff = np.where(weights >= bonds, buy, sell)
    sigmoid = 1.0 / (1.0 + np.exp(-(p.alpha_sigmoid_steepness / 100.0) * (diff - 0.5)))
    return np.clip(low + sigmoid * (high - low), low, high)


def _matrix(rows: Mapping[int, Sequence[tuple[int, int]]], n: int) -> np.ndarray:
    m = np.zeros((n, n))
    for i, row in rows.items():
        if 0 <= int(i) < n:
            for j, v in row:
                if 0 <= int(j) < n:
                    m[int(i), int(j)] = float(v)
    return m


def top_k_nonzero(stake: np.ndarray, k: int) -> np.ndarray:
    """The chain's ``is_topk_nonzero``: non-zero stake, and among those only the k largest (a stable sort)."""
    keep = stake != 0
    n = len(stake)
    if n < k:
        return keep
    order = sorted(range(n), key=lambda i: stake[i])
    for i in order[: n - k]:
        keep[i] = False
    return keep


def _masked_weights(e: EpochInput, permit: np.ndarray, last_update: np.ndarray,
                    registered: np.ndarray) -> np.ndarray:
    """The weights the epoch uses: rows of validators with a permit, no self-weight (the owner's stays), no weight
    to a uid registered since its setter's last update (or since its earliest live commit), rows summing to 1."""
    n = len(permit)
    w = _matrix(e.weights, n)
    w[~permit, :] = 0.0
    for i in range(n):
        if i != e.owner_uid:
            w[i, i] = 0.0
    w[last_update[:, None] <= registered[None, :]] = 0.0
    if e.commit_blocks:
        committed = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
        for uid, block in e.commit_blocks.items():
            if 0 <= int(uid) < n:
                committed[int(uid)] = min(committed[int(uid)], int(block))
        w[committed[:, None] < registered[None, :]] = 0.0
    sums = w.sum(axis=1, keepdims=True)
    return np.divide(w, sums, out=np.zeros_like(w), where=sums != 0)


def run_epoch(e: EpochInput, p: YumaParams | None = None) -> Epoch:
    """One epoch of Yuma 3 over ``e``, in the chain's order."""
    p = p or YumaParams()
    n = len(e.stake)
    raw = np.asarray(e.stake, dtype=float)
    last_update = np.asarray(e.last_update, dtype=np.int64)
    registered = np.asarray(e.registered_at, dtype=np.int64)
    permit = np.asarray(e.validator_permit, dtype=bool)
    active = ~(last_update + p.activity_cutoff < e.block)
    stake = normalize(np.where(raw < p.stake_threshold, 0.0, raw))
    new_permit = top_k_nonzero(stake, p.max_allowed_validators)
    active_stake = normalize(np.where(active & permit, stake, 0.0))

    w = _masked_weights(e, permit, last_update, registered)
    consensus = consensus_of(active_stake, w, p.kappa / U16_MAX)
    clipped = np.minimum(w, consensus[None, :])
    validator_trust = clipped.sum(axis=1)
    incentive = normalize(clipped.T @ active_stake)

    beta = p.bonds_penalty / U16_MAX
    for_bonds = w + beta * (clipped - w)
    last_tempo = e.block - e.tempo if e.last_epoch_block is None else e.last_epoch_block + 1
    bonds = _matrix(e.bonds, n) / U16_MAX
    bonds[:, registered >= last_tempo] = 0.0  # a miner registered since the last epoch starts with no bonds
    if p.liquid_alpha and consensus.any():
        alpha = liquid_alphas(for_bonds, bonds, consensus, p)
        ema = np.minimum(1.0, (1 - alpha) * bonds + np.maximum(0.0, alpha * for_bonds))
    else:
        a = 1.0 - p.bonds_moving_average / 1_000_000
        ema = a * for_bonds + (1 - a) * bonds
    dividends = normalize((col_normalize(ema) @ incentive) * active_stake)

    total = float(incentive.sum() + dividends.sum())
    if total > 0:
        server, validator = incentive / total, dividends / total
    else:  # no weights counted: emission goes to validators by stake
        server, validator = np.zeros(n), (active_stake if active_stake.any() else stake).copy()
    stored: dict[int, list[tuple[int, int]]] = {}
    for i in range(n):
        if new_permit[i]:
            stored[i] = [(j, b) for j in range(n) if (b := u16_fraction(ema[i, j]))]
        elif permit[i]:
            stored[i] = []  # a validator that lost its permit loses its bonds
        elif i in e.bonds:
            stored[i] = [(int(j), int(v)) for j, v in e.bonds[i]]
    return Epoch(stake=stake, active_stake=active_stake, active=active, validator_permit=new_permit, weights=w,
                 consensus=consensus, clipped=clipped, validator_trust=validator_trust, incentive=incentive,
                 dividends=dividends, bonds=stored, server_emission=server, validator_emission=validator)
