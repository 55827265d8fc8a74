"""The embedded local subnet: a local chain stand-in, simulated 5090 miners, the validator, traffic.

Everything real except the chain and the GPUs: the validator is the same ``Validator`` that runs on
finney, the chain calls go through the bittensor SDK over ``LocalSubstrate``, miners are the
reference miner serving the simulated RTX 5090 runtime on loopback (the last one a slower card),
and organic traffic is an HTTP client sending chat completions through the gateway.

Example::

    python -m neurons.validator --local --local.rounds 6
    python -m neurons.weights --state-dir ~/.tensorgate/local --netuid 1
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
from aiohttp import web
from loguru import logger

from .chain.local import LocalChain
from .keys import dev_keypair
from .miner.runtimes.sim import PROFILES, SimulatedRuntime
from .miner.server import start_miner
from .miner.trust import AllowList
from .traffic import OrganicTraffic
from .validator.build import build_validator
from .validator.config import ValidatorConfig
from .validator.neuron import Validator

VALIDATOR_URI = "Alice"


@dataclass
class LocalSubnet:
    """Handles to everything the local run started, for tests and the summary at exit."""

    cfg: ValidatorConfig
    chain: LocalChain
    validator: Validator
    miners: list[tuple[int, str, str]] = field(default_factory=list)  # (uid, hotkey, profile)
    runners: list[web.AppRunner] = field(default_factory=list)
    traffic: OrganicTraffic | None = None
    api_key: str = ""


def local_config(cfg: ValidatorConfig) -> ValidatorConfig:
    """Compress time for a newcomer: rounds of ``local_round_s``, weights about once a round."""
    blocks_per_round = max(2, int(round(cfg.local_round_s / cfg.local_block_time)))
    return replace(
        cfg,
        network="local",
        round_s=cfg.local_round_s,
        weights_interval_blocks=min(cfg.weights_interval_blocks, blocks_per_round),
        sync_interval_blocks=min(cfg.sync_interval_blocks, max(1, blocks_per_round // 2)),
    )


async def start_local_subnet(cfg: ValidatorConfig, *, seed: int | None = None) -> LocalSubnet:
    cfg = local_config(cfg)
    rng = random.Random(seed if seed is not None else cfg.seed)
    vkey = dev_keypair(VALIDATOR_URI)
    chain = LocalChain.open(cfg.state_dir / "chain", cfg.netuid, wallet=vkey, block_time=cfg.local_block_time,
                            weights_rate_limit=max(1, cfg.weights_interval_blocks // 2))
    substrate = chain.substrate
    substrate.register(vkey.ss58_address, vkey.ss58_address, endpoint=None, validator_permit=True, stake=10_000.0)
    runners: list[web.AppRunner] = []
    miners: list[tuple[int, str, str]] = []
    try:
        trust = AllowList({vkey.ss58_address})
        for i in range(cfg.local_miners):
            profile = "rtx5090-slow" if (i == cfg.local_miners - 1 and cfg.local_miners > 1) else "rtx5090"
            mkey = dev_keypair(f"Miner{i + 1}")
            runtime = SimulatedRuntime(PROFILES[profile], rng=random.Random(rng.random()))
            runner, port = await start_miner(mkey, runtime, slots=4, trust=trust, host="127.0.0.1", port=0)
            runners.append(runner)
            uid = substrate.register(mkey.ss58_address, mkey.ss58_address, endpoint=f"127.0.0.1:{port}",
                                     validator_permit=False, stake=0.0)
            miners.append((uid, mkey.ss58_address, profile))
        api_key = "sk-local-" + secrets.token_hex(8)
        validator = build_validator(cfg, chain, vkey, api_keys=[api_key], rng=random.Random(rng.random()))
    except BaseException:
        for r in runners:
            await r.cleanup()
        await chain.close()
        raise
    return LocalSubnet(cfg=cfg, chain=chain, validator=validator, miners=miners, runners=runners, api_key=api_key)


async def stop_local_subnet(subnet: LocalSubnet) -> None:
    for r in subnet.runners:
        await r.cleanup()
    await subnet.chain.close()


def _banner(subnet: LocalSubnet) -> str:
    rows = [f"  uid {uid:>3}  {hk[:12]}…  {profile}" for uid, hk, profile in subnet.miners]
    gw = subnet.validator.gateway
    port = gw.port if gw is not None else subnet.cfg.gateway_port
    return "\n".join([
        f"local subnet up: netuid {subnet.cfg.netuid} on a local chain "
        f"(block {subnet.cfg.local_block_time:.2f}s), round {subnet.cfg.round_s:.0f}s",
        "miners (simulated RTX 5090 on loopback):", *rows,
        f"gateway: http://{subnet.cfg.gateway_host}:{port}/v1  (API key: {subnet.api_key})",
        f"try:  curl -s http://{subnet.cfg.gateway_host}:{port}/v1/chat/completions "
        f"-H 'Authorization: Bearer {subnet.api_key}' -H 'Content-Type: application/json' "
        f"-d '{{\"model\":\"{subnet.cfg.models[0]}\",\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}]}}'",
        f"weights on the local chain:  python -m neurons.weights --state-dir {subnet.cfg.state_dir} "
        f"--netuid {subnet.cfg.netuid}",
    ])


async def run_local_subnet(cfg: ValidatorConfig, *, seed: int | None = None) -> int:
    """The README's main job: run until Ctrl-C, or for ``--local.rounds`` rounds."""
    subnet = await start_local_subnet(cfg, seed=seed)
    v = subnet.validator
    traffic_task: asyncio.Task[Any] | None = None
    try:
        await v.start()
        logger.info("\n{}", _banner(subnet))
        session = aiohttp.ClientSession()
        try:
            assert v.gateway is not None
            subnet.traffic = OrganicTraffic(
                session, f"http://{subnet.cfg.gateway_host}:{v.gateway.port}", subnet.api_key,
                model=subnet.cfg.models[0], rps=subnet.cfg.local_traffic_rps,
                rng=random.Random(seed if seed is not None else subnet.cfg.seed),
            )
            traffic_task = asyncio.create_task(subnet.traffic.run(), name="organic-traffic")
            want = subnet.cfg.local_rounds
            while want is None or v.rounds_closed < want:
                await asyncio.sleep(0.2)
                if traffic_task.done():
                    traffic_task.result()
                    raise RuntimeError("organic traffic ended")
            # Give the weights loop its chance after the last round before exiting.
            await _await_weights(v, timeout_s=subnet.cfg.local_block_time * 3 + 2)
        finally:
            if traffic_task is not None:
                traffic_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await traffic_task
            await session.close()
    finally:
        await v.stop()
        await stop_local_subnet(subnet)
    _print_summary(subnet)
    return 0


async def _await_weights(v: Validator, timeout_s: float) -> None:
    n = v.weights_submitted
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while v.weights_submitted == n and loop.time() < end:  # noqa: ASYNC110 - polls another task's counter
        await asyncio.sleep(0.1)


def _print_summary(subnet: LocalSubnet) -> None:
    v = subnet.validator
    last = v.weights_set[-1] if v.weights_set else None
    lines = [f"local subnet stopped after {v.rounds_closed} rounds"]
    if subnet.traffic is not None:
        lines.append(f"organic requests: {dict(subnet.traffic.counts)}")
    if last is None:
        lines.append("no weights were set")
    else:
        block, weights = last
        lines.append(f"last weights set at block {block}:")
        for uid, _hk, profile in subnet.miners:
            lines.append(f"  uid {uid:>3} {profile:<14} weight {weights.get(uid, 0.0):.4f}")
    logger.info("\n" + "\n".join(lines))
