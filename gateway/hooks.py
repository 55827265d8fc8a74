"""What the process around a gateway plugs into it: set before it serves, frozen once it does.

The gateway serves on its own; a validator (or a gateway worker) adds what only it knows: who watches admitted
requests (probes copy their shapes), where a key's day of usage is written, why the service is not ready, the
limits shared with other gateway processes, and metric families of its own. They used to be attributes set from
three files at eleven sites, at any time; now they are one frozen value, given with :meth:`Gateway.plug` before
:meth:`Gateway.start`, so what a request sees cannot change under it.

Example::

    gateway.plug(readiness=lambda: None, metrics=(my_families,))
    await gateway.start()               # gateway.plug(...) now raises
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.core import Metric

if TYPE_CHECKING:
    from .protocol.openai import ChatRequest
    from .shared.limits import SharedLimits

UsageRow = tuple[str, str, int, int]  # (key name, day, requests, tokens): a key's claim on its day


@dataclass(frozen=True, slots=True)
class GatewayHooks:
    """Each optional; a gateway with none serves alone (its own quota book, ready while a miner is routable)."""

    # Called with every admitted request (the validator keeps its shape, never its text, for probes); an observer
    # that raises never costs the client its answer.
    on_request: Callable[[ChatRequest], None] | None = None
    # Writes a key's usage row before its request is served (the validator's state file); failing to write never
    # costs the client its answer (the round's close saves the totals too).
    save_usage: Callable[[UsageRow], Awaitable[None]] | None = None
    # Why the service should not get traffic now (None: ready); without it, ready means some miner is routable.
    readiness: Callable[[], str | None] | None = None
    # Limits summed over every gateway process (gateway.shared.limits); None: this process's book alone.
    key_limits: SharedLimits | None = None
    # Metric families of the owner's, served with the gateway's own on /metrics.
    metrics: tuple[Callable[[], Iterable[Metric]], ...] = ()
