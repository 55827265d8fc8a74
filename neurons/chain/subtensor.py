"""``SubtensorChain``: the validator's :class:`~neurons.chain.base.Chain` over the bittensor 11 SDK.

Everything chain-shaped is the SDK's: reads go through the awaited ``bt.Client`` (``bt.Subtensor``
awaited), and weights go through the ``bt.SetWeights`` intent run by ``client.execute`` — so the
max-weight clip, u16 normalisation, ``MinAllowedWeights`` check, rate-limit preflight and the choice
between plaintext ``set_mechanism_weights`` and a drand-timelocked commit are the SDK's, never
re-implemented here. This module only translates to the validator's small dataclasses and turns
failures into clear outcomes: chain refusals become ``WeightsOutcome(ok=False)``; an unreachable
network raises :class:`ChainUnavailable`; an unregistered hotkey raises :class:`NotRegistered`.

Example::

    import asyncio, bittensor as bt
    from neurons.chain.subtensor import SubtensorChain

    async def main():
        chain = await SubtensorChain.connect("test", 7, wallet=bt.Wallet("vali", "default"))
        try:
            print(await chain.block(), await chain.params(), await chain.my_uid())
            print(await chain.set_weights({3: 0.7, 5: 0.3}))   # WeightsOutcome(ok=..., message=...)
        finally:
            await chain.close()
    asyncio.run(main())

Pass ``substrate=`` (any ``bt.Substrate``) to run the same code offline, e.g. over
:class:`~neurons.chain.local_substrate.LocalSubstrate` (that is ``LocalChain``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import bittensor as bt
from bittensor import BittensorError, ChainError, RpcConnectionError
from loguru import logger

from .base import ChainParams, NeuronInfo, WeightsOutcome

U16_MAX = 65535
RAO_PER_UNIT = 1e9
TOKEN_SYMBOLS_ENV = "BTCLI_TOKEN_SYMBOLS_CACHE"
# Storage items as the plain (pallet, item) pairs ``Client.query`` documents, not the SDK's generated catalog
# (``bittensor._generated``, a private module whose layout may change in any 11.x release).
NETWORKS_ADDED = ("SubtensorModule", "NetworksAdded")
TEMPO = ("SubtensorModule", "Tempo")
WEIGHTS_VERSION_KEY = ("SubtensorModule", "WeightsVersionKey")


class ChainSeamError(Exception):
    """Base of the chain seam's own errors."""


class ChainUnavailable(ChainSeamError):
    """The network could not be reached (or the connection broke)."""


class NotRegistered(ChainSeamError):
    """The validator's hotkey (or a uid) is not registered on the netuid."""


class SubnetNotFound(ChainSeamError):
    """The netuid does not exist on this chain."""


class _InterceptHandler(logging.Handler):
    """Forward stdlib records (the SDK logs under ``bittensor.*``) to loguru, keeping level and origin."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level: str | int = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        logger.opt(depth=6, exception=record.exc_info).log(level, "{}: {}", record.name, record.getMessage())


def route_sdk_logging(level: int = logging.INFO) -> None:
    """Send the SDK's ``bittensor`` logger into loguru, once per process."""
    sdk = logging.getLogger("bittensor")
    if any(isinstance(h, _InterceptHandler) for h in sdk.handlers):
        return
    sdk.addHandler(_InterceptHandler())
    sdk.setLevel(level)
    sdk.propagate = False


def use_token_symbols_cache(state_dir: Path | None) -> None:
    """The SDK writes a token-symbol cache at connect: keep it out of ``~/.bittensor`` unless told otherwise."""
    if os.environ.get(TOKEN_SYMBOLS_ENV):
        return
    base = Path(state_dir).expanduser() if state_dir is not None else Path(tempfile.gettempdir())
    os.environ[TOKEN_SYMBOLS_ENV] = str(base / "btcli_token_symbols.json")


def hotkey_address(wallet: Any) -> str:
    """The ss58 of the key that signs weights: a ``bt.Wallet``'s hotkey, or the Keypair itself."""
    for attr in ("hotkeypub", "hotkey"):  # hotkeypub first: it needs no private key file
        try:
            key = getattr(wallet, attr, None)
        except Exception:  # a bt.Wallet raises when that key file is missing
            continue
        if key is not None and hasattr(key, "ss58_address"):
            return str(key.ss58_address)
    if hasattr(wallet, "ss58_address"):
        return str(wallet.ss58_address)
    raise TypeError(f"cannot find a hotkey in {type(wallet).__name__}; pass a bt.Wallet or a Keypair")


