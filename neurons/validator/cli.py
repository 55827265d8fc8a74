"""``python -m neurons.validator``: parse flags, then run the validator on a chain or the embedded local subnet.

Operator mistakes (no wallet, unregistered hotkey, unreachable network, a corrupt state file, a missing
reference model or credit profile) end with one clear line and exit code 2, not a traceback.
"""

from __future__ import annotations

import asyncio

from loguru import logger

from .build import build_validator
from .config import ValidatorConfig, parse_args
from .process import configure_logging, raise_open_files_limit, until_stopped


async def _run_network(cfg: ValidatorConfig) -> int:
    from ..chain.subtensor import SubtensorChain
    from ..keys import load_hotkey

    keypair = load_hotkey(cfg.wallet_name, cfg.wallet_hotkey, cfg.wallet_path)
    chain = await SubtensorChain.connect(cfg.network, cfg.netuid, wallet=keypair, state_dir=cfg.state_dir,
                                         version_key=cfg.weights_version_key,
                                         fallback_endpoints=cfg.chain_fallbacks or None,
                                         connect_retries=cfg.chain_connect_retries)
    try:
        uid = await chain.my_uid()  # NotRegistered: refuse to run rather than serve without weights
        logger.info("hotkey {} is uid {} on netuid {}", keypair.ss58_address, uid, cfg.netuid)
        v = build_validator(cfg, chain, keypair)
        await v.run()
    finally:
        await chain.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point (``tensorgate-validator``)."""
    from gateway.auth import KeysFileError
    from gateway.http.server import ListenError
    from scoring.profiles import ProfileError
    from scoring.store import StateError

    from ..chain.local_files import CorruptChainState
    from ..chain.subtensor import ChainSeamError
    from ..keys import MissingKeyError
    from ..local_subnet import ExternalMinerError
    from ..local_subnet.lineup import LineupRecordError
    from ..model.packaged import ModelUnavailable
    from ..reference.bands import BandsFileError

    cfg = parse_args(argv)
    configure_logging(cfg.log_level, cfg.log_format)
    raise_open_files_limit()
    try:
        if cfg.gateway_only:
            from .gateway_only import run_gateway
            from .worker import worker_keypair

            return asyncio.run(until_stopped(run_gateway(cfg, worker_keypair(cfg))))
        if cfg.local:
            from ..local_subnet import run_local_subnet

            return asyncio.run(until_stopped(run_local_subnet(cfg)))
        return asyncio.run(until_stopped(_run_network(cfg)))
    except KeyboardInterrupt:
        logger.info("stopped")
        return 0
    except (MissingKeyError, ChainSeamError, StateError, ModelUnavailable, ProfileError, CorruptChainState,
            KeysFileError, BandsFileError, ListenError, LineupRecordError, ExternalMinerError) as e:
        logger.error("{}", e)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
