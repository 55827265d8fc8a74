"""The one measurement a dispatch ends as, and the answer kept with it for an audit: pure, from what was metered."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.protocol.measurement import Answer, FailureReason, Measurement

from ..metering import StreamMeter
from ..protocol.miner_request import MinerRequest
from ..protocol.sampling import SamplingParams
from ..protocol.structure import structure_of
from ..protocol.tools import prompt_messages

if TYPE_CHECKING:
    from .stream import UpstreamStream


def measurement_of(s: UpstreamStream, failure: FailureReason | None, latency_s: float) -> Measurement:
    """What the validator saw of ``s``: its timing and tokens as metered, and for a complete answer kept for an
    audit, the answer (:func:`answer_of`)."""
    meter = s.meter
    return Measurement(
        uid=s.uid,
        hotkey=s.hotkey,
        in_flight=s.lease.in_flight_at_dispatch,
        prompt_tokens=s.prompt_tokens,
        max_tokens=s.max_tokens,
        ttft_s=meter.ttft_s,
        latency_s=max(0.0, latency_s),
        completion_tokens=meter.countable_tokens,
        ok=failure is None,
        failure=failure,
        probe=s.probe,
        concurrency=meter.decode_concurrency(),
        answer=answer_of(s.request, s.sampling, meter) if failure is None and meter.keep_answer else None,
        finish_reason=meter.finish_reason if failure is None else None,
        slots=s.lease.slots_at_dispatch,
        capacity_check=s.capacity_check,
        arrivals=tuple(meter.arrivals) if meter.arrivals else None,
        free_draw=not s.sampling.greedy and s.sampling.seed is None,
        skipped=s.skipped,
    )


def answer_of(request: MinerRequest, sampling: SamplingParams, meter: StreamMeter) -> Answer:
    """The complete answer as the client received it, with the ids the miner said spell it and the prompt it
    conditioned on (tools and tool turns written out: :func:`gateway.protocol.tools.prompt_messages`)."""
    return Answer(
        messages=prompt_messages(request.fields),
        sampling=sampling,
        max_tokens=request.max_tokens,
        stop=request.stop,
        text="".join(meter.text),
        token_ids=tuple(meter.ids) if meter.ids_complete and meter.ids else None,
        finish_reason=meter.finish_reason,
        tool_calls=tuple((c["function"]["name"], c["function"]["arguments"]) for _, c in sorted(meter.calls.items()))
        if meter.calls else None,
        structure=structure_of(request.fields),
        logprobs=tuple(meter.logprobs) if request.fields.get("logprobs") is True else None,
    )
