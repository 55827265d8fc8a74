"""The one wiring of a validator from its config, used by the CLI, the local subnet, tests, soak and benchmarks.

Before it, the validator, the local subnet, the test harness, the soak and the gateway benchmark each
assembled router, upstream and gateway their own way, so a hook wired in one (slot learning, the
measurement sink, timeouts) could be missing in another and the figures measured something else than
what operators run. Here the parts are built once, in one order, and callers swap only what they are
testing (the router in the soak's comparisons, the sink for time-scaled runs, the timeouts in fault
tests).

Nothing here does I/O beyond reading configuration files (API keys, a calibrated credit profile): the
gateway binds its socket, the store opens SQLite, the reference loads its model and the chain is first
read in :meth:`neurons.validator.neuron.Validator.start`.

Example::

    parts = build_parts(ValidatorConfig(gateway_port=0), keypair, api_keys=["sk-local"])
    await parts.gateway.start()                  # serving; measurements pile up in parts.measurements
    v = build_validator(cfg, chain, keypair)     # the whole neuron: parts + chain + loops
    await v.run()
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.app import Gateway, GatewayConfig
from gateway.http.client import MinerClient
from gateway.protocol.measurement import MeasurementQueue, MeasurementSink
from gateway.protocol.openai import ChatRequest
from gateway.protocol.signing import RequestSigner
from gateway.protocol.tokens import PromptCounter
from gateway.router import Router
from gateway.shared.leases import SharedLeases
from gateway.shared.limits import SharedLimits
from gateway.shared.link import RedisLink
from gateway.shared.measurements import MeasurementPublisher
from gateway.shared.state import SharedState
from gateway.upstream import Upstream, UpstreamLimits, UpstreamTimeouts
from scoring.audit import AuditBands, StrikeBook, StrikePolicy
from scoring.audit.sequential import SequentialTest
from scoring.credit import CreditConfig
from scoring.profiles import load_profile
from scoring.scorer import Scorer

from ..chain.base import Chain
from ..model.tokenizer import GgufTokenCounter
from ..reference.bands import load_bands
from ..reference.base import Reference
from ..reference.llama import LlamaReference
from ..reference.remote import RemoteReference
from ..reference.toy import ToyReference
from .auditor import Auditor
from .config import ValidatorConfig
from .neuron import Validator
from .probes import ProbeRunner
from .prompts import MIXES, PromptGenerator
from .replays import ReplaySample
from .shapes import ShapeSample


@dataclass
class ValidatorParts:
    """Everything between the chain and the weights, wired; ``measurements`` feeds ``scorer``."""

    config: ValidatorConfig
    keypair: Any
    router: Router
    client: MinerClient
    measurements: MeasurementQueue
    upstream: Upstream
    gateway: Gateway
    scorer: Scorer
    prompts: PromptGenerator
    probes: ProbeRunner
    auditor: Auditor | None = None  # None: no reference configured, answers are paid unaudited
    shared: SharedState | None = None  # --redis.url: several gateway processes share in-flight, limits, measurements
    api_keys: list[str] | None = None  # the keys given as a list (the local subnet's), for the worker processes

    async def aclose(self, *, keep_link: bool = False) -> None:
        """Stop serving and drop miner connections (the chain and the store are the validator's); ``keep_link``:
        leave the Redis link open (the validator closes it after saving the round in progress)."""
        await self.probes.aclose()
        await self.gateway.stop()
        await self.upstream.aclose()
        await self.client.close()
        if self.shared is not None:
            await self.shared.aclose(keep_link=keep_link)
        if self.auditor is not None:
            await self.auditor.reference.aclose()


def build_parts(
    cfg: ValidatorConfig,
    keypair: Any,
    *,
    api_keys: list[str] | None = None,
    rng: random.Random | None = None,
    credit: CreditConfig | None = None,
    router: Router | None = None,
    sink: MeasurementSink | None = None,
    timeouts: UpstreamTimeouts | None = None,
    reference: Reference | None = None,
    bands: AuditBands | None = None,
    **gateway_options: Any,
) -> ValidatorParts:
    """Wire router -> upstream -> gateway, the scorer, the probes and the auditor from ``cfg``.

    ``sink`` replaces the measurement queue as the upstream's sink (the soak wraps the scorer to
    rescale time); ``reference`` replaces the one ``cfg.audit_model`` names (tests); ``credit``
    replaces ``cfg.credit_profile``; ``gateway_options`` go to :meth:`GatewayConfig.from_sources`
    (``env``, ``keys``, ``max_body_bytes``, ``freeze_heap``, ...).
    """
    seed_rng = rng if rng is not None else random.Random(cfg.seed)
    router = router if router is not None else Router(rng=random.Random(seed_rng.random()))
    client = MinerClient()
    measurements = MeasurementQueue()
    link = RedisLink(cfg.redis_url, shared_namespace(cfg.netuid, keypair.ss58_address)) if cfg.redis_url else None
    publisher = MeasurementPublisher(link) if link is not None else None  # every process's measurements: one stream
    if reference is None and (cfg.audit_model != "none" or cfg.audit_url):
        reference = _reference(cfg)
    limits = UpstreamLimits(keep_answers=reference is not None,
                            audited_model=cfg.models[0] if reference is not None else None,  # the reference's
                            audit_tools=reference is not None and not isinstance(reference, ToyReference),
                            audit_grammars=reference is not None and reference.grammars)
    if sink is None:
        sink = publisher if publisher is not None else measurements
    upstream = Upstream(client, RequestSigner(keypair), sink, timeouts=timeouts, limits=limits)
    upstream.on_slots = router.learn_slots  # capacity-aware least-in-flight (in_flight / slots)
    leases = SharedLeases(link, router, ttl_s=cfg.redis_lease_s) if link is not None else None
    gateway = Gateway(_gateway_config(cfg, api_keys, audited=reference is not None, **gateway_options), router,
                      upstream, counter=_prompt_counter(cfg, reference), leases=leases)
    shared = None
    if link is not None and publisher is not None and leases is not None:
        shared = SharedState(link, leases, SharedLimits(
            link, gateway.quota, share=cfg.redis_gateways or cfg.gateway_workers, ttl_s=cfg.redis_lease_s), publisher)
        gateway.plug(key_limits=shared.limits, metrics=(shared.families,))
    credit = credit or load_profile(cfg.credit_profile)
    scorer = Scorer(credit, window=cfg.settlement_rounds,
                    restore_max_age_s=cfg.restore_max_age_s, audits=reference is not None,
                    capacity_checks=cfg.capacity_check)
    prompts = _prompts(cfg, seed_rng, gateway)
    probes = ProbeRunner(router, upstream.probe, prompts, tuple(cfg.models), random.Random(seed_rng.random()),
                         capacity_check=cfg.capacity_check, hold=shared.leases.hold if shared is not None else None,
                         credit=credit)
    auditor = _auditor(cfg, reference, bands) if reference is not None else None
    return ValidatorParts(cfg, keypair, router, client, measurements, upstream, gateway, scorer, prompts, probes,
                          auditor, shared, api_keys)


def _prompts(cfg: ValidatorConfig, seed_rng: random.Random, gateway: Gateway) -> PromptGenerator:
    """The probes' prompts, which copy organic requests' shapes and replay some of them: the gateway shows them each
    admitted request."""
    shapes = ShapeSample(rng=random.Random(seed_rng.random()))
    replays = ReplaySample(rng=random.Random(seed_rng.random())) if cfg.probes_replay else None

    def observe(req: ChatRequest) -> None:
        shapes.observe(req)
        if replays is not None:
            replays.observe(req)

    gateway.plug(on_request=observe)
    return PromptGenerator(random.Random(seed_rng.random()), MIXES[cfg.prompt_mix], shapes=shapes, replays=replays)


def _gateway_config(cfg: ValidatorConfig, api_keys: list[str] | None, *, audited: bool,
                    **options: Any) -> GatewayConfig:
    """The gateway's settings from the validator's (``options`` first: a test's or a tool's own)."""
    options.setdefault("keys_file", cfg.api_keys_file)
    options.setdefault("shutdown_timeout", cfg.drain_s)
    options.setdefault("max_connections", cfg.max_connections)
    options.setdefault("first_byte_budget_s", cfg.first_byte_budget_s)
    options.setdefault("audits", audited)
    options.setdefault("access_log", cfg.log_access)
    options.setdefault("queue_s", cfg.queue_s)
    options.setdefault("reuse_port", cfg.gateway_workers > 1 or cfg.gateway_only)
    return GatewayConfig.from_sources(host=cfg.gateway_host, port=cfg.gateway_port, models=cfg.models, keys=api_keys,
                                      max_retries=cfg.max_retries, **options)


def _auditor(cfg: ValidatorConfig, reference: Reference, bands: AuditBands | None) -> Auditor:
    """The audits over ``reference``: the bands measured for it when a file names them (else the defaults), the
    sequential test, the strike book. Sampled with the system RNG: a seeded run must not make audits predictable."""
    test = SequentialTest()
    if cfg.audit_bands is not None:
        measured, test = load_bands(cfg.audit_bands)
        bands = bands or measured
    return Auditor(reference, bands or AuditBands(), StrikeBook(StrikePolicy(sequential=test)), rate=cfg.audit_rate,
                   max_queue=cfg.audit_queue)


def shared_namespace(netuid: int, hotkey: str) -> str:
    """Where one validator's shared state lives in Redis (validators may share a server, never their keys)."""
    return f"tensorgate:{netuid}:{hotkey}"


