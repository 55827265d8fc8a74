"""The README's main job: the local subnet running until Ctrl-C or for ``--local.rounds`` rounds, its banner, its
epoch tables as the chain runs them, and its summary at the end."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable
from typing import Any

import aiohttp
from loguru import logger

from ..chain.local_state import Subnet
from ..traffic import OrganicTraffic
from ..validator.config import ValidatorConfig
from ..validator.neuron import Validator
from ..validator.prompts import MIXES
from .config import FIRST_WEIGHTS_ROUND
from .epoch_table import epoch_table
from .subnet import LocalSubnet, LocalValidator, start_local_subnet, stop_local_subnet
from .summary import print_summary

EpochHook = Callable[[Subnet, dict[int, str]], None]


def _banner(subnet: LocalSubnet) -> str:
    rows = [f"  uid {uid:>3}  {hk[:12]}…  {profile}" for uid, hk, profile in subnet.miners]
    auditor = subnet.validator.auditor
    audit = (f"audits: {auditor.rate:.0%} of organic answers and every probe, on {auditor.reference.name}"
             if auditor is not None else "audits: off (simulated cards have no model to check against)")
    cfg = subnet.cfg
    model = cfg.models[0]
    lines = [
        f"local subnet up: netuid {cfg.netuid} on a local chain (block {cfg.local_block_time:.2f}s), "
        f"round {cfg.round_s:.0f}s, credit profile {cfg.credit_profile}",
        "miners:", *rows, audit,
        f"external miners: start with {' '.join(f'--allow {lv.hotkey}' for lv in subnet.validators)} and pass "
        "--local.miner-url host:port",
    ]
    for lv in subnet.validators:
        url = _gateway_url(lv)
        who = f"{lv.label} ({lv.hotkey[:10]}…, stake {lv.stake_share:.0%}, traffic {lv.traffic_share:.0%}): " \
            if len(subnet.validators) > 1 else ""
        lines.append(f"{who}gateway: {url}/v1  (API key: {lv.api_key})")
    first = subnet.validators[0]
    lines += [
        f"try:  curl -s {_gateway_url(first)}/v1/chat/completions -H 'Authorization: Bearer {first.api_key}' "
        f"-H 'Content-Type: application/json' "
        f"-d '{{\"model\":\"{model}\",\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}]}}'",
        f"weights on the local chain:  python -m neurons.weights --state-dir {cfg.state_dir} --netuid {cfg.netuid}",
    ]
    return "\n".join(lines)


def _gateway_url(lv: LocalValidator) -> str:
    gw = lv.validator.gateway
    return f"http://{lv.cfg.gateway_host}:{gw.port if gw is not None else lv.cfg.gateway_port}"


def _labelled(subnet: LocalSubnet, lv: LocalValidator) -> contextlib.AbstractContextManager[Any]:
    """With several validators, each one's lines (its tasks inherit the context) say whose they are."""
    return logger.contextualize(validator=lv.label) if len(subnet.validators) > 1 else contextlib.nullcontext()


async def run_local_subnet(cfg: ValidatorConfig, *, seed: int | None = None,
                           on_epoch: EpochHook | None = None) -> int:
    """The README's main job: run until Ctrl-C, or for ``--local.rounds`` rounds. ``on_epoch`` is called with the
    subnet's chain state and the miners' labels after each epoch the chain runs (the soak records them)."""
    subnet = await start_local_subnet(cfg, seed=seed)
    v = subnet.validator
    started: list[LocalValidator] = []
    traffic: list[asyncio.Task[Any]] = []
    try:
        for lv in subnet.validators:
            with _labelled(subnet, lv):
                await lv.validator.start()
            started.append(lv)
        logger.info("\n{}", _banner(subnet))
        session = aiohttp.ClientSession()
        try:
            base = seed if seed is not None else subnet.cfg.seed
            for i, lv in enumerate(subnet.validators):
                lv.traffic = OrganicTraffic(
                    session, _gateway_url(lv), lv.api_key, model=subnet.cfg.models[0],
                    rps=subnet.cfg.local_traffic_rps * lv.traffic_share,
                    rng=random.Random(base if i == 0 or base is None else base + i),
                    mix=MIXES[subnet.cfg.prompt_mix])
                traffic.append(asyncio.create_task(lv.traffic.run(), name=f"organic-traffic-{i + 1}"))
            subnet.traffic = subnet.validators[0].traffic
            want = subnet.cfg.local_rounds
            if want is not None and want < FIRST_WEIGHTS_ROUND:
                logger.warning("--local.rounds {}: no weights can be set that soon (capacity checks start in round {}, "
                               "and a miner's pay waits for its first reading); run {} or more to see them", want,
                               FIRST_WEIGHTS_ROUND, FIRST_WEIGHTS_ROUND + 1)
            epochs = _EpochWatch(subnet, on_epoch)
            while want is None or v.rounds_closed < want:
                await asyncio.sleep(0.2)
                epochs.check()
                for t in traffic:
                    if t.done():
                        t.result()
                        raise RuntimeError("organic traffic ended")
            # Give the weights loops their chance after the last round before exiting.
            await asyncio.gather(*(_await_weights(lv.validator, timeout_s=subnet.cfg.local_block_time * 3 + 2)
                                   for lv in subnet.validators))
        finally:
            subnet.rounds_run = v.rounds_closed
            for t in traffic:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            await session.close()
    finally:
        for lv in reversed(started):
            with _labelled(subnet, lv):
                await lv.validator.stop()
        await stop_local_subnet(subnet)
    print_summary(subnet)
    return 0


class _EpochWatch:
    """Logs the epoch table each time the local chain has run a new epoch."""

    def __init__(self, subnet: LocalSubnet, hook: EpochHook | None) -> None:
        self.subnet = subnet
        self.hook = hook
        self.seen = subnet.chain.substrate.subnet(subnet.cfg.netuid).last_step

    def check(self) -> None:
        s = self.subnet.chain.substrate.subnet(self.subnet.cfg.netuid)
        if s.last_step != self.seen:
            self.seen = s.last_step
            labels = {uid: label for uid, _, label in self.subnet.miners}
            self.subnet.last_epoch = epoch_table(s, labels)
            logger.info("\n{}", self.subnet.last_epoch)
            if self.hook is not None:
                self.hook(s, labels)


async def _await_weights(v: Validator, timeout_s: float) -> None:
    n = v.weights.submitted
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while v.weights.submitted == n and loop.time() < end:  # noqa: ASYNC110 - polls another task's counter
        await asyncio.sleep(0.1)
