"""The embedded local subnet: a local chain stand-in, miners, the validator, traffic.

Everything real except the chain: the validator is the same ``Validator`` that runs on finney, the
chain calls go through the bittensor SDK over ``LocalSubstrate``, and organic traffic is an HTTP
client sending chat completions through the gateway. Miners are the reference miner on loopback,
serving either

* ``--local.runtime sim`` (default): the simulated RTX 5090 runtime (the last one a slower card), no
  model, no GPU; answers are not audited (a simulated card has no model to check against); or
* ``--local.runtime real``: Gemma 3 270M on llama.cpp on this CPU, one slot each, audited by the
  validator's reference (the same packaged model), paid against the ``cpu-gemma270m`` speed profile.

``--local.miner-url host:port`` adds miners the run did not start (a real runtime on another port or
machine): the run reads the miner's hotkey from its ``/health`` and registers it on the local chain;
the banner prints the validator hotkey that miner must ``--allow``.

The validator's state and the local chain stay in ``--state-dir`` from run to run of the same lineup; a run with
other local miners under the same development keys starts fresh (:mod:`neurons.local_lineup`).

Example::

    python -m neurons.validator --local --local.rounds 6
    python -m neurons.validator --local --local.runtime real --local.rounds 3
    python -m neurons.weights --state-dir ~/.tensorgate/local --netuid 1
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
from aiohttp import web
from loguru import logger

from .chain.local import LocalChain
from .keys import dev_keypair
from .local_epoch_table import epoch_table
from .local_lineup import claim_state_dir, lineup_of, miner_cheat, miner_label, miner_model
from .miner.runtimes.base import Runtime
from .miner.runtimes.sim import PROFILES, SimulatedRuntime
from .miner.server import start_miner
from .miner.trust import AllowList
from .model.packaged import MODEL_ID
from .traffic import OrganicTraffic
from .validator.build import build_validator
from .validator.config import DEFAULT_MODEL, ValidatorConfig
from .validator.neuron import Validator
from .validator.prompts import MIXES

VALIDATOR_URI = "Alice"


@dataclass
class LocalSubnet:
    """Handles to everything the local run started, for tests and the summary at exit."""

    cfg: ValidatorConfig
    chain: LocalChain
    validator: Validator
    miners: list[tuple[int, str, str]] = field(default_factory=list)  # (uid, hotkey, profile)
    runners: list[web.AppRunner] = field(default_factory=list)
    runtimes: list[Any] = field(default_factory=list)  # real runtimes to close (threads, model contexts)
    traffic: OrganicTraffic | None = None
    api_key: str = ""
    rounds_run: int = 0  # rounds closed when the run was stopped (the round in progress is then saved too)


FIRST_WEIGHTS_ROUND = 2  # capacity checks start in round 2 (neurons.validator.probes): weights after it
REAL_MINERS = 2  # real miners by default: with the reference, they keep this 2-core machine's cores busy
REAL_TRAFFIC_RPS = 0.3  # a CPU miner answers in seconds; the simulated default (1.5/s) would only queue


def local_config(cfg: ValidatorConfig) -> ValidatorConfig:
    """Compress time for a newcomer: rounds of ``local_round_s``, weights about once a round.

    In real mode, settings still at their simulated defaults move to the CPU's: the packaged model's
    name, the ``cpu-gemma270m`` credit profile, the packaged model as the audit reference, requests
    sized for a CPU, fewer miners and less traffic. In simulated mode the toy model the cards run is
    the audit reference.
    """
    d = ValidatorConfig()
    if cfg.local_runtime == "real":
        cfg = replace(
            cfg,
            models=[MODEL_ID] if cfg.models == [DEFAULT_MODEL] else cfg.models,
            credit_profile="cpu-gemma270m" if cfg.credit_profile == d.credit_profile else cfg.credit_profile,
            audit_model="packaged" if cfg.audit_model == "none" else cfg.audit_model,
            prompt_mix="cpu",
            local_miners=REAL_MINERS if cfg.local_miners == d.local_miners else cfg.local_miners,
            local_traffic_rps=REAL_TRAFFIC_RPS if cfg.local_traffic_rps == d.local_traffic_rps
            else cfg.local_traffic_rps,
        )
    else:  # simulated cards run the toy model (neurons.model.toy): audited like a real one
        cfg = replace(cfg, audit_model="toy" if cfg.audit_model == "none" else cfg.audit_model)
    blocks_per_round = max(2, int(round(cfg.local_round_s / cfg.local_block_time)))
    return replace(
        cfg,
        network="local",
        round_s=cfg.local_round_s,
        weights_interval_blocks=min(cfg.weights_interval_blocks, blocks_per_round),
        sync_interval_blocks=min(cfg.sync_interval_blocks, max(1, blocks_per_round // 2)),
    )


def local_tempo(cfg: ValidatorConfig) -> int:
    """The local chain's tempo: an epoch (Yuma 3, :mod:`neurons.chain.local_epoch`) about once a round."""
    return max(2, int(round(cfg.round_s / cfg.local_block_time)))


