"""Per-key limits: requests per minute, tokens per minute and per day, concurrent streams. Pure, clock injected.

Every API key holder can send traffic that decides which miners earn, so a key is a budget, not a
blank cheque (issue 14: one key holder sent its own long prompts to favour its own miner). Limits
come from the keys file (:mod:`gateway.auth`); a key without limits is unlimited.

Tokens are charged the way OpenAI's own limits count them: at admission the most a request can use
(its prompt estimate + ``max_tokens``) is reserved against the minute and the day, and when it ends
the reservation is settled to what it used (its prompt + the completion tokens the gateway
counted), so a burst of long requests is refused up front instead of discovered afterwards. A
refusal says which limit and when to come back (``Retry-After``); the gateway answers it with a 429
``rate_limit_exceeded``. Usage per key and UTC day is kept for ``/v1/status`` and saved with the
scoring state at each round's close; a key with a daily limit also has a claim ahead of its use written
before a request is served (:meth:`QuotaBook.mark_due`), so neither a restart nor a kill -9 hands out a
fresh day.

Example::

    book = QuotaBook()
    policy = KeyPolicy("alice", rpm=60, tpm=100_000, tpd=2_000_000, streams=4)
    got = book.admit(policy, reserve=1_200, now=time.time())   # Ticket, or Refusal(limit, retry_after_s)
    ...
    book.settle(got, used=830, now=time.time())                 # exactly once per Ticket
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

DAY_S = 86_400.0
MINUTE_S = 60.0


@dataclass(frozen=True, slots=True)
class KeyPolicy:
    """One API key's name (what logs, status and usage show: never the key) and its limits (None: no limit)."""

    name: str
    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens (prompt + completion) per minute
    tpd: int | None = None  # tokens per UTC day
    streams: int | None = None  # requests in flight at once

    @property
    def limited(self) -> bool:
        return any(x is not None for x in (self.rpm, self.tpm, self.tpd, self.streams))


@dataclass(frozen=True, slots=True)
class Standing:
    """A key's minute windows as an admission left them: what the ``x-ratelimit-*`` headers say (OpenAI's names),
    so a client can pace itself before it meets a 429. None: not known (a refusal by another limit, say)."""

    requests: int | None = None  # requests in the last minute, this one included
    tokens: int | None = None  # tokens charged in the last minute, this one's reservation included
    requests_reset_s: float = MINUTE_S  # until the oldest of those requests leaves the minute (one more fits)
    tokens_reset_s: float = MINUTE_S  # until the oldest of those tokens leave it


def duration(seconds: float) -> str:
    """A wait as OpenAI writes it in ``x-ratelimit-reset-*``: ``20ms``, ``1.5s``, ``6m0s``."""
    s = max(0.0, seconds)
    if s < 1.0:
        return f"{int(s * 1000)}ms"
    if s < MINUTE_S:
        return f"{round(s, 3):g}s"
    return f"{int(s // MINUTE_S)}m{round(s % MINUTE_S, 3):g}s"


