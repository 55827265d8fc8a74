"""Whether the validator should be sent traffic now: ``/ready`` (``/health`` only says the process answers).

A load balancer or an orchestrator reads ``/ready``: 200 when the validator can serve and verify, 503 with the
first reason it cannot. Pure: the validator passes in what it knows.

* no miner routable: every request would get a 429 (an empty metagraph, or every miner quarantined);
* no routable miner answering: each one's last dispatch (a probe or a user's request) found it down (refused
  connection, timeout, 5xx, broken stream), so every request would get a 502 (listed is not serving: the only
  miner dying left ``/ready`` at 200 for over 90 s while every request failed);
* the metagraph older than its bound: the chain is unreachable and routing is drifting from the chain's truth;
* the audit reference failing every audit lately: answers would be paid unverified.

Example::

    not_ready(routable=0, metagraph_age_s=5.0, max_age_s=360.0, reference_errors=0)   # 'no miner is routable ...'
"""

from __future__ import annotations

REFERENCE_ERRORS = 3  # failed reference calls in a row that make the validator not ready


def not_ready(*, routable: int, metagraph_age_s: float | None, max_age_s: float, reference_errors: int = 0,
              reference_error: str = "", answering: int | None = None) -> str | None:
    """The first reason the validator is not ready, or None when it is."""
    if metagraph_age_s is None:
        return "the metagraph has not been read yet"
    if metagraph_age_s > max_age_s:
        return f"the metagraph is {metagraph_age_s:.0f} s old (bound {max_age_s:.0f} s): the chain is not answering"
    if routable <= 0:
        return "no miner is routable (none in the metagraph, or every one quarantined)"
    if answering is not None and answering <= 0:
        return (f"no routable miner is answering: the last request to each of the {routable} failed to connect, timed "
                "out or broke off")
    if reference_errors >= REFERENCE_ERRORS:
        return f"the audit reference failed its last {reference_errors} audits ({reference_error or 'no detail'})"
    return None
