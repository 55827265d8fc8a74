"""The chain seam: the validator sees :class:`Chain`; these are its implementations.

The implementations import the bittensor SDK (about half a second), so they load on first access;
``from neurons.chain.base import Chain`` stays light.

Example::

    from neurons.chain import LocalChain, SubtensorChain
    chain = await SubtensorChain.connect("finney", 7, wallet=bt.Wallet("vali", "default"))
    local = LocalChain.open("~/.tensorgate/local/chain", 1, Keypair.create_from_uri("//Alice"), block_time=1.0)
"""

from __future__ import annotations

import importlib
from typing import Any

from .base import Chain, ChainParams, NeuronInfo, WeightsOutcome

_LAZY = {
    "LocalChain": ".local",
    "LocalSubstrate": ".local_substrate",
    "StateDirLocked": ".local_substrate",
    "ChainSeamError": ".subtensor",
    "ChainUnavailable": ".subtensor",
    "NotRegistered": ".subtensor",
    "SubnetNotFound": ".subtensor",
    "SubtensorChain": ".subtensor",
}

__all__ = ["Chain", "ChainParams", "NeuronInfo", "WeightsOutcome", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