def _reference(cfg: ValidatorConfig) -> Reference:
    """The reference ``cfg.audit_model`` names: the packaged model, or a GGUF file of the subnet's model
    (found and loaded in ``start``: building does no I/O)."""
    if cfg.audit_url:
        return RemoteReference(cfg.audit_url)
    if cfg.audit_model == "toy":
        return ToyReference()
    path = None if cfg.audit_model == "packaged" else Path(cfg.audit_model).expanduser()
    return LlamaReference(path, n_ctx=cfg.audit_context, threads=cfg.audit_threads)


def _prompt_counter(cfg: ValidatorConfig, reference: Reference | None) -> PromptCounter | None:
    """What counts a limited API key's prompt tokens (loaded in ``start``): the subnet model's tokenizer."""
    choice = cfg.gateway_tokenizer
    if choice == "estimate":
        return None
    if choice != "auto":
        return GgufTokenCounter(Path(choice).expanduser())
    if isinstance(reference, LlamaReference):
        return GgufTokenCounter(reference.path)
    return None


def build_validator(cfg: ValidatorConfig, chain: Chain, keypair: Any, **kwargs: Any) -> Validator:
    """The whole neuron: :func:`build_parts` plus the chain; ``kwargs`` as for :func:`build_parts`."""
    return Validator(cfg, chain, build_parts(cfg, keypair, **kwargs))
