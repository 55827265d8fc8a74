"""The local subnet's miners: the reference miner on loopback over a simulated card or the packaged model on this
CPU, and miners the run did not start (``--local.miner-url``), all registered on the local chain."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp
from aiohttp import web

from ..chain.local_substrate import LocalSubstrate
from ..keys import dev_keypair
from ..miner.runtimes.base import Runtime
from ..miner.runtimes.sim import PROFILES, SimulatedRuntime
from ..miner.server import start_miner
from ..miner.trust import AllowList
from ..validator.config import ValidatorConfig
from .lineup import miner_cheat, miner_label, miner_model


class ExternalMinerError(RuntimeError):
    """A miner named with ``--local.miner-url`` cannot join: one line for the operator (exit 2)."""


async def _runtime(cfg: ValidatorConfig, i: int, rng: random.Random, subnet_runtimes: list[Any]) -> tuple[Runtime,
                                                                                                        str, int]:
    """The runtime of local miner ``i`` (the cheats come after the honest miners): (runtime, label, slots)."""
    if cfg.local_runtime == "real":
        from ..miner.runtimes.cheats import CHEATS
        from ..miner.runtimes.llama import LlamaRuntime
        from ..model.packaged import model_path

        cheat = miner_cheat(cfg, i)
        path = await asyncio.to_thread(model_path)  # assembles the packaged model once (hashing ~250 MB)
        rt = LlamaRuntime(path, slots=1, threads=1, model=cfg.models[0], seed=rng.getrandbits(32),
                          generate=CHEATS[cheat] if cheat else None)
        subnet_runtimes.append(rt)
        await rt.start()
        return rt, miner_label(cfg, i), 1
    profile = miner_label(cfg, i)
    return SimulatedRuntime(PROFILES[profile], rng=random.Random(rng.random())), profile, 4


async def _external_hotkey(url: str) -> str:
    """The hotkey an external miner serves under, from its ``/health``."""
    base = url if "://" in url else f"http://{url}"
    try:
        async with aiohttp.ClientSession() as s, s.get(base.rstrip("/") + "/health",
                                                       timeout=aiohttp.ClientTimeout(total=5)) as r:
            body = await r.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        raise ExternalMinerError(f"--local.miner-url {url}: no miner answers GET /health within 5 s "
                                 f"({type(e).__name__}{f': {e}' if str(e) else ''})") from None
    hotkey = body.get("hotkey") if isinstance(body, dict) else None
    if not isinstance(hotkey, str) or not hotkey:
        raise ExternalMinerError(f"--local.miner-url {url}: /health names no hotkey (is it a tensorgate miner?)")
    return hotkey


async def start_miners(cfg: ValidatorConfig, substrate: LocalSubstrate, trust: AllowList, rng: random.Random,
                       runners: list[web.AppRunner], runtimes: list[Any]) -> list[tuple[int, str, str]]:
    """Start the local miners and register them and the external ones: (uid, hotkey, label) each. What was started
    is added to ``runners`` and ``runtimes`` as it starts, so a failure half-way still closes it."""
    miners: list[tuple[int, str, str]] = []
    for i in range(cfg.local_miners + len(cfg.local_cheats)):
        mkey = dev_keypair(f"Miner{i + 1}")
        runtime, label, slots = await _runtime(cfg, i, rng, runtimes)
        # with several models (--gateway.models a,b) the miners serve them in turn, each declaring its own
        model = miner_model(cfg, i)
        models = (model,) if model is not None else ()
        runner, port = await start_miner(mkey, runtime, slots=slots, trust=trust, host="127.0.0.1", port=0,
                                         contexts=slots if cfg.local_runtime == "real" else None, models=models)
        runners.append(runner)
        uid = substrate.register(mkey.ss58_address, mkey.ss58_address, endpoint=f"127.0.0.1:{port}",
                                 validator_permit=False, stake=0.0)
        miners.append((uid, mkey.ss58_address, label))
    for url in cfg.local_miner_urls:
        hotkey = await _external_hotkey(url)
        endpoint = url.split("://", 1)[-1].rstrip("/")
        uid = substrate.register(hotkey, hotkey, endpoint=endpoint, validator_permit=False, stake=0.0)
        miners.append((uid, hotkey, f"external {endpoint}"))
    return miners
