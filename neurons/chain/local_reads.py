"""What the local chain answers to storage reads and the metagraph runtime call: pure functions over its state.

The ``bt.Substrate`` seam (:mod:`.local_substrate`) advances the clock and takes the lock; these say what
each item reads as at a block, in the shapes the SDK decodes from a real node, so the SDK's own read
code runs unchanged over them.
"""

from __future__ import annotations

from typing import Any

from bittensor import ChainError

from .local_state import MECHANISM_STRIDE, ChainState, Subnet


def read_storage(state: ChainState, module: str, item: str, params: list, head: int) -> Any:
    """One storage item at ``head``, in the shapes the SDK decodes from a real node."""
    if module == "Timestamp" and item == "Now":
        return state.block_timestamp_ms(head)
    if module != "SubtensorModule":
        raise ChainError(f"the local chain does not model {module}.{item}")
    if item == "NetworksAdded":
        return int(params[0]) in state.subnets
    if item == "TokenSymbol":
        s = state.subnets.get(int(params[0]))
        return None if s is None else s.symbol.encode()
    index = int(params[0]) if params else 0
    if item in {"LastUpdate", "Weights", "Bonds", "Incentive", "TimelockedWeightCommits"}:
        if index >= MECHANISM_STRIDE:  # only mechanism 0 is modelled
            return None
    s = state.subnets.get(index)
    if s is None:
        return None  # storage of a subnet that does not exist reads as empty
    scalar = {
        "Tempo": s.tempo, "WeightsSetRateLimit": s.weights_rate_limit, "MaxWeightsLimit": s.max_weights_limit,
        "MinAllowedWeights": s.min_allowed_weights, "CommitRevealWeightsEnabled": s.commit_reveal,
        "RevealPeriodEpochs": s.reveal_period, "WeightsVersionKey": s.weights_version_key,
        "StakeThreshold": s.weights_min_stake_rao, "MaxAllowedUids": s.max_allowed_uids,
        "SubnetworkN": len(s.neurons), "SubnetEpochConsensus": s.consensus,
        "NetworkRegisteredAt": s.registered_at, "SubnetOwner": s.owner_coldkey,
        "SubnetOwnerHotkey": s.owner_hotkey,
        "LastEpochBlock": s.last_epoch_block(head), "SubnetEpochIndex": s.epoch_index(head),
        "BlocksSinceLastStep": head - s.last_epoch_block(head), "PendingEpochAt": 0,
        "LastUpdate": [n.last_update for n in s.neurons],
        "ValidatorPermit": [n.validator_permit for n in s.neurons],
        "Active": [n.active for n in s.neurons],
        "Consensus": [n.consensus for n in s.neurons], "Incentive": [n.incentive for n in s.neurons],
        "Dividends": [n.dividends for n in s.neurons], "ValidatorTrust": [n.validator_trust for n in s.neurons],
        "Emission": [n.emission_rao for n in s.neurons],
        "Kappa": s.kappa, "BondsPenalty": s.bonds_penalty, "BondsMovingAverage": s.bonds_moving_average,
        "LiquidAlphaOn": s.liquid_alpha, "AlphaValues": (s.alpha_low, s.alpha_high), "Yuma3On": True,
        "AlphaSigmoidSteepness": s.alpha_sigmoid_steepness, "MaxAllowedValidators": s.max_allowed_validators,
        "ActivityCutoff": s.activity_cutoff, "ActivityCutoffFactorMilli": s.activity_cutoff_factor_milli,
        "LastMechansimStepBlock": s.last_step,
    }
    if item in scalar:
        return scalar[item]
    if item == "Uids":
        return s.uid_of(str(params[1]))
    if item == "Keys":
        uid = int(params[1])
        return s.neurons[uid].hotkey if 0 <= uid < len(s.neurons) else None
    if item in {"Weights", "Bonds"}:
        row = (s.weights if item == "Weights" else s.bonds).get(int(params[1]))
        return None if row is None else [tuple(p) for p in row]
    raise ChainError(f"the local chain does not model SubtensorModule.{item}")

def read_storage_map(state: ChainState, module: str, item: str, params: list) -> list[tuple[Any, Any]]:
    """Every entry of one storage map."""
    if module != "SubtensorModule":
        raise ChainError(f"the local chain does not model {module}.{item}")
    subnets = state.subnets
    if item == "TokenSymbol":
        return [(netuid, s.symbol.encode()) for netuid, s in sorted(subnets.items())]
    if item == "NetworksAdded":
        return [(netuid, True) for netuid in sorted(subnets)]
    if item == "Tempo":
        return [(netuid, s.tempo) for netuid, s in sorted(subnets.items())]
    index = int(params[0]) if params else -1
    s = subnets.get(index)
    if s is None:
        return []
    if item in {"Weights", "Bonds"}:
        rows = s.weights if item == "Weights" else s.bonds
        return [(uid, [tuple(p) for p in row]) for uid, row in sorted(rows.items())]
    if item == "TimelockedWeightCommits":
        by_epoch: dict[int, list[tuple[str, int, str, int]]] = {}
        for c in s.commits:
            by_epoch.setdefault(c.epoch, []).append((c.hotkey, c.commit_block, c.ciphertext, c.reveal_round))
        return sorted(by_epoch.items())
    if item == "Uids":
        return [(n.hotkey, uid) for uid, n in enumerate(s.neurons)]
    if item == "Keys":
        return [(uid, n.hotkey) for uid, n in enumerate(s.neurons)]
    raise ChainError(f"the local chain does not model the map SubtensorModule.{item}")

def metagraph(s: Subnet, head: int) -> dict[str, Any]:
    """``SubnetInfoRuntimeApi.get_metagraph``: the raw record the SDK turns into ``bt.Metagraph``."""
    ns = s.neurons
    zeros = [0 for _ in ns]
    last_step = s.last_step or s.last_epoch_block(head)  # the epoch whose figures these are
    return {
        "netuid": s.netuid, "name": list(s.name.encode()), "symbol": list(s.symbol.encode()),
        "identity": None, "network_registered_at": s.registered_at,
        "owner_hotkey": s.owner_hotkey, "owner_coldkey": s.owner_coldkey,
        "block": head, "tempo": s.tempo, "last_step": last_step, "blocks_since_last_step": head - last_step,
        "num_uids": len(ns), "max_uids": s.max_allowed_uids,
        "hotkeys": [n.hotkey for n in ns], "coldkeys": [n.coldkey for n in ns], "identities": [None for _ in ns],
        "axons": [{"block": n.registered_at, "version": 1, "ip": n.ip, "port": n.port, "ip_type": n.ip_type,
                   "protocol": 4, "placeholder1": 0, "placeholder2": 0} for n in ns],
        "active": [n.active for n in ns], "validator_permit": [n.validator_permit for n in ns],
        "last_update": [n.last_update for n in ns], "block_at_registration": [n.registered_at for n in ns],
        "alpha_stake": [n.stake_rao for n in ns], "tao_stake": zeros, "total_stake": [n.stake_rao for n in ns],
        "emission": [n.emission_rao for n in ns], "rank": zeros, "trust": zeros,
        "consensus": [n.consensus for n in ns], "incentives": [n.incentive for n in ns],
        "dividends": [n.dividends for n in ns], "pruning_score": zeros,
        "validator_trust": [n.validator_trust for n in ns],
    }
