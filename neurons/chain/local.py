"""``LocalChain``: :class:`SubtensorChain` over :class:`LocalSubstrate` — the SDK's real code, a local chain.

The validator cannot tell it from finney: reads, conforming, preflight and commit-reveal all run in
the bittensor SDK; only the ``bt.Substrate`` underneath is local. The orchestrator of the local subnet
registers neurons through :attr:`LocalChain.substrate`.

Example::

    import asyncio
    from bittensor.sp_core import Keypair
    from neurons.chain.local import LocalChain

    alice = Keypair.create_from_uri("//Alice")
    chain = LocalChain.open("/tmp/tg-chain", 1, alice, block_time=0.25, min_allowed_weights=1)
    chain.substrate.register(alice.ss58_address, alice.ss58_address, endpoint=None,
                             validator_permit=True, stake=1000.0)
    miner = chain.substrate.register("5FHneW46xGXgs5mUiveU4sbTyGBzmstUspZC92UhjJM694ty",
                                     "5FHneW46xGXgs5mUiveU4sbTyGBzmstUspZC92UhjJM694ty",
                                     endpoint="127.0.0.1:8091")

    async def main():
        print(await chain.set_weights({miner: 1.0}))
        await chain.close()
    asyncio.run(main())
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from bittensor.intents.weights import _conform, _preflight
from bittensor.result import BittensorError

from .base import WeightsOutcome
from .local_substrate import LocalSubstrate
from .subtensor import SubtensorChain


class LocalChain(SubtensorChain):
    """The chain seam in local mode; construct with :meth:`open`."""

    def __init__(self, substrate: LocalSubstrate, netuid: int, wallet: Any, *, owns_substrate: bool = False,
                 **kwargs: Any) -> None:
        """Wrap an open ``substrate`` (shared: e.g. a second key on the same local chain); ``open`` owns its own."""
        super().__init__("local", netuid, wallet, substrate=substrate, state_dir=substrate.state_dir, **kwargs)
        self._local = substrate
        self._owns_substrate = owns_substrate

    @classmethod
    def open(  # type: ignore[override]
        cls,
        state_dir: str | os.PathLike[str],
        netuid: int,
        wallet: Any,
        *,
        block_time: float = 12.0,
        clock: Callable[[], float] = time.time,
        **hyperparameters: Any,
    ) -> LocalChain:
        """Open (or create) the local chain in ``state_dir`` with subnet ``netuid``.

        ``hyperparameters`` go to :meth:`LocalSubstrate.set_hyperparameters` (e.g. ``weights_rate_limit``,
        ``commit_reveal``, ``tempo``); the ones not given keep their stored values across restarts.
        """
        substrate = LocalSubstrate.open(state_dir, block_time=block_time, clock=clock)
        substrate.ensure_subnet(netuid, **hyperparameters)
        substrate.default_netuid = netuid
        return cls(substrate, netuid, wallet, owns_substrate=True)

    @property
    def substrate(self) -> LocalSubstrate:
        return self._local

    async def set_weights(self, weights: dict[int, float]) -> WeightsOutcome:
        """As on any chain; on a commit-reveal subnet the conformed plaintext is left with the local chain.

        The plaintext is what the SDK's own ``_conform`` makes of these weights (the same function
        ``SetWeights`` runs), so the local reveal applies exactly what the ciphertext holds.
        """
        hotkey = self.hotkey
        try:
            if self._local.subnet(self.netuid).commit_reveal:
                pre = await _preflight(self._local, hotkey, self.netuid, 0)
                uids = sorted(int(u) for u in weights)
                uids_q, values = _conform(uids, [float(weights[u]) for u in uids], pre, self.netuid)
                self._local.expect_commit(self.netuid, hotkey, uids_q, values, self.version_key)
        except BittensorError:
            pass  # the SDK run below reports the same refusal as an outcome
        try:
            return await super().set_weights(weights)
        finally:
            self._local.forget_commit(self.netuid, hotkey)

    async def close(self) -> None:
        """Close the SDK client; an owned substrate is flushed and its writer lock released."""
        await super().close()
        if self._owns_substrate:
            self._local.release()
        else:
            await self._local.close()
