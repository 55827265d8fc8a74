"""The local subnet's settings, made from the validator's: compressed time, the CPU's defaults in real mode, and
each validator's key, stake and share of the traffic."""

from __future__ import annotations

from dataclasses import replace

from ..model.packaged import MODEL_ID
from ..validator.config import DEFAULT_MODEL, ValidatorConfig

FIRST_WEIGHTS_ROUND = 2  # capacity checks start in round 2 (neurons.validator.probes): weights after it
REAL_MINERS = 2  # real miners by default: with the reference, they keep this 2-core machine's cores busy
REAL_TRAFFIC_RPS = 0.3  # a CPU miner answers in seconds; the simulated default (1.5/s) would only queue
VALIDATOR_URI = "Alice"  # the first validator's development key (its gateway workers load it too)
VALIDATOR_URIS = (VALIDATOR_URI, "Bob", "Charlie", "Dave", "Eve", "Ferdie", "Validator7", "Validator8")
STAKE_UNITS = 10_000.0  # the validators' stake together, in alpha


def local_config(cfg: ValidatorConfig) -> ValidatorConfig:
    """Compress time for a newcomer: rounds of ``local_round_s``, weights about once a round.

    In real mode, settings still at their simulated defaults move to the CPU's: the packaged model's
    name, the ``cpu-gemma270m`` credit profile, the packaged model as the audit reference, requests
    sized for a CPU, fewer miners and less traffic. In simulated mode the toy model the cards run is
    the audit reference.
    """
    d = ValidatorConfig()
    if cfg.local_runtime == "real":
        cfg = replace(
            cfg,
            models=[MODEL_ID] if cfg.models == [DEFAULT_MODEL] else cfg.models,
            credit_profile="cpu-gemma270m" if cfg.credit_profile == d.credit_profile else cfg.credit_profile,
            audit_model="packaged" if cfg.audit_model == "none" else cfg.audit_model,
            prompt_mix="cpu",
            local_miners=REAL_MINERS if cfg.local_miners == d.local_miners else cfg.local_miners,
            local_traffic_rps=REAL_TRAFFIC_RPS if cfg.local_traffic_rps == d.local_traffic_rps
            else cfg.local_traffic_rps,
        )
    else:  # simulated cards run the toy model (neurons.model.toy): audited like a real one
        cfg = replace(cfg, audit_model="toy" if cfg.audit_model == "none" else cfg.audit_model)
    blocks_per_round = max(2, int(round(cfg.local_round_s / cfg.local_block_time)))
    return replace(
        cfg,
        network="local",
        round_s=cfg.local_round_s,
        weights_interval_blocks=min(cfg.weights_interval_blocks, blocks_per_round),
        sync_interval_blocks=min(cfg.sync_interval_blocks, max(1, blocks_per_round // 2)),
    )


def local_tempo(cfg: ValidatorConfig) -> int:
    """The local chain's tempo: an epoch (Yuma 3, :mod:`neurons.chain.local_epoch`) about once a round."""
    return max(2, int(round(cfg.round_s / cfg.local_block_time)))


def stake_shares(cfg: ValidatorConfig) -> list[float]:
    """Each validator's share of the stake: ``--local.stakes``, or unequal by default (50/30/20 for three; the
    i-th of n gets a share falling with i), one validator all of it."""
    n = cfg.local_validators
    if cfg.local_stakes:
        total = sum(cfg.local_stakes)
        return [s / total for s in cfg.local_stakes]
    if n == 3:
        return [0.5, 0.3, 0.2]
    weights = [float(n - i) for i in range(n)]
    return [w / sum(weights) for w in weights]


def traffic_shares(cfg: ValidatorConfig) -> list[float]:
    """Each validator's share of ``--local.traffic-rps``: ``--local.traffic`` (percent), or all of it to a lone
    validator, and with several none to the first (a validator without users, as most on a subnet are) and equal
    shares to the rest."""
    n = cfg.local_validators
    if cfg.local_traffic_split:
        return [s / 100.0 for s in cfg.local_traffic_split]
    if n == 1:
        return [1.0]
    return [0.0] + [1.0 / (n - 1)] * (n - 1)


def validator_config(cfg: ValidatorConfig, i: int) -> ValidatorConfig:
    """The config of the ``i``-th validator: the first keeps ``cfg`` (a lone validator runs as it always did);
    the others have a state directory of their own beside the chain's and a gateway on a port of their own."""
    if i == 0:
        return cfg
    seed = None if cfg.seed is None else cfg.seed + i
    return replace(cfg, state_dir=cfg.state_dir / f"validator-{i + 1}", gateway_port=0, seed=seed)
