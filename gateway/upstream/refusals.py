"""What a miner's refusal means, and the error a failed dispatch raises.

A 429 is the truth or a refusal the miner is booked for (:func:`refusal`); a 400 is the client's fault only when
it names one of the runtime codes for that (:func:`client_fault`) *and* the gateway's own reading of the request
says it may not fit the model (:func:`may_not_fit`). Every other failure is the miner's.
"""

from __future__ import annotations

from collections import deque

from gateway.protocol.measurement import FailureReason, Measurement

from ..protocol.errors import CLIENT_FAULT_CODES
from ..protocol.openai import MODEL_CONTEXT
from ..protocol.untrusted import loads as untrusted_json

REFUSAL_SLACK = 1  # free slots a miner may still show when it refuses: our release can race its own
DRAIN_GRACE_S = 2.0  # after this validator cancels a stream on a miner, how long a 429 may be its runtime draining
MAX_UNDERCOUNT = 4  # the prompt estimate's worst undercount against the model's tokenizer (digits 3.98x)


def refusal(in_flight: int, slots: int) -> FailureReason:
    """What a 429 is: the truth (``busy``) when this validator's streams fill the slots the miner declared
    *before* the request, a refusal the miner is booked for (``refused``) when at least two of them were free,
    or when none of this validator's streams was on it (whatever it declares: one slot is still one slot).

    ``slots`` is what the miner declared at dispatch, never the refusing response's own header: a miner
    declaring 4 slots on answers and 1 on each 429 turned every refusal into the truth (issue 23: 1.34-1.47x).
    The slack of one: the gateway releases a stream when it reads ``[DONE]``, a moment before the miner's
    handler returns, so a back-to-back dispatch can find an honest miner still counting the last one (the
    reference miner frees its slot before it sends ``[DONE]``, so it never refuses that way).
    """
    if in_flight <= 0:
        return FailureReason.REFUSED
    return FailureReason.REFUSED if in_flight + REFUSAL_SLACK < slots else FailureReason.BUSY


def client_fault(status: int, body: bytes) -> str | None:
    """The runtime's message when a miner's refusal says the *request* cannot be served, else None.

    Only a 400 naming one of :data:`~gateway.protocol.errors.CLIENT_FAULT_CODES` counts: anything else
    a miner refuses with stays its failure. A miner gains nothing by abusing it: a refused request
    earns no credit.
    """
    if status != 400:
        return None
    try:
        err = untrusted_json(body).get("error")
    except (ValueError, AttributeError):
        return None
    if not isinstance(err, dict) or err.get("code") not in CLIENT_FAULT_CODES:
        return None
    message = err.get("message")
    return str(message)[:500] if isinstance(message, str) and message else str(err.get("code"))


def may_not_fit(prompt_estimate: int, max_tokens: int, context: int = MODEL_CONTEXT) -> bool:
    """Whether a request may be too long for the model, as the gateway reads it: the prompt at the estimate's worst
    undercount (:data:`MAX_UNDERCOUNT`) plus the answer asked for, over ``context``.

    A miner's "too long" is believed only then (issue 38): four 1-slot hotkeys on one card answered 400
    ``context_length_exceeded`` whenever busy, the 400 was booked as the client's fault, and the group earned
    1.15-1.33x an honest card while 11-15 % of users' requests got a 400. A request that fits is a refusal the miner
    chose: blamed like any failed answer, and another miner is asked. The bound is generous on purpose: an honest
    runtime's truthful "too long" is never blamed.
    """
    return prompt_estimate * MAX_UNDERCOUNT + max_tokens > context


class CancelExcuses:
    """A 429 that comes just after this validator cancelled a stream on the miner is its runtime still draining the
    cancelled work, not a refusal (issue 38: an honest single-slot llama.cpp miner whose client left mid-prefill
    answered the next request 429, was booked for a refusal, and under load ended at weight 0).

    Bounded so it cannot be farmed: each cancel excuses one 429, within ``grace_s`` of it (the reference runtime
    frees a cancelled prefill within one 64-token step, under a second on this CPU). Only cancels this validator
    made count (a client that left mid-request), so a miner cannot make its own; a self-dealer's cancelled
    request buys one refusal's pardon at most. Times come from the caller's clock: pure, testable.
    """

    def __init__(self, grace_s: float = DRAIN_GRACE_S, per_miner: int = 8) -> None:
        self.grace_s = grace_s
        self._per_miner = per_miner
        self._cancels: dict[int, deque[float]] = {}

    def cancelled(self, uid: int, now: float) -> None:
        """This validator cancelled a stream on ``uid`` at ``now``."""
        self._cancels.setdefault(uid, deque(maxlen=self._per_miner)).append(now)

    def excuse(self, uid: int, now: float) -> bool:
        """Whether a refusal from ``uid`` at ``now`` is pardoned (using up the excuse of one recent cancel)."""
        times = self._cancels.get(uid)
        if not times:
            return False
        while times and now - times[0] > self.grace_s:
            times.popleft()
        if not times:
            del self._cancels[uid]
            return False
        times.popleft()
        return True


class UpstreamError(Exception):
    """The dispatch failed; ``measurement`` (already handed to the sink) says how."""

    def __init__(self, reason: FailureReason, measurement: Measurement, *, status: int | None = None,
                 after_content: bool = False, detail: str = "") -> None:
        super().__init__(f"{reason}{': ' + detail if detail else ''}")
        self.reason = reason
        self.measurement = measurement
        self.status = status
        self.after_content = after_content
        self.detail = detail
