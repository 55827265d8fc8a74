"""The validator's command line, in bittensor conventions (``--netuid``, ``--wallet.name``, ...).

Each setting is declared once, as a field of :class:`ValidatorConfig` (:mod:`neurons.config_fields`), and is
at once a flag, an environment variable and a key of a TOML file (:mod:`neurons.settings`: flags win, then the
environment, then ``--config``'s file). Parsing is kept apart from the process so tests can build a
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
from dataclasses import dataclass, fields
from pathlib import Path

from ..chain.base import DEFAULT_MIN_VALIDATOR_STAKE
from ..config_fields import add_flags, config_of, setting
from ..flag_types import LOG_LEVELS, log_level, percents, redis_url
from ..settings import VALIDATOR_PREFIX, add_config_flag, resolve

DEFAULT_MODEL = "tensorgate/sim-5090"


CHAIN, GATEWAY, SCORING, AUDITS, LOCAL = ("chain", "gateway", "scoring and weights", "verified inference (audits)",
                                         "embedded local subnet")
_S = setting


@dataclass
class ValidatorConfig:
    """Every setting of the validator, each declared once (:mod:`neurons.config_fields`): field, default, flag, type,
    bounds and help. Tests build one directly."""

    netuid: int = _S(1, flag="netuid", group=CHAIN, type=int, bounds=(0, 65535), flag_default=None,
                     help="subnet to validate (required off --local)")
    network: str = _S("finney", flag="network", group=CHAIN, help="finney | test | local | ws://host:port")
    wallet_name: str = _S("default", flag="wallet.name", group=CHAIN, help="coldkey wallet name")
    wallet_hotkey: str = _S("default", flag="wallet.hotkey", group=CHAIN, help="hotkey name")
    wallet_path: str = _S("~/.bittensor/wallets", flag="wallet.path", group=CHAIN, help="wallets directory")
    chain_fallbacks: list[str] = _S(flag="chain.fallback", group=CHAIN, kind="append", factory=list, metavar="URL",
                                    help="another endpoint of the same chain (ws:// or wss://), tried when "
                                         "--network's fails (repeatable; finney has the SDK's public pools "
                                         "without it)")
    chain_connect_retries: int = _S(4, flag="chain.connect-retries", group=CHAIN, type=int, bounds=(0, 100),
                                    help="when the chain cannot be reached at start: tries again this many times, "
                                         "2 s apart, doubling, before one clear line and exit 2")
    gateway_host: str = _S("127.0.0.1", flag="gateway.host", group=GATEWAY, help="bind address")
    gateway_port: int = _S(8000, flag="gateway.port", group=GATEWAY, type=int, bounds=(0, 65535), help="bind port")
    api_keys_file: str | None = _S(None, flag="gateway.keys-file", group=GATEWAY,
                                   help="file of client API keys, one per line (also read from "
                                        "$TENSORGATE_API_KEYS, comma-separated)")
    models: list[str] = _S(flag="gateway.model", group=GATEWAY, kind="append", factory=lambda: [DEFAULT_MODEL],
                           flag_default=None,
                           help=f"model name the gateway serves (repeatable; required off --local; the local "
                                f"subnet's default is {DEFAULT_MODEL})")
    max_retries: int = _S(2, flag="gateway.max-retries", group=GATEWAY, type=int, bounds=(0, 16),
                          help="other miners tried before the first byte when one refuses or fails")
    first_byte_budget_s: float = _S(30.0, flag="gateway.first-byte-budget", group=GATEWAY, type=float,
                                    bounds=(0.001, 3600),
                                    help="seconds a client waits at most for a first byte, across every miner tried")
    max_connections: int = _S(2048, flag="gateway.max-connections", group=GATEWAY, type=int, bounds=(1, 10**6),
                              help="client connections at once; more get 503 and are closed at once (file "
                                   "descriptors)")
    # How limited API keys' prompts are counted: "auto" (the in-process reference's GGUF tokenizer, else the
    # estimate), "estimate" (4 characters a token), or a GGUF file whose tokenizer counts them.
    gateway_tokenizer: str = _S("auto", flag="gateway.tokenizer", group=GATEWAY,
                                help="how API keys' token limits count a prompt: auto (the tokenizer of "
                                     "--audit.model when it runs in process, else the estimate) | estimate (4 "
                                     "characters a token, undercounts digits, emoji and CJK up to 4x) | path to a "
                                     "GGUF file of the subnet's model")
    queue_s: float = _S(10.0, flag="gateway.queue-seconds", group=GATEWAY, type=float, bounds=(0, 3600),
                        help="a request that finds every miner's declared slots busy waits this long at most for "
                             "one, in a queue fair across API keys, before a 429 with Retry-After (0: the 429 at "
                             "once)")
    offers_s: float = _S(60.0, flag="gateway.offers-seconds", group=GATEWAY, type=float, bounds=(0.1, 86400),
                         help="how often each miner's signed /health is read for the models and request features "
                              "it serves (gateway.offers; also once at start)")
    drain_s: float = _S(5.0, flag="gateway.drain-seconds", group=GATEWAY, type=float, bounds=(0, 3600),
                        help="on SIGTERM or Ctrl-C: stop accepting, give streams in progress this long to finish")
    # Scale-out (gateway.shared): N gateway processes on one port, state shared through Redis. One process, no Redis
    # by default.
    gateway_workers: int = _S(1, flag="gateway.workers", group=GATEWAY, type=int, bounds=(1, 256),
                              help="gateway processes serving --gateway.port together (SO_REUSEPORT); above 1 "
                                   "needs --redis.url, where they share in-flight counts, key limits and "
                                   "measurements")
    gateway_only: bool = _S(False, flag="gateway.only", group=GATEWAY, kind="switch",
                            help="run only a gateway (no chain, no scoring, no weights) routing by what the "
                                 "validator publishes in --redis.url: more gateways on this machine or others")
    redis_url: str | None = _S(None, flag="redis.url", group=GATEWAY, type=redis_url,
                               help="Redis shared by every gateway process of this validator (redis://host:6379/0)")
    redis_gateways: int | None = _S(None, flag="redis.gateways", group=GATEWAY, type=int, bounds=(1, 4096),
                                    help="gateway processes sharing --redis.url on all machines (default: "
                                         "--gateway.workers): while Redis is down each admits this share of every "
                                         "API key limit")
    redis_lease_s: float = _S(15.0, flag="redis.lease-seconds", group=GATEWAY, type=float, bounds=(1, 3600),
                              help="a gateway process renews its shared leases (miner slots, key streams) every "
                                   "third of this; one killed frees them within it")
    state_dir: Path = _S(Path("~/.tensorgate/validator").expanduser(), flag="state-dir", group=SCORING, type=Path,
                         help="where state lives")
    round_s: float = _S(300.0, flag="round.seconds", group=SCORING, type=float, bounds=(0.1, 7 * 86400),
                        help="scoring round length")
    settlement_rounds: int = _S(12, flag="settlement.rounds", group=SCORING, type=int, bounds=(1, 10**5),
                                help="trailing window of rounds that settle into weights")
    weights_interval_blocks: int = _S(100, flag="weights.interval", group=SCORING, type=int, bounds=(1, 10**7),
                                      help="blocks between weight submissions")
    weights_dry_run: bool = _S(False, flag="weights.dry-run", group=SCORING, kind="switch",
                               help="log the weights that would be set instead of submitting them")
    weights_version_key: int | None = _S(None, flag="weights.version-key", group=SCORING, type=int,
                                         bounds=(0, 2**64 - 1),
                                         help="version_key of weight submissions (default: the subnet's "
                                              "WeightsVersionKey, read from its hyperparameters before each "
                                              "submission)")
    probes_per_round: int = _S(2, flag="probes.per-round", group=SCORING, type=int, bounds=(0, 1000),
                               help="probe requests per miner per round")
    sync_interval_blocks: int = _S(10, flag="metagraph.sync-blocks", group=SCORING, type=int, bounds=(1, 10**6),
                                   help="blocks between metagraph syncs")
    min_validator_stake: float = _S(DEFAULT_MIN_VALIDATOR_STAKE, flag="validator.min-stake", group=SCORING,
                                    type=float, bounds=(0, 1e15),
                                    help="a permit holder with this much stake (or any validator trust) is a "
                                         "validator, not a miner")
    restore_max_age_s: float = _S(3600.0, flag="restore.max-age", group=SCORING, type=float, bounds=(0, 10**9),
                                  help="seconds within which saved credits make miners routable at once after a "
                                       "restart")
    capacity_check: bool = _S(True, flag="probes.capacity-check", group=SCORING, kind="onoff",
                              help="twice a round, fill every miner's declared slots at the same moment, so one "
                                   "card registered as several hotkeys shows it (costs the sum of all slots in "
                                   "streams)")
    probes_replay: bool = _S(True, flag="probes.replay", group=SCORING, kind="onoff",
                             help="most probes re-send a recent user request (held in memory only) to another "
                                  "miner, so probes cannot be told apart by their text; off: users' prompts never "
                                  "reach a second miner, and probes are generated (recognisable: "
                                  "docs/pages/design.md)")
    prompt_mix: str = _S("gpu", flag="probes.mix", group=SCORING, choices=("gpu", "cpu"),
                         help="request sizes of probes: gpu (up to 3.5k-token prompts, 512-token answers) or cpu")
    credit_profile: str = _S("rtx5090", flag="credit.profile", group=SCORING,
                             help="speed bar for full credit: rtx5090, cpu-gemma270m, or a JSON file written by "
                                  "'python scripts/calibrate.py'")
    audit_model: str = _S("none", flag="audit.model", group=AUDITS,
                          help="reference model that audits answers: none | packaged (Gemma 3 270M from '.[real]') "
                               "| path to a GGUF file of the subnet's model | toy (the simulated cards' model: the "
                               "local subnet's default)")
    audit_url: str | None = _S(None, flag="audit.url", group=AUDITS,
                               help="a reference service ('python -m neurons.reference', e.g. on a GPU box) instead "
                                    "of --audit.model in process; $TENSORGATE_AUDIT_KEY is its bearer key when set")
    audit_off: bool = _S(False, flag="audit.off", group=AUDITS, kind="switch",
                         help="run a real network without a reference: nothing is verified and every answer is "
                              "paid as measured (a random-word miner earns like an honest card); logged every "
                              "round and shown in /v1/status. Off --local, the validator refuses to start with "
                              "neither this nor --audit.model / --audit.url")
    audit_bands: Path | None = _S(None, flag="audit.bands", group=AUDITS, type=Path,
                                  help="bands measured for this reference against honest miners ('python -m "
                                       "neurons.reference.calibrate' writes the file; default: the bands measured "
                                       "CPU against CPU)")
    audit_rate: float = _S(0.1, flag="audit.rate", group=AUDITS, type=float, bounds=(0, 1),
                           help="share of organic answers audited (probes are always audited)")
    audit_queue: int = _S(256, flag="audit.queue", group=AUDITS, type=int, bounds=(1, 10**6),
                          help="answers waiting for the reference at most; beyond it sampled answers are paid "
                               "unaudited (counted)")
    audit_threads: int = _S(1, flag="audit.threads", group=AUDITS, type=int, bounds=(1, 256),
                            help="CPU threads of the reference")
    audit_context: int = _S(4096, flag="audit.context", group=AUDITS, type=int, bounds=(64, 1 << 20),
                            help="reference context in tokens (longer answers are not audited)")
    local: bool = _S(False, flag="local", group=LOCAL, kind="switch",
                     help="run a local chain stand-in, simulated 5090 miners and traffic (no chain, no GPU)")
    local_rounds: int | None = _S(None, flag="local.rounds", group=LOCAL, type=int, bounds=(0, 10**6),
                                  help="exit after this many rounds; unset: run until Ctrl-C")
    local_miners: int = _S(4, flag="local.miners", group=LOCAL, type=int, bounds=(0, 64),
                           help="number of simulated miners (the last one has a slower card)")
    local_round_s: float = _S(20.0, flag="local.round-seconds", group=LOCAL, type=float, bounds=(0.05, 86400),
                              help="compressed round length in local mode")
    local_block_time: float = _S(1.0, flag="local.block-time", group=LOCAL, type=float, bounds=(0.01, 3600),
                                 help="seconds per block of the local chain")
    local_traffic_rps: float = _S(1.5, flag="local.traffic-rps", group=LOCAL, type=float, bounds=(0, 10**4),
                                  help="organic requests per second sent through the gateway in local mode")
    local_validators: int = _S(1, flag="local.validators", group=LOCAL, type=int, bounds=(1, 8),
                               help="validators on the local subnet, each with its own hotkey, stake, state and "
                                    "gateway, all sharing the miners (the chain runs Yuma 3 over their weights)")
    local_stakes: list[float] = _S(flag="local.stakes", group=LOCAL, type=percents, factory=list,
                                   metavar="P,P,...", help="the validators' stakes in percent, first to last (default "
                                                           "unequal: 50,30,20 for three)")
    local_traffic_split: list[float] = _S(flag="local.traffic", group=LOCAL, type=percents, factory=list,
                                          metavar="P,P,...",
                                          help="each validator's percent of --local.traffic-rps (default: all to "
                                               "the one validator; with several, none to the first, the rest "
                                               "equal, like 0,50,50)")
    local_runtime: str = _S("sim", flag="local.runtime", group=LOCAL, choices=("sim", "real"),
                            help="sim: simulated RTX 5090s; real: one miner runs Gemma 3 270M on llama.cpp on this "
                                 "CPU (needs '.[real]'), audited by the validator's reference")
    local_miner_urls: list[str] = _S(flag="local.miner-url", group=LOCAL, kind="append", factory=list,
                                     help="register an external miner (host:port) on the local chain (repeatable); "
                                          "the banner prints the validator hotkey it must --allow")
    local_cheats: list[str] = _S(flag="local.cheat", group=LOCAL, kind="append", factory=list,
                                 choices=("random", "stop-early", "cached", "hot", "greedy", "truncated", "own-rng"),
                                 help="real mode: add a cheating miner of this kind (repeatable), to watch the "
                                      "audit catch it")
    seed: int | None = _S(None, flag="seed", type=int, bounds=(0, 2**64 - 1),
                          help="seed the router, probes and traffic (reproducible runs)")
    log_level: str = _S("INFO", flag="log-level", type=log_level, help=f"one of {', '.join(LOG_LEVELS)}")
    log_format: str = _S("text", flag="log.format", choices=("text", "json"),
                         help="text (dated lines) | json (one object a line: time, level, message, request_id)")
    log_access: bool = _S(False, flag="log.access", kind="switch",
                          help="an access log: one line per gateway request (method, path, status, time, request "
                               "id)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m neurons.validator",
        description="Tensorgate validator: OpenAI-compatible gateway, TTFT credit and on-chain weights.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_config_flag(p, VALIDATOR_PREFIX)
    add_flags(p, ValidatorConfig, groups=(CHAIN, GATEWAY, SCORING, AUDITS, LOCAL))
    return p


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
    cfg: ValidatorConfig = config_of(values, ValidatorConfig)
    if cfg.audit_url and cfg.audit_model != "none":
        build_parser().error("--audit.url and --audit.model are two references: pass one")
    if cfg.local and cfg.local_runtime == "sim" and (cfg.audit_model not in ("none", "toy") or cfg.audit_url):
        build_parser().error("a real model would fail every answer of a simulated card (they run the toy model, "
                             "which the local subnet audits by itself): use --local.runtime real")
    if cfg.audit_model == "toy" and not (cfg.local and cfg.local_runtime == "sim"):
        build_parser().error("--audit.model toy is the simulated cards' model: only for the simulated local subnet")
    if cfg.local_cheats and cfg.local_runtime != "real":
        build_parser().error("--local.cheat needs --local.runtime real (a simulated card has no model to cheat with)")
    for name, shares in (("--local.stakes", cfg.local_stakes), ("--local.traffic", cfg.local_traffic_split)):
        if shares and len(shares) != cfg.local_validators:
            build_parser().error(f"{name} gives {len(shares)} shares for {cfg.local_validators} validators "
                                 "(--local.validators): one each")
    if cfg.local_stakes and not sum(cfg.local_stakes):
        build_parser().error("--local.stakes: every stake is 0; a subnet's validators need stake")
    if cfg.local_validators > 1 and (cfg.gateway_workers > 1 or cfg.redis_url):
        build_parser().error("--local.validators above 1 runs each validator's gateway in this process: without "
                             "--gateway.workers and --redis.url")
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
