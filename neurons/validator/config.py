"""The validator's command line, in bittensor conventions (``--netuid``, ``--wallet.name``, ...).

Every flag is also an environment variable and a key of a TOML file (:mod:`neurons.settings`: flags win, then
the environment, then ``--config``'s file). Parsing is kept apart from the process so tests can build a
:class:`ValidatorConfig` directly.

Example::

    cfg = parse_args(["--netuid", "7", "--network", "test", "--wallet.name", "vali"])
    cfg.gateway_port   # 8000
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..chain.base import DEFAULT_MIN_VALIDATOR_STAKE
from ..flag_types import LOG_LEVELS, bound, log_level, redis_url
from ..settings import VALIDATOR_PREFIX, add_config_flag, resolve

DEFAULT_MODEL = "tensorgate/sim-5090"


@dataclass
class ValidatorConfig:
    netuid: int = 1
    network: str = "finney"
    wallet_name: str = "default"
    wallet_hotkey: str = "default"
    wallet_path: str = "~/.bittensor/wallets"
    chain_fallbacks: list[str] = field(default_factory=list)  # endpoints tried when --network's fails
    chain_connect_retries: int = 4  # a first connection that fails: tried again after 2, 4, 8, 16 s
    gateway_host: str = "127.0.0.1"
    gateway_port: int = 8000
    api_keys_file: str | None = None
    models: list[str] = field(default_factory=lambda: [DEFAULT_MODEL])
    state_dir: Path = Path("~/.tensorgate/validator").expanduser()
    round_s: float = 300.0
    settlement_rounds: int = 12
    weights_interval_blocks: int = 100
    weights_dry_run: bool = False
    weights_version_key: int | None = None  # None: the subnet's WeightsVersionKey, read from the chain
    probes_per_round: int = 2
    capacity_check: bool = True  # twice a round, fill every miner's slots at once (scoring.capacity)
    probes_replay: bool = True  # most probes re-send a recent organic request (neurons.validator.replays)
    sync_interval_blocks: int = 10
    min_validator_stake: float = DEFAULT_MIN_VALIDATOR_STAKE
    restore_max_age_s: float = 3600.0
    max_retries: int = 2
    first_byte_budget_s: float = 30.0  # a client's whole wait for a first byte, retries included
    drain_s: float = 5.0  # on a stop (SIGTERM, Ctrl-C): how long streams in progress may take to finish
    queue_s: float = 10.0  # a request that finds every miner's slots busy waits this long at most (gateway.admission)
    offers_s: float = 60.0  # how often every miner's signed /health is read for the models and features it serves
    max_connections: int = 2048  # client connections at once (each is a file descriptor)
    # Scale-out (gateway.shared): N gateway processes on one port, state shared through Redis. One process, no Redis
    # by default.
    gateway_workers: int = 1
    gateway_only: bool = False  # serve only (no chain, scoring nor weights): one more gateway against --redis.url
    redis_url: str | None = None
    redis_gateways: int | None = None  # gateway processes sharing the Redis, all machines (None: gateway_workers)
    redis_lease_s: float = 15.0  # a killed gateway process's in-flight leases and key streams free themselves in this
    # How limited API keys' prompts are counted: "auto" (the in-process reference's GGUF tokenizer, else the
    # estimate), "estimate" (4 characters a token), or a GGUF file whose tokenizer counts them.
    gateway_tokenizer: str = "auto"
    prompt_mix: str = "gpu"  # sizes of probe (and local traffic) requests: "gpu" or "cpu" (neurons.validator.prompts)
    credit_profile: str = "rtx5090"  # the card whose speed earns full credit (a name, or a calibrated JSON file)
    # Verified inference: the reference that audits answers ("none", "packaged", or a GGUF file path).
    audit_model: str = "none"
    audit_url: str | None = None  # a reference service (python -m neurons.reference) instead of a model in process
    audit_off: bool = False  # run without a reference on a real network, on purpose: logged every round
    audit_rate: float = 0.1
    audit_queue: int = 256
    audit_threads: int = 1
    audit_context: int = 4096
    audit_bands: Path | None = None  # a bands file from python -m neurons.reference.calibrate (None: the defaults)
    log_level: str = "INFO"
    log_format: str = "text"  # "json": one object a line (time, level, message, request_id), for log shippers
    log_access: bool = False  # one line per gateway request (method, path, status, time, request id)
    seed: int | None = None
    # Embedded local subnet (the README's main job).
    local: bool = False
    local_rounds: int | None = None
    local_miners: int = 4
    local_round_s: float = 20.0
    local_block_time: float = 1.0
    local_traffic_rps: float = 1.5
    local_runtime: str = "sim"  # "sim": simulated 5090s; "real": Gemma 3 270M on llama.cpp (CPU), audited
    local_miner_urls: list[str] = field(default_factory=list)  # external miners (host:port) to add to the chain
    local_cheats: list[str] = field(default_factory=list)  # real mode: cheating miners to add (demonstrates audits)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m neurons.validator",
        description="Tensorgate validator: OpenAI-compatible gateway, TTFT credit and on-chain weights.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = ValidatorConfig()
    add_config_flag(p, VALIDATOR_PREFIX)
    chain = p.add_argument_group("chain")
    chain.add_argument("--netuid", type=int, default=None, help="subnet to validate (required off --local)")
    chain.add_argument("--network", default=d.network, help="finney | test | local | ws://host:port")
    chain.add_argument("--wallet.name", dest="wallet_name", default=d.wallet_name, help="coldkey wallet name")
    chain.add_argument("--wallet.hotkey", dest="wallet_hotkey", default=d.wallet_hotkey, help="hotkey name")
    chain.add_argument("--wallet.path", dest="wallet_path", default=d.wallet_path, help="wallets directory")
    chain.add_argument("--chain.fallback", dest="chain_fallbacks", action="append", default=[], metavar="URL",
                       help="another endpoint of the same chain (ws:// or wss://), tried when --network's fails "
                            "(repeatable; finney has the SDK's public pools without it)")
    chain.add_argument("--chain.connect-retries", dest="chain_connect_retries", type=int,
                       default=d.chain_connect_retries,
                       help="when the chain cannot be reached at start: tries again this many times, 2 s apart, "
                            "doubling, before one clear line and exit 2")
    gw = p.add_argument_group("gateway")
    gw.add_argument("--gateway.host", dest="gateway_host", default=d.gateway_host, help="bind address")
    gw.add_argument("--gateway.port", dest="gateway_port", type=int, default=d.gateway_port, help="bind port")
    gw.add_argument(
        "--gateway.keys-file",
        dest="api_keys_file",
        default=d.api_keys_file,
        help="file of client API keys, one per line (also read from $TENSORGATE_API_KEYS, comma-separated)",
    )
    gw.add_argument(
        "--gateway.model",
        dest="models",
        action="append",
        default=None,
        help=f"model name the gateway serves (repeatable; required off --local; the local subnet's default is "
             f"{DEFAULT_MODEL})",
    )
    gw.add_argument("--gateway.max-retries", dest="max_retries", type=int, default=d.max_retries,
                    help="other miners tried before the first byte when one refuses or fails")
    gw.add_argument("--gateway.first-byte-budget", dest="first_byte_budget_s", type=float,
                    default=d.first_byte_budget_s,
                    help="seconds a client waits at most for a first byte, across every miner tried")
    gw.add_argument("--gateway.max-connections", dest="max_connections", type=int, default=d.max_connections,
                    help="client connections at once; more get 503 and are closed at once (file descriptors)")
    gw.add_argument("--gateway.tokenizer", dest="gateway_tokenizer", default=d.gateway_tokenizer,
                    help="how API keys' token limits count a prompt: auto (the tokenizer of --audit.model when it "
                         "runs in process, else the estimate) | estimate (4 characters a token, undercounts "
                         "digits, emoji and CJK up to 4x) | path to a GGUF file of the subnet's model")
    gw.add_argument("--gateway.queue-seconds", dest="queue_s", type=float, default=d.queue_s,
                    help="a request that finds every miner's declared slots busy waits this long at most for one, "
                         "in a queue fair across API keys, before a 429 with Retry-After (0: the 429 at once)")
    gw.add_argument("--gateway.offers-seconds", dest="offers_s", type=float, default=d.offers_s,
                    help="how often each miner's signed /health is read for the models and request features it "
                         "serves (gateway.offers; also once at start)")
    gw.add_argument("--gateway.drain-seconds", dest="drain_s", type=float, default=d.drain_s,
                    help="on SIGTERM or Ctrl-C: stop accepting, give streams in progress this long to finish")
    gw.add_argument("--gateway.workers", dest="gateway_workers", type=int, default=d.gateway_workers,
                    help="gateway processes serving --gateway.port together (SO_REUSEPORT); above 1 needs "
                         "--redis.url, where they share in-flight counts, key limits and measurements")
    gw.add_argument("--gateway.only", dest="gateway_only", action="store_true",
                    help="run only a gateway (no chain, no scoring, no weights) routing by what the validator "
                         "publishes in --redis.url: more gateways on this machine or others")
    gw.add_argument("--redis.url", dest="redis_url", type=redis_url, default=d.redis_url,
                    help="Redis shared by every gateway process of this validator (redis://host:6379/0)")
    gw.add_argument("--redis.gateways", dest="redis_gateways", type=int, default=d.redis_gateways,
                    help="gateway processes sharing --redis.url on all machines (default: --gateway.workers): "
                         "while Redis is down each admits this share of every API key limit")
    gw.add_argument("--redis.lease-seconds", dest="redis_lease_s", type=float, default=d.redis_lease_s,
                    help="a gateway process renews its shared leases (miner slots, key streams) every third of "
                         "this; one killed frees them within it")
    sc = p.add_argument_group("scoring and weights")
    sc.add_argument("--state-dir", dest="state_dir", type=Path, default=d.state_dir, help="where state lives")
    sc.add_argument("--round.seconds", dest="round_s", type=float, default=d.round_s, help="scoring round length")
    sc.add_argument("--settlement.rounds", dest="settlement_rounds", type=int, default=d.settlement_rounds,
                    help="trailing window of rounds that settle into weights")
    sc.add_argument("--weights.interval", dest="weights_interval_blocks", type=int,
                    default=d.weights_interval_blocks, help="blocks between weight submissions")
    sc.add_argument("--weights.dry-run", dest="weights_dry_run", action="store_true",
                    help="log the weights that would be set instead of submitting them")
    sc.add_argument("--weights.version-key", dest="weights_version_key", type=int, default=None,
                    help="version_key of weight submissions (default: the subnet's WeightsVersionKey, read from "
                         "its hyperparameters before each submission)")
    sc.add_argument("--probes.per-round", dest="probes_per_round", type=int, default=d.probes_per_round,
                    help="probe requests per miner per round")
    sc.add_argument("--metagraph.sync-blocks", dest="sync_interval_blocks", type=int,
                    default=d.sync_interval_blocks, help="blocks between metagraph syncs")
    sc.add_argument("--validator.min-stake", dest="min_validator_stake", type=float,
                    default=d.min_validator_stake,
                    help="a permit holder with this much stake (or any validator trust) is a validator, not a miner")
    sc.add_argument("--restore.max-age", dest="restore_max_age_s", type=float, default=d.restore_max_age_s,
                    help="seconds within which saved credits make miners routable at once after a restart")
    sc.add_argument("--probes.capacity-check", dest="capacity_check", choices=("on", "off"),
                    default="on" if d.capacity_check else "off",
                    help="twice a round, fill every miner's declared slots at the same moment, so one card "
                         "registered as several hotkeys shows it (costs the sum of all slots in streams)")
    sc.add_argument("--probes.replay", dest="probes_replay", choices=("on", "off"),
                    default="on" if d.probes_replay else "off",
                    help="most probes re-send a recent user request (held in memory only) to another miner, so "
                         "probes cannot be told apart by their text; off: users' prompts never reach a second "
                         "miner, and probes are generated (recognisable: docs/pages/design.md)")
    sc.add_argument("--probes.mix", dest="prompt_mix", choices=("gpu", "cpu"), default=d.prompt_mix,
                    help="request sizes of probes: gpu (up to 3.5k-token prompts, 512-token answers) or cpu")
    sc.add_argument("--credit.profile", dest="credit_profile", default=d.credit_profile,
                    help="speed bar for full credit: rtx5090, cpu-gemma270m, or a JSON file written by "
                         "'python scripts/calibrate.py'")
    au = p.add_argument_group("verified inference (audits)")
    au.add_argument("--audit.model", dest="audit_model", default=d.audit_model,
                    help="reference model that audits answers: none | packaged (Gemma 3 270M from '.[real]') | "
                         "path to a GGUF file of the subnet's model | toy (the simulated cards' model: the local "
                         "subnet's default)")
    au.add_argument("--audit.url", dest="audit_url", default=None,
                    help="a reference service ('python -m neurons.reference', e.g. on a GPU box) instead of "
                         "--audit.model in process; $TENSORGATE_AUDIT_KEY is its bearer key when set")
    au.add_argument("--audit.off", dest="audit_off", action="store_true",
                    help="run a real network without a reference: nothing is verified and every answer is paid as "
                         "measured (a random-word miner earns like an honest card); logged every round and shown "
                         "in /v1/status. Off --local, the validator refuses to start with neither this nor "
                         "--audit.model / --audit.url")
    au.add_argument("--audit.bands", dest="audit_bands", type=Path, default=None,
                    help="bands measured for this reference against honest miners ('python -m "
                         "neurons.reference.calibrate' writes the file; default: the bands measured CPU against CPU)")
    au.add_argument("--audit.rate", dest="audit_rate", type=float, default=d.audit_rate,
                    help="share of organic answers audited (probes are always audited)")
    au.add_argument("--audit.queue", dest="audit_queue", type=int, default=d.audit_queue,
                    help="answers waiting for the reference at most; beyond it sampled answers are paid unaudited "
                         "(counted)")
    au.add_argument("--audit.threads", dest="audit_threads", type=int, default=d.audit_threads,
                    help="CPU threads of the reference")
    au.add_argument("--audit.context", dest="audit_context", type=int, default=d.audit_context,
                    help="reference context in tokens (longer answers are not audited)")
    lo = p.add_argument_group("embedded local subnet")
    lo.add_argument("--local", action="store_true",
                    help="run a local chain stand-in, simulated 5090 miners and traffic (no chain, no GPU)")
    lo.add_argument("--local.rounds", dest="local_rounds", type=int, default=None,
                    help="exit after this many rounds; unset: run until Ctrl-C")
    lo.add_argument("--local.miners", dest="local_miners", type=int, default=d.local_miners,
                    help="number of simulated miners (the last one has a slower card)")
    lo.add_argument("--local.round-seconds", dest="local_round_s", type=float, default=d.local_round_s,
                    help="compressed round length in local mode")
    lo.add_argument("--local.block-time", dest="local_block_time", type=float, default=d.local_block_time,
                    help="seconds per block of the local chain")
    lo.add_argument("--local.traffic-rps", dest="local_traffic_rps", type=float, default=d.local_traffic_rps,
                    help="organic requests per second sent through the gateway in local mode")
    lo.add_argument("--local.runtime", dest="local_runtime", choices=("sim", "real"), default=d.local_runtime,
                    help="sim: simulated RTX 5090s; real: one miner runs Gemma 3 270M on llama.cpp on this CPU "
                         "(needs '.[real]'), audited by the validator's reference")
    lo.add_argument("--local.miner-url", dest="local_miner_urls", action="append", default=[],
                    help="register an external miner (host:port) on the local chain (repeatable); the banner "
                         "prints the validator hotkey it must --allow")
    lo.add_argument("--local.cheat", dest="local_cheats", action="append", default=[],
                    choices=("random", "stop-early", "cached", "hot", "greedy", "truncated", "own-rng"),
                    help="real mode: add a cheating miner of this kind (repeatable), to watch the audit catch it")
    p.add_argument("--seed", type=int, default=None, help="seed the router, probes and traffic (reproducible runs)")
    p.add_argument("--log-level", dest="log_level", type=log_level, default=d.log_level,
                   help=f"one of {', '.join(LOG_LEVELS)}")
    p.add_argument("--log.format", dest="log_format", choices=("text", "json"), default=d.log_format,
                   help="text (dated lines) | json (one object a line: time, level, message, request_id)")
    p.add_argument("--log.access", dest="log_access", action="store_true",
                   help="an access log: one line per gateway request (method, path, status, time, request id)")
    bound(p, _RANGES)
    return p


# What each number flag accepts (neurons.flag_types.bound): beyond these a value is refused at parse time.
_RANGES: dict[str, tuple[float, float]] = {
    "netuid": (0, 65535), "chain.connect-retries": (0, 100), "gateway.port": (0, 65535),
    "gateway.max-retries": (0, 16), "gateway.first-byte-budget": (0.001, 3600), "gateway.max-connections": (1, 10**6),
    "gateway.queue-seconds": (0, 3600), "gateway.offers-seconds": (0.1, 86400), "gateway.drain-seconds": (0, 3600),
    "gateway.workers": (1, 256), "redis.gateways": (1, 4096), "redis.lease-seconds": (1, 3600),
    "round.seconds": (0.1, 7 * 86400), "settlement.rounds": (1, 10**5), "weights.interval": (1, 10**7),
    "weights.version-key": (0, 2**64 - 1), "probes.per-round": (0, 1000), "metagraph.sync-blocks": (1, 10**6),
    "validator.min-stake": (0, 1e15), "restore.max-age": (0, 10**9), "audit.rate": (0, 1), "audit.queue": (1, 10**6),
    "audit.threads": (1, 256), "audit.context": (64, 1 << 20), "local.rounds": (0, 10**6), "local.miners": (0, 64),
    "local.round-seconds": (0.05, 86400), "local.block-time": (0.01, 3600), "local.traffic-rps": (0, 10**4),
    "seed": (0, 2**64 - 1),
}


def parse_args(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> ValidatorConfig:
    parser = build_parser()
    ns = resolve(parser, argv, env, prefix=VALIDATOR_PREFIX)
    values = vars(ns)
    values.pop("config", None)
    local = bool(values["local"])
    if not local:  # weights are real here: nothing may default to the local subnet's stand-ins
        if values["netuid"] is None:
            parser.error("--netuid is required: the subnet this validator sets weights on")
        if not values.get("models"):
            parser.error("--gateway.model is required: the name of the model the subnet serves "
                         f"({DEFAULT_MODEL} is the local subnet's simulated card)")
        if DEFAULT_MODEL in values["models"]:
            parser.error(f"{DEFAULT_MODEL} is the local subnet's simulated card, not a model miners serve")
        if values["audit_model"] == "none" and not values["audit_url"] and not values["audit_off"]:
            parser.error("no reference to verify answers: pass --audit.model (packaged or a GGUF of the subnet's "
                         "model) or --audit.url (a reference service), or --audit.off to pay unverified answers "
                         "on purpose")
    if values["audit_off"] and (values["audit_model"] != "none" or values["audit_url"]):
        parser.error("--audit.off and a reference (--audit.model / --audit.url) contradict each other: pass one")
    if values["gateway_workers"] < 1:
        parser.error("--gateway.workers must be at least 1")
    if (values["gateway_workers"] > 1 or values["gateway_only"]) and not values["redis_url"]:
        parser.error("--gateway.workers above 1 and --gateway.only need --redis.url: the processes share each "
                     "miner's in-flight count, the API key limits and the measurements there")
    if values["netuid"] is None:
        values["netuid"] = ValidatorConfig.netuid
    if not values.get("models"):
        values["models"] = [DEFAULT_MODEL]
    values["state_dir"] = Path(os.path.expanduser(str(values["state_dir"])))
    values["capacity_check"] = values["capacity_check"] == "on"
    values["probes_replay"] = values["probes_replay"] == "on"
    cfg = ValidatorConfig(**values)
    if cfg.audit_url and cfg.audit_model != "none":
        build_parser().error("--audit.url and --audit.model are two references: pass one")
    if cfg.local and cfg.local_runtime == "sim" and (cfg.audit_model not in ("none", "toy") or cfg.audit_url):
        build_parser().error("a real model would fail every answer of a simulated card (they run the toy model, "
                             "which the local subnet audits by itself): use --local.runtime real")
    if cfg.audit_model == "toy" and not (cfg.local and cfg.local_runtime == "sim"):
        build_parser().error("--audit.model toy is the simulated cards' model: only for the simulated local subnet")
    if cfg.local_cheats and cfg.local_runtime != "real":
        build_parser().error("--local.cheat needs --local.runtime real (a simulated card has no model to cheat with)")
    if cfg.local and cfg.state_dir == ValidatorConfig().state_dir:
        cfg.state_dir = Path("~/.tensorgate/local").expanduser()
    return cfg


def config_to_json(cfg: ValidatorConfig) -> str:
    """``cfg`` as JSON, for the gateway worker processes the validator starts (:func:`config_from_json`)."""
    return json.dumps({f.name: str(v) if isinstance(v := getattr(cfg, f.name), Path) else v for f in fields(cfg)})


def config_from_json(raw: str) -> ValidatorConfig:
    """The config :func:`config_to_json` wrote."""
    values = json.loads(raw)
    for name in ("state_dir", "audit_bands"):
        if values.get(name) is not None:
            values[name] = Path(values[name])
    known = {f.name for f in fields(ValidatorConfig)}
    return ValidatorConfig(**{k: v for k, v in values.items() if k in known})
