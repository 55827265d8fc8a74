"""Each miner's requests in flight across every gateway process, as leases in Redis that expire.

A lease is a member of the miner's sorted set (``lease:<hotkey>``) scored by when it expires on Redis's own clock;
one more set (``deliver:<hotkey>``) holds those whose stream has sent content. Taking one is an atomic script:
expired members go, and unless the miner's declared slots are all held (subnet-wide) this request's member goes in,
so no miner is ever sent more streams than it declared, however many processes route to it. The count the script
returns, the miner's requests in flight before this one, is the dispatch-time load a 429 is judged by, so an honest
card filled by two processes is not called a liar by either.

The process renews its live leases every third of their ``ttl_s`` and mirrors each release and first content in
one pipelined batch (never awaited by a request); a process killed with ``kill -9`` stops renewing, and its leases
free themselves within ``ttl_s``. Every ``refresh_s`` it reads every miner's counts and tells the router what the
other processes hold (:meth:`gateway.router.Router.set_elsewhere`): weighted-random least-in-flight then compares
subnet-wide loads, and the decode concurrency a rate is judged at counts every process's delivering streams.

Redis down: :meth:`SharedLeases.hold` says yes on local counts alone (the router's own view, as with one process),
and the leases it hands out then are this process's only.

Example::

    leases = SharedLeases(link, router, name="w1")
    lease = router.acquire()
    if not await leases.hold(lease):      # full subnet-wide: the router now knows
        router.release(lease)
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections import Counter

from loguru import logger

from ..router import Lease, Router
from .link import NOW_MS, RENEW, RedisError, RedisLink, interrupted, woken

# KEYS: the miner's lease set; ARGV: member, slots, ttl ms.
# Returns the miner's leases before this one, or -1 - that count when its slots are all held.
_TAKE = NOW_MS + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local n = redis.call('ZCARD', KEYS[1])
if n >= tonumber(ARGV[2]) then return -1 - n end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[3]))
return n
"""

# KEYS: sets; returns each one's live members, expired ones removed.
_COUNT = NOW_MS + """
local out = {}
for i, k in ipairs(KEYS) do
  redis.call('ZREMRANGEBYSCORE', k, '-inf', now)
  out[i] = redis.call('ZCARD', k)
end
return out
"""


