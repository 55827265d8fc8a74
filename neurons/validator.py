"""The validator neuron: metagraph sync, gateway, probes, scoring rounds and periodic weights.

One asyncio process. Data flows one way: chain -> metagraph -> router -> upstream -> measurement ->
scoring -> weights. Each loop is a supervised task (``neurons.supervise``): an exception is logged
with context and the loop restarted, never silently lost.

Run against a real subnet::

    python -m neurons.validator --netuid 7 --network test --wallet.name vali --wallet.hotkey default

or the embedded local subnet (no chain, no GPU)::

    python -m neurons.validator --local
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from loguru import logger

from gateway.app import Gateway, GatewayConfig
from gateway.http.client import MinerPool
from gateway.protocol.signing import RequestSigner
from gateway.router import Candidate, Router
from gateway.upstream import Upstream
from scoring.credit import CreditConfig
from scoring.scorer import Scorer
from scoring.store import ScoreStore

from .chain.base import Chain, NeuronInfo
from .config import ValidatorConfig, parse_args
from .probes import ProbeRunner
from .prompts import PromptGenerator
from .supervise import every, supervise


def is_validator(n: NeuronInfo, min_stake: float) -> bool:
    """A permit holder that acts as a validator. On small subnets every neuron can hold a permit, so
    the permit alone does not make a validator: it also needs validator trust or real stake."""
    return n.validator_permit and (n.validator_trust > 0.0 or n.stake >= min_stake)


def candidates(neurons: list[NeuronInfo], self_hotkey: str, min_validator_stake: float) -> list[Candidate]:
    """Routable miners: neurons serving an endpoint, minus this validator, minus validators."""
    out = []
    for n in neurons:
        if not n.endpoint or n.hotkey == self_hotkey or is_validator(n, min_validator_stake):
            continue
        out.append(Candidate(uid=n.uid, hotkey=n.hotkey, endpoint=n.endpoint))
    return out


@dataclass
class RoundLog:
    """What one closed round produced, for the live table and the tests."""

    index: int
    table: str
    weights: dict[int, float] = field(default_factory=dict)


class Validator:
    """Wires the chain, router, gateway, probes and scorer together on one event loop."""

    def __init__(
        self,
        cfg: ValidatorConfig,
        chain: Chain,
        keypair: Any,
        *,
        api_keys: list[str] | None = None,
        rng: random.Random | None = None,
        credit: CreditConfig | None = None,
    ) -> None:
        self.cfg = cfg
        self.chain = chain
        self.keypair = keypair
        self.hotkey: str = keypair.ss58_address
        seed_rng = rng if rng is not None else random.Random(cfg.seed)
        self.router = Router(rng=random.Random(seed_rng.random()))
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        self.store = ScoreStore(cfg.state_dir / "validator.sqlite")
        self.scorer = Scorer(credit or CreditConfig(), self.store, window=cfg.settlement_rounds,
                             restore_max_age_s=cfg.restore_max_age_s)
        self._api_keys = api_keys
        self._prompts = PromptGenerator(random.Random(seed_rng.random()))
        self._probe_rng = random.Random(seed_rng.random())
        self.hotkey_to_uid: dict[str, int] = {}
        self.my_uid: int | None = None
        self.rounds: list[RoundLog] = []
        self.weights_set: list[tuple[int, dict[int, float]]] = []
        self.restarts: dict[str, int] = {}
        self._last_weights_block: int | None = None
        self._pool: MinerPool | None = None
        self.gateway: Gateway | None = None
        self.upstream: Upstream | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._probes: ProbeRunner | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Sync once, restore routing from saved credits, open the gateway, start the loops."""
        await self.sync_metagraph()  # also hands the router the credits restored from the state dir
        if self.scorer.restored:
            logger.info("routing restored at once for {} miners from {}", len(self.scorer.routing_scores()),
                        self.cfg.state_dir)
        self._last_weights_block = self.store.last_weights_block()
        self._pool = MinerPool()
        self.upstream = Upstream(self._pool, RequestSigner(self.keypair), self.scorer)
        self.upstream.on_slots = self.router.learn_slots  # capacity-aware least-in-flight (in_flight / slots)
        gw_cfg = GatewayConfig.from_sources(
            host=self.cfg.gateway_host,
            port=self.cfg.gateway_port,
            models=self.cfg.models,
            keys_file=self.cfg.api_keys_file,
            keys=self._api_keys,
            max_retries=self.cfg.max_retries,
        )
        self.gateway = Gateway(gw_cfg, self.router, self.upstream)
        await self.gateway.start()
        self._probes = probe = ProbeRunner(self.router, self.upstream.probe, self._prompts, self.cfg.models[0],
                                           self._probe_rng)
        params = await self.chain.params()
        block_s = max(0.05, params.block_time)
        self._tasks = [
            supervise("metagraph-sync", lambda: every(self.cfg.sync_interval_blocks * block_s, self.sync_metagraph,
                                                      first_delay_s=self.cfg.sync_interval_blocks * block_s),
                      restarts=self.restarts),
            supervise("rounds", lambda: self._rounds_forever(probe), restarts=self.restarts),
            supervise("weights", lambda: every(block_s, self.maybe_set_weights, first_delay_s=block_s),
                      restarts=self.restarts),
        ]
        logger.info("validator {} (uid {}) on netuid {} via {}; gateway on http://{}:{}", self.hotkey,
                    self.my_uid, self.chain.netuid, self.cfg.network, self.cfg.gateway_host, self.gateway.port)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._probes is not None:
            await self._probes.aclose()
        if self.gateway is not None:
            await self.gateway.stop()
        if self._pool is not None:
            await self._pool.close()
        self.store.close()

    # -- loops -----------------------------------------------------------------------------------

    async def sync_metagraph(self) -> None:
        neurons = await self.chain.metagraph()
        self.hotkey_to_uid = {n.hotkey: n.uid for n in neurons}
        self.my_uid = self.hotkey_to_uid.get(self.hotkey)
        cands = candidates(neurons, self.hotkey, self.cfg.min_validator_stake)
        self.router.sync(cands)
        # A UID whose hotkey changed starts from nothing: scores are keyed by hotkey.
        self.router.set_scores(self.scorer.routing_scores())
        logger.debug("metagraph: {} neurons, {} routable miners", len(neurons), len(cands))

    async def _rounds_forever(self, probe: ProbeRunner) -> None:
        while True:
            await probe.run_round(self.cfg.probes_per_round, self.cfg.round_s)
            self.close_round()

    def close_round(self) -> RoundLog:
        report = self.scorer.close_round(time.time())
        self.router.set_scores(self.scorer.routing_scores())
        weights = self.scorer.weights(self.hotkey_to_uid)
        table = report.format_table(weights=weights)
        entry = RoundLog(index=len(self.rounds) + 1, table=table, weights=weights)
        self.rounds.append(entry)
        logger.info("round {} closed\n{}", entry.index, table)
        return entry

    async def maybe_set_weights(self) -> None:
        """Set weights when the interval has passed and the chain's rate limit allows; never fatal."""
        if not self.rounds:
            return
        block = await self.chain.block()
        if self._last_weights_block is not None and block - self._last_weights_block < self.cfg.weights_interval_blocks:
            return
        if self.my_uid is None:
            logger.warning("hotkey {} is not registered on netuid {}; not setting weights",
                           self.hotkey, self.chain.netuid)
            self._last_weights_block = block  # say so once an interval, not every block
            return
        params = await self.chain.params()
        since = await self.chain.blocks_since_last_update(self.my_uid)
        if since < params.weights_rate_limit:
            return
        weights = self.scorer.weights(self.hotkey_to_uid)
        if not weights:
            logger.info("no miner has a settled score yet; not setting weights")
            self._last_weights_block = block
            return
        if self.cfg.weights_dry_run:
            logger.info("dry run: would set weights at block {}: {}", block, _fmt_weights(weights))
            self._last_weights_block = block
            return
        outcome = await self.chain.set_weights(weights)
        if outcome.ok:
            self._last_weights_block = block
            self.weights_set.append((block, weights))
            self.store.record_weights(block, weights)
            how = "committed (commit-reveal)" if outcome.commit_reveal else "set"
            logger.info("weights {} at block {}: {}", how, block, _fmt_weights(weights))
        else:
            logger.warning("setting weights failed at block {} (will retry): {}", block, outcome.message)

    async def run(self, rounds: int | None = None) -> None:
        try:
            await self.start()
            while rounds is None or len(self.rounds) < rounds:
                await asyncio.sleep(0.2)
                dead = [t for t in self._tasks if t.done()]
                if dead:
                    raise RuntimeError(f"supervised task ended: {[t.get_name() for t in dead]}")
        finally:
            await self.stop()


