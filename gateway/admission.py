"""A short fair queue in front of the miners: a request that finds every declared slot full waits, briefly.

Without it, a request arriving while this validator's streams fill every miner's declared slots got an instant 429
(each miner it tried refused it, and rightly: those slots are ours). vLLM queues such a request and LiteLLM
retries it; clients expect either. Here it waits until a slot frees, for at most ``wait_s``, then gets the 429 with
``Retry-After``.

**Fair across keys.** Waiters queue per API key, and a freed slot goes to the keys in turn (round-robin), each
key's own requests first come first served. A key that bursts a thousand requests fills its own queue, not the
others': another key's request waits for at most one turn of the keys, not behind the burst.

A grant says "try now", it reserves nothing: the granted request resumes and takes its lease from the router
before anything else awaits, and grants never outnumber the free slots. A waiter that leaves (the client hung up,
or its wait ran out) passes on a grant it had been given. The queue holds at most ``max_waiting`` requests; past
that a request is refused at once.

Example::

    queue = AdmissionQueue(router, wait_s=10.0)
    router.on_room = queue.wake    # what frees a slot lets the waiting go (the gateway wires this)
    await queue.admit("alice")     # returns at once while a slot is free; raises the 429 past the bound
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque

from .protocol.errors import GatewayError, no_capacity
from .router import Router


class AdmissionQueue:
    def __init__(self, router: Router, wait_s: float = 10.0, max_waiting: int = 4096) -> None:
        self.router = router
        self.wait_s = max(0.0, wait_s)
        self.max_waiting = max_waiting
        self._queues: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()  # key -> waiters, in turn
        self._waiting = 0
        self._granted = 0  # grants given whose request has not resumed yet
        self.waited = 0  # requests that waited and were let through
        self.timed_out = 0  # requests that waited their bound and got the 429

    @property
    def waiting(self) -> int:
        return self._waiting

    async def admit(self, key: str) -> None:
        """Return when a request of ``key`` may be dispatched; GatewayError 429 when it cannot within the bound."""
        router = self.router
        if not self._waiting and not self._granted and (router.has_room() or not router.routable()):
            return  # the fast path; with no routable miner at all the relay gives its own answer at once
        if self.wait_s <= 0 or self._waiting >= self.max_waiting:
            raise no_capacity("every miner's slots are busy; retry shortly")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(key, deque()).append(fut)
        self._waiting += 1
        self.wake()
        try:
            async with asyncio.timeout(self.wait_s):  # not wait_for: it can swallow a cancel that races a grant
                await fut
        except (TimeoutError, asyncio.CancelledError) as e:
            granted = self._leave(key, fut)
            if granted:
                self.wake()  # the grant it had is someone else's now
            if isinstance(e, TimeoutError):
                self.timed_out += 1
                raise self._refusal() from None
            raise
        self._granted -= 1
        self.waited += 1

    def _refusal(self) -> GatewayError:
        return no_capacity(f"every miner's slots stayed busy for {self.wait_s:g} s; retry shortly")

    def _leave(self, key: str, fut: asyncio.Future[None]) -> bool:
        """Take ``fut`` out; True when it had already been granted (its grant is handed back)."""
        if fut.done() and not fut.cancelled():
            self._granted -= 1
            return True
        fut.cancel()
        waiters = self._queues.get(key)
        if waiters is not None and fut in waiters:
            waiters.remove(fut)
            self._waiting -= 1
            if not waiters:
                del self._queues[key]
        return False

    def wake(self) -> None:
        """Grant as many waiters as there are free slots not already granted, the keys in turn."""
        if not self._queues:
            return
        free = self.router.free_slots() - self._granted
        while free > 0 and self._queues:
            key, waiters = next(iter(self._queues.items()))
            fut = waiters.popleft()
            self._waiting -= 1
            if waiters:
                self._queues.move_to_end(key)  # this key has had its turn
            else:
                del self._queues[key]
            if not fut.done():
                fut.set_result(None)
                self._granted += 1
                free -= 1
