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

import bittensor as bt

from .base import WeightsOutcome
from .local_substrate import LocalSubstrate
from .subtensor import SubtensorChain


class PlaintextView:
    """The local chain as a ``bt.Substrate`` that reports commit-reveal off: for planning only.

    Every call goes to the real :class:`LocalSubstrate` except the ``CommitRevealWeightsEnabled`` read;
    closing the view leaves the chain open (it belongs to the :class:`LocalChain`).
    """

    def __init__(self, local: LocalSubstrate) -> None:
        self._local = local

    async def query(self, module: str, storage_function: str, params: list | None = None,
                    block_hash: str | None = None) -> Any:
        if (module, storage_function) == ("SubtensorModule", "CommitRevealWeightsEnabled"):
            return False
        return await self._local.query(module, storage_function, params, block_hash=block_hash)

    async def connect(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._local, name)


class LocalChain(SubtensorChain):
    """The chain seam in local mode; construct with :meth:`open`."""

    def __init__(self, substrate: LocalSubstrate, netuid: int, wallet: Any, *, owns_substrate: bool = False,
                 **kwargs: Any) -> None:
        """Wrap an open ``substrate`` (shared: e.g. a second key on the same local chain); ``open`` owns its own."""
        super().__init__("local", netuid, wallet, substrate=substrate, state_dir=substrate.state_dir, **kwargs)
        self._local = substrate
        self._owns_substrate = owns_substrate
        self._plan_client: bt.Client | None = None

    @classmethod
    def open(
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

        A timelocked commit cannot be opened without drand, so the local chain is told the plaintext it
        will reveal: what the SDK itself would submit on this subnet with commit-reveal off. It is read
        from ``Client.plan(SetWeights)`` over :class:`PlaintextView` (same state, commit-reveal reported
        off), so clipping, quantising and the checks are the SDK's, and the reveal applies exactly what
        the ciphertext holds.
        """
        hotkey = self.hotkey
        if self._local.subnet(self.netuid).commit_reveal:
            version = await self.weights_version_key()
            intent = bt.SetWeights(self.netuid, weights={int(u): float(w) for u, w in weights.items()},
                                   version_key=version)
            try:
                plan = await (await self._planner()).plan(intent, self.wallet)
            except bt.BittensorError:
                plan = None  # the SDK run below reports the same refusal as an outcome
            if plan is not None and plan.ok and plan.call is not None:
                _, function, params = plan.call
                if function == "set_mechanism_weights":
                    self._local.expect_commit(self.netuid, hotkey, list(params["dests"]), list(params["weights"]),
                                              version)
        try:
            return await super().set_weights(weights)
        finally:
            self._local.forget_commit(self.netuid, hotkey)

    async def _planner(self) -> bt.Client:
        if self._plan_client is None:
            self._plan_client = await bt.Subtensor("local", substrate=PlaintextView(self._local))
        return self._plan_client

    async def close(self) -> None:
        """Close the SDK clients; an owned substrate is flushed and its writer lock released."""
        await super().close()
        planner, self._plan_client = self._plan_client, None
        if planner is not None:
            await planner.close()
        if self._owns_substrate:
            self._local.release()
        else:
            await self._local.close()
