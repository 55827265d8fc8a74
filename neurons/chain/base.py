"""The chain seam: exactly what the validator needs from a chain, as one small interface.

Two implementations: ``SubtensorChain`` (the bittensor 11 SDK against finney/test/ws://) and
``LocalChain`` (the same SDK code over an in-process ``bt.Substrate`` stand-in). The validator
only ever sees :class:`Chain`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

DEFAULT_MIN_VALIDATOR_STAKE = 1000.0  # alpha: a permit holder with this stake counts as a validator


@dataclass(frozen=True, slots=True)
class NeuronInfo:
    """One metagraph entry, in the validator's terms."""

    uid: int
    hotkey: str
    endpoint: str | None  # "ip:port" ("[v6]:port"), None when the neuron serves nothing
    validator_permit: bool
    validator_trust: float
    stake: float  # total stake, in alpha/tao units as a float (informational)

    def acts_as_validator(self, min_stake: float = DEFAULT_MIN_VALIDATOR_STAKE) -> bool:
        """The one rule, for the validator (never route to a validator) and the miner (whom to serve).

        On small subnets every neuron can hold a permit, so the permit alone does not make a
        validator: it also needs validator trust or ``min_stake``.
        """
        return self.validator_permit and (self.validator_trust > 0.0 or self.stake >= min_stake)


@dataclass(frozen=True, slots=True)
class ChainParams:
    """Subnet hyperparameters the validator must respect."""

    tempo: int
    weights_rate_limit: int
    commit_reveal: bool
    max_weight_limit: float  # fraction, 0..1
    min_allowed_weights: int
    block_time: float  # seconds per block
    weights_version: int = 0  # the subnet's WeightsVersionKey: a submission below it is refused


@dataclass(frozen=True, slots=True)
class WeightsOutcome:
    ok: bool
    message: str
    block: int | None = None
    commit_reveal: bool = False


class Chain(Protocol):
    """A subnet on some chain; ``netuid`` and the validator's hotkey are bound at construction."""

    netuid: int

    async def block(self) -> int: ...

    async def metagraph(self) -> list[NeuronInfo]: ...

    async def params(self) -> ChainParams: ...

    async def blocks_since_last_update(self, uid: int) -> int: ...

    async def set_weights(self, weights: dict[int, float]) -> WeightsOutcome:
        """Submit weights; the SDK conforms them. Never raises for chain-side refusals."""
        ...

    async def close(self) -> None: ...
