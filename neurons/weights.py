"""Print the weights currently on chain and what the last epoch made of them: the analogue of ``btcli query
weights --netuid N`` with the metagraph's Yuma columns (validator trust, dividends, consensus, incentive).

Reads go through the SDK's own read path (``client.weights.weights``, the metagraph, and
``client.weights.timelocked_weight_commits``), over the local chain's state directory or a real
network, so what it shows is what any SDK client would see.

Example::

    python -m neurons.weights --state-dir ~/.tensorgate/local --netuid 1
    python -m neurons.weights --network test --netuid 7 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import bittensor as bt
from bittensor import BittensorError

from .chain.local_files import CorruptChainState
from .chain.local_substrate import LocalSubstrate
from .chain.subtensor import ChainUnavailable, route_sdk_logging, use_token_symbols_cache


async def collect(client: bt.Client, netuid: int) -> dict[str, Any]:
    """Weights, hotkeys, last updates and pending commits of ``netuid``, all via SDK reads."""
    block = await client.block()
    mg, weights, commits, cr = await asyncio.gather(
        client.subnets.metagraph(netuid, commitments=False),
        client.weights.weights(netuid),
        client.weights.timelocked_weight_commits(netuid),
        client.read("commit_reveal_enabled", netuid=netuid),
    )
    if mg is None:
        raise LookupError(f"netuid {netuid} does not exist")
    hotkeys = {n.uid: n.hotkey for n in mg.neurons}
    last_update = {n.uid: n.last_update for n in mg.neurons}
    rows = [
        {
            "validator_uid": vuid, "validator_hotkey": hotkeys.get(vuid),
            "miner_uid": muid, "miner_hotkey": hotkeys.get(muid), "weight": w,
            "last_update": last_update.get(vuid),
        }
        for vuid, row in weights.items() for muid, w in sorted(row.items())
    ]
    pending = [
        {
            "epoch": epoch, "hotkey": c["hotkey"], "validator_uid": mg.by_hotkey(c["hotkey"]).uid
            if mg.by_hotkey(c["hotkey"]) else None, "commit_block": c["commit_block"],
            "reveal_round": c["reveal_round"], "reveals_at": _iso(c.get("reveals_at")),
        }
        for epoch, entries in commits.items() for c in entries
    ]
    return {"netuid": netuid, "block": block, "commit_reveal": bool(cr), "neurons": len(mg.neurons),
            "weights": rows, "pending_commits": pending, "epoch": epoch_of(mg)}


def epoch_of(mg: Any) -> dict[str, Any]:
    """What the last epoch made of the weights (Yuma): per validator (a permit holder) its stake, validator trust,
    dividends and emission; per other neuron its consensus, incentive and emission (in the subnet's units)."""
    vtrust = list(mg.raw.get("validator_trust") or [])
    validators = [{"uid": n.uid, "hotkey": n.hotkey, "stake": n.total_stake.rao / 1e9,
                   "validator_trust": (vtrust[n.uid] if n.uid < len(vtrust) else 0) / 65535,
                   "dividends": n.dividends, "emission": n.emission.rao / 1e9}
                  for n in mg.neurons if n.validator_permit]
    miners = [{"uid": n.uid, "hotkey": n.hotkey, "consensus": n.consensus, "incentive": n.incentive,
               "emission": n.emission.rao / 1e9} for n in mg.neurons if not n.validator_permit]
    return {"block": mg.last_step, "validators": validators, "miners": miners}


def _iso(value: Any) -> str | None:
    return value.isoformat() if isinstance(value, datetime) else (None if value is None else str(value))


def _short(hotkey: str | None) -> str:
    return "-" if not hotkey else f"{hotkey[:6]}…{hotkey[-4:]}"


def format_table(data: dict[str, Any], source: str) -> str:
    """The human view: one line per (validator, miner) weight, then pending commits."""
    lines = [f"netuid {data['netuid']} on {source} at block {data['block']}: {data['neurons']} neurons, "
             f"commit-reveal {'on' if data['commit_reveal'] else 'off'}"]
    rows = data["weights"]
    if not rows:
        lines.append("no weights set yet")
    else:
        lines.append(f"{'val uid':>7}  {'validator':<12}  {'miner uid':>9}  {'miner':<12}  {'weight':>8}  last update")
        for r in rows:
            last = r["last_update"]
            ago = "" if last is None else f"block {last} ({data['block'] - last} ago)"
            lines.append(f"{r['validator_uid']:>7}  {_short(r['validator_hotkey']):<12}  {r['miner_uid']:>9}  "
                         f"{_short(r['miner_hotkey']):<12}  {r['weight']:>8.4f}  {ago}")
    pending = data["pending_commits"]
    lines.append(f"pending commits: {len(pending)}")
    for c in pending:
        lines.append(f"  validator uid {c['validator_uid']} ({_short(c['hotkey'])}) committed at block "
                     f"{c['commit_block']} (epoch {c['epoch']}), drand reveal round {c['reveal_round']}"
                     + (f" ~ {c['reveals_at']}" if c["reveals_at"] else ""))
    lines += format_epoch(data["epoch"])
    return "\n".join(lines)


def format_epoch(epoch: dict[str, Any]) -> list[str]:
    """The Yuma columns of the last epoch: validators (stake, vtrust, dividends), then miners."""
    lines = [f"last epoch at block {epoch['block']}:"]
    for v in epoch["validators"]:
        lines.append(f"  validator uid {v['uid']} ({_short(v['hotkey'])}): stake {v['stake']:.2f}, "
                     f"vtrust {v['validator_trust']:.4f}, dividends {v['dividends']:.4f}, emission {v['emission']:.4f}")
    for m in epoch["miners"]:
        lines.append(f"  miner uid {m['uid']} ({_short(m['hotkey'])}): consensus {m['consensus']:.4f}, "
                     f"incentive {m['incentive']:.4f}, emission {m['emission']:.4f}")
    return lines


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    if args.network:
        use_token_symbols_cache(args.state_dir)
        kwargs: dict[str, Any] = {}
        if args.network.startswith(("ws://", "wss://")):
            kwargs.update(fallback_endpoints=[], archive_endpoints=[])
        try:
            client = await asyncio.wait_for(_connect(args.network, kwargs), args.timeout)
        except (BittensorError, OSError, TimeoutError) as e:
            raise ChainUnavailable(f"cannot reach {args.network}: {e or type(e).__name__}") from e
    else:
        substrate = LocalSubstrate.open(args.state_dir, read_only=True)
        use_token_symbols_cache(substrate.state_dir)
        client = await _connect("local", {"substrate": substrate})
    try:
        return await collect(client, args.netuid)
    finally:
        await client.close()


async def _connect(network: str, kwargs: dict[str, Any]) -> bt.Client:
    return await bt.Subtensor(network, **kwargs)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m neurons.weights", description=__doc__.split("\n\n")[0])
    p.add_argument("--netuid", type=int, required=True, help="subnet whose weights to print")
    p.add_argument("--state-dir", type=Path, default=None,
                   help="local chain state (the validator's --state-dir or its chain/ directory)")
    p.add_argument("--network", default=None, help="read a real chain instead: finney | test | ws://host:port")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for a network connection")
    args = p.parse_args(argv)
    if args.network is None and args.state_dir is None:
        p.error("give --state-dir (local chain) or --network")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    route_sdk_logging()
    try:
        data = asyncio.run(_run(args))
    except (FileNotFoundError, LookupError, ChainUnavailable, BittensorError, CorruptChainState) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        source = args.network or f"the local chain in {LocalSubstrate.find_state_dir(args.state_dir)}"
        print(format_table(data, source))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
