"""The local subnet's view of each epoch the local chain ran: what Yuma 3 made of the validators' weights.

One table per epoch, read from the chain's state (the same u16 figures the SDK's metagraph read and
``python -m neurons.weights`` show): per validator its stake share, validator trust (the share of its weight that
survived the clip at consensus) and dividends; per miner its consensus and incentive.
"""

from __future__ import annotations

from ..chain.local_state import U16_MAX, Subnet


def epoch_table(s: Subnet, labels: dict[int, str]) -> str:
    """The last epoch of ``s``; ``labels`` names the miners (uid -> what the run started there)."""
    total = sum(n.stake_rao for n in s.neurons if n.validator_permit) or 1
    head = f"epoch at block {s.last_step} (Yuma 3, kappa {s.kappa / U16_MAX:.2f}, tempo {s.tempo})"
    if not any(n.incentive for n in s.neurons):
        return f"{head}: no weights counted yet (the epoch's emission went to the validators by stake)"
    lines = [head + ":"]
    for uid, n in enumerate(s.neurons):
        if n.validator_permit:
            lines.append(f"  validator uid {uid:>3} {n.hotkey[:10]}…  stake {n.stake_rao / total:6.1%}  "
                         f"vtrust {n.validator_trust / U16_MAX:.3f}  dividends {n.dividends / U16_MAX:.3f}")
    for uid, n in enumerate(s.neurons):
        if not n.validator_permit:
            lines.append(f"  miner     uid {uid:>3} {labels.get(uid, n.hotkey[:10] + '…'):<14} "
                         f"consensus {n.consensus / U16_MAX:.3f}  incentive {n.incentive / U16_MAX:.3f}")
    return "\n".join(lines)