class SubtensorChain:
    """A subnet on a bittensor chain, seen through the SDK; implements ``Chain``.

    ``network`` is ``finney`` | ``test`` | ``local`` | ``ws://...``; ``wallet`` is a ``bt.Wallet`` or a
    Keypair whose hotkey signs weights. The connection opens lazily on first use (or explicitly via
    :meth:`connect`); ``substrate`` replaces the RPC backend (the offline seam).
    """

    def __init__(
        self,
        network: str,
        netuid: int,
        wallet: Any,
        *,
        substrate: Any | None = None,
        state_dir: str | os.PathLike[str] | None = None,
        version_key: int | None = None,
        wait_for_finalization: bool = False,
        connect_timeout: float = 30.0,
        fallback_endpoints: list[str] | None = None,
        connect_retries: int = 0,
        retry_backoff_s: float = 2.0,
    ) -> None:
        self.network = network
        self.netuid = int(netuid)
        self.wallet = wallet
        self.version_key = version_key  # None: the subnet's WeightsVersionKey, read before each submission
        self.wait_for_finalization = wait_for_finalization
        self.connect_timeout = connect_timeout
        # Endpoints the SDK tries when the first fails (None: the SDK's own pools for finney; none for a URL).
        self.fallback_endpoints = fallback_endpoints
        # A first connection that fails is tried again this many times, waiting retry_backoff_s, then twice that,
        # ... (at most 60 s): a chain node restarting must not stop a validator that systemd started beside it.
        self.connect_retries = max(0, int(connect_retries))
        self.retry_backoff_s = retry_backoff_s
        self._substrate = substrate
        self._state_dir = Path(state_dir) if state_dir is not None else None
        self._client: bt.Client | None = None
        self._connect_lock = asyncio.Lock()
        route_sdk_logging()
        use_token_symbols_cache(self._state_dir)

    @classmethod
    async def connect(cls, network: str, netuid: int, wallet: Any, **kwargs: Any) -> SubtensorChain:
        """Construct and connect; raises :class:`ChainUnavailable` or :class:`SubnetNotFound`."""
        chain = cls(network, netuid, wallet, **kwargs)
        await chain.client()
        if not await chain._subnet_exists():
            await chain.close()
            raise SubnetNotFound(f"netuid {netuid} does not exist on {network}")
        return chain

    @property
    def hotkey(self) -> str:
        return hotkey_address(self.wallet)

    async def client(self) -> bt.Client:
        """The connected SDK client (connects on first call)."""
        if self._client is not None:
            return self._client
        async with self._connect_lock:
            if self._client is None:
                kwargs: dict[str, Any] = {"substrate": self._substrate}
                if self._substrate is None and self.fallback_endpoints is not None:
                    kwargs.update(fallback_endpoints=list(self.fallback_endpoints))
                elif self._substrate is None and self.network.startswith(("ws://", "wss://")):
                    kwargs.update(fallback_endpoints=[], archive_endpoints=[])
                wait = self.retry_backoff_s
                for attempt in range(self.connect_retries + 1):
                    try:
                        self._client = await asyncio.wait_for(_open(self.network, kwargs), self.connect_timeout)
                        break
                    except ValueError as e:  # unknown network name: no retry helps
                        raise ChainUnavailable(str(e)) from e
                    except (RpcConnectionError, OSError, TimeoutError) as e:
                        why = f"{e or type(e).__name__}"
                        if attempt == self.connect_retries:
                            tries = f" after {attempt + 1} attempts" if attempt else ""
                            raise ChainUnavailable(f"cannot reach {self.network}{tries}: {why}") from e
                        logger.warning("cannot reach {} ({}); attempt {} of {} in {:.0f} s", self.network, why,
                                       attempt + 2, self.connect_retries + 1, wait)
                        await asyncio.sleep(wait)
                        wait = min(60.0, wait * 2)
                logger.debug("connected to {} (netuid {})", self.network, self.netuid)
        assert self._client is not None  # connected, or ChainUnavailable was raised
        return self._client

    async def _read(self, coro_fn: Any) -> Any:
        client = await self.client()
        try:
            return await coro_fn(client)
        except RpcConnectionError as e:
            raise ChainUnavailable(f"lost {self.network}: {e}") from e

    async def _subnet_exists(self) -> bool:
        return bool(await self._read(lambda c: c.query(NETWORKS_ADDED, [self.netuid])))

    # -- Chain ------------------------------------------------------------------------------------

    async def block(self) -> int:
        return int(await self._read(lambda c: c.block()))

    async def metagraph(self) -> list[NeuronInfo]:
        """Every neuron of the subnet (one ``get_metagraph`` runtime call, no commitments).

        ``validator_trust`` is the runtime's ``validator_trust`` column when it has one; otherwise the
        neuron's dividends share, since only neurons acting as validators earn dividends.
        """
        mg = await self._read(lambda c: c.subnets.metagraph(self.netuid, commitments=False))
        if mg is None:
            raise SubnetNotFound(f"netuid {self.netuid} does not exist on {self.network}")
        vtrust = list((mg.raw or {}).get("validator_trust") or [])
        out = []
        for n in mg.neurons:
            raw_vt = vtrust[n.uid] if n.uid < len(vtrust) else None
            out.append(NeuronInfo(
                uid=n.uid,
                hotkey=n.hotkey,
                endpoint=n.axon,
                validator_permit=n.validator_permit,
                validator_trust=(int(raw_vt) / U16_MAX) if raw_vt is not None else float(n.dividends),
                stake=n.total_stake.rao / RAO_PER_UNIT,
            ))
        return out

    async def params(self) -> ChainParams:
        async def fetch(c: bt.Client) -> ChainParams:
            tempo, rate, cr, max_w, min_w, block_time, version = await asyncio.gather(
                c.query(TEMPO, [self.netuid]),
                c.read("weights_rate_limit", netuid=self.netuid),
                c.read("commit_reveal_enabled", netuid=self.netuid),
                c.read("max_weight_limit", netuid=self.netuid),
                c.read("min_allowed_weights", netuid=self.netuid),
                c.block_time(),
                c.query(WEIGHTS_VERSION_KEY, [self.netuid]),
            )
            return ChainParams(
                tempo=int(tempo or 0), weights_rate_limit=int(rate), commit_reveal=bool(cr),
                max_weight_limit=int(max_w) / U16_MAX, min_allowed_weights=int(min_w), block_time=float(block_time),
                weights_version=int(version or 0),
            )

        return await self._read(fetch)

    async def my_uid(self) -> int:
        """This validator's uid; raises :class:`NotRegistered` when its hotkey is not on the netuid."""
        uid = await self._read(lambda c: c.read("uid", hotkey_ss58=self.hotkey, netuid=self.netuid))
        if uid is None:
            raise NotRegistered(f"hotkey {self.hotkey} is not registered on netuid {self.netuid} ({self.network})")
        return int(uid)

    async def blocks_since_last_update(self, uid: int) -> int:
        since = await self._read(lambda c: c.read("blocks_since_last_update", netuid=self.netuid, uid=uid))
        if since is None:
            raise NotRegistered(f"uid {uid} does not exist on netuid {self.netuid}")
        return int(since)

    async def weights_version_key(self) -> int:
        """The ``version_key`` to submit: the operator's pin, else the subnet's ``WeightsVersionKey`` now.

        A key below the subnet's is refused by the chain; a hard-coded 0 failed every submission on a
        subnet whose owner had raised it.
        """
        if self.version_key is not None:
            return self.version_key
        return int(await self._read(lambda c: c.query(WEIGHTS_VERSION_KEY, [self.netuid])) or 0)

    async def set_weights(self, weights: dict[int, float]) -> WeightsOutcome:
        """Run ``bt.SetWeights`` through the SDK; every refusal comes back as ``ok=False``, never raised."""
        try:
            client = await self.client()
            intent = bt.SetWeights(self.netuid, weights={int(u): float(w) for u, w in weights.items()},
                                   version_key=await self.weights_version_key())
            result = await client.execute(intent, self.wallet, wait_for_inclusion=True,
                                          wait_for_finalization=self.wait_for_finalization)
        except ChainError as e:  # the SDK's preflight: NOT_REGISTERED, RATE_LIMITED, INVALID_ARGUMENT, ...
            return WeightsOutcome(ok=False, message=f"{e.code.value}: {e.message}")
        except (BittensorError, ChainSeamError) as e:  # bad weights, policy, transport
            return WeightsOutcome(ok=False, message=f"{type(e).__name__}: {e}")
        block = _result_block(result)
        if not result.success:
            name = result.error.name if result.error is not None and result.error.name else None
            return WeightsOutcome(ok=False, message=f"{name}: {result.message}" if name else result.message,
                                  block=block)
        reveal_round = (result.data or {}).get("reveal_round")
        if reveal_round is not None:
            return WeightsOutcome(ok=True, block=block, commit_reveal=True,
                                  message=f"committed (timelocked); the chain reveals at drand round {reveal_round}")
        return WeightsOutcome(ok=True, block=block, message="weights set")

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()


async def _open(network: str, kwargs: dict[str, Any]) -> bt.Client:
    return await bt.Subtensor(network, **kwargs)


def _result_block(result: Any) -> int | None:
    head, _, _ = (result.extrinsic_id or "").partition("-")
    return int(head) if head.isdigit() else None
