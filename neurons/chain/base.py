"""The chain seam: exactly what the validator needs from a chain, as one small interface.

Two implementations: ``SubtensorChain`` (the bittensor 11 SDK against finney/test/ws://) and
``LocalChain`` (the same SDK code over an in-process ``bt.Substrate`` stand-in). The validator
only ever sees :class:`Chain`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class NeuronInfo:
    """One metagraph entry, in the validator's terms."""

    uid: int
    hotkey: str
    endpoint: str | None  # "ip:port" ("[v6]:port"), None when the neuron serves nothing
    validator_permit: bool
    validator_trust: float
    stake: float  # total stake, in alpha/tao units as a float (informational)


@dataclass(frozen=True, slots=True)
class ChainParams:
    """Subnet hyperparameters the validator must respect."""

    tempo: int
    weights_rate_limit: int
    commit_reveal: bool
    max_weight_limit: float  # fraction, 0..1
    min_allowed_weights: int
    block_time: float  # seconds per block


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
