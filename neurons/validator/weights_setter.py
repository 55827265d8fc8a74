"""Setting weights on chain: when the interval and the chain's rate limit allow, never fatal.

One job, apart from the rounds that produce what is paid: the validator's weights loop calls
:meth:`WeightsSetter.maybe_set` every block with the rounds closed so far and its own UID; what to set comes from
``weigh`` (the scorer's payable values over the metagraph, quarantined miners at 0). A chain that keeps refusing is
tried less and less often (next block, then 2, 4, ... up to an interval), so a stale version key or a lost permit
never means a refusal every block.

Example::

    setter = WeightsSetter(chain, interval_blocks=100, dry_run=False, weigh=lambda: (scorer.weights(uids), why))
    await setter.maybe_set(rounds_closed=3, my_uid=0)
    setter.history[-1]                     # (block, {uid: weight})
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable

from loguru import logger

from ..chain.base import Chain

RECENT = 64  # weight submissions kept in memory (for the live table and tests); the state file keeps them all


class WeightsSetter:
    """The weights loop's state: the last block tried, refusals in a row, what was set."""

    def __init__(self, chain: Chain, *, hotkey: str, interval_blocks: int, dry_run: bool,
                 weigh: Callable[[], tuple[dict[int, float], str]],
                 record: Callable[[int, dict[int, float]], Awaitable[None]] | None = None) -> None:
        self.chain = chain
        self.hotkey = hotkey
        self.interval_blocks = interval_blocks
        self.dry_run = dry_run
        self.weigh = weigh  # the weights to set now, and why there are none when they are empty
        self.record = record  # persists a submission (the state file)
        self.history: deque[tuple[int, dict[int, float]]] = deque(maxlen=RECENT)  # (block, weights) set
        self.submitted = 0
        self.last_block: int | None = None  # the block weights were last set (or tried) at
        self.failures = 0  # refusals in a row
        self._retry_at = 0
        self._nothing_at_round: int | None = None  # rounds closed when the last try found no weights to set

    def _interval_holds(self, block: int, rounds_closed: int) -> bool:
        """Whether the weights interval since the last try still holds at ``block``.

        A try that found nothing to set holds it (one log line an interval) only until another round closes: the
        first round with work to pay is paid at once, not up to an interval later (a local subnet asked for a few
        rounds could stop before then, beside a CPU hog, with no weights at all).
        """
        last = self.last_block
        if last is None or block - last >= self.interval_blocks:
            return False
        return self._nothing_at_round is None or rounds_closed <= self._nothing_at_round

    async def maybe_set(self, rounds_closed: int, my_uid: int | None) -> None:
        """Set weights when the interval has passed and the chain's rate limit allows."""
        if not rounds_closed:
            return
        block = await self.chain.block()
        if self._interval_holds(block, rounds_closed) or block < self._retry_at:
            return
        if my_uid is None:
            logger.warning("hotkey {} is not registered on netuid {}; not setting weights", self.hotkey,
                           self.chain.netuid)
            self.last_block = block  # say so once an interval, not every block
            return
        params = await self.chain.params()
        if await self.chain.blocks_since_last_update(my_uid) < params.weights_rate_limit:
            return
        weights, why_none = self.weigh()
        if not weights:
            logger.info("not setting weights: {}", why_none)
            self.last_block = block
            self._nothing_at_round = rounds_closed
            return
        self._nothing_at_round = None
        if self.dry_run:
            logger.info("dry run: would set weights at block {}: {}", block, format_weights(weights))
            self.last_block = block
            return
        await self._submit(block, weights)

    async def _submit(self, block: int, weights: dict[int, float]) -> None:
        outcome = await self.chain.set_weights(weights)
        if outcome.ok:
            self.failures = 0
            self._retry_at = 0
            self.last_block = block
            self.history.append((block, weights))
            self.submitted += 1
            if self.record is not None:
                await self.record(block, weights)
            how = "committed (commit-reveal)" if outcome.commit_reveal else "set"
            logger.info("weights {} at block {}: {}", how, block, format_weights(weights))
            return
        # A transient failure is retried at the next block; one the chain keeps refusing (a stale version key, a
        # permit lost) backs off, doubling, to one attempt an interval.
        self.failures += 1
        wait = min(self.interval_blocks, 2 ** (self.failures - 1))
        self._retry_at = block + wait
        logger.warning("setting weights failed at block {} (attempt {}, next in {} blocks): {}", block,
                       self.failures, wait, outcome.message)


def format_weights(weights: dict[int, float]) -> str:
    return ", ".join(f"{uid}:{w:.3f}" for uid, w in sorted(weights.items()))