def ratelimit_headers(policy: KeyPolicy, standing: Standing | None) -> dict[str, str]:
    """The ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` headers of a key with a per-minute limit, as
    OpenAI sends them on every response (a 429 included); none for a limit the key does not have or a figure not
    known. Remaining tokens count reservations (the most each admitted request may use), as the limit does."""
    out: dict[str, str] = {}
    if standing is None:
        return out
    if policy.rpm is not None and standing.requests is not None:
        out["x-ratelimit-limit-requests"] = str(policy.rpm)
        out["x-ratelimit-remaining-requests"] = str(max(0, policy.rpm - standing.requests))
        out["x-ratelimit-reset-requests"] = duration(standing.requests_reset_s)
    if policy.tpm is not None and standing.tokens is not None:
        out["x-ratelimit-limit-tokens"] = str(policy.tpm)
        out["x-ratelimit-remaining-tokens"] = str(max(0, policy.tpm - standing.tokens))
        out["x-ratelimit-reset-tokens"] = duration(standing.tokens_reset_s)
    return out


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request was refused and when a retry can succeed."""

    limit: str  # "requests per minute" | "tokens per minute" | "tokens per day" | "concurrent streams"
    retry_after_s: float
    detail: str
    standing: Standing | None = None  # the key's minute windows, where known (the x-ratelimit-* headers)


@dataclass(slots=True, eq=False)
class Ticket:
    """One admitted request's hold on its key's limits; settle it exactly once."""

    key: str
    reserved: int
    at: float
    day: str
    charge: list[float]  # its [at, tokens] entry in the key's minute window, corrected when it settles
    settled: bool = False
    streams: int = 1  # the key's concurrent streams it holds (a request for n answers holds n)
    standing: Standing | None = None  # the key's minute windows with this request in them


def stream_detail(in_flight: int, asked: int, limit: int) -> str:
    """Why a request's streams do not fit the key's limit, in the refusal's words."""
    if asked > 1:
        return f"this request asks for {asked} streams (n={asked}); {in_flight} of {limit} in flight"
    return f"{in_flight} of {limit} streams in flight"


@dataclass(slots=True)
class KeyUsage:
    """What one key used on one UTC day (persisted), plus its live windows."""

    day: str = ""
    requests: int = 0
    tokens: int = 0  # settled tokens of the day, plus what is still reserved
    in_flight: int = 0
    minute_requests: deque[float] = field(default_factory=deque)
    minute_tokens: deque[list[float]] = field(default_factory=deque)  # [at, tokens], oldest first
    minute_sum: int = 0
    recorded: int = 0  # the day's tokens the state file holds for this key (at least what was admitted)


def utc_day(now: float) -> str:
    """``YYYY-MM-DD`` of ``now`` in UTC (the day a day's limit counts)."""
    return time.strftime("%Y-%m-%d", time.gmtime(now))


