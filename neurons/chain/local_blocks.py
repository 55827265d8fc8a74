"""What happens on the local chain as blocks pass, apart from extrinsics: timelocked commits revealed, epochs run.

Pure functions over :class:`~.local_state.ChainState`: the ``bt.Substrate`` seam (:mod:`.local_substrate`) calls
:func:`advance` before every read and write, so an epoch (:mod:`.local_epoch`) always sees the state as it was at
its block, and reveals due by an epoch's block are applied before it (as the chain's block step orders them).
"""

from __future__ import annotations

from typing import Any

from .local_epoch import epochs_between, run_subnet_epoch
from .local_rules import Refused, set_weights
from .local_state import EXTRINSIC_LOG_LIMIT, ChainState, Subnet


def advance(state: ChainState, before: int, head: int, *, epochs: bool = True) -> bool:
    """The blocks after ``before`` up to ``head``, in order; whether anything changed. ``epochs`` False (a reader of
    another process's chain): reveals only, so a reader shows the epochs the chain's writer ran, never epochs of its
    own over a run that has stopped (its validators inactive by then)."""
    changed = False
    for s in state.subnets.values():
        for block in epochs_between(s, before, head) if epochs else []:
            changed |= apply_reveals(state, s, block)
            run_subnet_epoch(s, block)
            changed = True
        changed |= apply_reveals(state, s, head)
    return changed


def apply_reveals(state: ChainState, s: Subnet, head: int) -> bool:
    """Reveal the commits due by ``head``: each is checked like a fresh ``set_weights`` (or dropped without its
    plaintext, as the chain drops one it cannot decrypt)."""
    due = sorted((c for c in s.commits if c.reveal_block <= head), key=lambda c: c.commit_block)
    for c in due:
        s.commits.remove(c)
        if c.plaintext is None:
            log_extrinsic(state, c.reveal_block, c.hotkey, "reveal", False,
                          "commit has no local plaintext (drand is not reachable offline); dropped")
            continue
        try:
            uid = set_weights(s, c.hotkey, c.plaintext["uids"], c.plaintext["values"], c.plaintext["version_key"],
                              c.reveal_block, reveal=True)
        except Refused as e:
            log_extrinsic(state, c.reveal_block, c.hotkey, "reveal", False, e.text)
        else:
            log_extrinsic(state, c.reveal_block, c.hotkey, "reveal", True,
                          f"uid {uid} weights revealed (committed at block {c.commit_block})",
                          [event("TimelockedWeightsRevealed", {"netuid": s.netuid, "hotkey": c.hotkey})])
    return bool(due)


def log_extrinsic(state: ChainState, block: int, signer: str, call: str, ok: bool, detail: str,
                  events: list[dict] | None = None) -> int:
    """Append to the chain's extrinsic log (the last ``EXTRINSIC_LOG_LIMIT``); the extrinsic's index in its block."""
    index = sum(1 for e in state.extrinsics if e["block"] == block)
    state.extrinsics.append({"block": block, "index": index, "signer": signer, "call": call, "ok": ok,
                             "detail": detail, "events": events or []})
    del state.extrinsics[:-EXTRINSIC_LOG_LIMIT]
    return index


def event(event_id: str, attributes: dict[str, Any]) -> dict[str, Any]:
    return {"event": {"module_id": "SubtensorModule", "event_id": event_id, "attributes": attributes}}
