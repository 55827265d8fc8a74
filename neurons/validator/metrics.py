"""The validator's own Prometheus families, added to the gateway's ``/metrics`` (:mod:`gateway.metrics`).

Read from the validator's live state at scrape time, like the gateway's: audits by outcome, the reference's
backlog and failures in a row, quarantined miners, each hotkey's settled value (what weights follow), the
last block weights were set at, weight refusals in a row, rounds closed, and the metagraph's age.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from .neuron import Validator


def validator_families(v: Validator) -> Iterator[Metric]:
    yield CounterMetricFamily("tensorgate_rounds_closed", "Scoring rounds closed", value=v.rounds_closed)
    if v._synced_at is not None:
        yield GaugeMetricFamily("tensorgate_metagraph_age_seconds", "Seconds since the metagraph was last read",
                                value=time.monotonic() - v._synced_at)
    if v.weights.last_block is not None:
        yield GaugeMetricFamily("tensorgate_weights_last_block", "The block weights were last set (or tried) at",
                                value=v.weights.last_block)
    yield GaugeMetricFamily("tensorgate_weights_refusals_in_a_row", "The chain's refusals of weights since the last "
                            "success", value=v.weights.failures)
    settled = GaugeMetricFamily("tensorgate_settled_value", "Each hotkey's settled value: what its weight follows",
                                labels=["hotkey"])
    for hotkey, value in sorted(v.scorer.settled_values().items()):
        settled.add_metric([hotkey], value)
    yield settled
    auditor = v.auditor
    if auditor is None:
        return
    audits = CounterMetricFamily("tensorgate_audits", "Answers audited, by outcome (passed, failed, errors, "
                                 "unauditable, dropped, sampled)", labels=["outcome"])
    for outcome, n in sorted(auditor.counts.items()):
        audits.add_metric([outcome], n)
    yield audits
    yield GaugeMetricFamily("tensorgate_audit_backlog", "Answers waiting for the reference", value=auditor.backlog)
    yield GaugeMetricFamily("tensorgate_reference_errors_in_a_row", "The reference's failures since its last verdict",
                            value=auditor.reference_errors)
    yield GaugeMetricFamily("tensorgate_quarantined_miners", "Hotkeys quarantined by their audits",
                            value=len(auditor.book.quarantined()))
    alarms = CounterMetricFamily("tensorgate_sequential_alarms", "Alarms of the sequential test, by hotkey",
                                 labels=["hotkey"])
    for hotkey, record in sorted(auditor.book.records.items()):
        if record.alarms:
            alarms.add_metric([hotkey], record.alarms)
    yield alarms
