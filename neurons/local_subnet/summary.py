"""What a local run says at its end: each validator's last weights, who was paid and who was caught and why, and
what the chain's last epoch made of the weights."""

from __future__ import annotations

from loguru import logger

from .config import FIRST_WEIGHTS_ROUND
from .subnet import LocalSubnet, LocalValidator


def print_summary(subnet: LocalSubnet) -> None:
    several = len(subnet.validators) > 1
    lines = [f"local subnet stopped after {subnet.rounds_run} rounds (the round in progress at the stop was saved "
             "too)"]
    for lv in subnet.validators:
        if several:
            lines.append(f"{lv.label} (stake {lv.stake_share:.0%}, traffic {lv.traffic_share:.0%}):")
        lines += _validator_lines(subnet, lv)
    if subnet.last_epoch:
        lines.append("the chain's last " + subnet.last_epoch)
    logger.info("\n" + "\n".join(lines))


def _validator_lines(subnet: LocalSubnet, lv: LocalValidator) -> list[str]:
    v = lv.validator
    lines = []
    if lv.traffic is not None:
        lines.append(f"organic requests: {dict(lv.traffic.counts)}")
    last = v.weights.history[-1] if v.weights.history else None
    if last is None:
        lines.append("no weights were set" + (f": the first can come after round {FIRST_WEIGHTS_ROUND}"
                                              if subnet.rounds_run <= FIRST_WEIGHTS_ROUND else ""))
        return lines
    block, weights = last
    lines.append(f"last weights set at block {block}:")
    for uid, _hk, profile in subnet.miners:
        lines.append(f"  uid {uid:>3} {profile:<14} weight {weights.get(uid, 0.0):.4f}")
    lines.append(verdict_line(subnet, lv, weights))
    return lines


def verdict_line(subnet: LocalSubnet, lv: LocalValidator, weights: dict[int, float]) -> str:
    """One line a newcomer can read the run by: who was paid, and who was caught and why."""
    v = lv.validator
    quarantined = v.quarantined()
    paid = [f"uid {uid} {weights[uid]:.2f}" for uid, _, _ in subnet.miners if weights.get(uid, 0.0) > 0]
    caught = []
    for uid, hk, profile in subnet.miners:
        if hk in quarantined and v.auditor is not None:
            record = v.auditor.book.records.get(hk)
            failed = f"{record.failures} of {record.audits} audits failed" if record is not None else "audits failed"
            why = v.auditor.last_failure.get(hk)
            caught.append(f"uid {uid} ({profile}: {failed}{f', {why}' if why else ''})")
    return (f"paid: {', '.join(paid) or 'nobody'}; caught and quarantined at weight 0: "
            f"{', '.join(caught) or 'nobody'}")