def _fmt_weights(weights: dict[int, float]) -> str:
    return ", ".join(f"{uid}:{w:.3f}" for uid, w in sorted(weights.items()))


def _configure_logging(level: str) -> None:
    logger.remove()
    logger.add(sys.stderr, level=level.upper(),
               format="<green>{time:HH:mm:ss}</green> <level>{level: <7}</level> {message}")


async def _run_network(cfg: ValidatorConfig) -> int:
    from .chain.subtensor import SubtensorChain
    from .keys import load_hotkey

    keypair = load_hotkey(cfg.wallet_name, cfg.wallet_hotkey, cfg.wallet_path)
    chain = await SubtensorChain.connect(cfg.network, cfg.netuid, wallet=keypair, state_dir=cfg.state_dir)
    try:
        uid = await chain.my_uid()  # NotRegistered: refuse to run rather than serve without weights
        logger.info("hotkey {} is uid {} on netuid {}", keypair.ss58_address, uid, cfg.netuid)
        v = Validator(cfg, chain, keypair)
        await v.run()
    finally:
        await chain.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; operator mistakes (no wallet, unregistered hotkey, unreachable network, a corrupt
    state file) end with one clear line and exit code 2, not a traceback."""
    from scoring.store import StateError

    from .chain.subtensor import ChainSeamError
    from .keys import MissingKeyError

    cfg = parse_args(argv)
    _configure_logging(cfg.log_level)
    try:
        if cfg.local:
            from .local_subnet import run_local_subnet

            return asyncio.run(run_local_subnet(cfg))
        return asyncio.run(_run_network(cfg))
    except KeyboardInterrupt:
        logger.info("stopped")
        return 0
    except (MissingKeyError, ChainSeamError, StateError) as e:
        logger.error("{}", e)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
