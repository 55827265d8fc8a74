"""``python -m neurons.miner``: the reference miner's command line (wallet, runtime, trust, slots).

Example::

    python -m neurons.miner --wallet.name miner --wallet.hotkey default --netuid 7 --network test \\
        --axon.ip 0.0.0.0 --axon.port 8091 --runtime.url http://127.0.0.1:8001 --slots 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
from collections.abc import Mapping
from typing import Any

import aiohttp
from loguru import logger

from gateway.protocol.openai import FEATURES, SUBNET_SAMPLER

from ..chain.base import DEFAULT_MIN_VALIDATOR_STAKE
from ..flag_types import bound, log_level
from ..logs import to_stderr
from ..settings import MINER_PREFIX, add_config_flag, resolve
from ..supervise import until_stop_signal
from .runtimes.base import Runtime
from .runtimes.sim import SimulatedRuntime, parse_profile
from .server import DEFAULT_MAX_BODY, start_miner
from .trust import AllowList, PermitTrust, Trust


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m neurons.miner",
                                description="tensorgate reference miner: signed, slot-limited chat completions")
    add_config_flag(p, MINER_PREFIX)
    p.add_argument("--netuid", type=int, default=1, help="subnet to serve (network mode)")
    p.add_argument("--network", default="finney", help="finney | test | local | ws://host:port")
    p.add_argument("--wallet.name", dest="wallet_name", default="default", help="wallet (coldkey) name")
    p.add_argument("--wallet.hotkey", dest="wallet_hotkey", default="default", help="hotkey name in the wallet")
    p.add_argument("--wallet.path", dest="wallet_path", default=None, help="default ~/.bittensor/wallets")
    p.add_argument("--dev-key", dest="dev_key", default=None, metavar="NAME",
                   help="use the development key //NAME instead of a wallet (local testing only)")
    p.add_argument("--axon.ip", dest="axon_ip", default="127.0.0.1", help="address to bind")
    p.add_argument("--axon.port", dest="axon_port", type=int, default=8091, help="port to bind (0: any free port)")
    p.add_argument("--slots", type=int, default=4,
                   help="concurrent requests served to each validator; more are refused with 429")
    p.add_argument("--runtime.url", dest="runtime_url", default=None,
                   help="OpenAI-compatible runtime to relay to (vLLM, SGLang, llama-server), e.g. http://127.0.0.1:8001")
    p.add_argument("--runtime.model", dest="runtime_model", default=None,
                   help="model name to put in requests to the runtime (default: keep the caller's)")
    p.add_argument("--runtime.sampler", dest="runtime_sampler", choices=("subnet", "own"), default="own",
                   help="with --runtime.url: 'subnet' when the runtime is a vLLM started with the subnet's sampler "
                        "plugin (docs/pages/operators.md, 'Miners on vLLM'): sampled answers are then audited token by "
                        "token and paid; 'own' (default): the runtime's own RNG, whose sampled answers validators do "
                        "not pay")
    p.add_argument("--runtime.features", dest="runtime_features", default="", metavar="LIST",
                   help="what the runtime behind --runtime.url serves beyond plain chat, comma-separated, of: "
                        f"{', '.join(sorted(FEATURES))} (declared to validators, who route requests using them here)")
    p.add_argument("--serve.models", dest="serve_models", default="", metavar="LIST",
                   help="the models this miner serves, comma-separated (declared in its signed /health; default: "
                        "none named, which validators read as the subnet's model)")
    p.add_argument("--runtime.gguf", dest="runtime_gguf", default=None, metavar="PATH|packaged",
                   help="serve a GGUF model in process on llama.cpp (needs '.[real]'): 'packaged' is the subnet's "
                        "Gemma 3 270M; each slot gets its own context and --runtime.threads threads")
    p.add_argument("--runtime.contexts", dest="runtime_contexts", type=int, default=None,
                   help="--runtime.gguf: contexts to load, the streams it runs at once in all validators together "
                        "(default --slots; with V validators calling, V x --slots serves each its slots, fewer "
                        "answers some of them 429, which they book as refusals)")
    p.add_argument("--runtime.threads", dest="runtime_threads", type=int, default=1,
                   help="CPU threads per slot of --runtime.gguf")
    p.add_argument("--runtime.sim", dest="runtime_sim", default=None,
                   help="serve a simulated card: NAME or NAME:key=value,... (e.g. rtx5090-slow); the default "
                        "(rtx5090) only with --dev-key, for local testing: a simulated card earns nothing on a "
                        "real subnet, its answers fail every audit")
    p.add_argument("--runtime.seed", dest="runtime_seed", type=int, default=None, help="seed of the simulated card")
    p.add_argument("--allow", action="append", default=[], metavar="HOTKEY",
                   help="trust this validator hotkey (repeatable); without it, trust the metagraph's permit holders")
    p.add_argument("--trust.min-stake", dest="trust_min_stake", type=float, default=DEFAULT_MIN_VALIDATOR_STAKE,
                   help="a permit holder with this stake (or any validator trust) is a validator; the validator's "
                        "--validator.min-stake rule")
    p.add_argument("--trust.refresh", dest="trust_refresh", type=float, default=300.0,
                   help="seconds between metagraph refreshes of the trusted validators")
    p.add_argument("--max-body", dest="max_body", type=int, default=DEFAULT_MAX_BODY, help="request body cap (bytes)")
    p.add_argument("--log-level", dest="log_level", type=log_level, default="INFO")
    bound(p, {"netuid": (0, 65535), "axon.port": (0, 65535), "slots": (1, 1024), "runtime.contexts": (1, 1024),
              "runtime.threads": (1, 256), "runtime.seed": (0, 2**64 - 1), "trust.min-stake": (0, 1e15),
              "trust.refresh": (1, 86400), "max-body": (1024, 1 << 31)})
    return p


def parse_args(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Flags, then ``TENSORGATE_MINER_<FLAG>`` variables, then ``--config``'s TOML file (:mod:`neurons.settings`)."""
    p = build_parser()
    args = resolve(p, argv, env, prefix=MINER_PREFIX)
    if args.slots < 1:
        p.error("--slots must be >= 1")
    if args.runtime_contexts is not None and args.runtime_contexts < 1:
        p.error("--runtime.contexts must be >= 1")
    named = [flag for flag, v in (("--runtime.url", args.runtime_url), ("--runtime.gguf", args.runtime_gguf),
                                  ("--runtime.sim", args.runtime_sim)) if v is not None]
    if len(named) > 1:
        p.error(f"{' and '.join(named)} are {len(named)} runtimes: pass one")
    if not named:
        if not args.dev_key:
            p.error("no runtime: pass --runtime.url (vLLM, SGLang, llama-server), --runtime.gguf PATH|packaged, "
                    "or --runtime.sim NAME to serve a simulated card on purpose (local testing: --dev-key)")
        args.runtime_sim = "rtx5090"  # local testing with a development key: the simulated card by default
    if args.runtime_sim is not None:
        try:
            parse_profile(args.runtime_sim)
        except ValueError as e:
            p.error(str(e))
    args.runtime_features = frozenset(f.strip() for f in args.runtime_features.split(",") if f.strip())
    if not args.runtime_features <= FEATURES:
        p.error(f"--runtime.features: unknown {sorted(args.runtime_features - FEATURES)}; known: {sorted(FEATURES)}")
    args.serve_models = tuple(m.strip() for m in args.serve_models.split(",") if m.strip())
    return args