class SharedLeases:
    """This process's side of the shared leases; wire it with ``router`` (it sets ``on_release``/``on_deliver``)."""

    def __init__(self, link: RedisLink, router: Router, *, name: str | None = None, ttl_s: float = 15.0,
                 refresh_s: float = 0.25) -> None:
        self.link = link
        self.router = router
        self.name = name or secrets.token_hex(4)
        self.ttl_ms = max(1000, int(ttl_s * 1000))
        self.refresh_s = refresh_s
        self._take = link.redis.register_script(_TAKE)
        self._renew = link.redis.register_script(RENEW)
        self._count = link.redis.register_script(_COUNT)
        self._ids = itertools.count()
        self._mine: dict[str, Lease] = {}  # token -> live lease this process holds in Redis
        self._per_miner: Counter[str] = Counter()  # hotkey -> how many of them
        self._ops: list[tuple[str, str, str]] = []  # ("rel" | "deliver", hotkey, token), flushed in one pipeline
        self._wake = asyncio.Event()
        self.refused = 0  # holds refused because the miner's slots were full subnet-wide
        router.on_release = self._released
        router.on_deliver = self._delivered

    def _keys(self, hotkey: str) -> tuple[str, str]:
        return self.link.key("lease", hotkey), self.link.key("deliver", hotkey)

    async def hold(self, lease: Lease) -> bool:
        """Take the request's place among the miner's declared slots subnet-wide; False when they are all held."""
        if not self.link.usable():
            return True
        m = lease.miner
        token = f"{self.name}:{next(self._ids)}"
        own = self._per_miner[m.hotkey]  # this process's leases on it in Redis
        try:
            n = int(await self._take(keys=[self._keys(m.hotkey)[0]],
                                     args=[token, m.slots, self.ttl_ms]))
        except (asyncio.CancelledError, RedisError, OSError) as e:
            if interrupted(e):  # the client left while we asked: the script may have run, so give its place back
                self._give_back(m.hotkey, token)
                raise asyncio.CancelledError from None
            self.link.failed(e)
            return True
        self.link.worked()
        if n < 0:
            self.refused += 1
            self.router.note_elsewhere(m, -1 - n - own)
            return False
        if lease.released:  # the client left while we asked: give it back at once
            self._give_back(m.hotkey, token)
            return True
        lease.token = token
        lease.in_flight_at_dispatch = n  # subnet-wide: a 429 is judged against every process's streams
        self._mine[token] = lease
        self._per_miner[m.hotkey] += 1
        self.router.note_elsewhere(m, n - own)
        return True

    def _released(self, lease: Lease) -> None:
        if lease.token is not None and self._mine.pop(lease.token, None) is not None:
            self._per_miner[lease.miner.hotkey] -= 1
            self._give_back(lease.miner.hotkey, lease.token)

    def _give_back(self, hotkey: str, token: str) -> None:
        """Free a place on ``hotkey``'s slots in Redis, with the next batch of releases."""
        self._ops.append(("rel", hotkey, token))
        self._wake.set()

    def _delivered(self, lease: Lease) -> None:
        if lease.token is not None and lease.token in self._mine:
            self._ops.append(("deliver", lease.miner.hotkey, lease.token))
            self._wake.set()

    async def run(self) -> None:
        """Mirror releases and deliveries, renew the live leases, read everyone's counts: until cancelled."""
        loop = asyncio.get_running_loop()
        renew_at = refresh_at = 0.0
        while True:
            await woken(self._wake, self.refresh_s)
            if not self.link.usable():
                self._ops.clear()  # what they would undo expires by itself
                continue
            try:
                await self.flush()
                now = loop.time()
                if now >= renew_at:
                    await self._renew_all()
                    renew_at = now + self.ttl_ms / 3000
                if now >= refresh_at:
                    await self.refresh()
                    refresh_at = now + self.refresh_s
            except (RedisError, OSError) as e:
                self.link.failed(e)
            except Exception:  # never let the loop die on a surprise: the supervisor would restart it anyway
                logger.opt(exception=True).error("shared leases: unexpected error")

    async def flush(self) -> None:
        ops, self._ops = self._ops, []
        released = [(h, t) for op, h, t in ops if op == "rel"]
        delivering = [(h, t) for op, h, t in ops if op == "deliver" and t in self._mine]
        if released:
            pipe = self.link.redis.pipeline(transaction=False)
            for hotkey, token in released:
                for key in self._keys(hotkey):
                    pipe.zrem(key, token)
            await pipe.execute()
        if delivering:
            await self._renew(keys=[self._keys(h)[1] for h, _ in delivering],
                              args=[self.ttl_ms, "1", *(t for _, t in delivering)])
        if ops:
            self.link.worked()

    async def _renew_all(self) -> None:
        keys: list[str] = []
        members: list[str] = []
        for token, lease in self._mine.items():
            lease_key, deliver_key = self._keys(lease.miner.hotkey)
            keys.append(lease_key)
            members.append(token)
            if lease.delivering:
                keys.append(deliver_key)
                members.append(token)
        if keys:
            await self._renew(keys=keys, args=[self.ttl_ms, "0", *members])

    async def refresh(self) -> None:
        """Every miner's subnet-wide counts, less this process's own, into the router."""
        miners = self.router.miners()
        if not miners:
            return
        keys = [k for m in miners for k in self._keys(m.hotkey)]
        counts = await self._count(keys=keys)
        own_delivering = Counter(lease.miner.hotkey for lease in self._mine.values() if lease.delivering)
        out = {m.hotkey: (int(counts[2 * i]) - self._per_miner[m.hotkey],
                          int(counts[2 * i + 1]) - own_delivering[m.hotkey])
               for i, m in enumerate(miners)}
        self.router.set_elsewhere(out)
        self.link.worked()