class QuotaBook:
    """Live usage of every key; ``admit`` / ``settle`` are O(1) amortised and never block."""

    def __init__(self) -> None:
        self.usage: dict[str, KeyUsage] = {}

    def _of(self, name: str, now: float) -> KeyUsage:
        u = self.usage.get(name)
        if u is None:
            u = self.usage[name] = KeyUsage(day=utc_day(now))
        day = utc_day(now)
        if u.day != day:
            u.day, u.requests, u.tokens = day, 0, 0
        cutoff = now - MINUTE_S
        while u.minute_requests and u.minute_requests[0] <= cutoff:
            u.minute_requests.popleft()
        while u.minute_tokens and u.minute_tokens[0][0] <= cutoff:
            u.minute_sum -= int(u.minute_tokens.popleft()[1])
        return u

    def admit(self, policy: KeyPolicy, reserve: int, now: float, *, streams: int = 1) -> Ticket | Refusal:
        """Admit one request that may use up to ``reserve`` tokens and hold ``streams`` miner streams at once (its
        ``n``), or say which limit it would break."""
        u = self._of(policy.name, now)
        reserve = max(0, int(reserve))
        streams = max(1, int(streams))
        minute = policy.rpm is not None or policy.tpm is not None  # only such a key's answers carry the headers
        standing = self._standing(u, now) if minute else None
        if policy.streams is not None and u.in_flight + streams > policy.streams:
            return Refusal("concurrent streams", 1.0, stream_detail(u.in_flight, streams, policy.streams), standing)
        if policy.rpm is not None and len(u.minute_requests) >= policy.rpm:
            # a limit of 0 (a share cut to nothing while Redis is down) with no request in the window: a minute
            # (this raised IndexError, a 500 for every such request: issue 56)
            wait = u.minute_requests[0] + MINUTE_S - now if u.minute_requests else MINUTE_S
            return Refusal("requests per minute", wait, f"{len(u.minute_requests)} of {policy.rpm} in the last minute",
                           standing)
        if policy.tpm is not None:
            if reserve > policy.tpm:
                return Refusal("tokens per minute", MINUTE_S,
                               f"this request may use {reserve} tokens, more than the {policy.tpm} a minute allows",
                               standing)
            if u.minute_sum + reserve > policy.tpm:
                return Refusal("tokens per minute", self._tokens_free_in(u, policy.tpm - reserve, now),
                               f"{u.minute_sum} of {policy.tpm} used in the last minute, this request may use "
                               f"{reserve}", standing)
        if policy.tpd is not None and u.tokens + reserve > policy.tpd:
            wait = (math.floor(now / DAY_S) + 1) * DAY_S - now
            return Refusal("tokens per day", wait, f"{u.tokens} of {policy.tpd} used today (UTC), this request may "
                                                   f"use {reserve}", standing)
        u.in_flight += streams
        u.requests += 1
        u.tokens += reserve
        u.minute_requests.append(now)
        charge = [now, float(reserve)]
        u.minute_tokens.append(charge)
        u.minute_sum += reserve
        return Ticket(policy.name, reserve, now, u.day, charge, streams=streams,
                      standing=self._standing(u, now) if minute else None)

    @staticmethod
    def _standing(u: KeyUsage, now: float) -> Standing:
        return Standing(requests=len(u.minute_requests), tokens=u.minute_sum,
                        requests_reset_s=u.minute_requests[0] + MINUTE_S - now if u.minute_requests else 0.0,
                        tokens_reset_s=u.minute_tokens[0][0] + MINUTE_S - now if u.minute_tokens else 0.0)

    @staticmethod
    def _tokens_free_in(u: KeyUsage, room: int, now: float) -> float:
        """Seconds until the minute's charged tokens fall to ``room``."""
        total = u.minute_sum
        for t, n in u.minute_tokens:
            total -= int(n)
            if total <= room:
                return max(0.0, t + MINUTE_S - now)
        return MINUTE_S

    def settle(self, ticket: Ticket, used: int, now: float) -> None:
        """The request ended having used ``used`` tokens: replace its reservation with that (idempotent)."""
        if ticket.settled:
            return
        ticket.settled = True
        u = self._of(ticket.key, now)
        u.in_flight = max(0, u.in_flight - ticket.streams)
        delta = max(0, int(used)) - ticket.reserved
        if u.day == ticket.day:
            u.tokens = max(0, u.tokens + delta)
        if ticket.at > now - MINUTE_S:  # still in the minute window: correct its entry there
            ticket.charge[1] += delta
            u.minute_sum += delta

    def restore(self, name: str, day: str, requests: int, tokens: int) -> None:
        """Take a saved day's usage back (at start); only today's matters for the limits."""
        u = self.usage.setdefault(name, KeyUsage(day=day))
        if u.day == day:
            u.requests, u.tokens = max(u.requests, requests), max(u.tokens, tokens)
            u.recorded = max(u.recorded, u.tokens)

    def mark_due(self, policy: KeyPolicy, ticket: Ticket) -> tuple[str, str, int, int] | None:
        """The row to write *before* an admitted request is served, so a kill -9 cannot hand its key a fresh day.

        Only for a key with a daily limit, and only when its day's tokens passed what the state file holds:
        the row then claims a twentieth of the limit ahead (at most the limit), so a key is written about 20
        times a day, not once a request. A restart reads the claim back: it may charge the key up to that
        twentieth it never used, never less than it used (issue 24: a ``tpd=3000`` key was admitted 4,260
        tokens over 5 restarts, 2 of them kill -9, with usage saved only at round close).
        """
        u = self.usage.get(ticket.key)
        if policy.tpd is None or u is None or u.day != ticket.day or u.tokens <= u.recorded:
            return None
        u.recorded = max(u.tokens, min(policy.tpd, u.tokens + max(1, policy.tpd // 20)))
        return (ticket.key, u.day, u.requests, u.recorded)

    def snapshot(self) -> list[tuple[str, str, int, int]]:
        """``(name, day, requests, tokens)`` per key, to save (what the state file then holds)."""
        for u in self.usage.values():
            u.recorded = u.tokens
        return [(name, u.day, u.requests, u.tokens) for name, u in sorted(self.usage.items())]