class _Exit(Exception):
    """Start-up failed with this exit status (its reason already logged in one line)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


async def _runtime(args: argparse.Namespace, stack: contextlib.AsyncExitStack) -> tuple[Runtime, int | None]:
    """The runtime the flags name (an engine's server, the packaged model on llama.cpp, or a simulated card), and
    the streams it runs at once in all (None: not a fixed number)."""
    if args.runtime_url:
        from .runtimes.proxy import ProxyRuntime

        session = await stack.enter_async_context(aiohttp.ClientSession())
        proxy = ProxyRuntime(args.runtime_url, session, model=args.runtime_model,
                             sampler=SUBNET_SAMPLER if args.runtime_sampler == "subnet" else None,
                             features=args.runtime_features)
        await proxy.start()
        if not proxy.health().ok:
            logger.warning("runtime {}: {} (serving anyway; /health says so)", args.runtime_url, proxy.health().detail)
        return proxy, None
    if args.runtime_gguf:
        from ..model.packaged import ModelUnavailable
        from .runtimes.llama import LlamaRuntime

        try:
            llama = LlamaRuntime(args.model_file, slots=args.runtime_contexts or args.slots,
                                 threads=args.runtime_threads, seed=args.runtime_seed)
            await llama.start()
        except ModelUnavailable as e:
            logger.error("{}", e)
            raise _Exit(2) from None
        stack.push_async_callback(llama.aclose)
        return llama, llama.capacity
    rng = random.Random(args.runtime_seed) if args.runtime_seed is not None else None
    return SimulatedRuntime(parse_profile(args.runtime_sim), rng=rng), None


async def _trust(args: argparse.Namespace, keypair: Any, stack: contextlib.AsyncExitStack) -> Trust:
    """Who may call: the hotkeys ``--allow`` names, else the permit holders of the subnet (read from the chain and
    refreshed)."""
    if args.allow:
        return AllowList(args.allow)
    from ..chain.subtensor import SubtensorChain

    try:
        chain = await SubtensorChain.connect(args.network, args.netuid, keypair)
    except Exception as e:
        logger.error("cannot reach netuid {} on {}: {} (or pass --allow HOTKEY for local mode)",
                     args.netuid, args.network, e)
        raise _Exit(1) from None
    stack.push_async_callback(chain.close)
    permit = PermitTrust(chain, refresh_s=args.trust_refresh, min_stake=args.trust_min_stake)
    await permit.refresh()
    refresher = asyncio.create_task(permit.run())
    stack.callback(refresher.cancel)
    return permit


async def _run(args: argparse.Namespace) -> int:
    from ..keys import MissingKeyError, dev_keypair, load_hotkey

    try:
        keypair = dev_keypair(args.dev_key) if args.dev_key else load_hotkey(
            args.wallet_name, args.wallet_hotkey, args.wallet_path)
    except MissingKeyError as e:
        logger.error("{}", e)
        return 2
    async with contextlib.AsyncExitStack() as stack:
        try:
            runtime, contexts = await _runtime(args, stack)
            trust = await _trust(args, keypair, stack)
        except _Exit as e:
            return e.status
        runner, port = await start_miner(keypair, runtime, slots=args.slots, trust=trust, host=args.axon_ip,
                                         contexts=contexts, models=args.serve_models,
                                         port=args.axon_port, max_body_bytes=args.max_body)
        stack.push_async_callback(runner.cleanup)
        logger.info("miner {} listening on {}:{} ({} slots, runtime {}, trust {})", keypair.ss58_address,
                    args.axon_ip, port, args.slots, runtime.name,
                    "allow-list" if args.allow else f"permit holders of netuid {args.netuid} on {args.network}")
        await until_stop_signal()
        logger.info("stopping")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    to_stderr(args.log_level)
    if args.runtime_gguf:  # found (and assembled, for the packaged model) before the event loop starts
        from pathlib import Path

        from ..model.packaged import ModelUnavailable, model_path

        try:
            args.model_file = model_path() if args.runtime_gguf == "packaged" else Path(args.runtime_gguf).expanduser()
        except ModelUnavailable as e:
            logger.error("{}", e)
            return 2
    try:
        return asyncio.run(_run(args))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
