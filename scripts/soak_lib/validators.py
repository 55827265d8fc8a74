"""The soak with several validators (issue 57): what the chain pays under Yuma 3 when three validators share every
miner, and the baseline the agreement issue (61) must beat.

Each seed runs the local subnet (``neurons.local_subnet``: the real validators, gateways, probes, audits, scoring and
weights, simulated cards on loopback, the local chain's Yuma 3 epoch about once a round) with three validators of
50 / 30 / 20 % of the stake receiving 0 / 30 / 70 % of the organic traffic, in compressed time. Every epoch the chain
ran is recorded; the figures are means over the epochs from the third that counted weights on: per validator its
vtrust and its dividends over its stake share, per miner its incentive over the mean of the identical honest cards'.

Example::

    python scripts/soak.py --scenario validators --seeds 3
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neurons.chain.local_state import U16_MAX, Subnet
from neurons.local_subnet import run_local_subnet
from neurons.validator.config import ValidatorConfig

STAKES = [50.0, 30.0, 20.0]
TRAFFIC = [0.0, 30.0, 70.0]
SKIP_EPOCHS = 2  # figures from the third epoch that counted weights on
HONEST = "rtx5090"  # the identical cards' label (the slow card is "rtx5090-slow")


@dataclass
class ValidatorsRun:
    seed: int
    rounds: int
    epochs: list[dict[str, Any]] = field(default_factory=list)
    labels: dict[int, str] = field(default_factory=dict)


def record(s: Subnet, labels: dict[int, str]) -> dict[str, Any]:
    """One epoch as the chain left it: each validator's stake share, vtrust and dividends; each miner's consensus
    and incentive."""
    total = sum(n.stake_rao for n in s.neurons if n.validator_permit) or 1
    return {
        "block": s.last_step,
        "validators": {uid: {"stake": n.stake_rao / total, "vtrust": n.validator_trust / U16_MAX,
                             "dividends": n.dividends / U16_MAX}
                       for uid, n in enumerate(s.neurons) if n.validator_permit},
        "miners": {uid: {"consensus": n.consensus / U16_MAX, "incentive": n.incentive / U16_MAX}
                   for uid, n in enumerate(s.neurons) if uid in labels},
    }


async def run_seed(seed: int, *, rounds: int, round_s: float, block_time: float, rps: float,
                   state_dir: Path | None = None) -> ValidatorsRun:
    run = ValidatorsRun(seed=seed, rounds=rounds)

    def on_epoch(s: Subnet, labels: dict[int, str]) -> None:
        run.labels = labels
        run.epochs.append(record(s, labels))

    with tempfile.TemporaryDirectory(prefix="soak-validators-") as tmp:
        cfg = ValidatorConfig(local=True, state_dir=state_dir or Path(tmp), gateway_port=0, local_rounds=rounds,
                              local_round_s=round_s, local_block_time=block_time, local_miners=4,
                              local_traffic_rps=rps, probes_per_round=1, seed=seed, local_validators=3,
                              local_stakes=list(STAKES), local_traffic_split=list(TRAFFIC))
        await run_local_subnet(cfg, seed=seed, on_epoch=on_epoch)
    return run


def summarize(run: ValidatorsRun) -> dict[str, Any]:
    """Means over the epochs from the third that counted weights on (fewer when the run had fewer)."""
    counted = [e for e in run.epochs if any(m["incentive"] for m in e["miners"].values())]
    used = counted[SKIP_EPOCHS:] or counted[-1:]
    honest = sorted(u for u, label in run.labels.items() if label == HONEST)
    out: dict[str, Any] = {"seed": run.seed, "epochs": len(run.epochs), "counted": len(counted), "used": len(used),
                           "validators": {}, "miners": {}}
    if not used:
        return out
    for uid in used[0]["validators"]:
        vt = [e["validators"][uid]["vtrust"] for e in used]
        over = [e["validators"][uid]["dividends"] / e["validators"][uid]["stake"] for e in used
                if e["validators"][uid]["stake"] > 0]
        out["validators"][uid] = {"stake": used[0]["validators"][uid]["stake"], "vtrust": statistics.fmean(vt),
                                  "vtrust_min": min(vt), "dividends_over_stake": statistics.fmean(over) if over else 0}
    incentive = {uid: statistics.fmean(e["miners"][uid]["incentive"] for e in used) for uid in run.labels}
    mean_honest = statistics.fmean(incentive[u] for u in honest) if honest else 0.0
    for uid, inc in incentive.items():
        out["miners"][uid] = {"label": run.labels[uid], "incentive": inc,
                              "over_honest": inc / mean_honest if mean_honest else 0.0}
    paid = [incentive[u] for u in honest]
    out["honest_spread"] = (max(paid) / min(paid)) if paid and min(paid) > 0 else float("inf")
    return out


def format_report(summaries: list[dict[str, Any]]) -> str:
    lines = [f"validators: stakes {'/'.join(f'{s:.0f}' for s in STAKES)} %, organic traffic "
             f"{'/'.join(f'{t:.0f}' for t in TRAFFIC)} %, every miner shared; means from the third epoch with "
             "weights on"]
    for s in summaries:
        lines.append(f"seed {s['seed']}: {s['epochs']} epochs, {s['counted']} with weights, {s['used']} used")
        for uid, v in s["validators"].items():
            lines.append(f"  validator uid {uid}  stake {v['stake']:5.1%}  vtrust {v['vtrust']:.3f} "
                         f"(min {v['vtrust_min']:.3f})  dividends/stake {v['dividends_over_stake']:.2f}")
        for uid, m in s["miners"].items():
            lines.append(f"  miner uid {uid} {m['label']:<13} incentive {m['incentive']:.3f}  "
                         f"over the honest cards' mean {m['over_honest']:.2f}")
        if "honest_spread" in s:
            lines.append(f"  identical honest cards: the best paid {s['honest_spread']:.2f}x the least")
    return "\n".join(lines)
