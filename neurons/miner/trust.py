"""Who may use a miner's slots: a fixed allow-list, or the subnet's validators read from the metagraph.

A miner's slots are its income; serving a caller that is not a validator gives away card time that
no validator measures. The rule for "is a validator" is the validator's own
(:meth:`neurons.chain.base.NeuronInfo.acts_as_validator`), so the two sides never disagree.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Protocol

from loguru import logger

from ..chain.base import DEFAULT_MIN_VALIDATOR_STAKE, NeuronInfo


class Trust(Protocol):
    """Who may use this miner's slots."""

    def allows(self, hotkey: str) -> bool: ...


class AllowList:
    """A fixed set of trusted hotkeys: the local subnet, or an operator pinning its validators."""

    def __init__(self, hotkeys: Iterable[str]) -> None:
        self.hotkeys = frozenset(hotkeys)

    def allows(self, hotkey: str) -> bool:
        return hotkey in self.hotkeys


class _Metagraph(Protocol):
    async def metagraph(self) -> list[NeuronInfo]: ...


class PermitTrust:
    """The subnet's validators (:meth:`NeuronInfo.acts_as_validator`, the validator's own rule), refreshed.

    A failed refresh keeps the last good set: a chain hiccup must not lock every validator out.
    """

    def __init__(self, chain: _Metagraph, *, refresh_s: float = 300.0,
                 min_stake: float = DEFAULT_MIN_VALIDATOR_STAKE) -> None:
        self._chain = chain
        self.refresh_s = refresh_s
        self.min_stake = min_stake
        self.hotkeys: frozenset[str] = frozenset()
        self.refreshed = False

    def allows(self, hotkey: str) -> bool:
        return hotkey in self.hotkeys

    async def refresh(self) -> bool:
        try:
            neurons = await self._chain.metagraph()
        except Exception as e:  # any chain failure keeps the last set
            logger.warning("metagraph refresh failed, keeping {} trusted hotkeys: {}", len(self.hotkeys), e)
            return False
        self.hotkeys = frozenset(n.hotkey for n in neurons if n.acts_as_validator(self.min_stake))
        self.refreshed = True
        logger.debug("trusting {} validator-permit hotkeys", len(self.hotkeys))
        return True

    async def run(self) -> None:
        """Refresh forever (cancel to stop)."""
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()
