"""Which miners a local run's state belongs to: a state directory is reused only by the same lineup.

The local subnet's miners sign with the same development keys on every run (``Miner1``, ``Miner2``, ...), whatever
they run, and the validator keeps its scoring state (rounds, audits, strikes, quarantines, routing) and the local
chain in one directory across runs, as it does on a real chain, where a restart must not forget a cheater. Across
*lineups* that carried blame to another miner: after the README's real-model run with a cheat (``Miner3`` answering
garbage), the simulated main job's honest ``Miner3`` started quarantined and ended at weight 0 (measured: 11 strikes
in its last 20 audits, weight 0.0000 after three rounds).

So the directory records the lineup it was written by (:data:`LINEUP_FILE`: each development key's runtime and
model), and a run with another lineup sets the old state aside, renamed beside it with the time, and starts fresh.
Nothing is deleted; the same lineup keeps its state, so a restarted local run still shows the validator restoring it.
A directory with no record (written before records were kept, or by hand) is taken as it is: what is in it is
checked as before, and a corrupt file still stops the run with its clear error rather than vanishing aside.

Example::

    moved = claim_state_dir(Path("~/.tensorgate/local").expanduser(), lineup_of(cfg), now=time.time())
    # None: fresh or the same lineup; else where the other lineup's state now lies
"""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path
from typing import Any

from ..validator.config import ValidatorConfig

LINEUP_FILE = "local-lineup.json"
REAL_LABEL = "llama.cpp gemma-3-270m (CPU)"


def miner_cheat(cfg: ValidatorConfig, i: int) -> str | None:
    """The cheat local miner ``i`` runs, if any: the cheats come after the honest miners (real runtime only)."""
    return cfg.local_cheats[i - cfg.local_miners] if i >= cfg.local_miners else None


def miner_label(cfg: ValidatorConfig, i: int) -> str:
    """What local miner ``i`` runs: its label in the banner and summary."""
    if cfg.local_runtime == "real":
        cheat = miner_cheat(cfg, i)
        return f"cheat: {cheat}" if cheat else REAL_LABEL
    return "rtx5090-slow" if (i == cfg.local_miners - 1 and cfg.local_miners > 1) else "rtx5090"


def miner_model(cfg: ValidatorConfig, i: int) -> str | None:
    """The one model local miner ``i`` declares when the run serves several (in turn), else None (all of them)."""
    return cfg.models[i % len(cfg.models)] if len(cfg.models) > 1 else None


def lineup_of(cfg: ValidatorConfig) -> dict[str, Any]:
    """Each development key's runtime and model (``cfg`` as :func:`neurons.local_subnet.local_config` made it), and
    how many validators when several. Miners added with ``--local.miner-url`` are left out: they sign with keys of
    their own."""
    n = cfg.local_miners + len(cfg.local_cheats)
    lineup: dict[str, Any] = {"runtime": cfg.local_runtime, "models": list(cfg.models),
                              "miners": [{"key": f"Miner{i + 1}", "runs": miner_label(cfg, i),
                                          "model": miner_model(cfg, i)} for i in range(n)]}
    if cfg.local_validators > 1:  # a lone validator's record stays as it was (its directories are kept)
        lineup["validators"] = cfg.local_validators
    return lineup


def claim_state_dir(state_dir: Path, lineup: dict[str, Any], *, now: float) -> Path | None:
    """Make ``state_dir`` this lineup's: a directory another lineup recorded is renamed to ``<name>.<time>`` beside
    it. Returns that path, or None when nothing moved."""
    record = state_dir / LINEUP_FILE
    moved: Path | None = None
    written_by = _read(record)
    if written_by is not None and written_by != lineup:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
        moved = state_dir.with_name(f"{state_dir.name}.{stamp}")
        n = 1
        while moved.exists():
            n += 1
            moved = state_dir.with_name(f"{state_dir.name}.{stamp}-{n}")
        state_dir.rename(moved)
    state_dir.mkdir(parents=True, exist_ok=True)
    partial = record.with_name(record.name + ".partial")
    partial.write_text(json.dumps(lineup, indent=1) + "\n")
    partial.replace(record)  # whole or not at all: a run killed here leaves the old record or the new one
    return moved


class LineupRecordError(ValueError):
    """The lineup record is there but is no record this code wrote (a directory, a FIFO, text that is not a small
    JSON object): one line for the operator, and the run stops (exit 2) rather than guess whose state it is."""


MAX_RECORD_BYTES = 1 << 20  # a record is a few hundred bytes; a larger file is not one


def _read(record: Path) -> Any:
    """The recorded lineup, or None when there is no record. Only a regular file is opened: a FIFO would block the
    start for ever, a directory cannot be replaced by the new record."""
    try:
        mode = record.lstat().st_mode
    except FileNotFoundError:
        return None
    except OSError as e:
        raise LineupRecordError(f"{record}: cannot read the local lineup record ({e.strerror or e})") from None
    if not stat.S_ISREG(mode):
        raise LineupRecordError(f"{record}: the local lineup record is not a regular file: move it aside to start")
    try:
        with record.open("rb") as f:
            text = f.read(MAX_RECORD_BYTES + 1)
        if len(text) > MAX_RECORD_BYTES:
            raise ValueError(f"over {MAX_RECORD_BYTES} bytes")
        found = json.loads(text)
    except OSError as e:
        raise LineupRecordError(f"{record}: cannot read the local lineup record ({e.strerror or e})") from None
    except (ValueError, RecursionError) as e:
        raise LineupRecordError(f"{record}: the local lineup record is not JSON this code wrote ({str(e)[:80]}): "
                                "move it aside to start") from None
    if not isinstance(found, dict):
        raise LineupRecordError(f"{record}: the local lineup record is not a JSON object: move it aside to start")
    return found
