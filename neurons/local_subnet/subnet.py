"""Starting and stopping everything a local run holds: the local chain, the miners, and each validator with its
key, stake, state directory, gateway and API key."""

from __future__ import annotations

import random
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from loguru import logger

from ..chain.local import LocalChain
from ..keys import dev_keypair
from ..miner.trust import AllowList
from ..traffic import OrganicTraffic
from ..validator.build import build_validator
from ..validator.config import ValidatorConfig
from ..validator.neuron import Validator
from .config import (
    STAKE_UNITS,
    VALIDATOR_URIS,
    local_config,
    local_tempo,
    stake_shares,
    traffic_shares,
    validator_config,
)
from .lineup import claim_state_dir, lineup_of
from .miners import start_miners


@dataclass
class LocalValidator:
    """One validator of the local subnet: its own key, stake, traffic share, chain client, state and gateway."""

    uid: int
    hotkey: str
    cfg: ValidatorConfig
    chain: LocalChain
    validator: Validator
    api_key: str
    stake_share: float
    traffic_share: float
    traffic: OrganicTraffic | None = None

    @property
    def label(self) -> str:
        return f"validator uid {self.uid}"


@dataclass
class LocalSubnet:
    """Handles to everything the local run started, for tests and the summary at exit. ``validator``, ``chain``,
    ``api_key`` and ``traffic`` are the first validator's (the only one unless ``--local.validators``)."""

    cfg: ValidatorConfig
    chain: LocalChain
    validator: Validator
    miners: list[tuple[int, str, str]] = field(default_factory=list)  # (uid, hotkey, profile)
    runners: list[web.AppRunner] = field(default_factory=list)
    runtimes: list[Any] = field(default_factory=list)  # real runtimes to close (threads, model contexts)
    traffic: OrganicTraffic | None = None
    api_key: str = ""
    rounds_run: int = 0  # rounds closed when the run was stopped (the round in progress is then saved too)
    validators: list[LocalValidator] = field(default_factory=list)
    last_epoch: str = ""  # the table of the last epoch the run saw the chain run


async def start_local_subnet(cfg: ValidatorConfig, *, seed: int | None = None) -> LocalSubnet:
    cfg = local_config(cfg)
    moved = claim_state_dir(cfg.state_dir, lineup_of(cfg), now=time.time())
    if moved is not None:  # before anything opens the directory: its miners were other runtimes under the same keys
        logger.warning("the state in {} was written by another local lineup (other runtimes, models or validators "
                       "under the same keys): set aside as {}; this run starts fresh", cfg.state_dir, moved)
    rng = random.Random(seed if seed is not None else cfg.seed)
    vkeys = [dev_keypair(uri) for uri in VALIDATOR_URIS[:cfg.local_validators]]
    chain = LocalChain.open(cfg.state_dir / "chain", cfg.netuid, wallet=vkeys[0], block_time=cfg.local_block_time,
                            weights_rate_limit=max(1, cfg.weights_interval_blocks // 2), tempo=local_tempo(cfg))
    substrate = chain.substrate
    stakes, shares = stake_shares(cfg), traffic_shares(cfg)
    uids = [substrate.register(k.ss58_address, k.ss58_address, endpoint=None, validator_permit=stake > 0,
                               stake=STAKE_UNITS * stake) for k, stake in zip(vkeys, stakes, strict=True)]
    runners: list[web.AppRunner] = []
    runtimes: list[Any] = []
    chains = [chain] + [LocalChain(substrate, cfg.netuid, k) for k in vkeys[1:]]
    try:
        trust = AllowList({k.ss58_address for k in vkeys})
        miners = await start_miners(cfg, substrate, trust, rng, runners, runtimes)
        validators = []
        for i, (k, c) in enumerate(zip(vkeys, chains, strict=True)):
            vcfg = validator_config(cfg, i)
            api_key = "sk-local-" + secrets.token_hex(8)
            v = build_validator(vcfg, c, k, api_keys=[api_key], rng=random.Random(rng.random()))
            validators.append(LocalValidator(uid=uids[i], hotkey=k.ss58_address, cfg=vcfg, chain=c, validator=v,
                                             api_key=api_key, stake_share=stakes[i], traffic_share=shares[i]))
    except BaseException:
        for r in runners:
            await r.cleanup()
        for rt in runtimes:
            await rt.aclose()
        for c in reversed(chains):
            await c.close()
        raise
    first = validators[0]
    return LocalSubnet(cfg=cfg, chain=chain, validator=first.validator, miners=miners, runners=runners,
                       runtimes=runtimes, api_key=first.api_key, validators=validators)


async def stop_local_subnet(subnet: LocalSubnet) -> None:
    for r in subnet.runners:
        await r.cleanup()
    for rt in subnet.runtimes:
        await rt.aclose()
    for lv in reversed(subnet.validators[1:]):
        await lv.chain.close()
    await subnet.chain.close()