async def _runtime(cfg: ValidatorConfig, i: int, rng: random.Random, subnet_runtimes: list[Any]) -> tuple[Runtime,
                                                                                                        str, int]:
    """The runtime of local miner ``i`` (the cheats come after the honest miners): (runtime, label, slots)."""
    if cfg.local_runtime == "real":
        from .miner.runtimes.cheats import CHEATS
        from .miner.runtimes.llama import LlamaRuntime
        from .model.packaged import model_path

        cheat = miner_cheat(cfg, i)
        path = await asyncio.to_thread(model_path)  # assembles the packaged model once (hashing ~250 MB)
        rt = LlamaRuntime(path, slots=1, threads=1, model=cfg.models[0], seed=rng.getrandbits(32),
                          generate=CHEATS[cheat] if cheat else None)
        subnet_runtimes.append(rt)
        await rt.start()
        return rt, miner_label(cfg, i), 1
    profile = miner_label(cfg, i)
    return SimulatedRuntime(PROFILES[profile], rng=random.Random(rng.random())), profile, 4


class ExternalMinerError(RuntimeError):
    """A miner named with ``--local.miner-url`` cannot join: one line for the operator (exit 2)."""


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


async def start_local_subnet(cfg: ValidatorConfig, *, seed: int | None = None) -> LocalSubnet:
    cfg = local_config(cfg)
    moved = claim_state_dir(cfg.state_dir, lineup_of(cfg), now=time.time())
    if moved is not None:  # before anything opens the directory: its miners were other runtimes under the same keys
        logger.warning("the state in {} was written by another local lineup (other runtimes or models under the "
                       "same miner keys): set aside as {}; this run starts fresh", cfg.state_dir, moved)
    rng = random.Random(seed if seed is not None else cfg.seed)
    vkey = dev_keypair(VALIDATOR_URI)
    chain = LocalChain.open(cfg.state_dir / "chain", cfg.netuid, wallet=vkey, block_time=cfg.local_block_time,
                            weights_rate_limit=max(1, cfg.weights_interval_blocks // 2), tempo=local_tempo(cfg))
    substrate = chain.substrate
    substrate.register(vkey.ss58_address, vkey.ss58_address, endpoint=None, validator_permit=True, stake=10_000.0)
    runners: list[web.AppRunner] = []
    runtimes: list[Any] = []
    miners: list[tuple[int, str, str]] = []
    try:
        trust = AllowList({vkey.ss58_address})
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
        api_key = "sk-local-" + secrets.token_hex(8)
        validator = build_validator(cfg, chain, vkey, api_keys=[api_key], rng=random.Random(rng.random()))
    except BaseException:
        for r in runners:
            await r.cleanup()
        for rt in runtimes:
            await rt.aclose()
        await chain.close()
        raise
    return LocalSubnet(cfg=cfg, chain=chain, validator=validator, miners=miners, runners=runners,
                       runtimes=runtimes, api_key=api_key)


async def stop_local_subnet(subnet: LocalSubnet) -> None:
    for r in subnet.runners:
        await r.cleanup()
    for rt in subnet.runtimes:
        await rt.aclose()
    await subnet.chain.close()


def _banner(subnet: LocalSubnet) -> str:
    rows = [f"  uid {uid:>3}  {hk[:12]}…  {profile}" for uid, hk, profile in subnet.miners]
    gw = subnet.validator.gateway
    port = gw.port if gw is not None else subnet.cfg.gateway_port
    auditor = subnet.validator.auditor
    audit = (f"audits: {auditor.rate:.0%} of organic answers and every probe, on {auditor.reference.name}"
             if auditor is not None else "audits: off (simulated cards have no model to check against)")
    return "\n".join([
        f"local subnet up: netuid {subnet.cfg.netuid} on a local chain "
        f"(block {subnet.cfg.local_block_time:.2f}s), round {subnet.cfg.round_s:.0f}s, "
        f"credit profile {subnet.cfg.credit_profile}",
        "miners:", *rows, audit,
        f"external miners: start with --allow {subnet.validator.hotkey} and pass --local.miner-url host:port",
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
                rng=random.Random(seed if seed is not None else subnet.cfg.seed), mix=MIXES[subnet.cfg.prompt_mix],
            )
            traffic_task = asyncio.create_task(subnet.traffic.run(), name="organic-traffic")
            want = subnet.cfg.local_rounds
            if want is not None and want < FIRST_WEIGHTS_ROUND:
                logger.warning("--local.rounds {}: no weights can be set that soon (capacity checks start in round {}, "
                               "and a miner's pay waits for its first reading); run {} or more to see them", want,
                               FIRST_WEIGHTS_ROUND, FIRST_WEIGHTS_ROUND + 1)
            epochs = _EpochWatch(subnet)
            while want is None or v.rounds_closed < want:
                await asyncio.sleep(0.2)
                epochs.check()
                if traffic_task.done():
                    traffic_task.result()
                    raise RuntimeError("organic traffic ended")
            # Give the weights loop its chance after the last round before exiting.
            await _await_weights(v, timeout_s=subnet.cfg.local_block_time * 3 + 2)
        finally:
            subnet.rounds_run = v.rounds_closed
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


class _EpochWatch:
    """Logs the epoch table each time the local chain has run a new epoch."""

    def __init__(self, subnet: LocalSubnet) -> None:
        self.subnet = subnet
        self.seen = subnet.chain.substrate.subnet(subnet.cfg.netuid).last_step

    def check(self) -> None:
        s = self.subnet.chain.substrate.subnet(self.subnet.cfg.netuid)
        if s.last_step != self.seen:
            self.seen = s.last_step
            logger.info("\n{}", epoch_table(s, {uid: label for uid, _, label in self.subnet.miners}))


async def _await_weights(v: Validator, timeout_s: float) -> None:
    n = v.weights.submitted
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while v.weights.submitted == n and loop.time() < end:  # noqa: ASYNC110 - polls another task's counter
        await asyncio.sleep(0.1)


def _print_summary(subnet: LocalSubnet) -> None:
    v = subnet.validator
    last = v.weights.history[-1] if v.weights.history else None
    lines = [f"local subnet stopped after {subnet.rounds_run} rounds (the round in progress at the stop was saved "
             "too)"]
    if subnet.traffic is not None:
        lines.append(f"organic requests: {dict(subnet.traffic.counts)}")
    if last is None:
        lines.append("no weights were set" + (f": the first can come after round {FIRST_WEIGHTS_ROUND}"
                                              if subnet.rounds_run <= FIRST_WEIGHTS_ROUND else ""))
    else:
        block, weights = last
        lines.append(f"last weights set at block {block}:")
        for uid, _hk, profile in subnet.miners:
            lines.append(f"  uid {uid:>3} {profile:<14} weight {weights.get(uid, 0.0):.4f}")
        lines.append(_verdict_line(subnet, weights))
    logger.info("\n" + "\n".join(lines))


def _verdict_line(subnet: LocalSubnet, weights: dict[int, float]) -> str:
    """One line a newcomer can read the run by: who was paid, and who was caught and why."""
    v = subnet.validator
    quarantined = v.quarantined()
    paid = [f"uid {uid} {weights[uid]:.2f}" for uid, _, _ in subnet.miners if weights.get(uid, 0.0) > 0]
    caught = []
    for uid, hk, profile in subnet.miners:
        if hk in quarantined and v.auditor is not None:
            record = v.auditor.book.records.get(hk)
            failed = f"{record.failures} of {record.audits} audits failed" if record is not None else "audits failed"
            why = v.auditor.last_failure.get(hk)
            caught.append(f"uid {uid} ({profile}: {failed}{f', {why}' if why else ''})")
    return (f"paid: {', '.join(paid) or 'nobody'}; caught and quarantined at weight 0: "
            f"{', '.join(caught) or 'nobody'}")
