"""Per-API-key limits across every gateway process: one atomic Redis script an admission.

The same limits as :class:`gateway.quota.QuotaBook` (requests and tokens per minute, tokens per UTC day,
concurrent streams), charged the same way: the most a request can use is reserved when it is admitted and settled
to what it used when it ends. Here the windows live in Redis, so a key's limit holds for the sum of every process's
requests: the admission script reads the key's windows, refuses with the limit it would break and when to come
back, or charges it, all in one step no other process can interleave with.

* the minute windows are per-second buckets (a hash, second -> count), summed over the last 60 s: a refusal's
  ``Retry-After`` is exact to the second;
* the day is one hash (``requests``, ``tokens``) per UTC day, kept two days;
* concurrent streams are members scored by when they expire, renewed while the request runs, so a process killed
  with ``kill -9`` frees its key's streams within ``ttl_s``.

Keys without limits never touch Redis. Redis down: a request is admitted by this process's own book against
``1/share`` of each limit (``share``: the gateway processes sharing the key, ``--redis.gateways``), so the key's
total stays near its limit while Redis is away; the outage is logged once (:mod:`.link`).

Example::

    limits = SharedLimits(link, QuotaBook(), share=2)
    got = await limits.admit(policy, reserve=1_200)   # SharedTicket, or a local Ticket (Redis down), or Refusal
    ...
    limits.settle(got, used=830)
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import secrets
import time
from dataclasses import dataclass
from typing import Any

from loguru import logger

from ..quota import DAY_S, KeyPolicy, QuotaBook, Refusal, Standing, Ticket, stream_detail, utc_day
from .link import NOW_MS, RENEW, RedisError, RedisLink, interrupted, woken

# KEYS: streams zset, rpm hash, tpm hash, day hash. ARGV: streams, rpm, tpm, tpd (-1: none), reserve, ticket, ttl ms,
# streams this request holds (its n: members ticket#1..ticket#n).
# Returns {0, second, 0, requests this minute, tokens this minute, tokens today, oldest request's second, oldest
# tokens' second} when admitted (the key's use with this request, summed over every process); {code, figure, wait s}
# when not (1 streams, 2 rpm, 3 tpm, 4 tpd, 5 too big).
_ADMIT = NOW_MS + """
local sec = tonumber(t[1])
local streams, rpm, tpm, tpd = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local reserve, ttl, need = tonumber(ARGV[5]), tonumber(ARGV[7]), tonumber(ARGV[8])
local function window(key)
  local all = redis.call('HGETALL', key)
  local sum, entries = 0, {}
  for i = 1, #all, 2 do
    local s, v = tonumber(all[i]), tonumber(all[i + 1])
    if s <= sec - 60 then redis.call('HDEL', key, all[i]) else sum = sum + v; entries[#entries + 1] = {s, v} end
  end
  table.sort(entries, function(a, b) return a[1] < b[1] end)
  return sum, entries
end
if streams >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  local n = redis.call('ZCARD', KEYS[1])
  if n + need > streams then return {1, n, 1} end
end
local rsum, rent = window(KEYS[2])
if rpm >= 0 and rsum >= rpm then return {2, rsum, rent[1][1] + 60 - sec} end
local tsum, tent = window(KEYS[3])
if tpm >= 0 then
  if reserve > tpm then return {5, reserve, 60} end
  if tsum + reserve > tpm then
    local left, wait = tsum, 60
    for _, e in ipairs(tent) do
      left = left - e[2]
      if left + reserve <= tpm then wait = e[1] + 60 - sec; break end
    end
    return {3, tsum, wait}
  end
end
local used = tonumber(redis.call('HGET', KEYS[4], 'tokens') or '0')
if tpd >= 0 and used + reserve > tpd then return {4, used, 0} end
if streams >= 0 then
  for i = 1, need do redis.call('ZADD', KEYS[1], now + ttl, ARGV[6] .. '#' .. i) end
  redis.call('PEXPIRE', KEYS[1], 2 * ttl)
end
redis.call('HINCRBY', KEYS[2], sec, 1)
redis.call('EXPIRE', KEYS[2], 120)
redis.call('HINCRBY', KEYS[3], sec, reserve)
redis.call('EXPIRE', KEYS[3], 120)
redis.call('HINCRBY', KEYS[4], 'requests', 1)
redis.call('HINCRBY', KEYS[4], 'tokens', reserve)
redis.call('EXPIRE', KEYS[4], 172800)
local r0, t0 = rent[1] and rent[1][1] or sec, tent[1] and tent[1][1] or sec
return {0, sec, 0, rsum + 1, tsum + reserve, used + reserve, r0, t0}
"""

# KEYS: streams zset, tpm hash, day hash. ARGV: admitted second, delta tokens, then the ticket's stream members.
_SETTLE = """
for i = 3, #ARGV do redis.call('ZREM', KEYS[1], ARGV[i]) end
local delta = tonumber(ARGV[2])
if delta ~= 0 then
  if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then redis.call('HINCRBY', KEYS[2], ARGV[1], delta) end
  if redis.call('EXISTS', KEYS[3]) == 1 then
    if redis.call('HINCRBY', KEYS[3], 'tokens', delta) < 0 then redis.call('HSET', KEYS[3], 'tokens', 0) end
  end
end
return 1
"""

# KEYS: streams zset, day hash. Returns {requests today, tokens today, streams still held}: one round trip, one clock.
_USAGE = NOW_MS + """
local day = redis.call('HMGET', KEYS[2], 'requests', 'tokens')
return {tonumber(day[1] or '0'), tonumber(day[2] or '0'), redis.call('ZCOUNT', KEYS[1], now, '+inf')}
"""

_LIMITS = {1: "concurrent streams", 2: "requests per minute", 3: "tokens per minute", 4: "tokens per day",
           5: "tokens per minute"}


@dataclass(slots=True, eq=False)
class SharedTicket:
    """One admitted request's hold on its key's shared limits; settle it exactly once."""

    key: str
    reserved: int
    second: int  # Redis's second it was admitted in (its bucket in the minute window)
    day: str
    token: str
    streams: int  # the key's concurrent streams it holds (members token#1..token#n; 0 for a key without the limit)
    settled: bool = False
    standing: Standing | None = None  # the key's minute windows over every process, this request in them

    def members(self) -> list[str]:
        return [f"{self.token}#{i}" for i in range(1, self.streams + 1)]


class SharedLimits:
    """Admission against the key's limits summed over every process; ``local`` is this process's own book."""

    def __init__(self, link: RedisLink, local: QuotaBook, *, share: int = 1, ttl_s: float = 120.0) -> None:
        self.link = link
        self.local = local
        self.share = max(1, int(share))
        self.ttl_ms = max(1000, int(ttl_s * 1000))
        self._admit = link.redis.register_script(_ADMIT)
        self._settle = link.redis.register_script(_SETTLE)
        self._renew = link.redis.register_script(RENEW)
        self._usage = link.redis.register_script(_USAGE)
        self._name = secrets.token_hex(4)
        self._ids = itertools.count()
        self._live: dict[str, SharedTicket] = {}  # tickets holding a stream, renewed while they run
        self._settles: list[tuple[SharedTicket, int]] = []  # (ticket, tokens used less reserved), to send
        self._wake = asyncio.Event()
        self.fallbacks = 0  # admissions by the local share while Redis was down
        # each key's use as Redis last told it (at, day, requests this minute, tokens this minute, tokens today; None:
        # not told): what a fallback share is cut from, so an outage never admits what the key had already used
        self._seen: dict[str, tuple[float, str, int | None, int | None, int | None]] = {}

    def _keys(self, name: str, day: str) -> list[str]:
        k = self.link.key
        return [k("key", name, "streams"), k("key", name, "rpm"), k("key", name, "tpm"), k("key", name, "day", day)]

    def local_share(self, policy: KeyPolicy, now: float | None = None) -> KeyPolicy:
        """What one process admits while Redis is away: what is left of each limit, divided among the processes.
        Left is the limit less the key's use Redis last reported (within its minute for the per-minute limits,
        within its UTC day for the daily one); a key never seen is left its whole limit, and each process at least
        1 of a limit nothing is known against (an outage's first requests are not all refused)."""
        now = time.time() if now is None else now
        seen = self._seen.get(policy.name)
        minute = seen is not None and now - seen[0] < 60.0
        today = seen is not None and seen[1] == utc_day(now)

        def cut(limit: int | None, used: int | None) -> int | None:
            if limit is None:
                return None
            if used is None:
                return max(1, limit // self.share)
            return max(0, limit - used) // self.share
        return dataclasses.replace(policy, rpm=cut(policy.rpm, seen[2] if minute and seen else None),
                                   tpm=cut(policy.tpm, seen[3] if minute and seen else None),
                                   tpd=cut(policy.tpd, seen[4] if today and seen else None),
                                   streams=cut(policy.streams, None))

    async def admit(self, policy: KeyPolicy, reserve: int, now: float | None = None, *,
                    streams: int = 1) -> SharedTicket | Ticket | Refusal:
        """Admit a request of up to ``reserve`` tokens holding ``streams`` miner streams at once (its ``n``)."""
        now = time.time() if now is None else now
        streams = max(1, int(streams))
        if not policy.limited or not self.link.usable():
            if policy.limited:
                self.fallbacks += 1
            return self.local.admit(self.local_share(policy, now) if policy.limited else policy, reserve, now,
                                    streams=streams)
        reserve = max(0, int(reserve))
        day = utc_day(now)
        token = f"{self._name}:{next(self._ids)}"
        args = [-1 if x is None else x for x in (policy.streams, policy.rpm, policy.tpm, policy.tpd)]
        try:
            code, figure, wait, *use = (int(x) for x in await self._admit(
                keys=self._keys(policy.name, day), args=[*args, reserve, token, self.ttl_ms, streams]))
        except (asyncio.CancelledError, RedisError, OSError) as e:
            if interrupted(e):
                # the client left while we asked: a stream the script may have taken is given back (what it
                # charged stays: at most one request's reservation, against the key)
                self.settle(SharedTicket(policy.name, reserve, 0, day, token, streams=streams), reserve)
                raise asyncio.CancelledError from None
            self.link.failed(e)
            self.fallbacks += 1
            return self.local.admit(self.local_share(policy, now), reserve, now, streams=streams)
        self.link.worked()
        if code == 0:
            standing = None
            if len(use) >= 3:
                self._seen[policy.name] = (now, day, use[0], use[1], use[2])
            if len(use) == 5:  # the oldest request's and tokens' seconds: when each window next gives room
                standing = Standing(requests=use[0], tokens=use[1], requests_reset_s=float(use[3] + 60 - figure),
                                    tokens_reset_s=float(use[4] + 60 - figure))
            ticket = SharedTicket(policy.name, reserve, figure, day, token,
                                  streams=streams if policy.streams is not None else 0, standing=standing)
            if ticket.streams:
                self._live[token] = ticket
            return ticket
        self._saw_refusal(policy.name, code, figure, now, day)
        return _refusal(code, figure, wait, policy, reserve, now, streams)

    def _saw_refusal(self, name: str, code: int, figure: int, now: float, day: str) -> None:
        """A refusal tells the key's use of the limit it broke (every process's): kept as an admission's figures
        are. Only admissions updated the view before, so a process whose requests Redis refused kept the view of its
        last admission, and an outage then admitted what the others had used since: a key used up through Redis got
        8-14 more a minute of its 60 with Redis down (issue 56)."""
        if code not in (2, 3, 4):  # rpm, tpm, tpd: the view's fields 2, 3, 4
            return
        at = code
        old = self._seen.get(name)
        view: list[Any] = [now, day, None, None, None]
        if old is not None:  # the others as last told, while they still hold (the same minute, the same day)
            view[2:4] = old[2:4] if now - old[0] < 60.0 else (None, None)
            view[4] = old[4] if old[1] == day else None
        view[at] = max(figure, view[at] or 0)
        self._seen[name] = (now, day, view[2], view[3], view[4])

    async def usage(self, name: str, now: float | None = None) -> dict[str, Any] | None:
        """Key ``name``'s use today summed over every process (``/v1/status``); None while Redis is away."""
        day = utc_day(time.time() if now is None else now)
        keys = self._keys(name, day)
        if not self.link.usable():
            return None
        try:
            requests, tokens, streams = (int(x) for x in await self._usage(keys=[keys[0], keys[3]]))
        except (RedisError, OSError) as e:
            self.link.failed(e)
            return None
        self.link.worked()
        return {"day": day, "requests_today": requests, "tokens_today": tokens, "in_flight": streams}

    def settle(self, ticket: SharedTicket | Ticket, used: int, now: float | None = None) -> None:
        """The request ended having used ``used`` tokens (idempotent; sent in the background)."""
        if isinstance(ticket, Ticket):
            self.local.settle(ticket, used, time.time() if now is None else now)
            return
        if ticket.settled:
            return
        ticket.settled = True
        self._live.pop(ticket.token, None)
        self._settles.append((ticket, max(0, int(used)) - ticket.reserved))
        self._wake.set()

    async def run(self) -> None:
        """Send settlements as they come and renew live streams every third of ``ttl_s``, until cancelled."""
        loop = asyncio.get_running_loop()
        renew_at = loop.time() + self.ttl_ms / 3000
        while True:
            await woken(self._wake, 1.0)
            if not self.link.usable():
                continue  # kept: sent when Redis is back (a stream's hold expires by itself meanwhile)
            try:
                await self.flush()
                if loop.time() >= renew_at and self._live:
                    held = [(self._keys(t.key, t.day)[0], member) for t in self._live.values()
                            for member in t.members()]
                    await self._renew(keys=[k for k, _ in held], args=[self.ttl_ms, "0", *(m for _, m in held)])
                    renew_at = loop.time() + self.ttl_ms / 3000
            except (RedisError, OSError) as e:
                self.link.failed(e)
            except Exception:
                logger.opt(exception=True).error("shared key limits: unexpected error")

    async def flush(self) -> None:
        settles, self._settles = self._settles, []
        if not settles:
            return
        try:
            pipe = self.link.redis.pipeline(transaction=False)
            for t, delta in settles:
                keys = self._keys(t.key, t.day)
                await self._settle(keys=[keys[0], keys[2], keys[3]], args=[t.second, delta, *t.members()],
                                   client=pipe)
            await pipe.execute()
        except BaseException:
            self._settles[:0] = settles
            raise
        self.link.worked()


def _refusal(code: int, figure: int, wait: int, policy: KeyPolicy, reserve: int, now: float,
             streams: int = 1) -> Refusal:
    limit = _LIMITS.get(code, "requests per minute")
    standing: Standing | None = None  # what the refusing limit's figure says of its window (the others: unknown)
    if code == 1:
        detail = stream_detail(figure, streams, policy.streams or 0)
    elif code == 2:
        detail = f"{figure} of {policy.rpm} in the last minute"
        standing = Standing(requests=figure, requests_reset_s=float(wait))
    elif code == 5:
        detail = f"this request may use {reserve} tokens, more than the {policy.tpm} a minute allows"
    elif code == 3:
        detail = f"{figure} of {policy.tpm} used in the last minute, this request may use {reserve}"
        standing = Standing(tokens=figure, tokens_reset_s=float(wait))
    else:
        detail = f"{figure} of {policy.tpd} used today (UTC), this request may use {reserve}"
        wait = math.ceil((math.floor(now / DAY_S) + 1) * DAY_S - now)
    return Refusal(limit, float(max(1, wait)), detail, standing)
