"""The one path every dispatched request takes, organic or probe: sign, POST, stream, measure.

Everything is measured on the validator's clock. The TTFT clock starts at dispatch, before signing
and connecting (a slow accept queue is the miner's latency too, never hidden by timing from response
headers); the rules of what counts are :class:`gateway.metering.StreamMeter`'s, fed each network read
with the time it was taken. Whatever the miner does — refuse (429), hang, stall, send garbage, NaN,
too-long lines, more tokens than ``max_tokens``, drop the connection — the stream is bounded, stopped
and recorded as exactly one :class:`~gateway.protocol.measurement.Measurement`.

Deadlines only run while the validator waits on the miner: the first token within ``first_token`` of
dispatch, then each read within ``stall`` of the last event, all within ``total``. While the relay
waits on a slow *client*, no read is pending and no miner deadline runs: a client's back-pressure is
never booked as the miner's stall.

Example::

    up = Upstream(MinerClient(), RequestSigner(keypair), sink=MeasurementQueue())
    lease = router.acquire()
    try:
        async with await up.open(lease, {"model": m, "messages": msgs, "max_tokens": 64}) as stream:
            while batch := await stream.next_batch():      # the chunks of one network read
                print("".join(c.content for c in batch), end="")
    except UpstreamError as e:
        e.reason                                # a FailureReason; e.measurement was already recorded
    finally:
        router.release(lease)

    m = await up.probe(lease, payload)          # the same code path, consumed to the end

The path is split one job a module (it was one 576-line module, and ``UpstreamStream`` held five jobs):

* :mod:`.config`: the timeouts and limits a dispatch runs under;
* :mod:`.connect`: sign and POST (re-signed once on a pooled connection the miner had closed), and the head's
  checks (refusals, status, content type), every failure a :class:`~gateway.upstream.connect.ConnectFailed`;
* :mod:`.refusals`: what a 429 or a 400 from a miner means, and :class:`UpstreamError`;
* :mod:`.deadline`: the one deadline timer of a stream;
* :mod:`.record`: the one measurement (and answer) a dispatch ends as;
* :mod:`.stream`: :class:`UpstreamStream`, which runs those for one dispatch and meters its reads
  (:mod:`gateway.metering`);
* :mod:`.dispatch`: :class:`Upstream`, what every dispatch shares (client, signer, sink, stats).
"""

from .config import UpstreamLimits, UpstreamTimeouts
from .connect import settle
from .dispatch import MinerStats, Upstream
from .refusals import REFUSAL_SLACK, UpstreamError, client_fault, refusal
from .stream import UpstreamStream

__all__ = ["REFUSAL_SLACK", "MinerStats", "Upstream", "UpstreamError", "UpstreamLimits", "UpstreamStream",
           "UpstreamTimeouts", "client_fault", "refusal", "settle"]
